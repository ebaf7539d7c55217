"""The fused elementwise kernels (add + RMSNorm, RoPE, SiLU-and-multiply) against the torch
modules they replace, and a model whose forward runs through them against the plain forward.

Without CUDA they run on CPU tensors under Triton's interpreter, in float32, float16 and
bfloat16 (these kernels use no `tl.dot`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # under the interpreter without CUDA (tests/conftest.py)

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.kernels.triton_attention import _jit, _rnd, tl, triton
from conveyor.kernels.triton_fused import add_rms_norm, rope_, silu_mul, triton_available
from conveyor.models.llama import RMSNorm, apply_rope
from tests.kernels.precision import close, examples

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton cannot run here")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_add_rms_norm_matches_add_then_norm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE) * 3
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    want_sum = res + x
    with torch.no_grad():
        want = norm(want_sum)
    got, got_sum = add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(got_sum, want_sum)  # the residual add rounds exactly as torch's
    close(got, want, max_ulps=1, exact_share=0.97)
    # No delta: the norm of the residual itself, which comes back untouched.
    got, same = add_rms_norm(None, res, norm.weight, norm.eps)
    assert same is res
    with torch.no_grad():
        close(got, norm(res), max_ulps=1, exact_share=0.97)


@_jit
def _round_kernel(x_ptr, like_ptr, out_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    dt = tl.load(like_ptr).dtype
    tl.store(out_ptr + offs, _rnd(v, dt, IS_BF16), mask=offs < n)


def _round_through_the_kernels(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 `x` rounded to `dtype` by the kernels' `_rnd` (in a kernel of its own), as float32."""
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, torch.zeros(1, dtype=dtype, device=x.device), out, x.numel(),
                                            IS_BF16=dtype == torch.bfloat16, BLOCK=256)
    return out


# float32 values at the edges of each half precision: float16's subnormals (below 2^-14, steps
# of 2^-24) and its ties there, halfway between two float16 normals (ties to even), its largest
# value and where it turns infinite, and bfloat16's ties and a NaN whose rounding carries.
EDGES = [0.0, -0.0, 2.0**-25, 2.0**-25 * 1.0001, 3 * 2.0**-25, 2.0**-24 * 1.5, 2.0**-14 - 2.0**-26,
         2.0**-14, 1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11), 65504.0, 65519.99, 65520.0, 1e6,
         1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.0e38, float("inf"), float("-inf"), 1e-40, -1e-45]


@settings(max_examples=examples(30), deadline=None)
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300), dtype=st.sampled_from([torch.float16,
                                                                                               torch.bfloat16]))
def test_rounding_to_half_precision_matches_torch_bit_for_bit(bits, dtype):
    """`_rnd`, with which every kernel rounds as torch rounds: any float32 (bit patterns drawn
    whole, so every exponent, subnormals, infinities and NaNs) to float16 and bfloat16 as torch
    casts it, ties to even. float16 is rounded on the bits (the compiler narrowed casts to half
    arithmetic and contracted it into half FMAs: RoPE one ulp off torch on an H100; that the
    compiled kernels keep no half arithmetic is tests/kernels/test_triton_sm90.py's check)."""
    bits = [*bits, 0x7F800001, 0xFF800001, 0x7F807FFF, 0x7FC00000]  # NaNs whose rounding would carry
    signed = [b - 2**32 if b >= 2**31 else b for b in bits]
    x = torch.cat([torch.tensor(signed, dtype=torch.int32).view(torch.float32), torch.tensor(EDGES)]).to(DEVICE)
    got = _round_through_the_kernels(x, dtype)
    want = x.to(dtype).float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # -0.0 too


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_matches_apply_rope_on_a_fused_projection(dtype):
    g = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim = 5, 6, 2, 32
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=g) * 50
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    qk = qkv[:, : heads + kv_heads]  # a strided view, as in Attention.forward
    want = apply_rope(qk.clone(), (cos, sin))
    v_before = qkv[:, heads + kv_heads :].clone()
    rope_(qk, cos, sin, heads + kv_heads)
    if dtype == torch.float32:  # products may contract into an FMA: an ulp at most
        close(qk, want, max_ulps=2, exact_share=0.9)
    else:
        assert torch.equal(qk, want)  # every product and sum rounded as torch rounds them
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)  # V untouched


