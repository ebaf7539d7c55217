"""The elementwise stages of a decoder layer fused in Triton: the CUDA path's answer to a decode
step made of hundreds of one-microsecond kernels.

At batch 1 on an H100 a Llama-3.2-1B-shaped layer ran about 19 small torch kernels besides its
four GEMMs and its attention (residual adds, the norm's casts, RoPE's halves, multiplies and
concatenation, SiLU and the gate product), some 30 µs a layer: a quarter of the step
(BENCHMARKS.md, "CUDA path"). Three kernels replace them, and a fourth takes greedy rows'
argmax:

- `add_rms_norm`: the residual add and the RMSNorm after it, one program per row; it returns
  the normalised row and the new residual (vLLM's fused_add_rms_norm idea).
- `rope_`: the rotation of every query and key head of a token, in place on the fused QKV
  projection's output; `rope_write_kv_`, with the Triton attention backend, rotates the query
  heads in place and writes the rotated key heads and the value heads straight into the paged
  KV cache, so a layer's RoPE and K/V write are one launch. `rope_attend` goes further for a
  step of decodes only: RoPE, the K/V write and the attention are one launch
  (`TritonPagedAttention.attend_decodes_rope`).
- `silu_mul`: SiLU of the gate times the up projection.
- `argmax`: the first index of each row's maximum, over chunks of the vocabulary in one launch
  (the last chunk of a row to finish merges the row).

Each kernel rounds where the torch reference rounds (every torch op of the reference stores
its result in the model dtype; the kernels compute in float32 and round at the same points),
so they agree with the reference but for the summation order of the norm and an FMA the
compiler may contract in float32 (the model uses them in half precision only), and in half
precision for the rare rounding tie that order breaks. They run on CPU tensors
under `TRITON_INTERPRET=1`, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch

from conveyor.kernels.triton_attention import (
    ArrivalCounters,
    TritonPagedAttention,
    _jit,
    _pow2,
    _rnd,
    _rotate,
    opted_in,
    tl,
    triton,
    triton_available,
)
from conveyor.models.attention import AttentionMetadata

__all__ = ["add_rms_norm", "argmax", "enabled", "rope_", "rope_attend", "rope_write_kv_", "silu_mul", "triton_available"]


def enabled() -> bool:
    """Whether the CUDA path uses these kernels: opt-in with `CONVEYOR_TRITON_FUSED=1`, never
    with `CONVEYOR_TRITON=0`, and only where Triton can run. On an H100 they took a batch-1 step
    of Llama-3.2-1B's shape from 1.88 to 1.37 ms (BENCHMARKS.md, thirty-fourth session); they
    stay opt-in until they are measured at hundreds of sequences and on a whole workload."""
    return opted_in("CONVEYOR_TRITON_FUSED")


@_jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out, n, eps,
    HAS_DELTA: tl.constexpr, IS_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    s = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        s = _rnd(s.to(tl.float32) + x.to(tl.float32), s.dtype, IS_BF16).to(s.dtype)  # `h = x + a`
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
    f = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(f * f, 0) / n + eps)
    normed = _rnd(f * inv, s.dtype, IS_BF16)  # half precision: rounded before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, _rnd(w * normed, s.dtype, IS_BF16).to(s.dtype), mask=mask)


def add_rms_norm(
    delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(residual + delta) * weight, residual + delta)` over rows `[T, hidden]`; with
    `delta=None`, the norm of `residual` itself (which is returned as is)."""
    rows, n = residual.shape
    out = torch.empty_like(residual)
    res_out = residual if delta is None else torch.empty_like(residual)
    if rows:
        x = residual if delta is None else delta
        assert x.stride(-1) == 1 and residual.stride(-1) == 1 and x.dtype == residual.dtype
        _add_rms_norm_kernel[(rows,)](
            x, residual, weight, out, res_out,
            x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), n, eps,
            HAS_DELTA=delta is not None, IS_BF16=residual.dtype == torch.bfloat16, BLOCK=_pow2(n, 16), num_warps=8 if n >= 4096 else 4,
        )
    return out, res_out


