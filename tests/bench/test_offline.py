"""End to end on the tiny random model: `conveyor bench compare` / `offline` in-process with
the HF baselines, and `conveyor bench serve --launch` over HTTP; report files included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.bench.offline import BUILTIN_CONFIGS, SystemSpec, parse_config
from conveyor.bench.workload import BenchRequest, LengthDist, LoadPoint, synthetic_requests
from conveyor.cli import main

SMALL = ["--num-kv-blocks", "64", "--input-len", "uniform:4,24", "--output-len", "uniform:2,9", "--no-progress"]


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> str:
    return str(tiny_models["llama"])


def test_parse_config() -> None:
    assert parse_config("static") == SystemSpec("static", "conveyor", BUILTIN_CONFIGS["static"])
    assert parse_config("hf_continuous").kind == "hf_continuous"
    spec = parse_config("small:prefill-mode=chunked,max_num_batched_tokens=64,policy=sjf,aging_bound_s=2.5")
    assert spec == SystemSpec("small", "conveyor", {"prefill_mode": "chunked", "max_num_batched_tokens": 64, "policy": "sjf", "aging_bound_s": 2.5})
    assert parse_config("batching=static").name == "batching=static"
    for bad in ("fastest", "x:prefill_mode", "x:static=1"):
        with pytest.raises(ValueError):
            parse_config(bad)


def test_compare_static_continuous_and_hf_baselines(model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    rc = main(["bench", "compare", "static", "continuous+chunked", "hf_static", "hf_continuous", "bad:policy=nope",
               "--model", model_dir, *SMALL, "--num-requests", "6", "--batch-size", "4",
               "--request-rate", "40,inf", "--slo", "ttft=2s,tpot=1s", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    systems = {s["name"]: s for s in result["systems"]}
    assert list(systems) == ["static", "continuous+chunked", "hf_static", "hf_continuous", "bad"]
    assert "policy" in systems["bad"]["error"] and not systems["bad"]["points"]
    expected_tokens = None
    for name in ("static", "continuous+chunked", "hf_static", "hf_continuous"):
        points = systems[name]["points"]
        assert [p["load"]["label"] for p in points] == ["40/s", "inf"]
        for p in points:
            s = p["summary"]
            if name == "hf_continuous" and p["error"]:
                pytest.skip(f"HF continuous batching failed here: {p['error']}")
            assert p["error"] is None and s["completed"] == 6, (name, p["error"], s.get("errors"))
            # EOS ignored everywhere: every system produces exactly the workload's tokens.
            expected_tokens = expected_tokens or s["total_output_tokens"]
            assert s["total_output_tokens"] == expected_tokens
            assert s["ttft_s"]["p50"] > 0 and s["goodput"] > 0
    assert systems["static"]["options"]["max_batch_size"] == 4
    # Static batching: nobody joins a running batch. The first 4 start together; the other 2
    # start only after all of the first 4 are done.
    occ = systems["static"]["points"][1]["occupancy"]
    spans: dict[int, list[int]] = {}
    for idx, first, last, _ in occ["bars"]:
        spans.setdefault(idx, [first, last])[1] = last
    starts = sorted(s[0] for s in spans.values())
    assert starts[:4] == [0, 0, 0, 0]
    first_batch_end = max(span[1] for span in spans.values() if span[0] == 0)
    assert all(span[0] > first_batch_end for span in spans.values() if span[0] != 0)
    assert sorted(spans) == list(range(6))
    # Continuous batching admits all 6 at once (max_num_seqs is far above 6).
    occ = systems["continuous+chunked"]["points"][1]["occupancy"]
    assert {b[1] for b in occ["bars"]} == {0}
    # HF static: a finished request's seat stays taken (waste) until its batch's longest is done.
    hf_bars = systems["hf_static"]["points"][1]["occupancy"]["bars"]
    assert any(b[3] == 1 for b in hf_bars) and sorted({b[0] for b in hf_bars}) == list(range(6))
    # The report.
    assert result["command"].startswith("conveyor bench compare static continuous+chunked")
    md = (out / "summary.md").read_text()
    assert "| hf_static | inf | 6/6 |" in md
    for png in ("throughput.png", "latency_vs_load.png", "latency_cdf.png", "occupancy.png"):
        size = (out / png).stat().st_size
        assert 5_000 < size < 200_000, png
    assert "wrote" in capsys.readouterr().out


def test_offline_closed_loop_without_baselines(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "off"
    rc = main(["bench", "offline", "--model", model_dir, *SMALL, "--num-requests", "5", "--baselines", "none",
               "--concurrency", "2", "--max-num-seqs", "8", "--label", "mine", "--out", str(out), "--no-plots"])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    (system,) = result["systems"]
    assert system["name"] == "mine" and system["options"]["max_num_seqs"] == 8
    (point,) = system["points"]
    assert point["summary"]["completed"] == 5
    assert point["engine"]["max_batch"] <= 2  # never more than 2 in flight
    assert not (out / "throughput.png").exists()


def test_a_shared_prefix_is_found_by_prefix_caching_and_reported(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "prefix"
    rc = main(["bench", "compare", "on:enable_prefix_caching=true", "off:enable_prefix_caching=false",
               "--model", model_dir, *SMALL, "--block-size", "4", "--shared-prefix-len", "32", "--num-requests", "6",
               "--concurrency", "1", "--out", str(out), "--no-plots"])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    assert result["workload"]["shared_prefix_len"] == 32
    on, off = ({s["name"]: s["points"][0]["summary"] for s in result["systems"]}[k] for k in ("on", "off"))
    # One at a time: every request after the first finds the prefix's 8 blocks of 4.
    assert on["total_cached_tokens"] == 5 * 32 and off["total_cached_tokens"] == 0
    rows = {line.split(" | ")[0]: line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| o")}
    assert rows["| on"].endswith(f"| {on['prefix_cache_hit_rate']:.0%} |") and rows["| off"].endswith("| 0% |")


def test_tenants_reach_the_engine_and_the_report(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "tenants"
    rc = main(["bench", "compare", "vtc:policy=vtc", "--model", model_dir, *SMALL, "--tenants", "a:1,b:1",
               "--num-requests", "8", "--request-rate", "inf", "--out", str(out), "--no-plots"])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    assert result["workload"]["tenants"] == "a:1,b:1"
    (point,) = result["systems"][0]["points"]
    per = point["summary"]["per_tenant"]
    assert sorted(per) == ["a", "b"] and sum(t["completed"] for t in per.values()) == 8
    assert {r["tenant"] for r in point["requests"]} == {"a", "b"}
    summary = (out / "summary.md").read_text()
    assert "Per tenant:" in summary and "| vtc | inf | a |" in summary


def test_serve_launch_reads_server_metrics(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "srv"
    rc = main(["bench", "serve", "--launch", "--model", model_dir, "--vocab-size", "384", *SMALL,
               "--num-requests", "4", "--concurrency", "2", "--out", str(out), "--no-plots"])
    assert rc == 0, (out / "server.log").read_text()
    result = json.loads((out / "result.json").read_text())
    (point,) = result["systems"][0]["points"]
    s = point["summary"]
    assert s["completed"] == 4
    workload = synthetic_requests(4, LengthDist.parse("uniform:4,24"), LengthDist.parse("uniform:2,9"), 384, seed=0)
    assert [r["output_len"] for r in point["requests"]] == [r.output_len for r in workload]  # ignore_eos
    assert [r["prompt_len"] for r in point["requests"]] == [r.prompt_len for r in workload]
    metrics = point["server_metrics"]
    assert metrics is not None and metrics["preemptions"] == 0 and metrics["kv_cache_usage_max"] is not None


def test_offline_replays_a_trace_at_its_own_times(model_dir: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"arrival_s": 0.0, "prompt_len": 8, "output_len": 3},
            {"arrival_s": 0.3, "prompt_token_ids": [100, 101, 102], "output_len": 2},
            {"arrival_s": 0.6, "prompt_len": 5, "output_len": 4}]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "tr"
    rc = main(["bench", "offline", "--model", model_dir, "--num-kv-blocks", "64", "--trace", str(trace),
               "--baselines", "none", "--no-progress", "--no-plots", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    assert result["sweep"] == [{"kind": "trace", "value": 0.0, "label": "trace"}]
    (point,) = result["systems"][0]["points"]
    assert [r["output_len"] for r in point["requests"]] == [3, 2, 4]
    assert [r["prompt_len"] for r in point["requests"]] == [8, 3, 5]
    assert point["summary"]["duration_s"] >= 0.6  # the last request arrives at 0.6 s


@pytest.mark.parametrize("kind", ["hf_static", "hf_continuous"])
def test_hf_baselines_stop_at_their_time_limit_and_count_what_they_made(model_dir: str, kind: str) -> None:
    """A time limit far below what the work needs: the run stops there, every request counts
    at most its own output, the cut ones have no end, and the finished ones all their tokens;
    every request is reported, the ones never started as cut with no tokens."""
    from conveyor.bench.offline import HFContinuousSystem, HFStaticSystem, load_hf_model

    model = load_hf_model(model_dir)
    reqs = [BenchRequest(i, tuple(range(10, 10 + p)), p, o) for i, (p, o) in enumerate([(6, 400), (9, 3), (4, 450), (12, 420), (5, 2), (7, 380)])]
    spec = SystemSpec(kind, kind)
    if kind == "hf_static":
        system: HFStaticSystem | HFContinuousSystem = HFStaticSystem(spec, model, None, batch_size=4, time_limit_s=0.4)
    else:
        system = HFContinuousSystem(spec, model, None, 512, time_limit_s=0.4)
    try:
        run = system.run(reqs, LoadPoint("rate", float("inf")))
    except Exception as e:  # HF's continuous batching where it cannot run here
        if kind == "hf_continuous":
            pytest.skip(f"HF continuous batching failed here: {e}")
        raise
    by_index = {r.index: r for r in reqs}
    assert run.engine_stats is not None and run.engine_stats["time_limit_s"] == 0.4
    assert run.engine_stats["cut"] >= 1  # 400-odd tokens each do not fit in 0.4 s
    assert run.engine_stats["cut"] + run.engine_stats["not_started"] + sum(t.end is not None for t in run.timings) == len(reqs)
    assert 0.4 <= run.duration_s < 10
    assert sorted(t.index for t in run.timings) == list(range(len(reqs)))
    assert sum(t.cut for t in run.timings) == run.engine_stats["cut"] + run.engine_stats["not_started"]
    made = 0
    for t in run.timings:
        want = by_index[t.index].output_len
        assert 0 <= t.output_len <= want
        assert (t.end is not None) == (t.output_len == want)
        made += t.output_len
    assert 0 < made < sum(r.output_len for r in reqs)
    if kind == "hf_static":  # batches in order: the first 4 started, the cut batch was the first
        assert run.engine_stats["not_started"] == 2
        assert all(t.output_len == 0 and not t.chunk_times and t.cut for t in run.timings[4:])
        assert {t.output_len for t in run.timings if t.index in (0, 2, 3)} == {run.engine_stats["steps"]}
        assert by_index[1].output_len == 3 and run.timings[1].end is not None


def test_compare_with_an_hf_time_limit_reports_cut_requests_and_the_generated_rate(
    model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--hf-time-limit-s`: the HF baseline stops there and reports every request (cut ones too),
    its rate is every token it made over the time it ran, and the report marks it and compares
    conveyor's rate with it; conveyor itself runs everything."""
    out = tmp_path / "limit"
    rc = main(["bench", "compare", "continuous", "hf_static", "--model", model_dir, "--num-kv-blocks", "160",
               "--input-len", "uniform:4,12", "--output-len", "fixed:300", "--no-progress", "--num-requests", "6",
               "--batch-size", "4", "--request-rate", "inf", "--hf-time-limit-s", "0.3", "--no-plots",
               "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    systems = {s["name"]: s for s in result["systems"]}
    assert systems["hf_static"]["options"]["time_limit_s"] == 0.3
    mine = systems["continuous"]["points"][0]["summary"]
    assert mine["completed"] == 6 and mine["cut"] == 0 and mine["generated_output_tokens"] == 1800
    hf = systems["hf_static"]["points"][0]
    s = hf["summary"]
    assert s["num_requests"] == 6 and s["completed"] + s["cut"] == 6 and s["failed"] == 0
    assert s["cut"] >= 2  # 300 tokens each do not fit in 0.3 s; the second batch never starts
    assert 0 < s["generated_output_tokens"] < 1800 and s["total_output_tokens"] <= s["generated_output_tokens"]
    assert s["duration_s"] >= 0.3
    assert s["generated_output_throughput"] == pytest.approx(s["generated_output_tokens"] / s["duration_s"])
    assert sum(r.get("cut", False) for r in hf["requests"]) == s["cut"]
    assert hf["engine"]["cut"] + hf["engine"]["not_started"] == s["cut"]
    md = (out / "summary.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| hf_static | inf |"))
    assert f"({s['cut']} cut)" in row and f"{s['generated_output_throughput']:.1f}*" in row
    assert "stopped at its time limit (0.3 s into the point)" in md
    ratio = mine["output_throughput"] / s["generated_output_throughput"]
    assert f"against hf_static ({s['generated_output_throughput']:.1f} out tok/s): continuous {ratio:.2f}x" in md
    assert "cut at the time limit" in capsys.readouterr().out
