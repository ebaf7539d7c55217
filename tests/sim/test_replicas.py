"""Simulated replicas behind a router: one replica is the single-engine replay exactly; over
random schedules every request finishes once, on the replica it was routed to, and the router
saw each replica's true load at the moment it routed."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cli import main
from conveyor.core.routing import Decision, RouterConfig, available_routers, make_router
from conveyor.replay import TimedRequest, replay
from conveyor.sampling_params import SamplingParams
from conveyor.sim.replicas import replay_on_replicas
from tests.sim.test_sim import toy_engine


def workload(n: int, seed: int, rate: float = 200.0, groups: int = 0) -> list[TimedRequest]:
    """Poisson arrivals; with `groups`, each prompt starts with one of that many 64-token prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 900) for _ in range(64)] for _ in range(groups)]
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        head = prefixes[rng.randrange(groups)] if groups else []
        reqs.append(TimedRequest(t, head + [rng.randrange(10, 900) for _ in range(rng.randint(4, 100))],
                                 SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, temperature=0.0),
                                 f"r{i}"))
    return reqs


def timeline(outs: Sequence[object]) -> list[tuple[float | None, float | None, int]]:
    return [(o.metrics.first_token_time, o.metrics.finished_time, len(o.outputs[0].token_ids)) for o in outs]  # type: ignore[attr-defined]


def test_one_replica_is_the_single_engine_replay() -> None:
    reqs = workload(60, 3)
    single = timeline(replay(toy_engine(num_kv_blocks=40, max_num_seqs=8), reqs))
    one = replay_on_replicas([toy_engine(num_kv_blocks=40, max_num_seqs=8)],
                             make_router(RouterConfig(router_policy="round_robin")), reqs)
    assert timeline(one.outputs) == single and one.routed == [0] * 60


class Recording:
    """A router that remembers the loads it was shown."""

    def __init__(self, inner: object) -> None:
        self.inner, self.seen = inner, []  # type: ignore[var-annotated]
        self.num_replicas = inner.num_replicas  # type: ignore[attr-defined]
        self.wants_kv_events = inner.wants_kv_events  # type: ignore[attr-defined]
        self.on_kv_events = inner.on_kv_events  # type: ignore[attr-defined]

    def route(self, prompt: object, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        self.seen.append(list(loads))
        return self.inner.route(prompt, loads, candidates)  # type: ignore[attr-defined, no-any-return]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 4), policy=st.sampled_from(available_routers()),
       rate=st.sampled_from([50.0, 400.0, 5000.0]), closed=st.sampled_from([None, 1, 3, 8]))
def test_every_request_finishes_once_where_it_was_sent_and_loads_are_true(
    seed: int, n: int, policy: str, rate: float, closed: int | None
) -> None:
    reqs = workload(30, seed, rate, groups=3)
    engines = [toy_engine(num_kv_blocks=30, max_num_seqs=4, max_num_batched_tokens=128) for _ in range(n)]
    router = Recording(make_router(RouterConfig(data_parallel_size=n, router_policy=policy, router_balance_abs_threshold=2)))
    done = replay_on_replicas(engines, router, reqs, concurrency=closed)  # type: ignore[arg-type]
    assert [len(o.outputs[0].token_ids) for o in done.outputs] == [r.params.max_tokens for r in reqs]
    assert sum(done.reasons.values()) == len(reqs) and sorted(set(done.routed)) <= list(range(n))
    for i, engine in enumerate(engines):  # each replica served exactly what was routed to it
        assert sorted(r.request_id for r in engine.finished_requests) == sorted(r.request_id for r, k in zip(reqs, done.routed, strict=True) if k == i)
        assert engine.scheduler.block_manager.num_used_blocks == 0
        engine.scheduler.check_integrity()
    # The loads shown at each decision: requests routed to the replica before it, unfinished then.
    order = sorted(range(len(reqs)), key=lambda j: (done.outputs[j].metrics.arrival_time, j))
    for k, j in enumerate(order):
        t = done.outputs[j].metrics.arrival_time
        expected = [sum(1 for m in order[:k] if done.routed[m] == i and done.outputs[m].metrics.finished_time > t)
                    for i in range(n)]
        assert router.seen[k] == expected
    if closed is not None:  # never more than `closed` in flight
        for j in range(len(reqs)):
            t = done.outputs[j].metrics.arrival_time
            assert sum(1 for o in done.outputs if o.metrics.arrival_time <= t < o.metrics.finished_time) <= closed


def test_cache_aware_routing_finds_more_prefixes_than_round_robin() -> None:
    reqs = workload(120, 1, rate=300.0, groups=8)

    def hits(policy: str) -> float:
        engines = [toy_engine(num_kv_blocks=200, max_num_seqs=8) for _ in range(4)]
        done = replay_on_replicas(engines, make_router(RouterConfig(data_parallel_size=4, router_policy=policy)), reqs)
        return sum(o.num_cached_tokens for o in done.outputs) / sum(len(o.prompt_token_ids) for o in done.outputs)

    # Round robin computes each prefix once per replica (up to 32 misses); cache-aware about once (8).
    assert hits("cache_aware") > hits("round_robin") + 0.05


