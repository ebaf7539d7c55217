"""Optional native CPU kernels, compiled on first use with the system's C++ compiler.

`cpu_kernels.cpp` holds float32 kernels: a skinny matrix product for decode steps that streams
the weights at memory speed (see its header), paged decode attention that reads K/V in place
through the block tables, a whole decode step's layers in one call (`decode_layers`), the int8
path's helpers, and a layer's element-wise passes over any number of rows (RMSNorm, rope,
SiLU * up, the K/V write into the cache) and the greedy sampler's argmax, each one pass
instead of several tensor ops. It has a plain C ABI and is
loaded with ctypes, so it needs no torch headers and compiles in about a second; the library is
cached under `$CONVEYOR_CACHE/kernels` (default `~/.cache/conveyor/kernels`). Without an x86-64 CPU with AVX2, FMA and F16C, or without a compiler,
or with `CONVEYOR_NATIVE_KERNELS=0`, `skinny_linear()` returns None and the model uses torch's
matmul. Compiled with `-O3 -mavx2 -mfma -mf16c -fopenmp`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("conveyor")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
# Float32 steps of up to SKINNY_MAX_ROWS rows take the skinny kernel, larger ones MKL's GEMM.
# On SmolLM2 a whole prompt step of 65-128 tokens ran 5-21% faster through the kernel, and the
# two were even at 144-160 (BENCHMARKS.md, eleventh session: MKL packs the weights at every
# call). Up to SKINNY_STREAM_ROWS rows it streams each weight row once (memory-bound steps);
# above, register tiles (cpu_kernels.cpp, SMALL_ROWS), in one pass over the weights per
# SKINNY_PASS_ROWS rows. Decode-only steps of up to FUSED_DECODE_ROWS rows run all layers in
# one native call (`decode_layers`). The int8 kernels pass over the weights once per 8 rows
# and stop at Q8_MAX_ROWS, where fbgemm's int8 GEMM takes over.
SKINNY_MAX_ROWS = 128
SKINNY_PASS_ROWS = 64
FUSED_DECODE_ROWS = 64
SKINNY_STREAM_ROWS = 4
Q8_MAX_ROWS = 16


def _cpu_supported() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        ).split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags and "f16c" in flags


def _build(cache_dir: Path, source: bytes | None = None) -> Path:
    """The compiled library of `source` (default: cpu_kernels.cpp), built once into `cache_dir`."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX)")
    source = SOURCE.read_bytes() if source is None else source
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib = cache_dir / f"cpu_kernels-{key}.so"
    if lib.is_file():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never see a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        src = Path(tmp).with_suffix(".cpp")
        src.write_bytes(source)
        try:
            subprocess.run([compiler, *FLAGS, "-o", tmp, str(src)], capture_output=True, text=True, check=True)
        finally:
            src.unlink()
        os.replace(tmp, lib)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"compiling {SOURCE.name} failed: {e.stderr.strip()[:500]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("CONVEYOR_NATIVE_KERNELS", "1") == "0":
        return None
    if not _cpu_supported():
        logger.info("native kernels off: this CPU is not x86-64 with AVX2 and FMA")
        return None
    root = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
    try:
        return load(_build(root / "kernels"))
    except (OSError, RuntimeError) as e:
        logger.warning("native CPU kernels unavailable, using torch: %s", e)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A compiled cpu_kernels library with its C signatures declared (benchmarks load other
    versions of the source this way, built with `_build(folder, source)`)."""
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.skinny_linear.restype = None
    lib.skinny_linear.argtypes = [p, p, p, i64, i64, i64]
    lib.skinny_set_threads.argtypes = [ctypes.c_int]
    lib.rms_norm_rows.restype = None
    lib.rms_norm_rows.argtypes = [p, p, p, i64, i64, ctypes.c_float]
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = [p, p, p, p, i64, p, i64, i64, i64, i64, i64, ctypes.c_float, i64, p, i64,
                                           ctypes.c_float, p, p, i64, p]
    f32 = ctypes.c_float
    lib.skinny_linear_q8.restype = None
    lib.skinny_linear_q8.argtypes = [p, p, p, p, p, i64, i64, i64]
    lib.int8_prepare_rows.restype = None
    lib.int8_prepare_rows.argtypes = [p, p, p, p, i64, i64]
    lib.rope_rows.restype = None
    lib.rope_rows.argtypes = [p, p, p, i64, i64, i64, i64]
    lib.silu_mul_rows.restype = None
    lib.silu_mul_rows.argtypes = [p, p, i64, i64]
    lib.argmax_rows.restype = None
    lib.argmax_rows.argtypes = [p, i64, i64, p]
    lib.write_kv_rows.restype = None
    lib.write_kv_rows.argtypes = [p, p, i64, i64, p, p, p, i64, i64, i64]
    lib.decode_layers.restype = None
    lib.decode_layers.argtypes = [p, i64, p, i64, i64, i64, i64, i64, i64, f32, p, p, p, p, p, i64, p, i64, f32, i64,
                                  i64, p, p, p, i64, p, i64, p, p, i64, p]
    lib.shm_all_reduce.restype = ctypes.c_int
    lib.shm_all_reduce.argtypes = [p, i64, i64, i64, p, i64, i64, p, ctypes.c_double]
    return lib


_threads = [0]


def _sync_threads(lib: ctypes.CDLL) -> None:
    import torch

    n = torch.get_num_threads()
    if n != _threads[0]:  # follow torch.set_num_threads
        lib.skinny_set_threads(n)
        _threads[0] = n


def clear_cache() -> None:
    """Forget the loaded library (tests that toggle CONVEYOR_NATIVE_KERNELS)."""
    _library.cache_clear()
    _threads[0] = 0


def skinny_linear() -> Callable[..., torch.Tensor] | None:
    """`f(x, w) -> x @ w.T` for float32 CPU tensors (x `[M, K]`, w `[N, K]` contiguous), or
    None where the kernels are unavailable (the reason is logged once)."""
    lib = _library()
    if lib is None:
        return None
    import torch

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _sync_threads(lib)
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty((m, w.shape[0]), dtype=torch.float32)
        lib.skinny_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, k, w.shape[0])
        return y

    return run


def rms_norm() -> Callable[..., torch.Tensor] | None:
    """`f(x, weight, eps)`: RMSNorm over the last dim of float32 rows `[M, H]`, or None."""
    lib = _library()
    if lib is None:
        return None
    import torch

    def run(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _sync_threads(lib)
        x = x.contiguous()
        out = torch.empty_like(x)
        lib.rms_norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[-1], eps)
        return out

    return run


def rope() -> Callable[..., None] | None:
    """`f(x, cos, sin, heads)`: rope in place on the first `heads` heads of each row of x, a
    float32 `[M, >= heads, head_dim]` tensor whose rows may be strided (a view of the QKV
    projection) but whose heads are contiguous; cos / sin `[M, 1, head_dim / 2]`. Or None."""
    lib = _library()
    if lib is None:
        return None

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
        _sync_threads(lib)
        m, _, hd = x.shape
        assert x.stride(2) == 1 and x.stride(1) == hd and cos.is_contiguous() and sin.is_contiguous()
        lib.rope_rows(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), m, heads, hd, x.stride(0))

    return run


def silu_mul() -> Callable[..., torch.Tensor] | None:
    """`f(gate_up) -> silu(gate) * up` for the float32 gate/up projection `[M, 2I]` (gate first).
    Or None."""
    lib = _library()
    if lib is None:
        return None
    import torch

    def run(gate_up: torch.Tensor) -> torch.Tensor:
        _sync_threads(lib)
        gate_up = gate_up.contiguous()
        m, two_i = gate_up.shape
        out = torch.empty((m, two_i // 2), dtype=torch.float32)
        lib.silu_mul_rows(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2)
        return out

    return run


def argmax() -> Callable[..., torch.Tensor] | None:
    """`f(logits) -> logits.argmax(dim=-1)` for float32 rows `[M, N]` (ties and NaN as torch).
    Or None."""
    lib = _library()
    if lib is None:
        return None
    import torch

    def run(logits: torch.Tensor) -> torch.Tensor:
        _sync_threads(lib)
        logits = logits.contiguous()
        m, n = logits.shape
        out = torch.empty(m, dtype=torch.long)
        lib.argmax_rows(logits.data_ptr(), m, n, out.data_ptr())
        return out

    return run


def paged_decode_attention() -> Callable[..., torch.Tensor] | None:
    """`f(q, k_cache, v_cache, tables, ctx_lens, block_size, scale, window, softcap=0, sinks=None)
    -> out`: q float32 `[D, H, d]`, caches `[slots, KVH, d]` (contiguous) in float32 or float16,
    tables `[D, max_blocks]` and ctx_lens `[D]` int64; window 0 means none; softcap > 0 caps each
    score, `cap * tanh(score / cap)`; sinks float32 `[H]`, a logit a head in its softmax's
    denominator. `paths` `[D, width]` and `path_lens` `[D]` int64: a token tree's rows, whose last
    `path_lens[i]` context positions are `paths[i]`'s (`AttentionMetadata.decode_paths`). Or None."""
    lib = _library()
    if lib is None:
        return None
    import torch

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            ctx_lens: torch.Tensor, block_size: int, scale: float, window: int, softcap: float = 0.0,
            sinks: torch.Tensor | None = None, paths: torch.Tensor | None = None,
            path_lens: torch.Tensor | None = None) -> torch.Tensor:
        _sync_threads(lib)
        if sinks is not None:
            sinks = sinks.float().contiguous()
        q = q.contiguous()
        tables = tables.contiguous()
        ctx_lens = ctx_lens.contiguous()
        d_, h, hd = q.shape
        out = torch.empty_like(q)
        lib.paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            ctx_lens.data_ptr(), d_, h, k_cache.shape[1], hd, block_size, scale, window, out.data_ptr(),
            int(k_cache.dtype == torch.float16), softcap, None if sinks is None else sinks.data_ptr(),
            *_paths(paths, path_lens, d_),
        )
        return out

    return run


