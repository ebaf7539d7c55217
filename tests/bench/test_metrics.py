"""Metric definitions on synthetic timestamps: every number is checked exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.bench.metrics import (
    SLO,
    RequestTiming,
    max_load_meeting,
    per_request_rows,
    percentile,
    summarize,
)


def timing(i: int, start: float, ttft: float, gaps: list[float], prompt_len: int = 10, tail: float = 0.0) -> RequestTiming:
    """A request whose first token comes `ttft` after `start`, then one token per gap."""
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestTiming(i, start, len(times), times, times[-1] + tail, prompt_len)


def test_one_request_ttft_tpot_itl_e2e_exact() -> None:
    t = RequestTiming(0, 10.0, 4, [10.25, 10.5, 10.75, 11.5], 11.5, 7)
    assert t.ok
    assert t.ttft == pytest.approx(0.25, abs=1e-12)
    assert t.e2e == pytest.approx(1.5, abs=1e-12)
    assert t.tpot == pytest.approx((1.5 - 0.25) / 3, abs=1e-12)
    assert t.itls == pytest.approx([0.25, 0.25, 0.75], abs=1e-12)


def test_chunk_with_several_tokens_counts_them_in_tpot_not_itl() -> None:
    # 5 tokens in 3 chunks: TPOT divides by the tokens, ITL has one gap per chunk.
    t = RequestTiming(0, 0.0, 5, [1.0, 2.0, 3.0], 3.0, 1)
    assert t.tpot == pytest.approx(0.5)
    assert t.itls == [1.0, 1.0]


def test_single_token_output_has_no_tpot_and_meets_a_tpot_slo() -> None:
    t = RequestTiming(0, 0.0, 1, [0.1], 0.1, 3)
    assert t.tpot is None and t.itls == []
    assert SLO(tpot_s=0.001).met_by(t)
    assert not SLO(ttft_s=0.05).met_by(t)


def test_failed_requests_never_meet_an_slo_and_are_not_counted_as_completed() -> None:
    bad = RequestTiming(1, 0.0, error="HTTP 500: boom")
    assert not bad.ok and bad.ttft is None and bad.e2e is None
    assert not SLO(e2e_s=100).met_by(bad)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear_interpolation(q: float) -> None:
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.15]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)


def test_summarize_throughputs_distributions_and_goodput_exact() -> None:
    timings = [
        timing(0, 0.0, 0.1, [0.02, 0.02, 0.02], prompt_len=100),  # fast: meets everything
        timing(1, 0.5, 0.3, [0.02, 0.02], prompt_len=50),  # TTFT 300 ms > 200 ms
        timing(2, 1.0, 0.1, [0.2, 0.2], prompt_len=20),  # TPOT 200 ms > 50 ms
        timing(3, 1.5, 0.15, [0.01], prompt_len=30),  # meets everything
        RequestTiming(4, 2.0, prompt_len=40, error="timeout"),
    ]
    s = summarize(timings, duration_s=4.0, slo=SLO(ttft_s=0.2, tpot_s=0.05))
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["total_input_tokens"] == 200 and s["total_output_tokens"] == 4 + 3 + 3 + 2
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["input_throughput"] == pytest.approx(50.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(53.0)
    ttfts = [0.1, 0.3, 0.1, 0.15]
    assert s["ttft_s"]["mean"] == pytest.approx(np.mean(ttfts))
    for p in (50, 90, 99):
        assert s["ttft_s"][f"p{p}"] == pytest.approx(float(np.percentile(ttfts, p)))
    tpots = [0.02, 0.02, 0.2, 0.01]
    assert s["tpot_s"]["mean"] == pytest.approx(np.mean(tpots))
    itls = [0.02, 0.02, 0.02, 0.02, 0.02, 0.2, 0.2, 0.01]
    assert s["itl_s"]["p50"] == pytest.approx(float(np.percentile(itls, 50)))
    assert s["itl_s"]["max"] == pytest.approx(0.2)
    e2es = [0.16, 0.34, 0.5, 0.16]
    assert s["e2e_s"]["p99"] == pytest.approx(float(np.percentile(e2es, 99)))
    # Goodput: requests 0 and 3 meet TTFT <= 200 ms and TPOT <= 50 ms.
    assert s["requests_meeting_slo"] == 2
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["errors"] == ["timeout"]


def test_prefix_cache_hit_rate_counts_completed_requests_that_report_it() -> None:
    timings = [timing(0, 0.0, 0.1, [0.02], prompt_len=100), timing(1, 0.0, 0.1, [0.02], prompt_len=60)]
    assert "prefix_cache_hit_rate" not in summarize(timings, 1.0)  # nobody reported it
    timings[0].cached_tokens, timings[1].cached_tokens = 64, 16
    timings.append(RequestTiming(2, 0.0, prompt_len=40, error="timeout", cached_tokens=32))
    s = summarize(timings, 1.0)
    assert s["total_cached_tokens"] == 80 and s["prefix_cache_hit_rate"] == 80 / 160


def test_per_tenant_summaries_split_the_requests_by_who_sent_them() -> None:
    timings = [timing(0, 0.0, 0.1, [0.02]), timing(1, 0.0, 0.5, [0.02, 0.02]), timing(2, 1.0, 0.3, [0.02])]
    assert "per_tenant" not in summarize(timings, 2.0)
    timings[0].tenant, timings[1].tenant, timings[2].tenant = "a", "b", "a"
    timings.append(RequestTiming(3, 0.0, prompt_len=5, error="timeout", tenant="b"))
    per = summarize(timings, 2.0, SLO(ttft_s=0.4))["per_tenant"]
    assert sorted(per) == ["a", "b"]
    assert per["a"]["completed"] == 2 and per["a"]["output_throughput"] == 4 / 2.0
    assert per["a"]["ttft_s"]["max"] == pytest.approx(0.3) and per["a"]["slo_attainment"] == 1.0
    assert per["b"]["num_requests"] == 2 and per["b"]["completed"] == 1 and per["b"]["slo_attainment"] == 0.0


def test_e2e_slo_and_no_slo() -> None:
    timings = [timing(0, 0.0, 0.1, [0.1] * 9), timing(1, 0.0, 0.1, [0.3] * 9)]  # E2E 1.0 and 2.8 s
    assert summarize(timings, 3.0, SLO(e2e_s=1.5))["requests_meeting_slo"] == 1
    assert "goodput" not in summarize(timings, 3.0)


def test_summarize_of_no_completed_requests_has_empty_distributions() -> None:
    s = summarize([RequestTiming(0, 0.0, error="x")], 1.0, SLO(ttft_s=1))
    assert s["completed"] == 0 and s["ttft_s"]["p50"] is None and s["goodput"] == 0.0


def test_cut_requests_are_neither_completed_nor_failed_and_count_in_the_generated_rate() -> None:
    """A time limit's cut requests (no end, no error): their tokens count in the generated
    output throughput only, they never meet an SLO, and a failure stays a failure."""
    done = timing(0, 0.0, 0.5, [0.25, 0.25])  # 3 tokens
    cut = RequestTiming(1, 0.0, 5, [0.2, 0.4, 0.6, 0.8, 1.0], None, 8)
    unstarted = RequestTiming(2, 0.0, 0, [], None, 9)
    failed = RequestTiming(3, 0.0, 2, [0.1, 0.2], error="boom")
    assert cut.cut and unstarted.cut and not done.cut and not failed.cut
    assert not SLO(e2e_s=100).met_by(cut)
    s = summarize([done, cut, unstarted, failed], 2.0, SLO(e2e_s=100))
    assert (s["completed"], s["cut"], s["failed"]) == (1, 2, 1)
    assert s["total_output_tokens"] == 3 and s["output_throughput"] == 1.5
    assert s["generated_output_tokens"] == 8 and s["generated_output_throughput"] == 4.0
    assert s["slo_attainment"] == 0.25
    assert [r.get("cut", False) for r in per_request_rows([done, cut, unstarted, failed])] == [False, True, True, False]


@given(st.lists(st.tuples(st.sampled_from(["ok", "cut", "failed"]), st.integers(0, 50)), max_size=30),
       st.floats(0.1, 100))
def test_summary_counts_every_request_once_and_the_generated_tokens_bound_the_completed(
    kinds: list[tuple[str, int]], duration: float
) -> None:
    timings = []
    for i, (kind, n) in enumerate(kinds):
        times = [0.01 * (k + 1) for k in range(n)]
        if kind == "ok" and n:
            timings.append(RequestTiming(i, 0.0, n, times, times[-1] + 0.01, 4))
        elif kind == "cut":
            timings.append(RequestTiming(i, 0.0, n, times, None, 4))
        else:
            timings.append(RequestTiming(i, 0.0, n, times, None, 4, error="x"))
    s = summarize(timings, duration)
    assert s["completed"] + s["cut"] + s["failed"] == s["num_requests"] == len(kinds)
    assert s["generated_output_tokens"] == sum(t.output_len for t in timings if t.ok or t.cut) >= s["total_output_tokens"]
    assert s["generated_output_throughput"] == pytest.approx(s["generated_output_tokens"] / duration)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ttft=500ms,tpot=100ms", SLO(0.5, 0.1, None)),
        ("ttft=0.5s, e2e=20s", SLO(0.5, None, 20.0)),
        ("tpot:50", SLO(None, 0.05, None)),  # vLLM's KEY:VALUE in ms
        ("e2el=1500us", SLO(None, None, 0.0015)),
    ],
)
def test_slo_parse(text: str, expected: SLO) -> None:
    got = SLO.parse(text)
    for name in ("ttft_s", "tpot_s", "e2e_s"):
        assert getattr(got, name) == pytest.approx(getattr(expected, name))


@pytest.mark.parametrize("text", ["", "latency=5ms", "ttft=fast", "ttft=-5ms"])
def test_slo_parse_refuses_bad_input(text: str) -> None:
    with pytest.raises(ValueError):
        SLO.parse(text)


def test_max_load_meeting_is_distserve_goodput_of_a_sweep() -> None:
    points = [(0.5, 1.0), (1.0, 0.95), (2.0, 0.9), (4.0, 0.4), (8.0, None)]
    assert max_load_meeting(points, 0.9) == 2.0
    assert max_load_meeting(points, 0.99) == 0.5
    assert max_load_meeting(points, 1.01) is None