@_jit
def _rope_kernel(
    qk_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_cos, heads,
    HALF: tl.constexpr, IS_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < HALF)
    base = qk_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    c = tl.load(cos_ptr + t * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1.to(tl.float32), x2.to(tl.float32), c, s, dt, IS_BF16)
    tl.store(base, o1.to(dt), mask=mask)
    tl.store(base + HALF, o2.to(dt), mask=mask)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
    """Rotate `qk` `[T, heads, head_dim]` in place (the HF / NeoX halves layout). `cos` and
    `sin` are the step's tables `[T, 1, head_dim/2]` in the model dtype (`Rotary.forward`)."""
    tokens, _, head_dim = qk.shape
    if not tokens:
        return
    assert qk.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    half = head_dim // 2
    _rope_kernel[(tokens,)](
        qk, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0), heads,
        HALF=half, IS_BF16=qk.dtype == torch.bfloat16, BLOCK_H=_pow2(heads), BLOCK_D=_pow2(half),
    )


@_jit
def _rope_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
    stride_t, stride_h, stride_cos, stride_kv, stride_slot, stride_head,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    IS_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_FULL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * stride_t
    d = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(cos_ptr + t * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    # The query heads, rotated in place as `_rope_kernel` rotates them.
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < HEADS) & (d < HALF)
    q1 = tl.load(row + h * stride_h + d, mask=mask, other=0.0)
    q2 = tl.load(row + h * stride_h + d + HALF, mask=mask, other=0.0)
    dt = q1.dtype
    o1, o2 = _rotate(q1.to(tl.float32), q2.to(tl.float32), c, s, dt, IS_BF16)
    tl.store(row + h * stride_h + d, o1.to(dt), mask=mask)
    tl.store(row + h * stride_h + d + HALF, o2.to(dt), mask=mask)
    # The key heads, rotated the same way, and the value heads go to the token's cache slot (a
    # negative slot is padding: nothing is written).
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    hk = tl.arange(0, BLOCK_KV)[:, None]
    kmask = (hk < KV_HEADS) & (d < HALF)
    kbase = row + (HEADS + hk) * stride_h + d
    k1 = tl.load(kbase, mask=kmask, other=0.0).to(tl.float32)
    k2 = tl.load(kbase + HALF, mask=kmask, other=0.0).to(tl.float32)
    o1, o2 = _rotate(k1, k2, c, s, dt, IS_BF16)
    dst = cache_ptr + slot * stride_slot + hk * stride_head + d
    tl.store(dst, o1.to(dt), mask=kmask)
    tl.store(dst + HALF, o2.to(dt), mask=kmask)
    f = tl.arange(0, BLOCK_FULL)[None, :]
    vmask = (hk < KV_HEADS) & (f < HEAD_DIM)
    v = tl.load(row + (HEADS + KV_HEADS + hk) * stride_h + f, mask=vmask, other=0.0)
    tl.store(cache_ptr + stride_kv + slot * stride_slot + hk * stride_head + f, v, mask=vmask)


