"""benchmarks/launch_count.py: the kernels a graphed decode step launches on each CUDA path
(the graph runs from the embedding to the greedy tokens), counted on a CPU through Triton's
interpreter. The counts are what the fused paths are for:
a kernel that a change adds to a layer shows here before it costs microseconds on a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_kernels_a_graphed_decode_step_launches(tmp_path):
    script = Path(__file__).parents[2] / "benchmarks" / "launch_count.py"
    out = tmp_path / "counts.json"
    proc = subprocess.run([sys.executable, str(script), "--batch", "1", "--layers", "2", "--max-model-len", "1024",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    # (`+3launch`: the fused kernels' decode attention as RoPE and write, attention, reduce)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plain, fused, three, gemv = json.loads(out.read_text())
    assert [r["variant"] for r in (plain, fused, three, gemv)] == [
        "triton", "triton+fused", "triton+fused+gemv+3launch", "triton+fused+gemv"]
    assert three["layer_kernels"] == {"triton._gemv_kernel": 4, "triton._rope_write_kv_kernel": 1,
                                      "triton._decode_split_kernel": 1, "triton._decode_reduce_kernel": 1}
    assert plain["splits"] > 1 and "triton._decode_reduce_kernel" in plain["layer_kernels"]
    # With the fused kernels a layer's attention is one launch: RoPE, the K/V write, the
    # attention and the merge of its splits.
    assert fused["layer_kernels"] == {"torch.mm": 4, "triton._add_rms_norm_kernel": 2,
                                      "triton._decode_split_kernel": 1, "triton._silu_mul_kernel": 1}
    assert gemv["layer_kernels"] == {"triton._gemv_kernel": 4, "triton._decode_split_kernel": 1}
    # Outside the layers, in the same graph: the embedding, one gather of both RoPE tables, and
    # the final norm, LM head and greedy argmax as one GEMV (on the fused path: the norm, the
    # head's GEMM, the one-launch argmax).
    assert gemv["outside_kernels"] == {"torch.embedding": 1, "torch.index": 1, "triton._gemv_kernel": 1}
    assert fused["outside_kernels"] == {"torch.embedding": 1, "torch.index": 1, "triton._add_rms_norm_kernel": 1,
                                        "torch.mm": 1, "triton._argmax_kernel": 1}
    assert "torch.argmax" in plain["outside_kernels"] and "torch.mm" in plain["outside_kernels"]
    assert plain["forward"] > 3 * fused["forward"] > 3 * gemv["forward"]
    assert gemv["forward_syncs"] == 0
    assert "| triton+fused+gemv | 1 |" in proc.stdout
