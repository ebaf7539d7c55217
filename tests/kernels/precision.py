"""Closeness in units of the last place, for kernels that round where torch rounds."""

from __future__ import annotations

import os

import torch


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between a and b, elementwise."""
    assert a.dtype == b.dtype and a.shape == b.shape
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    ia, ib = a.view(ints).long(), b.view(ints).long()
    # Map sign-magnitude to a monotone integer line.
    top = 1 << (8 * a.element_size() - 1)
    ia = torch.where(ia < 0, -(ia + top), ia)
    ib = torch.where(ib < 0, -(ib + top), ib)
    return (ia - ib).abs()


def close(got: torch.Tensor, want: torch.Tensor, max_ulps: int, exact_share: float) -> None:
    """Every element within `max_ulps`, and at least `exact_share` of them bit-equal. In
    float32 a row's norm differs from torch's in its last bits (summation order), which moves
    every element of the row by a few ulps: only closeness is asked there."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    d = ulps_apart(got, want)
    assert int(d.max()) <= max_ulps, f"{int(d.max())} ulps apart"
    assert float((d == 0).float().mean()) >= exact_share, f"{float((d == 0).float().mean()):.3f} exact"


def examples(n: int) -> int:
    """A property test's example count: `n`, or at most `CONVEYOR_GPU_EXAMPLES` where a CUDA
    device runs the kernels. A GPU loan's test call sets it (benchmarks/gpu_session.sh tests):
    there each new shape compiles its kernels, so every test gets its turn inside the call,
    while the interpreter on the CPU keeps running all `n`."""
    cap = os.environ.get("CONVEYOR_GPU_EXAMPLES")
    if cap and torch.cuda.is_available():
        return max(1, min(n, int(cap)))
    return n
