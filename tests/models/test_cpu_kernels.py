"""The native CPU kernels: equal to their torch references, row-invariant, and optional."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import kernels

op = kernels.skinny_linear()
needs_kernel = pytest.mark.skipif(op is None, reason="native kernel unavailable here (no AVX2/FMA or no compiler)")


@needs_kernel
@pytest.mark.parametrize("k", [576, 1536, 100, 37, 7])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11, 16])
def test_matches_torch(m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(301, k, generator=g)
    ref = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(op(x, w), ref, rtol=1e-5, atol=1e-4)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from([576, 579, 1536]), st.sampled_from([200, 203]))
def test_a_row_does_not_depend_on_the_batch_within_a_regime(data, k, n):
    """Up to SKINNY_STREAM_ROWS rows, and above it (register tiles), a row's result is the same
    bits whatever batch it is in, and wherever in the batch; the two regimes differ in rounding."""
    small = kernels.SKINNY_STREAM_ROWS
    lo, hi = data.draw(st.sampled_from([(1, small), (small + 1, kernels.SKINNY_MAX_ROWS)]))
    m = data.draw(st.integers(lo, hi), label="batch")
    part = data.draw(st.integers(lo, m), label="sub-batch")
    start = data.draw(st.integers(0, m - part), label="start")
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    assert torch.equal(op(x[start : start + part], w), op(x, w)[start : start + part])


@needs_kernel
def test_non_contiguous_input_and_threads():
    x = torch.randn(576, 4).t()  # a transposed view
    w = torch.randn(64, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, op(x, w))
    torch.testing.assert_close(one, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-4)


def test_can_be_turned_off(monkeypatch):
    kernels.clear_cache()
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    try:
        assert kernels.skinny_linear() is None
    finally:
        kernels.clear_cache()


def test_model_uses_the_kernel_only_in_float32(tiny_models):
    from conveyor import LLM
    from conveyor.models.llama import SkinnyLinear, TransposedLinear

    path = tiny_models["llama"]
    fp64 = LLM(str(path), dtype="float64", num_kv_blocks=16)
    kinds64 = {type(m) for m in fp64.engine.runner.model.modules()}
    assert SkinnyLinear not in kinds64 and TransposedLinear in kinds64
    if op is not None:
        fp32 = LLM(str(path), dtype="float32", num_kv_blocks=16)
        assert SkinnyLinear in {type(m) for m in fp32.engine.runner.model.modules()}


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (9, 3, None), (8, 2, 5), (4, 2, 30)])
@pytest.mark.parametrize("d", [16, 64, 80])  # the kernel's 8-dim and 64-dim chunks, and their tails
def test_paged_decode_attention_matches_the_torch_backend(heads, kv_heads, window, kv_dtype, d):
    from conveyor.models.attention import CpuPagedAttention, TorchPagedAttention, build_metadata

    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    bs, num_blocks = 4, 64
    cache = torch.randn(2, num_blocks * bs, kv_heads, d, generator=g).to(kv_dtype)
    # Four decodes at contexts 1, 7, 13 and 43 (whole groups of eight tokens and a rest) and a
    # prefill chunk of 5 over a context of 6, on scattered blocks.
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[0:1], perm[1:3], perm[3:7], perm[7:18], perm[18:21]]
    starts, news = [0, 6, 12, 42, 6], [1, 1, 1, 1, 5]
    meta = build_metadata(tables, starts, news, bs, torch.device("cpu"), window)
    t = sum(news)
    qkv = torch.randn(t, heads + 2 * kv_heads, d, generator=g)  # q, k, v as views of one projection
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    ref_cache = cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, d**-0.5)
    native = CpuPagedAttention(kernels.paged_decode_attention(), window, kernels.write_kv())
    out = native.forward(q, k, v, cache, meta, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache, ref_cache)  # the same K/V written (float16: rounded as torch rounds)


@needs_kernel
@pytest.mark.parametrize("kind", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, 5)])
@pytest.mark.parametrize("d", [16, 80])
def test_capped_scores_and_sinks_match_the_explicit_backend(kind, heads, kv_heads, window, d):
    """Gemma 2's soft cap and gpt-oss's sinks in the native decode (`CpuEagerAttention`; its
    prompts take the explicit products) against `EagerAttention`; a cap of 0.3 bites here."""
    from conveyor.models.attention import CpuEagerAttention, EagerAttention, build_metadata

    g = torch.Generator().manual_seed(heads + d)
    bs, num_blocks = 4, 64
    cache = torch.randn(2, num_blocks * bs, kv_heads, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[0:1], perm[1:3], perm[3:7], perm[7:18], perm[18:21]]
    starts, news = [0, 6, 12, 42, 6], [1, 1, 1, 1, 5]
    meta = build_metadata(tables, starts, news, bs, torch.device("cpu"), window)
    t = sum(news)
    qkv = torch.randn(t, heads + 2 * kv_heads, d, generator=g)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    cap = 0.3 if kind != "sinks" else 0.0
    sinks = torch.randn(heads, generator=g) * 2 if kind != "softcap" else None
    reference, native = EagerAttention(cap), CpuEagerAttention(kernels.paged_decode_attention(), window,
                                                               kernels.write_kv(), cap)
    reference.sinks = native.sinks = sinks
    ref = reference.forward(q, k, v, cache.clone(), meta, d**-0.5)
    out = native.forward(q, k, v, cache.clone(), meta, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain = CpuEagerAttention(kernels.paged_decode_attention(), window, kernels.write_kv(), 0.0)
    assert (plain.forward(q, k, v, cache.clone(), meta, d**-0.5)[:4] - out[:4]).abs().max() > 1e-2  # it bites


@needs_kernel
@pytest.mark.parametrize("rows,h", [(5, 576), (300, 768), (7, 100)])  # 300 rows: split over threads
def test_rms_norm_matches_torch(rows, h):
    x = torch.randn(rows, h)
    w = torch.randn(h)
    ref = torch.nn.functional.rms_norm(x.double(), (h,), w.double(), 1e-5).float()
    out = kernels.rms_norm()(x, w, 1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(kernels.rms_norm()(x[3:4], w, 1e-5), out[3:4])  # a row does not depend on the batch


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 400])
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 4, 16)])
def test_rope_matches_apply_rope_on_a_qkv_view(rows, heads, kv_heads, hd):
    """In place on the q and k heads of the QKV projection's rows (a strided view); v untouched."""
    from conveyor.models.llama import apply_rope

    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, heads + 2 * kv_heads, hd, generator=g) * 10
    angles = torch.rand(rows, 1, hd // 2, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    ref = apply_rope(qkv[:, : heads + kv_heads], (cos, sin))
    v = qkv[:, heads + kv_heads :].clone()
    kernels.rope()(qkv[:, : heads + kv_heads], cos, sin, heads + kv_heads)
    torch.testing.assert_close(qkv[:, : heads + kv_heads], ref, rtol=1e-6, atol=1e-5)
    assert torch.equal(qkv[:, heads + kv_heads :], v)


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 100), (64, 2048)])
def test_silu_mul_matches_torch(rows, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 8
    gate_up[0, :6] = torch.tensor([-200.0, -88.5, -87.0, 0.0, 88.5, 200.0])  # the clamps of exp
    gate, up = gate_up.split(inter, dim=-1)
    ref = torch.nn.functional.silu(gate.double()) * up.double()
    out = kernels.silu_mul()(gate_up)
    torch.testing.assert_close(out, ref.float(), rtol=2e-6, atol=1e-6)
    assert torch.equal(kernels.silu_mul()(gate_up[-1:]), out[-1:])


@needs_kernel
@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=st.integers(1, 40),
    data=st.data(),
)
def test_argmax_equals_torch(rows, n, data):
    """Ties give the first index, a NaN wins (its first index), -inf rows give 0: as torch."""
    values = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])
    x = torch.tensor(data.draw(st.lists(st.lists(values, min_size=n, max_size=n), min_size=rows, max_size=rows)))
    assert torch.equal(kernels.argmax()(x), x.argmax(dim=-1))


