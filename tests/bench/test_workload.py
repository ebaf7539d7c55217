"""Workloads are the same for a seed, differ across seeds, and follow their distributions."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from conveyor.bench.workload import (
    SHAREGPT_MAX_PROMPT,
    SHAREGPT_MAX_TOTAL,
    BenchRequest,
    LengthDist,
    LoadPoint,
    ShareGPTLike,
    at_load,
    load_trace,
    parse_sweep,
    parse_tenants,
    sharegpt_requests,
    synthetic_requests,
    token_id_range,
    unit_gaps,
    with_shared_prefix,
    with_tenants,
)

VOCAB = 1000


def make(seed: int, n: int = 50) -> list[BenchRequest]:
    return synthetic_requests(n, LengthDist.parse("uniform:4,64"), LengthDist.parse("lognormal:32,16"), VOCAB, seed)


def test_same_seed_same_workload_and_prefix_stable() -> None:
    assert make(0) == make(0)
    assert make(0, 20) == make(0, 50)[:20]  # more requests never changes the first ones
    assert make(0) != make(1)
    low, high = token_id_range(VOCAB)
    for r in make(0):
        assert isinstance(r.prompt, tuple) and len(r.prompt) == r.prompt_len
        assert all(low <= t < high for t in r.prompt)
        assert r.output_len >= 1 and r.arrival_s == 0.0


def test_a_shared_prefix_starts_every_prompt_and_keeps_the_rest() -> None:
    base = make(0, 10)
    shared = with_shared_prefix(base, 32, VOCAB, seed=0)
    prefix = shared[0].prompt[:32]
    for before, after in zip(base, shared, strict=True):
        assert after.prompt[:32] == prefix and after.prompt[32:] == before.prompt
        assert after.prompt_len == before.prompt_len + 32
        assert (after.output_len, after.arrival_s) == (before.output_len, before.arrival_s)
    assert with_shared_prefix(base, 32, VOCAB, seed=0) == shared
    assert with_shared_prefix(base, 0, VOCAB) == base
    text = [BenchRequest(0, "hello", None, 4)]
    with pytest.raises(ValueError, match="token-id prompts"):
        with_shared_prefix(text, 8, VOCAB)


def test_a_prefix_share_leaves_the_other_requests_their_own_prompts() -> None:
    base = make(0, 200)
    mixed = with_shared_prefix(base, 16, VOCAB, seed=0, num_groups=2, share=0.25)
    took = [after.prompt_len == before.prompt_len + 16 for before, after in zip(base, mixed, strict=True)]
    assert 30 <= sum(took) <= 70  # about a quarter of 200
    for before, after, t in zip(base, mixed, took, strict=True):
        assert after.prompt[16:] == before.prompt if t else after == before
    assert with_shared_prefix(base, 16, VOCAB, seed=0, num_groups=2, share=0.25) == mixed
    with pytest.raises(ValueError, match="prefix share"):
        with_shared_prefix(base, 16, VOCAB, share=0.0)


def test_prefix_groups_draw_one_of_several_prefixes_per_request() -> None:
    base = make(0, 40)
    grouped = with_shared_prefix(base, 16, VOCAB, seed=0, num_groups=3)
    prefixes = {tuple(r.prompt[:16]) for r in grouped}
    assert len(prefixes) == 3
    assert tuple(with_shared_prefix(base, 16, VOCAB, seed=0)[0].prompt[:16]) in prefixes  # group 0
    for before, after in zip(base, grouped, strict=True):
        assert after.prompt[16:] == before.prompt and after.prompt_len == before.prompt_len + 16
    assert with_shared_prefix(base, 16, VOCAB, seed=0, num_groups=3) == grouped
    assert with_shared_prefix(base[:10], 16, VOCAB, seed=0, num_groups=3) == grouped[:10]
    with pytest.raises(ValueError, match="groups"):
        with_shared_prefix(base, 16, VOCAB, num_groups=0)


def test_tenants_split_the_requests_by_their_shares() -> None:
    assert parse_tenants("heavy:3,light:1") == [("heavy", 0.75), ("light", 0.25)]
    assert parse_tenants("a,b") == [("a", 0.5), ("b", 0.5)]
    for bad in ("a:0", "a:x", ":2", "a,a"):
        with pytest.raises(ValueError, match="--tenants"):
            parse_tenants(bad)
    base = make(0, 400)
    tagged = with_tenants(base, parse_tenants("heavy:3,light:1"), seed=0)
    assert [replace(r, tenant=None) for r in tagged] == base  # nothing else changes
    share = sum(r.tenant == "heavy" for r in tagged) / len(tagged)
    assert 0.7 < share < 0.8
    assert with_tenants(base[:10], parse_tenants("heavy:3,light:1"), seed=0) == tagged[:10]


@pytest.mark.parametrize(
    ("spec", "mean", "std"),
    [
        ("fixed:37", 37, 0),
        ("uniform:10,30", 20, math.sqrt((21**2 - 1) / 12)),
        ("normal:200,20", 200, 20),
        ("lognormal:100,80", 100, 80),
    ],
)
def test_length_distributions_have_their_mean_and_spread(spec: str, mean: float, std: float) -> None:
    dist = LengthDist.parse(spec)
    import random

    rng = random.Random(0)
    xs = [dist.sample(rng) for _ in range(20000)]
    assert statistics.fmean(xs) == pytest.approx(mean, rel=0.03, abs=0.6)
    assert statistics.pstdev(xs) == pytest.approx(std, rel=0.08, abs=0.6)
    assert min(xs) >= 1


@pytest.mark.parametrize("spec", ["", "zipf:3", "uniform:5", "uniform:9,3", "normal:-1,2", "fixed:0", "lognormal:a,b"])
def test_bad_length_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        LengthDist.parse(spec)


def test_sharegpt_like_means_scale_and_vllm_filter() -> None:
    full = sharegpt_requests(4000, ShareGPTLike(), VOCAB, seed=0)
    plens = [r.prompt_len or 0 for r in full]
    olens = [r.output_len for r in full]
    assert all(4 <= p <= SHAREGPT_MAX_PROMPT for p in plens)
    assert all(p + o <= SHAREGPT_MAX_TOTAL for p, o in zip(plens, olens, strict=True))
    # The filter trims the long tail a little; the means stay near the published ones.
    assert statistics.fmean(plens) == pytest.approx(161.31, rel=0.1)
    assert statistics.fmean(olens) == pytest.approx(337.99, rel=0.15)
    quarter = sharegpt_requests(4000, ShareGPTLike(scale=0.25), VOCAB, seed=0)
    assert statistics.fmean(r.output_len for r in quarter) == pytest.approx(statistics.fmean(olens) / 4, rel=0.02)
    assert sharegpt_requests(30, ShareGPTLike(), VOCAB, 3) == sharegpt_requests(30, ShareGPTLike(), VOCAB, 3)


def test_poisson_and_gamma_arrivals() -> None:
    poisson = unit_gaps(20000, 1.0, seed=0)
    assert statistics.fmean(poisson) == pytest.approx(1.0, rel=0.03)
    assert statistics.pstdev(poisson) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = unit_gaps(20000, 0.25, seed=0)
    assert statistics.fmean(bursty) == pytest.approx(1.0, rel=0.05)
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.08)  # CV 1/sqrt(b)
    with pytest.raises(ValueError):
        unit_gaps(3, 0.0, 0)


def test_a_rate_sweep_keeps_the_requests_and_scales_one_arrival_pattern() -> None:
    base = make(0, 200)
    slow = at_load(base, LoadPoint("rate", 2.0), seed=0)
    fast = at_load(base, LoadPoint("rate", 8.0), seed=0)
    assert [(r.prompt, r.output_len) for r in slow] == [(r.prompt, r.output_len) for r in base]
    assert slow[0].arrival_s == 0.0
    assert all(f.arrival_s == pytest.approx(s.arrival_s / 4) for s, f in zip(slow, fast, strict=True))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(slow))
    assert slow[-1].arrival_s / (len(slow) - 1) == pytest.approx(0.5, rel=0.2)  # mean gap 1/rate
    assert at_load(base, LoadPoint("rate", 2.0), seed=0) == slow
    assert all(r.arrival_s == 0 for r in at_load(base, LoadPoint("rate", math.inf)))
    assert all(r.arrival_s == 0 for r in at_load(base, LoadPoint("concurrency", 4)))


def test_parse_sweep() -> None:
    assert [p.label for p in parse_sweep("0.5,1, inf", None)] == ["0.5/s", "1/s", "inf"]
    assert [p.concurrency for p in parse_sweep(None, "1,8")] == [1, 8]
    assert parse_sweep(None, None) == [LoadPoint("trace", 0.0)]
    for rates, conc in [("1", "2"), ("0", None), (None, "1.5"), (",", None)]:
        with pytest.raises(ValueError):
            parse_sweep(rates, conc)


def test_load_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 100.5, "prompt_len": 12, "output_len": 4},
        {"timestamp": 101.0, "prompt_token_ids": [5, 6, 7], "max_tokens": 2, "tenant": "a"},
        {"timestamp": 103.0, "prompt": "hello there", "user": "b"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = load_trace(path, VOCAB, seed=0, default_output_len=LengthDist.parse("9"))
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 2.5]
    assert [r.prompt_len for r in reqs] == [12, 3, None]
    assert [r.output_len for r in reqs] == [4, 2, 9]
    assert reqs[1].prompt == (5, 6, 7) and reqs[2].prompt == "hello there"
    assert [r.tenant for r in reqs] == [None, "a", "b"]  # `tenant`, or the OpenAI `user`
    assert load_trace(path, VOCAB, 0, LengthDist.parse("9")) == reqs
    assert len(load_trace(path, VOCAB, 0, LengthDist.parse("9"), limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "output_len": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_trace(bad, VOCAB)
    bad.write_text('{"prompt_len": 3}\n')
    with pytest.raises(ValueError, match="output_len"):
        load_trace(bad, VOCAB)
