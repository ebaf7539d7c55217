"""Paged attention in Triton: the CUDA backend, tested on CPU through Triton's interpreter.

Three kernels, all reading K/V in place through block tables (no gather, no padding copies):

- `_write_kv_kernel`: one program per new token, stores its K and V at `slot_mapping[t]`
  (negative slots are padding and skipped).
- decode (flash-decoding): one program per (sequence, kv head, KV split). All query heads of
  a kv-head group sit in one program, so each K/V tile is read once per group. Each split
  leaves a normalised partial output and its log-sum-exp; `_decode_reduce_kernel` merges the
  splits. With one split the first kernel writes the output directly. With
  `merge_splits=True` there is no second launch: each split counts itself in (an atomic
  counter per sequence and kv head) and the last one to arrive merges them, as the reduce
  would, then zeroes the counter for the next launch (a CUDA graph replays it as it is).
  `attend_decodes_rope` folds in RoPE and the K/V write as well: the kernel reads the fused
  QKV projection's output, rotates its query heads, and the split that holds the new token
  writes that token's rotated key and its value to the cache before it attends. A decode
  layer's attention is then one launch. A program sees only its own sequence's writes, so
  the scheduler never lets a sequence of a step of decodes only read another's new K/V as a
  prefix-cache hit (`Scheduler._emit`).
- prefill: one launch for every prefill span, fresh or chunked. A program takes a tile of
  query rows (tokens x heads of one kv-head group) of one sequence and loops over that
  sequence's context, cached prefix and this step's tokens alike (the write kernel has
  already put them in the cache); the causal mask compares absolute positions.

Softmax is online, in float32, with exp2 (the scale is pre-multiplied by log2 e). A missing
sliding window is a window wider than any context, so there is one code path. Kernels take
strides, so q/k/v may be the strided head views of a fused QKV projection (last dim contiguous).

Triton is optional: without it this module still imports and `triton_available()` is False.
Under `TRITON_INTERPRET=1` (set before this module is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from conveyor.models.attention import (
    AttentionBackend,
    AttentionMetadata,
    CrossMetadata,
    PrefillSpan,
    TorchPagedAttention,
    gather_blocks,
    to_device,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: the backend is simply unavailable
    triton = None
    tl = None

MAX_HEAD_DIM = 256
NO_WINDOW = 1 << 30  # wider than any context: the window mask keeps every position
LOG2_E = 1.4426950408889634
DECODE_BLOCK_N = 64  # KV positions per tile in decode
PREFILL_BLOCK_M = 64  # query rows (tokens x heads of a group) per prefill program
PREFILL_BLOCK_N = 64
MIN_SPLIT_LEN = 256  # a decode split is never shorter than this (default heuristic)
MAX_SPLITS = 32


def triton_available() -> bool:
    """True when the kernels can run here: triton imports, and there is a CUDA device or the
    interpreter is on (`TRITON_INTERPRET=1`)."""
    if triton is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def opted_in(variable: str) -> bool:
    """Whether the opt-in kernels switched on by `variable` (`CONVEYOR_TRITON_FUSED`,
    `CONVEYOR_TRITON_GEMV`) run: set to 1, never with `CONVEYOR_TRITON=0`, and only where
    Triton can run."""
    return (os.environ.get(variable, "0") == "1" and os.environ.get("CONVEYOR_TRITON", "1") != "0"
            and triton_available())


def pdl_enabled() -> bool:
    """Whether the CUDA path uses programmatic dependent launch: opt-in with
    `CONVEYOR_TRITON_PDL=1` until measured, on a CUDA device of compute capability 9 or more
    (the interpreter has no grid dependencies). The GEMVs (`triton_gemv`) then launch early
    and wait for their input; the attention kernels let such a launch start
    (`gdc_launch_dependents`) as soon as all their programs run."""
    return (opted_in("CONVEYOR_TRITON_PDL") and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)


def _jit(fn: Callable[..., None]) -> Any:
    """`triton.jit`, or the bare function when triton is absent (it is then never called)."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _rnd(x, dt, IS_BF16: tl.constexpr):
    """float32 `x` rounded to the nearest `dt` (ties to even), kept in float32. bfloat16 is
    rounded on the bits: Triton's interpreter truncates a float32 -> bfloat16 cast, and the
    tests that run there check the rounding. float16 too (`_rnd_f16`): through casts, the
    compiler narrows a product of half-precision values and the sum after it to half-precision
    arithmetic and contracts the two into one half FMA (one rounding where torch makes two; seen
    in the PTX and, on an H100, as RoPE one ulp off torch's)."""
    if IS_BF16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, b.to(tl.float32, bitcast=True))  # a NaN's carry must not make it infinite
    elif dt == tl.float16:
        return _rnd_f16(x)
    else:
        return x.to(dt).to(tl.float32)