@settings(max_examples=examples(25), deadline=None)
@given(tokens=st.integers(1, 6), kv_heads=st.integers(1, 3), group=st.integers(1, 4),
       head_dim=st.sampled_from([8, 16, 24, 64]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 10_000))
def test_rope_and_kv_write_in_one_launch_match_the_two(tokens, kv_heads, group, head_dim, dtype, seed):
    """`rope_write_kv_` leaves the same query heads and the same cache as `rope_` followed by
    the attention backend's K/V write, bit for bit (one kernel, the same roundings), and
    writes nothing for a padding token (slot -1)."""
    from conveyor.kernels.triton_attention import TritonPagedAttention
    from conveyor.kernels.triton_fused import rope_write_kv_

    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=g) * 50
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    slots = torch.randperm(4 * tokens, generator=g)[:tokens]
    slots[torch.rand(tokens, generator=g) < 0.25] = -1
    slots = slots.to(DEVICE)
    cache = torch.randn(2, 4 * tokens, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)

    want_qkv, want_cache = qkv.clone(), cache.clone()
    rope_(want_qkv[:, : heads + kv_heads], cos, sin, heads + kv_heads)
    TritonPagedAttention()._write(want_qkv[:, heads : heads + kv_heads], want_qkv[:, heads + kv_heads :], want_cache,
                                  slots)
    rope_write_kv_(qkv, cos, sin, heads, cache, slots)
    if dtype == torch.float32 and DEVICE.type == "cuda":  # each kernel may contract into FMAs its own way
        close(qkv[:, :heads], want_qkv[:, :heads], max_ulps=2, exact_share=0.9)
        close(cache, want_cache, max_ulps=2, exact_share=0.9)
    else:
        assert torch.equal(qkv[:, :heads], want_qkv[:, :heads])
        assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [128, 1536])
