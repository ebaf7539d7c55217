"""benchmarks/gpu_speed.py runs on a lent GPU, in one call, with no chance to debug it there:
its --smoke mode runs every part on the CPU with tiny shapes, and must produce every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.bench import load_script


def test_gpu_speed_smoke(tmp_path):
    script = Path(__file__).parents[2] / "benchmarks" / "gpu_speed.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--hf-num-requests", "6", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_speed.json").read_text())
    parity = result["parity"]["float32"]
    assert parity["exact"] + parity["ours_in_hf_top5_where_parted"] == parity["prompts"] == 16
    assert parity["exact"] >= 12
    shapes = result["gemv"]["shapes"]  # the fused GEMVs through the interpreter, 1 row, each projection
    assert {name.split(" ")[0] for name in shapes} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    for entry in shapes.values():
        assert entry["cublas_us"] > 0 and 0 < entry["best_us"] <= entry["default_us"] and entry["configs_timed"] == 2
    configs = json.loads((tmp_path / "gemv_configs.json").read_text())
    assert {(c["n"], c["k"]) for c in configs} == {(e["n"], e["k"]) for e in shapes.values()}
    for variant in ("graphs+async", "graphs", "eager"):
        b1 = result["batch1"][variant]
        assert b1["ms_per_step"] > 0 and 0 < b1["fraction_of_limit"] < 2
        assert set(b1["ms_per_step_at_batch"]) == {"2", "4", "8"} and min(b1["ms_per_step_at_batch"].values()) > 0
    tput = result["throughput"]
    assert tput["conveyor"]["output_tok_per_s"] > 0 and tput["conveyor_first_6"]["output_tok_per_s"] > 0
    assert tput["hf_static"]["output_tok_per_s"] > 0 and tput["hf_static"]["requests"] == 6  # the same 6 as conveyor's
    assert tput["hf_static"]["conveyor_ratio"] > 0
    assert "output_tok_per_s" in tput["hf_continuous"] or "error" in tput["hf_continuous"]
    for mode in ("sync", "async"):
        assert result["overhead"][mode]["engine_ms_per_step"] > 0
        phases = result["overhead"][mode]["host_phases"]
        assert 0 < phases["schedule_ms"] < phases["sum_ms"]


def test_a_failing_variant_costs_only_its_own_row():
    gpu_speed = load_script("gpu_speed")
    assert gpu_speed.guarded("ok", "cpu", lambda: {"ms": 1.0}) == {"ms": 1.0}
    assert gpu_speed.guarded("bad", "cpu", lambda: {"ms": 1 / 0}) == {"error": "ZeroDivisionError: division by zero"}