@_jit
def _rnd_f16(x):
    """float32 `x` rounded to the nearest float16 (ties to even) on the bits, kept in float32:
    the mantissa at bit 13 in float16's normal range; below it (2^-14) float16's subnormals are
    the multiples of 2^-24, which adding and taking away 0.75 (whose ulp is 2^-24) rounds to;
    past 65504, infinity. No cast for the compiler to narrow (`_rnd`)."""
    b = x.to(tl.uint32, bitcast=True)
    sign = b & 0x80000000
    mag = b & 0x7FFFFFFF
    a = mag.to(tl.float32, bitcast=True)
    normal = ((mag + 0xFFF + ((mag >> 13) & 1)) & 0xFFFFE000).to(tl.float32, bitcast=True)
    r = tl.where(a < 6.103515625e-05, (a + 0.75) - 0.75, normal)
    r = tl.where(r > 65504.0, float("inf"), r)
    r = tl.where(a != a, a, r)  # NaN stays NaN
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@_jit
def _rotate(a1, a2, c, s, dt, IS_BF16: tl.constexpr):
    """RoPE of the halves `a1`, `a2` (float32): a1*cos - a2*sin and a2*cos + a1*sin, each
    product and each sum rounded to `dt` as torch rounds them."""
    o1 = _rnd(_rnd(a1 * c, dt, IS_BF16) - _rnd(a2 * s, dt, IS_BF16), dt, IS_BF16)
    o2 = _rnd(_rnd(a2 * c, dt, IS_BF16) + _rnd(a1 * s, dt, IS_BF16), dt, IS_BF16)
    return o1, o2


