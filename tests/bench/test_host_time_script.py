"""benchmarks/host_time.py, in small: every mode produces its phases (a next GPU session runs
it on that machine's CPU, with no chance to debug it there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_host_time_small(tmp_path, smollm2):
    script = Path(__file__).parents[2] / "benchmarks" / "host_time.py"
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(script), "--seqs", "8", "--steps", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(out.read_text())["sides"]["this"]
    assert set(figures) == {"8,sync", "8,async", "8,stream"}
    for phases in figures.values():
        (schedule,), (prep,), (complete,), (host,) = (phases[p] for p in ("schedule", "prep", "complete", "host"))
        assert min(schedule, prep, complete) > 0
        assert host > 0  # the median of the steps' sums, not the sum of the medians
    assert "| 8 | stream |" in proc.stdout
