"""benchmarks/overlap.py, in small: every cell is measured, and the emulated device holds a
synchronous step for at least its time (the step waits for the tokens it launched)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_overlap_small(tmp_path, smollm2):
    script = Path(__file__).parents[2] / "benchmarks" / "overlap.py"
    out = tmp_path / "overlap.json"
    proc = subprocess.run([sys.executable, str(script), "--seqs", "4", "--device-ms", "0,3", "--steps", "8",
                           "--rounds", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(out.read_text())["figures"]
    assert set(figures) == {f"4,{d},{m}" for d in ("0.0", "3.0") for m in ("sync", "async", "stream", "served")}
    for key, cell in figures.items():
        # The host waits within a step: on average, no longer than the average step.
        assert cell["step_ms"] > 0 and 0 <= cell["waited_ms"] <= cell["step_mean_ms"], key
    assert figures["4,3.0,sync"]["step_ms"] >= 3.0  # launch, then 3 ms of device, every step
    assert figures["4,3.0,sync"]["waited_ms"] > 2.5  # the stub forward leaves the wait to the device
    assert "| 4 | 3.00 | stream |" in proc.stdout
