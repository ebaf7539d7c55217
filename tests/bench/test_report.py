"""Report files from a result: JSON that parses, a Markdown table, small PNGs."""

from __future__ import annotations

import json
from pathlib import Path

from conveyor.bench import report
from conveyor.bench.metrics import SLO, RequestTiming
from conveyor.bench.workload import LoadPoint

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def timings(n: int, ttft: float, gap: float) -> list[RequestTiming]:
    out = []
    for i in range(n):
        start = 0.1 * i
        times = [start + ttft * (1 + i / n) + gap * k for k in range(8)]
        out.append(RequestTiming(i, start, 8, times, times[-1], 20))
    return out


def fake_result() -> dict:
    points = [LoadPoint("rate", 1.0), LoadPoint("rate", 4.0), LoadPoint("rate", float("inf"))]
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    result = report.new_result("compare", {"description": "test", "num_requests": 12, "seed": 0}, points, slo, 0.9)
    for name, batching, base in (("static", "static", 0.2), ("continuous", "continuous", 0.05)):
        system = report.add_system(result, name, "conveyor", {"batching": batching})
        for k, p in enumerate(points):
            ts = timings(12, base * (k + 1), 0.02 * (k + 1))
            # Occupancy: static holds 4 seats until all 4 are done; continuous refills at once.
            bars = [[i, (i // 4) * 10, (i // 4) * 10 + 3 + i % 4, 0] for i in range(12)]
            occ = {"num_steps": 30, "bars": bars, "step_start_s": [0.01 * s for s in range(30)]}
            report.add_point(system, p, ts, 2.0 + k, slo, engine={"steps": 30, "preemptions": 0, "kv_blocks_max": 5},
                             occupancy=occ)
    report.add_system(result, "broken", "conveyor", {}, error="ConfigError: nope")
    return result


def test_report_files(tmp_path: Path) -> None:
    files = report.write_report(fake_result(), tmp_path)
    names = {f.name for f in files}
    assert names == {"result.json", "summary.md", "throughput.png", "latency_vs_load.png", "latency_cdf.png", "occupancy.png"}
    data = json.loads((tmp_path / "result.json").read_text())
    assert [s["name"] for s in data["systems"]] == ["static", "continuous", "broken"]
    assert data["sweep"][2] == {"kind": "rate", "value": None, "label": "inf"}
    assert data["systems"][0]["points"][0]["summary"]["completed"] == 12
    assert len(data["systems"][0]["points"][0]["requests"]) == 12
    assert "max_load_meeting_slo" in data["systems"][0]
    md = (tmp_path / "summary.md").read_text()
    assert "| system | load | done | req/s |" in md
    assert "| static | 1/s | 12/12 |" in md and "| continuous | inf | 12/12 |" in md
    assert "broken" in md and "ConfigError: nope" in md
    assert "DistServe" in md
    for f in files:
        if f.suffix == ".png":
            data_bytes = f.read_bytes()
            assert data_bytes.startswith(PNG_MAGIC)
            assert 5_000 < len(data_bytes) < report.MAX_PNG_BYTES, f


def test_report_redraws_from_json_alone(tmp_path: Path) -> None:
    report.write_report(fake_result(), tmp_path / "a", plots=False)
    result = report.load_result(tmp_path / "a" / "result.json")
    files = report.write_report(result, tmp_path / "b", occupancy_names=["continuous"])
    assert (tmp_path / "b" / "occupancy.png") in files
    assert (tmp_path / "a" / "summary.md").read_text() == (tmp_path / "b" / "summary.md").read_text()


def test_occupancy_picks_static_next_to_continuous_and_packs_lanes() -> None:
    result = fake_result()
    assert [s["name"] for s in report.occupancy_systems(result)] == ["static", "continuous"]
    lanes = report._lanes([[0, 0, 4, 0], [1, 0, 2, 0], [2, 3, 6, 0], [3, 5, 8, 0], [1, 3, 3, 1]])
    assert lanes[0] != lanes[1]  # overlapping requests never share a slot
    # 1's seat is held (grey, waste) through step 3, when 2 starts: a third slot; 3 reuses 0's.
    assert len(set(lanes.values())) == 3 and lanes[3] == lanes[0]