def test_silu_mul_matches_torch(dtype, intermediate):
    g = torch.Generator().manual_seed(intermediate)
    gate_up = (torch.randn(3, 2 * intermediate, generator=g) * 4).to(dtype).to(DEVICE)
    gate, up = gate_up.split(intermediate, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    close(silu_mul(gate_up), want, max_ulps=1, exact_share=0.97)


@settings(max_examples=examples(15), deadline=None)
@given(rows=st.integers(0, 9), hidden=st.sampled_from([16, 48, 80]), seed=st.integers(0, 1000))
def test_any_row_count(rows, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(DEVICE)
    res = torch.randn(rows, hidden, generator=g).to(DEVICE)
    w = torch.rand(hidden, generator=g).to(DEVICE)
    got, s = add_rms_norm(x, res, w, 1e-6)
    assert got.shape == (rows, hidden) and torch.equal(s, res + x)
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(res + x, (hidden,), w, 1e-6))
    assert silu_mul(torch.randn(rows, 2 * hidden, generator=g).to(DEVICE)).shape == (rows, hidden)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_forward_through_the_fused_kernels(tiny_models, dtype, monkeypatch):
    """The whole model with `_use_triton_fused` against the same weights without it: the
    same greedy tokens over a prefill and decodes of a paged cache."""
    from conveyor import LLM, SamplingParams

    path = str(tiny_models["llama"])
    prompts = [[5 + (i * 7 + j * 3) % 300 for j in range(3 + 4 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for fused in (False, True):
        monkeypatch.setenv("CONVEYOR_TRITON_FUSED", "1" if fused else "0")
        llm = LLM(path, device=str(DEVICE), dtype=str(dtype).removeprefix("torch."), num_kv_blocks=128,
                  block_size=4, enforce_eager=True)
        model = llm.engine.runner.model
        if DEVICE.type == "cpu":
            model._use_triton_fused(dtype)  # on CUDA prepare_for_inference has done it
        assert (model.add_norm is not None) == fused
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    plain, fused = runs
    agree = sum(a == b for a, b in zip(plain, fused, strict=True))
    assert agree >= len(prompts) - 1, f"{agree}/{len(prompts)} prompts agree"


def test_model_forward_with_rope_kv_write_and_attention_in_one_kernel(tiny_models, monkeypatch):
    """On the Triton attention backend, the fused kernels rotate, write K/V and attend in one
    launch a layer for a step of decodes (`Attention.rope_attend`, its splits merged in the
    launch), and rotate and write in one launch before the attention for a step with prompts:
    the same greedy tokens as the unfused RoPE, write and attention, over prompts long enough
    for several decode splits. Eager on CUDA too: the calls are counted in Python (an H100
    replayed the graphs captured before the counting, so neither count moved; CUDA graphs of
    the fused path are tests/runner/test_cuda_graphs.py's)."""
    from conveyor import LLM, SamplingParams
    from conveyor.kernels import triton_fused

    path = str(tiny_models["llama"])
    dtype = torch.bfloat16
    prompts = [[5 + (i * 7 + j * 3) % 300 for j in range(3 + 60 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs, calls = [], {"decodes": 0, "write": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    for fused_attention in (False, True):
        monkeypatch.setenv("CONVEYOR_TRITON_FUSED", "1")
        llm = LLM(path, device=str(DEVICE), dtype=str(dtype).removeprefix("torch."), num_kv_blocks=128,
                  block_size=4, enforce_eager=True)  # a CUDA graph's replay would call neither counted path
        model = llm.engine.runner.model
        if DEVICE.type == "cpu":  # on CUDA prepare_for_inference has done both
            model._use_triton_attention(dtype)
            model._use_triton_fused(dtype)
        attentions = [m for m in model.modules() if hasattr(m, "rope_attend")]
        assert all(a.rope_attend is not None and a.backend.merge_splits for a in attentions)
        backend = attentions[0].backend
        backend.decode_split_len = 64  # contexts up to 131: up to 3 splits, merged in the launch
        backend.attend_decodes_rope = counted("decodes", backend.attend_decodes_rope)
        monkeypatch.setattr(triton_fused, "rope_write_kv_", counted("write", triton_fused.rope_write_kv_))
        for a in attentions:
            a.rope_attend = a.rope_attend if fused_attention else None
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert calls["decodes"] and calls["write"]  # both paths of rope_attend ran
    assert runs[0] == runs[1]


@settings(max_examples=examples(20), deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 5000), ties=st.booleans(), seed=st.integers(0, 1000),
       dtype=st.sampled_from(DTYPES))
def test_argmax_matches_torch_first_index_of_a_tie(rows, vocab, ties, seed, dtype):
    from conveyor.kernels.triton_fused import ARGMAX_COUNTERS, argmax

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    if ties:  # the maximum repeated, across chunks too
        logits = logits.round()
        logits[:, torch.randint(0, vocab, (3,), generator=g)] = 9.0
    logits = logits.to(dtype).to(DEVICE)
    assert torch.equal(argmax(logits), logits.argmax(-1))
    counters = ARGMAX_COUNTERS.current  # every row's back at zero for the next launch (a graph's replay)
    assert counters is not None and counters.numel() >= rows and not counters.any()


def test_fused_kernels_are_opt_in(monkeypatch):
    from conveyor.kernels.triton_fused import enabled

    monkeypatch.delenv("CONVEYOR_TRITON_FUSED", raising=False)
    assert not enabled()
    monkeypatch.setenv("CONVEYOR_TRITON_FUSED", "1")
    assert enabled()
    monkeypatch.setenv("CONVEYOR_TRITON", "0")
    assert not enabled()
