"""The projections of a few-row decode step as Triton GEMVs, each with the element-wise stage
around it fused in: the CUDA path's answer to a batch-1 step that is mostly weight reads and
kernel boundaries.

At batch 1 on an H100 a Llama-3.2-1B-shaped step read its body's weights at 78% of the HBM
bandwidth through cuBLAS, and spent another 28% of its device time in small element-wise
kernels between the GEMMs (BENCHMARKS.md, "CUDA path"). `linear` computes `x @ W.T` for up to
`MAX_ROWS` rows, and folds in what sits next to each projection of a decoder layer:

- a **norm prologue** (`norm=`): the RMSNorm of each input row, applied as the row is read, so
  `qkv_proj` and `gate_up_proj` read the residual stream itself;
- a **SiLU-and-multiply prologue** (`silu_mul=True`): the input is `[gate | up]` and
  `down_proj` reads `silu(gate) * up` as it goes;
- a **residual epilogue** (`residual=`): `residual + x @ W.T`, so `o_proj` and `down_proj`
  return the new residual stream.

A layer is then four GEMVs, RoPE and attention: every element-wise kernel of the torch path is
gone. Each program owns a block of output columns and reads its slice of the weight once,
row-major along K, in tiles; it accumulates in float32 (`blocks` sizes them). Half precision rounds where the torch
reference rounds (the normalised row, the weighted row, the activation and the product, the
projection, the sum), as `triton_fused` does, so the two paths part only by summation order.
No split over K, so the epilogue sees whole sums; the block of columns shrinks instead, to
keep some 2 programs per SM busy on the narrow projections.

Each program issues the load of its first weight tile before it reads any input; each next
tile is loaded after the tile in hand is multiplied, or (`Config.prefetch`) before. With programmatic dependent launch (`CONVEYOR_TRITON_PDL=1`,
Hopper and later), a GEMV is launched before the kernel ahead of it has finished: its programs
put their first weight tile in flight (weights are never written, so no kernel has to finish
first), then wait (`gdc_wait`) for the previous kernel's results before they read an input,
and let the kernel after them launch likewise (`gdc_launch_dependents`). The kernel boundaries
of a decode step then overlap weight reads instead of idling the memory system.

The blocks, warps and pipelining depth of each shape come from a table (`Config`,
`set_configs`; a JSON file named by `CONVEYOR_GEMV_CONFIGS`, as `benchmarks/gpu_speed.py
--parts gemv` writes one on a GPU after timing each candidate) or, for a shape not in it, from
the `blocks` heuristic.

Opt-in with `CONVEYOR_TRITON_GEMV=1`. On an H100 (BENCHMARKS.md, thirty-fourth session) it took
a batch-1 step from 1.37 ms (the fused element-wise kernels alone) to 1.30, 1.24 with PDL, and
lost at 2-8 rows (`MODEL_MAX_ROWS`); its config sweep has yet to run there. It runs on CPU
tensors under `TRITON_INTERPRET=1`, which is how the tests check it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from conveyor.kernels.triton_attention import (
    ArrivalCounters,
    _jit,
    _pow2,
    _rnd,
    opted_in,
    pdl_enabled,
    tl,
    triton_available,
)
from conveyor.kernels.triton_fused import ARGMAX_MERGE_BLOCK, _merge_argmax

__all__ = ["MAX_ROWS", "MODEL_MAX_ROWS", "Config", "config_for", "enabled", "linear", "linear_argmax", "load_configs",
           "model_max_rows", "pdl_enabled", "set_configs", "triton_available"]

MAX_ROWS = 8  # steps of more rows keep cuBLAS: the prologues are recomputed by every program
# The model's GEMVs stop at this many rows unless CONVEYOR_GEMV_MAX_ROWS says otherwise
# (`model_max_rows`). On an H100 (2026-11-26, Llama-3.2-1B's shape, bfloat16, graphed steps, the
# heuristic's configs) the GEMV path took a batch-1 step from 1.37 ms to 1.30 ms (1.24 ms with
# programmatic dependent launch), but steps of 2, 4 and 8 rows from 1.34-1.37 ms to 2.97, 5.53
# and 9.03 ms: the few-row path (a [rows, N, K] product reduced over K each tile) loses to cuBLAS.
MODEL_MAX_ROWS = 1
TILE = 8192  # elements of the product tile a program holds at once (64 float32 a thread at 4 warps)


def model_max_rows() -> int:
    """The most rows a model step runs through the GEMVs: `CONVEYOR_GEMV_MAX_ROWS` (1 to
    MAX_ROWS), else MODEL_MAX_ROWS; steps of more rows keep the cuBLAS path."""
    value = os.environ.get("CONVEYOR_GEMV_MAX_ROWS", "")
    if not value:
        return MODEL_MAX_ROWS
    try:
        rows = int(value)
    except ValueError:
        raise ValueError(f"CONVEYOR_GEMV_MAX_ROWS={value!r}: an integer from 1 to {MAX_ROWS}") from None
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"CONVEYOR_GEMV_MAX_ROWS={rows}: from 1 to {MAX_ROWS}")
    return rows


def enabled() -> bool:
    """Whether the CUDA path uses these kernels: opt-in with `CONVEYOR_TRITON_GEMV=1`, never with
    `CONVEYOR_TRITON=0`, and only where Triton can run."""
    return opted_in("CONVEYOR_TRITON_GEMV")


@dataclass(frozen=True)
class Config:
    """How one GEMV shape is launched: columns and K elements per program, warps per program,
    Triton's software-pipelining depth (None: Triton's default), whether each next
    weight tile's load is issued before the tile in hand is multiplied (`prefetch`) or after,
    and whether the tile is multiplied as a matrix product on the tensor cores (`dot`: the rows
    padded to 16, `block_n` at least 16) instead of reduced over K in registers. The few-row
    path without it lost to cuBLAS on an H100 (`MODEL_MAX_ROWS`); `dot` is the candidate the
    config sweep times against it."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int | None = None
    prefetch: bool = False
    dot: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v}: a power of two is needed")
        if self.block_k < 16:
            raise ValueError(f"block_k={self.block_k}: at least 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps}: one of 1, 2, 4, 8, 16")
        if self.dot and self.block_n < 16:
            raise ValueError(f"block_n={self.block_n} with dot: at least 16 (a matrix product's tile)")


