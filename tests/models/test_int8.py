"""quantization="int8": close to float32, rows independent of the batch, clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError
from conveyor.models.quantize import Int8Linear, choose_smoothing, int8_supported

pytestmark = pytest.mark.skipif(not int8_supported(), reason="torch has no fbgemm int8 kernels here")


def outlier_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, :3] *= 60  # a few channels far larger than the rest, as in real activations
    return x


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_int8_linear_close_to_float_and_smoothing_helps():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) / 128**0.5
    bias = torch.randn(96, generator=g)
    calib, x = outlier_inputs(64, 128, 1), outlier_inputs(16, 128, 2)
    reference = torch.nn.functional.linear(x, w, bias)
    plain = Int8Linear(w, bias)(x)
    smooth = choose_smoothing(calib, w, calib.abs().amax(dim=0))
    smoothed = Int8Linear(w, bias, smooth)(x)
    assert rel_err(smoothed, reference) < 0.02
    assert rel_err(smoothed, reference) < 0.5 * rel_err(plain, reference)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 40), seed=st.integers(0, 10_000),
       scale=st.floats(1e-3, 1e3))
def test_int8_rows_do_not_depend_on_the_batch(rows, k, n, seed, scale):
    g = torch.Generator().manual_seed(seed)
    layer = Int8Linear(torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.rand(k, generator=g) + 0.5)
    x = torch.randn(rows, k, generator=g) * scale
    x[rows // 2] *= 1000  # one loud row must not coarsen the others
    batched = layer(x)
    for i in range(rows):
        assert torch.equal(batched[i], layer(x[i : i + 1])[0])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300),  # rows x k above 32768 take the threaded path
       k=st.integers(1, 300), seed=st.integers(0, 10_000), scale=st.floats(1e-6, 1e6),
       smoothed=st.booleans())
def test_native_preparation_is_bit_equal_to_torch(rows, k, seed, scale, smoothed):
    from conveyor.kernels import int8_prepare

    native = int8_prepare()
    if native is None:
        pytest.skip("native kernels unavailable here")
    g = torch.Generator().manual_seed(seed)
    layer = Int8Linear(torch.randn(4, k, generator=g), None, torch.rand(k, generator=g) + 0.5 if smoothed else None)
    x = torch.randn(rows, k, generator=g) * scale
    x[0] = 0.0  # an all-zero row takes the 1e-12 floor
    buffer, row_max = native(x, layer.inv_smooth)
    ref_buffer, ref_max = layer._prepare(x)
    assert torch.equal(buffer, ref_buffer) and torch.equal(row_max, ref_max)


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    model = llm.engine.runner.model
    return model.compute_logits(model.forward_sequence(ids))


def assert_int8_close_to_float32(path: str) -> LLM:
    """The model in int8 against float32 over 60 teacher-forced tokens: logits within 5%, 90% of
    the argmaxes equal; and it serves (every request gets its tokens). The int8 LLM."""
    reference = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8)
    quantized = LLM(path, quantization="int8", num_kv_blocks=64, block_size=8)
    ids = [(7 * i + 3) % 380 + 2 for i in range(60)]
    ref, q8 = teacher_forced_logits(reference, ids), teacher_forced_logits(quantized, ids)
    assert rel_err(q8, ref) < 0.05
    assert (q8.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    outs = quantized.generate([ids[:10], ids[20:45]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    return quantized


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # an untied and a tied LM head
def test_int8_engine_close_to_float32(tiny_models, family):
    assert_int8_close_to_float32(str(tiny_models[family]))


def test_int8_bad_configs_say_why(tiny_models):
    with pytest.raises(ConfigError, match="quantization"):
        LLM(str(tiny_models["llama"]), quantization="int4")
    with pytest.raises(ConfigError, match="CPU float32"):
        LLM(str(tiny_models["llama"]), quantization="int8", dtype="float64")


def test_native_weight_only_int8_product_matches_its_formula():
    from conveyor.kernels import skinny_linear_q8

    op = skinny_linear_q8()
    if op is None:
        pytest.skip("native kernels unavailable here")
    g = torch.Generator().manual_seed(3)
    for rows, k, n in ((1, 576, 300), (5, 100, 33), (16, 37, 8)):
        x = torch.randn(rows, k, generator=g)
        layer = Int8Linear(torch.randn(n, k, generator=g), None, torch.rand(k, generator=g) + 0.5)
        ref = (x.double() * layer.inv_smooth.double()) @ (layer.qweight.double() * layer.wscale.double()[:, None]).t()
        torch.testing.assert_close(op(x, layer.qweight, layer.wscale, layer.inv_smooth), ref.float(),
                                   rtol=1e-5, atol=1e-5)
        plain = Int8Linear(torch.randn(n, k, generator=g), None, None)
        ref = x.double() @ (plain.qweight.double() * plain.wscale.double()[:, None]).t()
        torch.testing.assert_close(op(x, plain.qweight, plain.wscale, None), ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases, a tied head
def test_int8_fused_decode_is_at_least_as_close_to_float32_as_the_w8a8_path(tiny_models, family):
    """Small decode steps of an int8 model run fused and weight-only (float activations): their
    hidden states and logits must stay close to float32, no further than fbgemm's W8A8 path."""
    import copy

    from conveyor.models.attention import build_metadata
    from conveyor.models.llama import FusedDecode

    path = str(tiny_models[family])
    fp = LLM(path, dtype="float32", num_kv_blocks=64).engine.runner.model
    q8 = LLM(path, dtype="float32", num_kv_blocks=64, quantization="int8").engine.runner.model
    if not isinstance(q8.fused_decode, FusedDecode):
        pytest.skip("native kernels unavailable here")
    arch, bs, rows = fp.arch, 4, 3
    g = torch.Generator().manual_seed(11)
    starts = [5, 17, 30]
    tables = [list(range(i * 12, (i + 1) * 12)) for i in range(rows)]
    caches = [torch.randn(2, rows * 12 * bs, arch.num_kv_heads, arch.head_dim, generator=g) * 0.5
              for _ in range(arch.num_layers)]
    meta = build_metadata(tables, starts, [1] * rows, bs, torch.device("cpu"), arch.sliding_window)
    ids = torch.randint(0, arch.vocab_size, (rows,), generator=g)
    with torch.inference_mode():
        ref = fp(ids, meta.positions, copy.deepcopy(caches), meta)
        fused = q8(ids, meta.positions, copy.deepcopy(caches), meta)
        fused_logits = q8.compute_logits(fused)
        path_, head = q8.fused_decode, q8._head_q8
        q8.fused_decode, q8._head_q8 = None, None
        try:
            w8a8 = q8(ids, meta.positions, copy.deepcopy(caches), meta)
            w8a8_logits = q8.compute_logits(w8a8)
        finally:
            q8.fused_decode, q8._head_q8 = path_, head
        ref_logits = fp.compute_logits(ref)
    assert rel_err(fused, ref) < 0.05
    assert rel_err(fused, ref) <= rel_err(w8a8, ref) * 1.1
    assert rel_err(fused_logits, ref_logits) <= rel_err(w8a8_logits, ref_logits) * 1.1
    assert (fused_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 2 / 3
