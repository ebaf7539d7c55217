"""The CUDA path's Triton kernels compile for an H100 (sm_90) here, without a GPU, specialised
as a launch there would be: none spills registers, every GEMV reads its weights in 16-byte
loads, the GEMVs built for programmatic dependent launch wait for their input, the
attention kernels built for it let the next launch start, and a decode that merges its splits
in the launch (or an LM head that takes its argmax) counts them with a barrier and an
acquire-release atomic
(benchmarks/triton_sm90.py): the interpreter the other kernel tests use runs
the kernels in Python and compiles nothing, so a kernel it passes could still fail to build on
a lent GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path).is_file()
    except Exception:
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="this triton has no CUDA backend with ptxas")
def test_the_cuda_kernels_compile_for_sm90_without_spills(tmp_path):
    script = Path(__file__).parents[2] / "benchmarks" / "triton_sm90.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(script), "--no-spills"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = re.search(r"(\d+) compiles for sm_90: 0 failed, 0 spill, 0 with narrow", proc.stdout)
    # GEMVs at 1-8 rows and with PDL at 1 row (the LM head also with its argmax, which merges
    # like the decodes below), 5 fused (the argmax merging its chunks in the launch), 4
    # attention, 3 with PDL's trigger, and 3 decodes that merge their splits in the launch
    # (one with RoPE and the K/V write, one more with PDL)
    assert summary is not None and int(summary.group(1)) >= 45, proc.stdout[-2000:]