# (BLOCK_M, N, K) -> Config; BLOCK_M is the row count rounded up to a power of two.
_configs: dict[tuple[int, int, int], Config] = {}
_configs_loaded = False


def set_configs(table: dict[tuple[int, int, int], Config]) -> None:
    """Replace the table of tuned configs, keyed by (rows rounded up to a power of two, N, K)."""
    global _configs_loaded
    _configs.clear()
    _configs.update(table)
    _configs_loaded = True


def load_configs(path: str | Path) -> dict[tuple[int, int, int], Config]:
    """A table as `save_configs` writes it: a JSON list of {rows, n, k, block_n, block_k,
    num_warps, num_stages}."""
    table = {}
    for entry in json.loads(Path(path).read_text()):
        entry = dict(entry)
        key = (_pow2(int(entry.pop("rows"))), int(entry.pop("n")), int(entry.pop("k")))
        entry = {k: v for k, v in entry.items() if k in Config.__dataclass_fields__}
        table[key] = Config(**entry)
    return table


def save_configs(table: dict[tuple[int, int, int], Config], path: str | Path) -> None:
    rows = [dict(rows=m, n=n, k=k, **asdict(c)) for (m, n, k), c in sorted(table.items())]
    Path(path).write_text(json.dumps(rows, indent=1) + "\n")


def config_for(rows: int, n: int, k: int) -> Config:
    """The tuned config of this shape, or the `blocks` heuristic's with 4 warps."""
    global _configs_loaded
    if not _configs_loaded:
        _configs_loaded = True
        path = os.environ.get("CONVEYOR_GEMV_CONFIGS")
        if path:
            _configs.update(load_configs(path))
    found = _configs.get((_pow2(rows), n, k))
    if found is not None:
        return found
    _, block_n, block_k = blocks(rows, n, k)
    return Config(block_n, block_k)


@_jit
def _load_x(x_ptr, rows, ks, stride_x, K, row_mask, inv, g_ptr,
            NORM: tl.constexpr, SILU: tl.constexpr, IS_BF16: tl.constexpr):
    """The input tile `[rows, ks]` as the projection sees it (float32, rounded as the reference
    rounds): the row itself, its RMSNorm (`inv` per row, weight at `g_ptr`), or silu(gate) * up."""
    kmask = ks < K
    m = row_mask[:, None] & kmask[None, :]
    offs = rows[:, None] * stride_x + ks[None, :]
    a = tl.load(x_ptr + offs, mask=m, other=0.0)
    dt = a.dtype
    if SILU:
        gf = a.to(tl.float32)
        up = tl.load(x_ptr + offs + K, mask=m, other=0.0).to(tl.float32)
        act = _rnd(gf / (1.0 + tl.exp(-gf)), dt, IS_BF16)
        xv = _rnd(act * up, dt, IS_BF16)
    else:
        xv = a.to(tl.float32)
    if NORM:
        g = tl.load(g_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        xv = _rnd(g[None, :] * _rnd(xv * inv[:, None], dt, IS_BF16), dt, IS_BF16)
    return xv


@_jit
def _load_w(w_rows, ks, K, col_mask):
    """The weight tile `[cols, ks]`; read once, so it is evicted first, leaving L2 to the input
    rows."""
    return tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & (ks < K)[None, :], other=0.0,
                   eviction_policy="evict_first")