@needs_kernel
def test_argmax_on_logits_shape():
    x = torch.randn(64, 32000)
    x[5, 31999] = 100.0  # the last element
    x[7, 12] = x[7, 13] = 50.0
    assert torch.equal(kernels.argmax()(x), x.argmax(dim=-1))


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral-window"])
def test_fused_decode_matches_the_layer_by_layer_path(tiny_models, tmp_path, family, kv_dtype):
    """Decode steps through FusedDecode (all layers in one native call) give the hidden states
    and the cache contents of the module path, for GQA, q/k/v bias, q/k norm, a sliding window,
    batches of 1 to 64 decodes (both regimes of the skinny product) at different contexts; and
    the same bits whether the embedding lookup and the final norm run in the native call or not."""
    import copy

    from conveyor import LLM
    from conveyor.models.attention import build_metadata
    from conveyor.models.llama import FusedDecode
    from tests.conftest import build_tiny_model

    path = build_tiny_model(tmp_path / "m", "mistral", seed=4, sliding_window=5) if family == "mistral-window" \
        else tiny_models[family]
    model = LLM(str(path), dtype="float32", num_kv_blocks=16).engine.runner.model
    assert isinstance(model.fused_decode, FusedDecode)
    arch, bs = model.arch, 4
    g = torch.Generator().manual_seed(7)
    for rows in (1, 3, 5, 16, 41, kernels.SKINNY_MAX_ROWS):
        starts = torch.randint(0, 40, (rows,), generator=g).tolist()
        perm = torch.randperm(rows * 12, generator=g).tolist()
        tables = [perm[i * 12 : (i + 1) * 12] for i in range(rows)]
        caches = [torch.randn(2, rows * 12 * bs, arch.num_kv_heads, arch.head_dim, generator=g).to(kv_dtype)
                  for _ in range(arch.num_layers)]
        meta = build_metadata(tables, starts, [1] * rows, bs, torch.device("cpu"), arch.sliding_window)
        ids = torch.randint(0, arch.vocab_size, (rows,), generator=g)
        ref_caches, unfolded_caches = copy.deepcopy(caches), copy.deepcopy(caches)
        with torch.inference_mode():
            fused = model(ids, meta.positions, caches, meta)
            fused_path = model.fused_decode
            fused_path.fold_ends = False  # embedding and final norm in torch instead of the native call
            try:
                unfolded = model(ids, meta.positions, unfolded_caches, meta)
            finally:
                fused_path.fold_ends = True
            model.fused_decode = None
            try:
                ref = model(ids, meta.positions, ref_caches, meta)
            finally:
                model.fused_decode = fused_path
        assert torch.equal(fused, unfolded)
        torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)
        for a, b in zip(caches, ref_caches, strict=True):
            # float16 K/V written by the kernel round exactly as torch's .to(float16); the
            # inputs to that rounding may differ in the last float32 bit, so allow one half ulp.
            tol = 1e-5 if kv_dtype == torch.float32 else 1e-3
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
