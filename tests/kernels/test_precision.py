"""The kernel tests' helpers: the example count a GPU loan's test call caps."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.precision import examples


@pytest.mark.parametrize(("cuda", "cap", "want"), [(True, "4", 4), (True, "50", 20), (True, "", 20), (False, "4", 20)])
def test_a_gpu_call_caps_the_examples_and_the_cpu_keeps_them(monkeypatch, cuda, cap, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv("CONVEYOR_GPU_EXAMPLES", cap)
    assert examples(20) == want