def rope_write_kv_(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """RoPE and the K/V cache write of a step in one launch: `qkv` `[T, heads + 2 kv_heads,
    head_dim]` is the fused projection's output; its query heads are rotated in place, its key
    heads rotated into the cache (`[2, slots, kv_heads, head_dim]`) at `slots` (negative:
    padding), its value heads copied there. The same values as `rope_` followed by the
    attention backend's write (`TritonPagedAttention.attend_cached` then reads them)."""
    tokens, total, head_dim = qkv.shape
    if not tokens:
        return
    kv_heads = kv_cache.shape[2]
    assert total == heads + 2 * kv_heads and kv_cache.shape[3] == head_dim and kv_cache.dtype == qkv.dtype
    assert qkv.stride(-1) == 1 and kv_cache.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
    half = head_dim // 2
    _rope_write_kv_kernel[(tokens,)](
        qkv, cos, sin, kv_cache, slots, qkv.stride(0), qkv.stride(1), cos.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        HEADS=heads, KV_HEADS=kv_heads, HALF=half, HEAD_DIM=head_dim, IS_BF16=qkv.dtype == torch.bfloat16,
        BLOCK_H=_pow2(heads), BLOCK_KV=_pow2(kv_heads), BLOCK_D=_pow2(half), BLOCK_FULL=_pow2(head_dim),
    )


def rope_attend(
    backend: TritonPagedAttention, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, one_launch: bool = True,
) -> torch.Tensor:
    """RoPE, the K/V write and paged attention of a layer, from the fused projection's output
    `qkv` `[T, heads + 2 kv_heads, head_dim]`; returns `[T, heads, head_dim]`. A step of
    decodes only (every CUDA-graphed step) takes one launch (`attend_decodes_rope`); a step
    with prompts, or any step with `one_launch=False`, two: `rope_write_kv_`, then
    `attend_cached`."""
    if one_launch and not meta.prefills and meta.decode_paths is None:
        return backend.attend_decodes_rope(qkv, cos, sin, kv_cache, meta, scale)
    rope_write_kv_(qkv, cos, sin, heads, kv_cache, meta.slot_mapping)
    return backend.attend_cached(qkv[:, :heads], kv_cache, meta, scale)


@_jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = _rnd(gf / (1.0 + tl.exp(-gf)), g.dtype, IS_BF16)  # silu(gate), rounded
    tl.store(out_ptr + row * stride_out + cols, _rnd(act * u.to(tl.float32), g.dtype, IS_BF16).to(g.dtype),
             mask=mask)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up = [gate | up]` of shape `[T, 2 * intermediate]`."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        assert gate_up.stride(-1) == 1
        _silu_mul_kernel[(rows, triton.cdiv(n, SILU_BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, IS_BF16=gate_up.dtype == torch.bfloat16,
            BLOCK=SILU_BLOCK,
        )
    return out


@_jit
def _merge_argmax(part_val, part_idx, tokens_ptr, rows, row_mask, programs,
                  BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """Each row's token from its blocks' partials `[rows, programs]` (each block's largest
    value and that value's first column), which other programs of this launch stored (read
    past the L1): the column of the first block holding the row's maximum, `BLOCK_P` blocks
    at a time. The merge of both one-launch argmaxes: `_argmax_kernel`'s chunks and the
    LM head GEMV's column blocks (`triton_gemv.linear_argmax`)."""
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    at = tl.zeros([BLOCK_M], tl.int32)
    for p0 in range(0, programs, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        m = row_mask[:, None] & (ps < programs)[None, :]
        v = tl.load(part_val + rows[:, None] * programs + ps[None, :], mask=m, other=float("-inf"),
                    cache_modifier=".cg")
        v_max = tl.max(v, 1)
        take = v_max > best  # strictly: an earlier block keeps a tie
        at = tl.where(take, p0 + tl.argmax(v, 1, tie_break_left=True), at)
        best = tl.where(take, v_max, best)
    token = tl.load(part_idx + rows * programs + at, mask=row_mask, other=0, cache_modifier=".cg")
    tl.store(tokens_ptr + rows, token, mask=row_mask)


@_jit
def _argmax_kernel(x_ptr, val_ptr, idx_ptr, out_ptr, counters, stride_row, n, chunks,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of one row: its maximum and first index, stored; the row's last chunk to
    arrive (an acquire-release count at GPU scope after a barrier, one counter a row) merges
    the row (`_merge_argmax`), and zeroes the counter for the next launch."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_row + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    tl.store(val_ptr + row * chunks + c, tl.max(x, 0))
    tl.store(idx_ptr + row * chunks + c, c * CHUNK + tl.argmax(x, 0, tie_break_left=True))
    tl.debug_barrier()
    arrived = tl.atomic_add(counters + row, 1, sem="acq_rel", scope="gpu")
    if arrived == chunks - 1:
        rows = row + tl.arange(0, 1)
        _merge_argmax(val_ptr, idx_ptr, out_ptr, rows, rows == row, chunks, 1, BLOCK)
        tl.store(counters + row, 0)


ARGMAX_CHUNK = 2048
ARGMAX_COUNTERS = ArrivalCounters("argmax", 1024)  # one a row
ARGMAX_MERGE_BLOCK = 1024  # partials an argmax's merge reads at a time (an LM head GEMV of 128k: 4 times)


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`logits.argmax(-1)` for `[rows, vocab]` (the first index of a tie, as torch), into `out`
    if given, in one launch over chunks of the vocabulary, whose last chunk to finish a row
    merges it: torch's one reduction per row took 27 µs over Llama-3's 128,256 entries at
    batch 1 on an H100 (BENCHMARKS.md, "CUDA path")."""
    rows, n = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.long, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.long and out.stride(0) == 1
    if rows == 0 or n == 0:
        return logits.argmax(-1) if n == 0 else out
    assert logits.stride(-1) == 1
    chunks = triton.cdiv(n, ARGMAX_CHUNK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, chunks), dtype=torch.int64, device=logits.device)
    counters = ARGMAX_COUNTERS.get(rows, logits.device)
    _argmax_kernel[(rows, chunks)](logits, vals, idx, out, counters, logits.stride(0), n, chunks,
                                   CHUNK=ARGMAX_CHUNK, BLOCK=_pow2(min(chunks, ARGMAX_MERGE_BLOCK), 16))
    return out
