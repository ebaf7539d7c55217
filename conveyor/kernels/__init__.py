"""Optional native CPU kernels, compiled on first use with the system's C++ compiler.

`skinny.cpp` multiplies the few rows of a decode step by a weight matrix at memory speed
(see its header). It has a plain C ABI and is loaded with ctypes, so it needs no torch headers
and compiles in about a second; the library is cached under `$CONVEYOR_CACHE/kernels` (default
`~/.cache/conveyor/kernels`). Without an x86-64 CPU with AVX2 and FMA, or without a compiler,
or with `CONVEYOR_NATIVE_KERNELS=0`, `skinny_linear()` returns None and the model uses torch's
matmul. Compiled with `-O3 -mavx2 -mfma -fopenmp`.
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

logger = logging.getLogger("conveyor")

SOURCE = Path(__file__).with_name("skinny.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
# Above this many rows MKL's GEMM is faster (benchmarks/skinny_linear.py).
SKINNY_MAX_ROWS = 8


def _cpu_supported() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        ).split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _build(cache_dir: Path) -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX)")
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib = cache_dir / f"skinny-{key}.so"
    if lib.is_file():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never see a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, check=True)
        os.replace(tmp, lib)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"compiling {SOURCE.name} failed: {e.stderr.strip()[:500]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@cache
def skinny_linear() -> Callable[..., object] | None:
    """`f(x, w) -> x @ w.T` for float32 CPU tensors (x `[M, K]`, w `[N, K]` contiguous), or
    None where the kernel is unavailable (the reason is logged once)."""
    if os.environ.get("CONVEYOR_NATIVE_KERNELS", "1") == "0":
        return None
    if not _cpu_supported():
        logger.info("native kernels off: this CPU is not x86-64 with AVX2 and FMA")
        return None
    root = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
    try:
        lib = ctypes.CDLL(str(_build(root / "kernels")))
    except (OSError, RuntimeError) as e:
        logger.warning("native CPU kernels unavailable, using torch's matmul: %s", e)
        return None
    fn = lib.skinny_linear
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    set_threads = lib.skinny_set_threads
    set_threads.argtypes = [ctypes.c_int]

    import torch

    threads = [0]

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n = torch.get_num_threads()
        if n != threads[0]:  # follow torch.set_num_threads
            set_threads(n)
            threads[0] = n
        x = x.contiguous()
        m, k = x.shape
        y = torch.empty((m, w.shape[0]), dtype=torch.float32)
        fn(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, k, w.shape[0])
        return y

    return run