def test_simulate_cli_with_replicas(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    rc = main(["simulate", "--hardware", "h100-sxm", "--model", "llama-3.1-8b", "--num-requests", "80",
               "--request-rate", "20", "--shared-prefix-len", "512", "--prefix-groups", "8", "--data-parallel-size", "2",
               "--no-plots", "--no-progress", "--out", str(out), "rr: router_policy=round_robin", "ca: router_policy=cache_aware",
               "single: data_parallel_size=1"])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    systems = {s["name"]: s for s in result["systems"]}
    assert systems["rr"]["options"]["data_parallel_size"] == 2 and systems["single"]["options"]["data_parallel_size"] == 1
    point = systems["ca"]["points"][0]
    assert point["summary"]["completed"] == 80
    replicas = point["engine"]["replicas"]
    assert len(replicas) == 2 and sum(r["requests"] for r in replicas) == 80
    assert point["engine"]["routing"]["policy"] == "cache_aware"
    assert "replicas" not in systems["single"]["points"][0]["engine"]
    assert result["simulation"]["systems"]["ca"]["replicas"] == 2
    assert main(["simulate", "--hardware", "h100-sxm", "--request-rate", "inf", "--no-plots",
                 "--router-policy", "fastest", "--out", str(tmp_path / "x")]) == 2
    assert main(["simulate", "--hardware", "h100-sxm", "--request-rate", "inf", "--no-plots",
                 "--data-parallel-backend", "ray", "--out", str(tmp_path / "y")]) == 2


def test_kv_events_routers_taking_turns_find_what_cache_aware_ones_lose() -> None:
    """Four routers taking turns: each cache_aware one knows a quarter of the history, so a
    prefix gets a home per router; kv_events routers all read the replicas' caches."""
    reqs = workload(160, 1, rate=300.0, groups=8)

    def hits(policy: str) -> float:
        engines = [toy_engine(num_kv_blocks=200, max_num_seqs=8) for _ in range(4)]
        config = RouterConfig(data_parallel_size=4, router_policy=policy, router_instances=4)
        done = replay_on_replicas(engines, make_router(config), reqs)
        assert all(e.take_kv_events() == [] for e in engines) or policy == "cache_aware"  # (the router took them)
        return sum(o.num_cached_tokens for o in done.outputs) / sum(len(o.prompt_token_ids) for o in done.outputs)

    assert hits("kv_events") > hits("cache_aware") + 0.05


def long_workload(n: int, seed: int) -> list[TimedRequest]:
    """Prompts and answers long against a small cache: replicas fill up unevenly."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(40.0)
        reqs.append(TimedRequest(t, [rng.randrange(10, 900) for _ in range(rng.randint(16, 120))],
                                 SamplingParams(max_tokens=rng.randint(8, 200), ignore_eos=True, temperature=0.0),
                                 f"r{i}"))
    return reqs


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), receive=st.booleans())
def test_migration_moves_requests_and_each_ends_once_with_its_length(seed: int, receive: bool) -> None:
    reqs = long_workload(80, seed)
    options = {"num_kv_blocks": 40, "block_size": 8, "max_num_seqs": 8}
    if receive:
        options["kv_receive_space"] = 1 << 20
    engines = [toy_engine(**options) for _ in range(3)]
    done = replay_on_replicas(engines, make_router(RouterConfig(data_parallel_size=3, router_policy="round_robin")),
                              reqs, migration=True, link_bandwidth=1e9)
    assert [len(o.outputs[0].token_ids) for o in done.outputs] == [r.params.max_tokens for r in reqs]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in done.outputs)
    assert sum(e.num_migrated_out for e in engines) == sum(e.num_migrated_in for e in engines) == done.migrations
    assert done.migrations > 0 and (done.migrated_bytes > 0) == (done.migrations > 0)
    if receive:
        assert sum(e.num_kv_received for e in engines) > 0
    first = done.outputs[0].metrics.arrival_time - reqs[0].arrival_s
    for o, r in zip(done.outputs, reqs, strict=True):  # timestamps carried over: the TTFT is from arrival
        assert o.metrics.arrival_time == pytest.approx(first + r.arrival_s)
        assert o.metrics.arrival_time <= o.metrics.first_token_time <= o.metrics.finished_time


def test_the_server_refuses_migration() -> None:
    from conveyor.config import ConfigError
    from conveyor.server.replicas import build_replica_set

    with pytest.raises(ConfigError, match="simulated only"):
        build_replica_set({"model": "x"}, RouterConfig(data_parallel_size=2, replica_migration=True), engine_process=False)