@_jit
def _tile_product(xv, w, DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """`xv @ w.T` of the input rows `[M, K]` (float32, rounded as the reference rounds them) and
    a weight tile `[N, K]`, in float32: reduced over K in registers, or (DOT) a matrix product
    on the tensor cores, the input cast to the weight's dtype (exact: it holds values of that
    dtype). DOT_F32: float32 products (a float32 model, or the interpreter, which has no
    bfloat16 product), exact (`ieee`) rather than TF32."""
    if DOT:
        if DOT_F32:
            return tl.dot(xv, tl.trans(w.to(tl.float32)), input_precision="ieee")
        return tl.dot(xv.to(w.dtype), tl.trans(w))
    return tl.sum(xv[:, None, :] * w.to(tl.float32)[None, :, :], 2)


@_jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, g_ptr, part_val, part_idx, counter, tokens_ptr,
    M, N, K, stride_x, stride_w, stride_out, stride_res, eps,
    NORM: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, IS_BF16: tl.constexpr,
    ONE_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr, ARGMAX: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT: tl.constexpr, DOT_F32: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    # The first weight tile needs no input: in flight before anything else, and with PDL before
    # the kernel ahead of this one has finished.
    w = _load_w(w_rows, tl.arange(0, BLOCK_K), K, col_mask)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (this GEMV's input) are visible
        tl.extra.cuda.gdc_launch_dependents()
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:  # a first pass over the (few, cached) input rows for their RMS
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :],
                        other=0.0).to(tl.float32)
            ss += tl.sum(a * a, 1)
        inv = 1.0 / tl.sqrt(ss / K + eps)
    # The tile in hand is multiplied, and the next one loaded (past the end: masked off, no
    # memory traffic). With PREFETCH the next load is issued first, so two tiles are in
    # registers or in flight at once (more registers a program, fewer programs an SM).
    if ONE_ROW:
        # One input row: multiply-accumulate the tile elementwise, reduce once at the end.
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xv = _load_x(x_ptr, rows, ks, stride_x, K, row_mask, inv, g_ptr, NORM, SILU, IS_BF16)
            if PREFETCH:
                w_next = _load_w(w_rows, ks + BLOCK_K, K, col_mask)
            acc2 += w.to(tl.float32) * xv  # xv is [1, BLOCK_K]
            if not PREFETCH:
                w_next = _load_w(w_rows, ks + BLOCK_K, K, col_mask)
            w = w_next
        acc = tl.sum(acc2, 1)[None, :]
    else:
        # Several rows: each tile's product reduced over K in registers, or (DOT) taken as a
        # matrix product of the rows, padded to 16, and the tile (`_tile_product`).
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xv = _load_x(x_ptr, rows, ks, stride_x, K, row_mask, inv, g_ptr, NORM, SILU, IS_BF16)
            if PREFETCH:
                w_next = _load_w(w_rows, ks + BLOCK_K, K, col_mask)
            acc += _tile_product(xv, w, DOT, DOT_F32)
            if not PREFETCH:
                w_next = _load_w(w_rows, ks + BLOCK_K, K, col_mask)
            w = w_next
    omask = row_mask[:, None] & col_mask[None, :]
    out_offs = rows[:, None] * stride_out + cols[None, :]
    dt = out_ptr.dtype.element_ty
    y = _rnd(acc, dt, IS_BF16)  # the projection, rounded as cuBLAS rounds it
    if RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=omask, other=0.0).to(tl.float32)
        y = _rnd(r + y, dt, IS_BF16)
    tl.store(out_ptr + out_offs, y.to(dt), mask=omask)
    if ARGMAX:
        # A greedy step's tokens in the same launch: each program stores, per row, its block's
        # largest logit (as rounded to the output dtype: what an argmax of the logits reads)
        # and that logit's first column. Every thread's stores are issued before the count,
        # which is acquire-release at GPU scope, so the last program to arrive sees every
        # program's partials; it merges them, then zeroes the counter for the next launch (a
        # CUDA graph replays it as it is).
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        yv = tl.where(omask, y, float("-inf"))
        part = rows * programs + pid
        tl.store(part_val + part, tl.max(yv, 1), mask=row_mask)
        tl.store(part_idx + part, pid * BLOCK_N + tl.argmax(yv, 1, tie_break_left=True), mask=row_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == programs - 1:
            _merge_argmax(part_val, part_idx, tokens_ptr, rows, row_mask, programs, BLOCK_M, BLOCK_P)
            tl.store(counter, 0)


@cache
def _programs_wanted() -> int:
    """About two programs per SM; under the interpreter, which runs programs one by one in
    Python, as few as the tile allows."""
    if torch.cuda.is_available():
        return 2 * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 1


def blocks(rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the fewest columns a program (4 to 32) that still leave
    `_programs_wanted()` programs, then as long a stretch of K as a tile of TILE elements
    holds (up to 2048): on a narrow projection many programs each with a long run of bytes
    in flight, on a wide one (the LM head) wider blocks."""
    block_m = _pow2(rows)
    wide = max(1, n // _programs_wanted())
    block_n = max(4, min(1 << (wide.bit_length() - 1), 32))
    block_k = max(16, min(_pow2(k, 16), TILE // (block_m * block_n), 2048))
    return block_m, block_n, block_k


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    config: Config | None = None,
    pdl: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ weight.T` for `x` `[rows, K]` (rows <= MAX_ROWS) and `weight` `[N, K]`, in x's dtype
    with float32 accumulation; with `norm`, of `rms_norm(x) * norm` (epsilon `eps`); with
    `silu_mul`, of `silu(x[:, :K]) * x[:, K:]` for `x` `[rows, 2K]`; with `residual` `[rows, N]`,
    plus it. Into `out` (`[rows, N]`, rows contiguous) if given, else a new tensor. `config`
    overrides the table's (`config_for`); `pdl` launches it with programmatic dependent launch
    (the model passes `pdl_enabled()`)."""
    return _launch(x, weight, norm, eps, silu_mul, residual, config, pdl, out, None)


def linear_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    config: Config | None = None,
    pdl: bool = False,
    out: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head of a few-row step and its greedy tokens in one launch: `linear(x, weight,
    norm=..., eps=...)` and its argmax over each row (the first column of a tie, as torch's),
    written to `out` and `tokens` (`[rows]`, int64) if given. The argmax reads the logits as
    rounded to x's dtype, so it is `logits.argmax(-1)` of the logits returned."""
    rows = x.shape[0]
    if tokens is None:
        tokens = torch.empty(rows, dtype=torch.long, device=x.device)
    assert tokens.shape == (rows,) and tokens.dtype == torch.long and tokens.stride(0) == 1
    logits = _launch(x, weight, norm, eps, False, None, config, pdl, out, tokens)
    return logits, tokens


# The argmax's arrival counter: one serves every launch on the device, one at a time in stream order.
ARGMAX_COUNTER = ArrivalCounters("GEMV argmax")


def _launch(
    x: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor | None, eps: float, silu_mul: bool,
    residual: torch.Tensor | None, config: Config | None, pdl: bool, out: torch.Tensor | None,
    tokens: torch.Tensor | None,
) -> torch.Tensor:
    rows = x.shape[0]
    n, k = weight.shape
    assert rows <= MAX_ROWS, f"{rows} rows: the GEMV takes up to {MAX_ROWS}"
    assert x.shape[1] == (2 * k if silu_mul else k), (x.shape, weight.shape)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and x.dtype == weight.dtype
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    assert out.shape == (rows, n) and out.stride(-1) == 1 and out.dtype == x.dtype, (out.shape, out.dtype)
    if rows == 0:
        return out
    if n == 0:
        if tokens is not None:
            raise ValueError("an argmax over no columns")
        return out
    if residual is not None:
        assert residual.shape == (rows, n) and residual.stride(-1) == 1 and residual.dtype == x.dtype
    cfg = config or config_for(rows, n, k)
    options: dict[str, object] = {"num_warps": cfg.num_warps}
    if cfg.num_stages is not None:
        options["num_stages"] = cfg.num_stages
    if pdl:
        options["launch_pdl"] = True
    programs = -(-n // cfg.block_n)
    argmax = tokens is not None
    if argmax:
        part_val = torch.empty((rows, programs), dtype=torch.float32, device=x.device)
        part_idx = torch.empty((rows, programs), dtype=torch.int32, device=x.device)
        counter = ARGMAX_COUNTER.get(1, x.device)
    else:
        part_val = part_idx = counter = tokens = out  # never read: ARGMAX is off
    _gemv_kernel[(programs,)](
        x, weight, out, residual if residual is not None else out, norm if norm is not None else weight,
        part_val, part_idx, counter, tokens,
        rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, eps,
        NORM=norm is not None, SILU=silu_mul, RESIDUAL=residual is not None, IS_BF16=x.dtype == torch.bfloat16,
        ONE_ROW=rows == 1 and not cfg.dot, BLOCK_M=max(16, _pow2(rows)) if cfg.dot else _pow2(rows),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PREFETCH=cfg.prefetch,
        PDL=pdl, ARGMAX=argmax, BLOCK_P=_pow2(min(programs, ARGMAX_MERGE_BLOCK), 16) if argmax else 16,
        DOT=cfg.dot, DOT_F32=cfg.dot and (x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"),
        **options,
    )
    return out
