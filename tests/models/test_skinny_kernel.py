"""The native skinny-GEMM kernel: equal to torch's matmul, row-invariant, and optional."""

from __future__ import annotations

import pytest
import torch

from conveyor import kernels

op = kernels.skinny_linear()
needs_kernel = pytest.mark.skipif(op is None, reason="native kernel unavailable here (no AVX2/FMA or no compiler)")


@needs_kernel
@pytest.mark.parametrize("k", [576, 1536, 100, 37, 7])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 11])
def test_matches_torch(m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(301, k, generator=g)
    ref = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(op(x, w), ref, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 576, generator=g)
    w = torch.randn(200, 576, generator=g)
    full = op(x, w)
    for i in range(9):
        assert torch.equal(op(x[i : i + 1], w)[0], full[i])
    assert torch.equal(op(x[3:7], w), full[3:7])


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
    kernels.skinny_linear.cache_clear()
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    try:
        assert kernels.skinny_linear() is None
    finally:
        kernels.skinny_linear.cache_clear()


def test_model_uses_the_kernel_only_in_float32(tiny_models):
    from conveyor.models.llama import SkinnyLinear, TransposedLinear

    from conveyor import LLM

    path = tiny_models["llama"]
    fp64 = LLM(str(path), dtype="float64", num_kv_blocks=16)
    kinds64 = {type(m) for m in fp64.engine.runner.model.modules()}
    assert SkinnyLinear not in kinds64 and TransposedLinear in kinds64
    if op is not None:
        fp32 = LLM(str(path), dtype="float32", num_kv_blocks=16)
        assert SkinnyLinear in {type(m) for m in fp32.engine.runner.model.modules()}