def write_kv() -> Callable[..., None] | None:
    """`f(k, v, k_cache, v_cache, slots)`: float32 K/V rows `[T, kv_heads, head_dim]` (rows may
    be strided, heads contiguous) into cache slots `[slots, kv_heads, head_dim]` of float32 or
    float16 (rounded as torch's `.to(float16)`), slots int64 `[T]`. Or None."""
    lib = _library()
    if lib is None:
        return None
    import torch

    def run(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            slots: torch.Tensor) -> None:
        _sync_threads(lib)
        n, kvh, hd = k.shape
        for t in (k, v):
            assert t.stride(2) == 1 and t.stride(1) == hd
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
        slots = slots.contiguous()
        lib.write_kv_rows(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                          slots.data_ptr(), n, kvh * hd, int(k_cache.dtype == torch.float16))

    return run


def int8_prepare() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """`f(x, inv_smooth) -> (buffer [M, K + 2], row_max [M, 1])`: Int8Linear's input preparation
    (smooth, divide each row by its max |x|, append the +1/-1 range columns) in one native call,
    bit-equal to its torch code. `inv_smooth` may be None. Or None where the kernels are off."""
    lib = _library()
    if lib is None:
        return None
    import torch

    def run(x: torch.Tensor, inv_smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        _sync_threads(lib)
        x = x.contiguous()
        m, k = x.shape
        buffer = torch.empty((m, k + 2), dtype=torch.float32)
        row_max = torch.empty((m, 1), dtype=torch.float32)
        lib.int8_prepare_rows(x.data_ptr(), 0 if inv_smooth is None else inv_smooth.data_ptr(), buffer.data_ptr(),
                              row_max.data_ptr(), m, k)
        return buffer, row_max

    return run


# The order of one layer's row in decode_layers' pointer table (struct LayerWeights); the int8
# fields (row scales, smoothing divisors) are 0 for float32 weights.
LAYER_FIELDS = ("in_norm", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "post_norm", "wgu", "wd", "k_cache", "v_cache",
                "sqkv", "zqkv", "so", "zo", "sgu", "zgu", "sd", "zd")


def skinny_linear_q8() -> Callable[..., torch.Tensor] | None:
    """`f(x, qweight, scale, inv_smooth) -> (x * inv_smooth) @ (qweight * scale[:, None]).T` for
    float32 rows x `[M, K]` and int8 `qweight` `[N, K]` (inv_smooth may be None): weight-only int8
    for the few rows of a decode step. Or None."""
    lib = _library()
    if lib is None:
        return None
    import torch

    def run(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, inv_smooth: torch.Tensor | None) -> torch.Tensor:
        _sync_threads(lib)
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty((m, qweight.shape[0]), dtype=torch.float32)
        lib.skinny_linear_q8(x.data_ptr(), qweight.data_ptr(), scale.data_ptr(),
                             0 if inv_smooth is None else inv_smooth.data_ptr(), y.data_ptr(), m, k, qweight.shape[0])
        return y

    return run


def decode_layers() -> Callable[..., None] | None:
    """`f(x, layers, dims, cos, sin, positions, slots, tables, ctx, block_size, scale, window, kv_half,
    ids=None, embed=None, final_norm=None, chained=False, aux_layers=None, aux=None, paths=None,
    path_lens=None)`: every decoder
    layer of a decode-only step, in place on
    the residual rows `x` `[M, hidden]` (float32), in one native call; the K/V caches are float16
    when `kv_half`, else float32. `layers` is an int64 tensor `[L, len(LAYER_FIELDS)]` of data
    pointers (0 where a tensor is absent); `dims` is (hidden, heads, kv_heads, head_dim,
    intermediate, eps); `cos` / `sin` are the whole rope tables, read at `positions`. With `ids`
    and `embed`, `x` is first filled with the tokens' embedding rows; with `final_norm`, it ends
    normalised by that RMSNorm weight. `chained`: rows of one sequence follow each other (each
    reads the K/V of those before it), so every row's K/V are written before any attends. With
    `aux_layers` (int64 layer indices) `aux` `[M, len(aux_layers) * hidden]` gets the residual
    stream entering each of those layers. `paths` / `path_lens`: chained rows of a token tree, as in
    `paged_decode_attention`. Or None."""
    lib = _library()
    if lib is None:
        return None
    import torch

    def run(x, layers, dims, cos, sin, positions, slots, tables, ctx, block_size: int, scale: float, window: int,
            kv_half: bool, ids=None, embed=None, final_norm=None, chained: bool = False, aux_layers=None,
            aux=None, paths=None, path_lens=None) -> None:
        assert (aux_layers is None) == (aux is None)
        assert aux is None or (aux.is_contiguous() and aux.dtype == torch.float32
                               and aux.shape == (x.shape[0], aux_layers.numel() * x.shape[1]))
        _sync_threads(lib)
        hidden, heads, kv_heads, head_dim, intermediate, eps = dims
        lib.decode_layers(
            x.data_ptr(), x.shape[0], layers.data_ptr(), layers.shape[0], hidden, heads, kv_heads, head_dim,
            intermediate, eps, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.shape[1], ctx.data_ptr(), block_size, scale, window, int(kv_half),
            None if ids is None else ids.data_ptr(), None if embed is None else embed.data_ptr(),
            None if final_norm is None else final_norm.data_ptr(), int(chained),
            None if aux_layers is None else aux_layers.data_ptr(), 0 if aux_layers is None else aux_layers.numel(),
            None if aux is None else aux.data_ptr(), *_paths(paths, path_lens, x.shape[0]),
        )

    return run


def _paths(paths: Any, path_lens: Any, rows: int) -> tuple[int | None, int, int | None]:
    """A token tree's row paths as the kernels take them: (pointer, width, lengths' pointer)."""
    if paths is None:
        return None, 0, None
    import torch

    assert paths.is_contiguous() and path_lens.is_contiguous() and paths.shape[0] == path_lens.shape[0] == rows
    assert paths.dtype == path_lens.dtype == torch.long
    return paths.data_ptr(), paths.shape[1], path_lens.data_ptr()


HUGE_PAGE = 1 << 21
MADV_HUGEPAGE = 14


@cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of the CPU tensor `t` in memory advised for transparent huge pages (2 MiB), or
    `t` itself where that is not possible (not Linux, under 2 MiB, madvise refused).

    A decode step streams every weight once; with 4 KiB pages that is a TLB miss per 4 KiB and a
    hardware prefetcher that stops at every page boundary. Huge pages streamed the weights about
    9% faster at batch 1 here (BENCHMARKS.md). The buffer is advised before its first touch, so
    the copy's page faults allocate huge pages directly; Linux falls back to small pages silently.
    `CONVEYOR_HUGE_PAGES=0` turns this off.
    """
    import torch

    libc = _libc() if os.environ.get("CONVEYOR_HUGE_PAGES", "1") != "0" else None
    nbytes = t.numel() * t.element_size()
    if libc is None or t.device.type != "cpu" or nbytes < HUGE_PAGE:
        return t
    slack = 2 * HUGE_PAGE // t.element_size()  # room to align the start and round the end
    raw = torch.empty(t.numel() + slack, dtype=t.dtype)
    start = (raw.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    if libc.madvise(start, (nbytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), MADV_HUGEPAGE) != 0:
        return t
    offset = (start - raw.data_ptr()) // t.element_size()
    out = raw[offset : offset + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def shm_all_reduce() -> Callable[..., int] | None:
    """`f(base, rank, size, slot_bytes, x, n, elem_bytes, gen, timeout_s) -> 0`: the shared-memory
    all-reduce of tensor-parallel ranks (cpu_kernels.cpp; conveyor/runner/tensor_parallel.py
    holds the mapping), in place over `n` float32 or float64 elements at address `x`; -1 on
    timeout, -2 when the mapping's abort word is set. Or None."""
    lib = _library()
    return None if lib is None else lib.shm_all_reduce
