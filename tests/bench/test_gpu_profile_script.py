"""benchmarks/gpu_profile.py's device timeline, read from a profiler trace: it runs on a lent GPU
only, so its arithmetic is checked here on traces whose answers are known."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.bench import load_script


@pytest.fixture(scope="module")
def gpu_profile():
    return load_script("gpu_profile")


def kernel(name, ts, dur, grid=(1, 1, 1), cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid)}}


def test_busy_idle_and_the_kernels_of_a_known_trace(gpu_profile):
    events = [
        kernel("gemv", 0, 10, (384, 1, 1)),
        kernel("attn", 12, 3),  # 2 us idle before it
        kernel("gemv", 14, 6, (128, 1, 1)),  # overlaps attn (PDL): counted once
        kernel("gemv", 25, 5, (384, 1, 1)),  # 5 us idle before it
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host: not the device's
        kernel("Memset", 31, 1, cat="gpu_memset"),
    ]
    t = gpu_profile.kernel_timeline(events, steps=1)
    assert t["kernels_per_step"] == 5
    assert t["span_us_per_step"] == 32  # 0 to 32
    assert t["busy_us_per_step"] == 10 + 8 + 5 + 1  # [0,10] [12,20] [25,30] [31,32]
    assert t["idle_us_per_step"] == 2 + 5 + 1 and t["longest_gaps_us"] == [5, 2, 1]
    assert t["idle_share"] == pytest.approx(8 / 32)
    first = t["kernels"][0]
    assert (first["name"], first["grid"], first["per_step"], first["mean_us"]) == ("gemv", "384x1x1", 2, 7.5)
    assert {(k["name"], k["grid"]) for k in t["kernels"]} == {("gemv", "384x1x1"), ("attn", "1x1x1"),
                                                             ("gemv", "128x1x1"), ("Memset", "1x1x1")}
    assert gpu_profile.kernel_timeline([events[4]], steps=1) is None  # a CPU run: no device events


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 40)), min_size=1, max_size=30), st.integers(1, 4))
def test_busy_and_idle_add_up_to_the_span_for_any_trace(gpu_profile, spans, steps):
    events = [kernel(f"k{i % 3}", ts, dur) for i, (ts, dur) in enumerate(spans)]
    t = gpu_profile.kernel_timeline(events, steps=steps)
    span = max(ts + dur for ts, dur in spans) - min(ts for ts, _ in spans)
    assert t["span_us_per_step"] * steps == pytest.approx(span)
    assert (t["busy_us_per_step"] + t["idle_us_per_step"]) * steps == pytest.approx(span)
    # busy is the union: at least the longest kernel, at most the sum of them all
    assert max(d for _, d in spans) - 1e-9 <= t["busy_us_per_step"] * steps <= sum(d for _, d in spans) + 1e-9
    assert sum(k["total_us_per_step"] for k in t["kernels"]) * steps == pytest.approx(sum(d for _, d in spans))
    covered = set()
    for ts, dur in spans:
        covered.update(range(ts, ts + dur))  # unit cells of the integer timeline
    assert t["busy_us_per_step"] * steps == pytest.approx(len(covered))