@_jit
def _rope_heads(ptr, cos_row, sin_row, heads_off, head_mask, d, HEAD_DIM: tl.constexpr, IS_BF16: tl.constexpr):
    """Whole heads `[rows, BLOCK_D]` at `ptr + heads_off[:, None] + d`, rotated (the halves
    layout) with the rounding of `_rotate`: each position reads its partner in the other half,
    and x*cos - p*sin is x*cos + (-1)*p*sin, bit for bit. Returns them in the input dtype."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d_mask = d < HEAD_DIM
    first = d < HALF
    mask = head_mask[:, None] & d_mask[None, :]
    x = tl.load(ptr + heads_off[:, None] + d[None, :], mask=mask, other=0.0)
    partner = tl.where(first, d + HALF, d - HALF)
    p = tl.load(ptr + heads_off[:, None] + partner[None, :], mask=mask, other=0.0)
    freq = tl.where(first, d, d - HALF)
    c = tl.load(cos_row + freq, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_row + freq, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    dt = x.dtype
    sign = tl.where(first, -1.0, 1.0)[None, :]
    rot = _rnd(_rnd(x.to(tl.float32) * c, dt, IS_BF16) + sign * _rnd(p.to(tl.float32) * s, dt, IS_BF16), dt, IS_BF16)
    return rot.to(dt)


@_jit
def _softcap_log2(s, scale_log2, softcap):
    """Scores `q.k` as `cap * tanh(q.k * scale / cap)` in the log2 domain (Gemma 2), tanh from
    one exp2 of a non-positive argument: no overflow."""
    log2e = 1.4426950408889634  # (LOG2_E: a kernel reads no Python globals)
    x = s * (scale_log2 / log2e) / softcap
    t = tl.exp2(-2.0 * log2e * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -th, th) * (softcap * log2e)


@_jit
def _with_sinks(m, lsum, acc, sinks, heads, head_mask):
    """The normalized output of running (max, sum, output) with each row's head's sink logit
    in the softmax's denominator (gpt-oss), in the log2 domain of the scores."""
    sink = tl.load(sinks + heads, mask=head_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    top = tl.maximum(m, sink)
    alpha = tl.exp2(tl.where(m == float("-inf"), float("-inf"), m - top))
    return acc * (alpha / (lsum * alpha + tl.exp2(sink - top)))[:, None]


@_jit
def _attend_tile(
    q, k_cache, v_cache, table, pos, p_mask, keep, kv_head, d, d_mask,
    m, lsum, acc, scale_log2, softcap, stride_slot, stride_head, PAGE: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One online-softmax step of query rows `q` over the KV positions `pos` (read in place
    through the block table; `p_mask` marks real positions, `keep` the (row, position) pairs
    that may attend). Returns the updated running max, sum and output."""
    block = tl.load(table + pos // PAGE, mask=p_mask, other=0).to(tl.int64)
    kv_off = (block * PAGE + pos % PAGE) * stride_slot + kv_head * stride_head
    k = tl.load(k_cache + kv_off[None, :] + d[:, None], mask=p_mask[None, :] & d_mask[:, None], other=0.0)
    if SOFTCAP:
        s = _softcap_log2(tl.dot(q, k, input_precision="ieee"), scale_log2, softcap)
    else:
        s = tl.dot(q, k, input_precision="ieee") * scale_log2  # [rows, positions]
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row may see nothing in this tile yet (window, causal): keep exp2 away from -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    v = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, lsum, acc


@_jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv, stride_slot, stride_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + slot * stride_slot + h * stride_head + d
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_kv, v, mask=mask)


@_jit
def _merge_head(
    part_out, part_lse, out_ptr, seq, head, stride_ot, stride_oh, num_splits, sinks,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):
    """One head's output from its splits' partial outputs, weighted by their log-sum-exps (and
    the head's sink logit in the denominator, with `SINKS`). The partials are read past the
    L1 (`.cg`): in the one-launch merge other programs wrote them during this launch."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + s
    lse = tl.load(part_lse + row, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
    if SINKS:
        sink = tl.load(sinks + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(tl.max(lse, 0), sink)
        weight = tl.exp2(lse - top)
        weight = weight / (tl.sum(weight, 0) + tl.exp2(sink - top))
    else:
        weight = tl.exp2(lse - tl.max(lse, 0))  # at least one split holds the query's own token
        weight = weight / tl.sum(weight, 0)
    parts = tl.load(part_out + row[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None] & (d < HEAD_DIM)[None, :],
                    other=0.0, cache_modifier=".cg")
    out = tl.sum(parts * weight[:, None], 0)
    dst = out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@_jit
def _decode_split_kernel(
    q_ptr, k_cache, v_cache, tables, context_lens, out_ptr, part_out, part_lse, counters,
    cos_ptr, sin_ptr, slot_ptr, sinks,
    scale_log2, window, split_len, num_splits, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table, stride_slot, stride_head, stride_cos,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    DIRECT: tl.constexpr, MERGE: tl.constexpr, ROPE: tl.constexpr, IS_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    TRIGGER: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    if TRIGGER:  # the next kernel (a GEMV launched with PDL) may start loading its weights
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    context = tl.load(context_lens + seq).to(tl.int32)
    # This split's positions, clipped to the context and to the window of the one query
    # (position context - 1). Every tile starts at a valid position, so no row is all -inf.
    lo = tl.maximum(split * split_len, context - window)
    hi = tl.minimum((split + 1) * split_len, context)

    g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    head_mask = g < GROUP
    d_mask = d < HEAD_DIM
    row_ptr = q_ptr + seq.to(tl.int64) * stride_qt
    if ROPE:  # q_ptr is the fused projection's output: [T, heads + 2 kv heads, head_dim]
        cos_row = cos_ptr + seq.to(tl.int64) * stride_cos
        sin_row = sin_ptr + seq.to(tl.int64) * stride_cos
        q = _rope_heads(row_ptr, cos_row, sin_row, heads * stride_qh, head_mask, d, HEAD_DIM, IS_BF16)
        # The split holding the new token (position context - 1) writes its key, rotated, and
        # its value into the token's cache slot (negative: padding), then attends over it.
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        if (split * split_len <= context - 1) & (context - 1 < (split + 1) * split_len) & (slot >= 0):
            r = tl.arange(0, 1)  # the one key head of this program, as a row
            k = _rope_heads(row_ptr, cos_row, sin_row, (NUM_HEADS + kv_head) * stride_qh + r, r < 1, d, HEAD_DIM,
                            IS_BF16)
            dst = slot * stride_slot + kv_head * stride_head + r[:, None] + d[None, :]
            kv_mask = (r < 1)[:, None] & d_mask[None, :]
            tl.store(k_cache + dst, k, mask=kv_mask)
            v_off = (NUM_HEADS + num_kv_heads + kv_head) * stride_qh + r[:, None] + d[None, :]
            tl.store(v_cache + dst, tl.load(row_ptr + v_off, mask=kv_mask, other=0.0), mask=kv_mask)
        tl.debug_barrier()  # the writes are visible to every thread of the program
    else:
        q = tl.load(
            row_ptr + heads[:, None] * stride_qh + d[None, :],
            mask=head_mask[:, None] & d_mask[None, :], other=0.0,
        )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = tables + seq.to(tl.int64) * stride_table
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < hi
        m, lsum, acc = _attend_tile(q, k_cache, v_cache, table, pos, p_mask, p_mask[None, :], kv_head, d, d_mask,
                                    m, lsum, acc, scale_log2, softcap, stride_slot, stride_head, PAGE, SOFTCAP)

    nonempty = lsum > 0  # a split past the context or before the window is empty
    out = acc / tl.where(nonempty, lsum, 1.0)[:, None]
    out_mask = head_mask[:, None] & d_mask[None, :]
    if DIRECT:  # a single split: its output is final
        if SINKS:
            out = _with_sinks(m, lsum, acc, sinks, heads, head_mask)
        dst = out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (seq.to(tl.int64) * NUM_HEADS + heads) * num_splits + split  # [D, H, S] layout
        tl.store(part_out + row[:, None] * BLOCK_D + d[None, :], out, mask=out_mask)
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, lsum, 1.0)), float("-inf"))
        tl.store(part_lse + row, lse, mask=head_mask)
        if MERGE:
            # Every thread's stores are issued before the count; the count is acquire-release
            # at GPU scope, so the last split to arrive sees every split's partials.
            tl.debug_barrier()
            counter = counters + seq * num_kv_heads + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                for h in range(GROUP):
                    _merge_head(part_out, part_lse, out_ptr, seq, kv_head * GROUP + h, stride_ot, stride_oh,
                                num_splits, sinks, NUM_HEADS, HEAD_DIM, BLOCK_S, BLOCK_D, SINKS)
                tl.store(counter, 0)  # zero again for the next launch


@_jit
def _decode_reduce_kernel(
    part_out, part_lse, out_ptr, stride_ot, stride_oh, num_splits, sinks,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    TRIGGER: tl.constexpr, SINKS: tl.constexpr,
):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    _merge_head(part_out, part_lse, out_ptr, tl.program_id(0), tl.program_id(1), stride_ot, stride_oh, num_splits,
                sinks, NUM_HEADS, HEAD_DIM, BLOCK_S, BLOCK_D, SINKS)


@_jit
def _prefill_kernel(
    q_ptr, k_cache, v_cache, out_ptr, tables, spans, sinks,
    scale_log2, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table, stride_slot, stride_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TRIGGER: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    row_start = tl.load(spans + seq * 3)
    num_tokens = tl.load(spans + seq * 3 + 1)
    start_pos = tl.load(spans + seq * 3 + 2)
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    first = tile * TOKENS
    if first >= num_tokens:  # the grid is sized for the longest span
        return

    r = tl.arange(0, BLOCK_M)
    token = first + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    r_mask = (r < TOKENS * GROUP) & (token < num_tokens)
    q_pos = start_pos + token
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = (row_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=r_mask[:, None] & d_mask[None, :], other=0.0,
    )
    last = start_pos + tl.minimum(first + TOKENS, num_tokens)  # one past the tile's last query
    lo = tl.maximum(start_pos + first - window + 1, 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables + seq.to(tl.int64) * stride_table
    for start in range(lo, last, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < last
        keep = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window) & p_mask[None, :]
        m, lsum, acc = _attend_tile(q, k_cache, v_cache, table, pos, p_mask, keep, kv_head, d, d_mask,
                                    m, lsum, acc, scale_log2, softcap, stride_slot, stride_head, PAGE, SOFTCAP)

    if SINKS:
        out = _with_sinks(m, lsum, acc, sinks, heads, r_mask)
    else:
        out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


class PrefillPlan(NamedTuple):
    """The per-step launch data of the prefill kernel, built once and shared by every layer."""

    spans: torch.Tensor  # [num_prefills, 3] int32: first row, number of new tokens, start_pos
    tables: torch.Tensor  # [num_prefills, max_blocks] block tables (meta.prefill_blocks)
    max_tokens: int  # the longest span, which sizes the grid


def prefill_plan(meta: AttentionMetadata) -> PrefillPlan | None:
    """The prefill kernel's inputs for `meta`, or None when the step has no prefills."""
    if not meta.prefills:
        return None
    if meta.prefill_blocks is None:
        raise ValueError("metadata has prefills but no prefill_blocks (build it with build_metadata)")
    rows = [(p.token_start, p.token_end - p.token_start, p.start_pos) for p in meta.prefills]
    spans = to_device(torch.tensor(rows, dtype=torch.int32), meta.prefill_blocks.device)
    return PrefillPlan(spans, meta.prefill_blocks, max(n for _, n, _ in rows))


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << (n - 1).bit_length())


class ArrivalCounters:
    """int32 counters at zero for a kernel whose last program to arrive merges the others'
    partials (the one-launch decode's splits, the LM head GEMV's argmax, the one-launch
    argmax). Each launch leaves its counters at zero, so they are allocated once, outside any
    CUDA graph capture (the eager run before each capture allocates what the graph will need),
    at least `at_least` of them. A launch that needs more gets a larger buffer; the outgrown one
    is kept (`retired`), because graphs captured earlier still read it."""

    def __init__(self, what: str, at_least: int = 1) -> None:
        self.what = what
        self.at_least = at_least
        self.current: torch.Tensor | None = None
        self.retired: list[torch.Tensor] = []

    def get(self, n: int, device: torch.device) -> torch.Tensor:
        if device.type == "cuda" and device.index is None:  # "cuda" is the tensors' cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        counters = self.current
        if counters is None or counters.numel() < n or counters.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"the {self.what} counters must be allocated before a CUDA graph capture")
            if counters is not None:  # graphs captured earlier still point at it: never freed
                self.retired.append(counters)
            counters = self.current = torch.zeros(max(n, self.at_least), dtype=torch.int32, device=device)
        return counters


class TritonPagedAttention(AttentionBackend):
    """Paged attention in Triton kernels: fp32 / fp16 / bf16 inputs, fp32 accumulation.

    q/k/v and the cache must share a dtype and device; head_dim is at most 256 (any value:
    tiles are padded and masked); the cache's block size may be any positive integer.
    One instance serves every layer: the prefill plan is built on the first layer's call
    for a given metadata object and reused by the others.
    """

    def __init__(
        self, sliding_window: int | None = None, decode_split_len: int | None = None, merge_splits: bool = False,
        softcap: float = 0.0,
    ) -> None:
        """`decode_split_len` fixes the KV positions per decode split (rounded up to a whole
        number of DECODE_BLOCK_N tiles); by default the number of splits fills the GPU when
        there are few (sequence, kv head) pairs, and is 1 off CUDA. `merge_splits`: the last
        split to finish merges them, in the decode launch itself (no reduce launch).
        `softcap`: each score `cap * tanh(score / cap)` (Gemma 2; 0: none). A layer with sinks
        (gpt-oss) sets `sinks` `[heads]` before its call: each softmax's denominator takes
        exp(sink) too."""
        if not triton_available():
            raise RuntimeError("TritonPagedAttention needs triton and a CUDA device (or TRITON_INTERPRET=1)")
        if decode_split_len is not None and decode_split_len < 1:
            raise ValueError(f"decode_split_len must be positive, got {decode_split_len}")
        self.window = sliding_window or NO_WINDOW
        self.softcap = softcap
        self.sinks: torch.Tensor | None = None
        self.decode_split_len = decode_split_len
        self.merge_splits = merge_splits
        self._plan_meta: AttentionMetadata | None = None
        self._plan: PrefillPlan | None = None
        self._num_sms: int | None = None
        # One per (sequence, kv head) for the one-launch merge. The first 1024 cover every
        # step the default heuristic splits (it splits only while sequences x kv heads are
        # under twice the SMs); a fixed `decode_split_len` can need more.
        self.counters = ArrivalCounters("decode split", 1024)
        self.pdl = pdl_enabled()  # the kernels after attention (GEMVs) may launch early

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _check(q, k, v, kv_cache)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        self._write(k, v, kv_cache, meta.slot_mapping)
        return self.attend_cached(q, kv_cache, meta, scale)

    def attend_cached(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """`forward` for a step whose K/V are already in the cache (`triton_fused.rope_write_kv_`
        wrote them): only the attention itself."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            self._decode(q, kv_cache, meta, scale, out)
        if meta.prefills:
            self._prefill(q, kv_cache, meta, scale, out)
        return out

    def attend_decodes_rope(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """A step of decodes only, from the fused projection's output `qkv` `[T, heads + 2
        kv_heads, head_dim]` and the step's RoPE tables `cos`, `sin` `[T, 1, head_dim / 2]`:
        RoPE, the K/V write and the attention in one launch. Returns `[T, heads, head_dim]`,
        the values of `triton_fused.rope_write_kv_` then `attend_cached` (and the same cache);
        `qkv` is left as it was."""
        if meta.prefills or meta.num_decodes != qkv.shape[0]:
            raise ValueError("attend_decodes_rope takes a step of decodes only")
        kv_heads = kv_cache.shape[2]
        heads = qkv.shape[1] - 2 * kv_heads
        assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
        assert qkv.dtype == kv_cache.dtype and qkv.shape[2] == kv_cache.shape[3] and qkv.shape[2] % 2 == 0
        out = torch.empty((qkv.shape[0], heads, qkv.shape[2]), dtype=qkv.dtype, device=qkv.device)
        self._decode(qkv, kv_cache, meta, scale, out, rope=(cos, sin, meta.slot_mapping))
        return out

    def cross(self, q: torch.Tensor, kv_cache: torch.Tensor, cross: CrossMetadata, scale: float) -> torch.Tensor:
        """Cross-attention (Whisper's): each row a decode over all its sequence's encoder
        positions in the cache, through the decode kernel (split over the positions)."""
        assert self.window == NO_WINDOW and not self.softcap and self.sinks is None
        q = q if q.stride(-1) == 1 else q.contiguous()
        none = cross.row_lens[:0]
        meta = AttentionMetadata(cross.block_size, none, none, q.shape[0], decode_blocks=cross.row_tables,
                                 decode_context_lens=cross.row_lens)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._decode(q, kv_cache, meta, scale, out)
        return out

    def _write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        tokens, kv_heads, head_dim = k.shape
        if tokens == 0:
            return
        _write_kv_kernel[(tokens,)](
            k, v, kv_cache, slots,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=_pow2(kv_heads), BLOCK_D=_pow2(head_dim),
        )

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The decode rows' attention into `out`; with `rope` (cos, sin, slots), `q` is the
        fused projection's output and the kernel rotates and writes K/V itself."""
        assert meta.decode_blocks is not None and meta.decode_context_lens is not None
        if meta.decode_paths is not None:  # a token tree's rows (an EAGLE head's): the torch reference's
            assert rope is None and not self.softcap and self.sinks is None
            nd = meta.num_decodes
            out[:nd] = TorchPagedAttention().decode(q[:nd], kv_cache[0], kv_cache[1], meta, scale)
            return
        num_decodes = meta.num_decodes
        heads, head_dim = out.shape[1], out.shape[2]
        kv_heads = kv_cache.shape[2]
        group = heads // kv_heads
        max_len = meta.decode_blocks.shape[1] * meta.block_size  # a host-side bound: no sync
        split_len = self._split_len(num_decodes * kv_heads, max_len, q.device)
        splits = triton.cdiv(max_len, split_len)
        block_d = _pow2(head_dim, 16)
        merge = self.merge_splits and splits > 1
        if splits > 1:
            part_out = torch.empty(num_decodes, heads, splits, block_d, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(num_decodes, heads, splits, dtype=torch.float32, device=q.device)
        else:
            part_out = part_lse = out  # unused: the kernel writes `out` directly
        counters = self.counters.get(num_decodes * kv_heads, q.device) if merge else out
        cos, sin, slots = rope if rope is not None else (out, out, out)  # unused without rope
        sinks = self.sinks if self.sinks is not None else out  # (unused without sinks)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        _decode_split_kernel[(num_decodes, kv_heads, splits)](
            q, k_cache, v_cache, meta.decode_blocks, meta.decode_context_lens, out, part_out, part_lse, counters,
            cos, sin, slots, sinks,
            scale * LOG2_E, self.window, split_len, splits, self.softcap or 1.0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.decode_blocks.stride(0),
            k_cache.stride(0), k_cache.stride(1), cos.stride(0),
            NUM_HEADS=heads, GROUP=group, HEAD_DIM=head_dim, PAGE=meta.block_size, DIRECT=splits == 1,
            MERGE=merge, ROPE=rope is not None, IS_BF16=q.dtype == torch.bfloat16,
            BLOCK_H=_pow2(group, 16), BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, BLOCK_S=_pow2(splits),
            TRIGGER=self.pdl and (splits == 1 or merge), SOFTCAP=bool(self.softcap), SINKS=self.sinks is not None,
            num_warps=4,
        )
        if splits > 1 and not merge:
            _decode_reduce_kernel[(num_decodes, heads)](
                part_out, part_lse, out, out.stride(0), out.stride(1), splits, sinks,
                NUM_HEADS=heads, HEAD_DIM=head_dim, BLOCK_S=_pow2(splits), BLOCK_D=block_d, TRIGGER=self.pdl,
                SINKS=self.sinks is not None,
            )

    def _prefill(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> None:
        if meta is not self._plan_meta:
            self._plan_meta, self._plan = meta, prefill_plan(meta)
        plan = self._plan
        assert plan is not None
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = kv_cache.shape[2]
        group = heads // kv_heads
        block_m = _pow2(group, PREFILL_BLOCK_M)
        block_d = _pow2(head_dim, 16)
        tokens_per_tile = block_m // group
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # Tiles on the grid's first axis, the only one not capped at 65535 on CUDA.
        grid = (triton.cdiv(plan.max_tokens, tokens_per_tile), len(meta.prefills), kv_heads)
        _prefill_kernel[grid](
            q, k_cache, v_cache, out, plan.tables, plan.spans, self.sinks if self.sinks is not None else out,
            scale * LOG2_E, self.window, self.softcap or 1.0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), plan.tables.stride(0),
            k_cache.stride(0), k_cache.stride(1),
            GROUP=group, HEAD_DIM=head_dim, PAGE=meta.block_size,
            BLOCK_M=block_m, BLOCK_N=PREFILL_BLOCK_N, BLOCK_D=block_d, TRIGGER=self.pdl,
            SOFTCAP=bool(self.softcap), SINKS=self.sinks is not None, num_warps=4 if block_d <= 64 else 8,
        )
        for span in meta.prefills:
            if span.tree or span.ranges:  # a token tree's rows or an image's, not causal: the torch reference's
                self._tree_span(q, kv_cache, meta, span, scale, out)

    def _tree_span(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, span: PrefillSpan,
                   scale: float, out: torch.Tensor) -> None:
        """A token tree's span (a speculative step's branching guesses, a few rows) or one with
        image rows that see each other both ways (`open_ranges`), over its context under its
        mask, as `TorchPagedAttention` computes it (the prefill kernel has written a causal
        result there first)."""
        assert not self.softcap and self.sinks is None, "no masked spans with soft-capped scores or sinks"
        assert span.context_blocks is not None and span.bias is not None
        a, b = span.token_start, span.token_end
        length = span.start_pos + (b - a)
        ks, vs = (gather_blocks(c, span.context_blocks[None], meta.block_size, length)[0] for c in kv_cache)
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], ks.transpose(0, 1)[None].to(q.dtype), vs.transpose(0, 1)[None].to(q.dtype),
            attn_mask=span.bias.to(q.dtype), scale=scale, enable_gqa=q.shape[1] != kv_cache.shape[2])
        out[a:b] = o[0].transpose(0, 1)

    def _split_len(self, programs: int, max_len: int, device: torch.device) -> int:
        """KV positions per decode split, a whole number of DECODE_BLOCK_N tiles: about
        `decode_split_len` when set; else short enough that `programs` (sequences x kv heads)
        times the splits fill the GPU, but no shorter than MIN_SPLIT_LEN; off CUDA, no split."""
        if self.decode_split_len is not None:
            length = self.decode_split_len
        elif device.type != "cuda":
            length = max_len
        else:
            if self._num_sms is None:
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            length = gpu_split_len(programs, max_len, self._num_sms)
        return triton.cdiv(length, DECODE_BLOCK_N) * DECODE_BLOCK_N


def gpu_split_len(programs: int, max_len: int, num_sms: int) -> int:
    """The default KV positions per decode split on a GPU of `num_sms` SMs (before rounding to
    whole tiles): short enough that `programs` (sequences x kv heads) times the splits fill
    the GPU twice over, but no shorter than MIN_SPLIT_LEN, and in at most MAX_SPLITS splits."""
    wanted = triton.cdiv(2 * num_sms, programs)
    splits = max(1, min(wanted, triton.cdiv(max_len, MIN_SPLIT_LEN), MAX_SPLITS))
    return triton.cdiv(max_len, splits)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> None:
    dtypes = {q.dtype, k.dtype, v.dtype, kv_cache.dtype}
    if len(dtypes) != 1 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q, k, v and the cache must share one of fp32/fp16/bf16, got {sorted(map(str, dtypes))}")
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is above the kernels' limit of {MAX_HEAD_DIM}")
    if q.shape[1] % kv_cache.shape[2] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kv_cache.shape[2]} kv heads")
    if kv_cache.stride(-1) != 1:
        raise ValueError("the KV cache's last dim must be contiguous")
    if k.shape[1:] != kv_cache.shape[2:] or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit a cache of"
            f" {tuple(kv_cache.shape[2:])} per token"
        )
