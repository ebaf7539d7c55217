"""Engine replicas behind a router (`ReplicaSet`, `conveyor serve --data-parallel-size N`).

Replicas in threads (sharing one load of the weights) and in processes give the tokens a
single engine gives; the router's choice shows in which replica's prefix cache a follow-up
finds its prompt; a full replica passes a request on; a killed replica resumes its own
requests while the others go on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor import EngineConfig, SamplingParams
from conveyor.config import ConfigError
from conveyor.core.routing import RouterConfig, make_router
from conveyor.engine import Engine
from conveyor.outputs import RequestOutput
from conveyor.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    EngineShuttingDownError,
    OutputStream,
    QueueFullError,
)
from conveyor.server.metrics import ServerMetrics
from conveyor.server.replicas import ReplicaSet, build_replica_set, replica_engine_kwargs
from tests.server.conftest import ServerProcess, StreamReader, engine_pids, sample, scrape

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def kwargs(model: Path) -> dict[str, Any]:
    return {"model": str(model), "num_kv_blocks": 512, "max_num_seqs": 4, "num_threads": 1}


def run(replicas: ReplicaSet, body: Callable[[ReplicaSet], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        replicas.start()
        try:
            return await body(replicas)
        finally:
            await replicas.stop()

    return asyncio.run(main())


async def collect(stream: OutputStream) -> list[RequestOutput]:
    return [out async for out in stream]


def reference(model: Path, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    engine = Engine.from_config(EngineConfig.from_kwargs(**kwargs(model)))
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def routed(metrics: ServerMetrics) -> dict[tuple[str, str], float]:
    """(replica, reason) -> requests routed, from the metrics."""
    return {(s.labels["replica"], s.labels["reason"]): s.value
            for fam in metrics.registry.collect() if fam.name == "conveyor:router_requests"
            for s in fam.samples if s.name.endswith("_total")}


def test_thread_replicas_give_a_single_engines_tokens_and_take_turns(tiny_model: Path) -> None:
    prompts = {f"r{i}": [5 + i, 6, 7, 8 + i] for i in range(6)}
    metrics = ServerMetrics("tiny")
    replicas = build_replica_set(kwargs(tiny_model), RouterConfig(data_parallel_size=2, router_policy="round_robin"),
                                 engine_process=False, metrics=metrics)
    # One load of the weights, two runners and two KV caches.
    a, b = (r.engine for r in replicas.replicas)
    assert a.runner.model is b.runner.model and a.scheduler is not b.scheduler

    async def body(rs: ReplicaSet) -> dict[str, list[int]]:
        streams = [await rs.add([EngineRequest(rid, p, GREEDY)]) for rid, p in prompts.items()]
        finals = [(await collect(s))[-1] for s in streams]
        assert rs.loads() == [0, 0]
        return {o.request_id: list(o.outputs[0].token_ids) for o in finals}

    assert run(replicas, body) == reference(tiny_model, prompts)
    assert routed(metrics) == {("0", "turn"): 3.0, ("1", "turn"): 3.0}
    assert len(a.finished_requests) == len(b.finished_requests) == 3


def test_cache_aware_sends_a_follow_up_where_its_prefix_is_cached(tiny_model: Path) -> None:
    docs = [list(range(100 + 64 * k, 164 + 64 * k)) for k in range(2)]  # 4 blocks of 16 each
    metrics = ServerMetrics("tiny")
    replicas = build_replica_set(kwargs(tiny_model), RouterConfig(data_parallel_size=2, router_policy="cache_aware"),
                                 engine_process=False, metrics=metrics)

    async def body(rs: ReplicaSet) -> list[RequestOutput]:
        firsts = [await rs.add([EngineRequest(f"doc{k}", [*doc, 1], GREEDY)]) for k, doc in enumerate(docs)]
        for s in firsts:
            await collect(s)
        follow = [await rs.add([EngineRequest(f"q{k}", [*doc, 2, 3], GREEDY)]) for k, doc in enumerate(docs)]
        return [(await collect(s))[-1] for s in follow]

    finals = run(replicas, body)
    assert [o.num_cached_tokens for o in finals] == [64, 64]
    assert routed(metrics) == {("0", "room"): 1.0, ("1", "room"): 1.0, ("0", "cache"): 1.0, ("1", "cache"): 1.0}


def test_kv_events_routing_reads_the_replicas_published_caches(tiny_model: Path, tmp_path: Path) -> None:
    """Replicas publish their KV events (at the user's endpoint, offset by replica); the
    router reads them before each decision, and so does any other subscriber."""
    pytest.importorskip("zmq")
    from conveyor.core.kv_events import BlockStored, KVEventSubscriber, offset_endpoint

    docs = [list(range(100 + 64 * k, 164 + 64 * k)) for k in range(2)]  # 4 blocks of 16 each
    endpoint = f"ipc://{tmp_path}/kv"
    metrics = ServerMetrics("tiny")
    replicas = build_replica_set({**kwargs(tiny_model), "kv_events_endpoint": endpoint, "kv_events_topic": "t"},
                                 RouterConfig(data_parallel_size=2, router_policy="kv_events"),
                                 engine_process=False, metrics=metrics)
    outside = KVEventSubscriber([offset_endpoint(endpoint, i) for i in range(2)], "t")

    async def body(rs: ReplicaSet) -> list[RequestOutput]:
        await asyncio.sleep(0.3)  # (a SUB socket joins a moment after it connects)
        for k, doc in enumerate(docs):
            await collect(await rs.add([EngineRequest(f"doc{k}", [*doc, 1], GREEDY)]))
        for index in rs.router.indexes:  # type: ignore[attr-defined]
            index.clear()  # (what was sent where forgotten: only the events can say where they are)
        await asyncio.sleep(0.3)
        follow = [await rs.add([EngineRequest(f"q{k}", [*doc, 2, 3], GREEDY)]) for k, doc in enumerate(docs)]
        return [(await collect(s))[-1] for s in follow]

    try:
        finals = run(replicas, body)
        assert [o.num_cached_tokens for o in finals] == [64, 64]
        assert routed(metrics) == {("0", "room"): 1.0, ("1", "room"): 1.0, ("0", "cache"): 1.0, ("1", "cache"): 1.0}
        seen = outside.poll()
        stored = {(i, b.data_parallel_rank, tuple(e.token_ids[:16])) for i, b in seen for e in b.events
                  if isinstance(e, BlockStored) and e.parent_block_hash is None}
        assert {(0, 0, tuple(docs[0][:16])), (1, 1, tuple(docs[1][:16]))} <= stored
    finally:
        outside.close()


def test_kv_events_routing_is_refused_where_it_cannot_subscribe() -> None:
    with pytest.raises(ConfigError, match="kv_events_publisher at zmq"):
        build_replica_set({"model": "x", "enable_kv_cache_events": True, "kv_events_publisher": "null"},
                          RouterConfig(data_parallel_size=2, router_policy="kv_events"), engine_process=False)


def test_round_robin_finds_no_prefix_where_it_was_not_sent(tiny_model: Path) -> None:
    """The counterfactual of the test above: the follow-ups land on the other replica."""
    docs = [list(range(100 + 64 * k, 164 + 64 * k)) for k in range(2)]
    replicas = build_replica_set(kwargs(tiny_model), RouterConfig(data_parallel_size=2, router_policy="round_robin"),
                                 engine_process=False)

    async def body(rs: ReplicaSet) -> list[RequestOutput]:
        for k, doc in enumerate(docs):
            await collect(await rs.add([EngineRequest(f"doc{k}", [*doc, 1], GREEDY)]))
        rs.router.route([0], [0, 0], [0, 1])  # shift the turn: doc0's follow-up goes to replica 1
        follow = [await rs.add([EngineRequest(f"q{k}", [*doc, 2, 3], GREEDY)]) for k, doc in enumerate(docs)]
        return [(await collect(s))[-1] for s in follow]

    assert [o.num_cached_tokens for o in run(replicas, body)] == [0, 0]


class StubReplica(AsyncEngine):
    """A replica whose `add` answers as told, recording what it was given."""

    def __init__(self, answer: type[Exception] | None, load: int = 0) -> None:
        self._init_front(None, None, 0.0)
        self.answer, self.load = answer, load
        self.given: list[str] = []
        self._accepting = True

    @property
    def num_in_flight(self) -> int:
        return self.load

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def add(self, requests: Sequence[EngineRequest]) -> OutputStream:
        self.given.append(requests[0].request_id)
        if self.answer is not None:
            raise self.answer("no")
        return OutputStream(self, [r.request_id for r in requests])


def stub_set(*replicas: StubReplica, policy: str = "least_requests") -> ReplicaSet:
    return ReplicaSet(list(replicas), make_router(RouterConfig(data_parallel_size=len(replicas), router_policy=policy)))


def test_a_full_replica_passes_the_request_to_the_next_least_loaded() -> None:
    full, busy, idle_full = StubReplica(QueueFullError, 0), StubReplica(None, 9), StubReplica(QueueFullError, 5)
    rs = stub_set(full, busy, idle_full)
    stream = asyncio.run(rs.add([EngineRequest("x", [1], GREEDY)]))
    assert stream.request_ids == ["x"]
    assert (full.given, idle_full.given, busy.given) == (["x"], ["x"], ["x"])  # least loaded first


def test_every_replica_full_is_a_429_and_every_replica_gone_is_a_503() -> None:
    with pytest.raises(QueueFullError, match="every replica"):
        asyncio.run(stub_set(StubReplica(QueueFullError), StubReplica(QueueFullError)).add([EngineRequest("x", [1], GREEDY)]))
    stopping = stub_set(StubReplica(None), StubReplica(None))
    stopping.stop_accepting()
    with pytest.raises(EngineShuttingDownError):
        asyncio.run(stopping.add([EngineRequest("x", [1], GREEDY)]))
    racing = stub_set(StubReplica(EngineDeadError), StubReplica(EngineShuttingDownError))
    with pytest.raises(EngineDeadError):
        asyncio.run(racing.add([EngineRequest("x", [1], GREEDY)]))


def test_a_replica_that_stopped_accepting_gets_nothing() -> None:
    a, b = StubReplica(None), StubReplica(None, load=50)
    rs = stub_set(a, b)
    a._accepting = False
    asyncio.run(rs.add([EngineRequest("x", [1], GREEDY)]))
    assert (a.given, b.given) == ([], ["x"])


def test_replica_options_split_cores_or_give_one_gpu_each() -> None:
    from conveyor.config import ConfigError

    cpu = replica_engine_kwargs({"model": "m", "device": "cpu"}, 2)
    assert [kw["device"] for kw in cpu] == ["cpu", "cpu"] and all(kw["num_threads"] >= 1 for kw in cpu)
    assert replica_engine_kwargs({"model": "m", "num_threads": 3}, 2, gpus=0)[1]["num_threads"] == 3
    from unittest import mock

    with mock.patch("os.cpu_count", return_value=16):  # 2 replicas of 4 ranks: 2 cores a rank
        assert replica_engine_kwargs({"model": "m", "device": "cpu", "tensor_parallel_size": 4}, 2)[0]["num_threads"] == 2
    assert [kw["device"] for kw in replica_engine_kwargs({"model": "m"}, 2, gpus=4)] == ["cuda:0", "cuda:1"]
    with pytest.raises(ConfigError, match="needs 3 GPUs"):
        replica_engine_kwargs({"model": "m", "device": "cuda"}, 3, gpus=2)
    with pytest.raises(ConfigError, match="cuda:i"):
        replica_engine_kwargs({"model": "m", "device": "cuda:1"}, 2, gpus=2)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _busiest(pids: list[int]) -> int:
    """The engine process that is generating: an idle one sleeps and uses no CPU."""
    import time

    before = {p: _cpu_ticks(p) for p in pids}
    time.sleep(0.3)
    return max(pids, key=lambda p: _cpu_ticks(p) - before[p])


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the engine processes through /proc")
def test_served_replicas_share_the_load_and_one_survives_the_others_death(tiny_model: Path, tmp_path: Path) -> None:
    server = ServerProcess(
        ["--model", str(tiny_model), "--max-num-seqs", "4", "--num-kv-blocks", "1024",
         "--data-parallel-size", "2", "--router-policy", "round_robin"],
        tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        pids = engine_pids(server)
        assert len(pids) == 2
        long = {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "temperature": 0.0,
                "logprobs": 0, "stream": True}
        reader = StreamReader(server.url, long)
        assert reader.flowing.wait(60), server.log()
        os.kill(_busiest(pids), signal.SIGKILL)
        # The other replica answers while the victim's successor loads (round robin's next turn
        # is the other replica; the turn after it, the restarted one).
        short = {"prompt": [9, 9, 9], "max_tokens": 8, "ignore_eos": True, "temperature": 0.0, "logprobs": 0}
        answers = [httpx.post(server.url + "/v1/completions", json=short, timeout=120.0) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[0].json()["choices"][0]["logprobs"]["tokens"] == answers[1].json()["choices"][0]["logprobs"]["tokens"]
        reader.join(120)
        tokens = reader.tokens()
        assert len(tokens) == 4000 and reader.events[-2]["choices"][0]["finish_reason"] == "length"
        again = httpx.post(server.url + "/v1/completions", json={**long, "stream": False}, timeout=120.0).json()
        assert again["choices"][0]["logprobs"]["tokens"] == tokens  # on the other replica: the same tokens
        m = scrape(server.url)
        assert sample(m, "conveyor:engine_restarts_total") == 1
        assert sample(m, "conveyor:requests_replayed_total") == 1
        assert [sample(m, "conveyor:router_requests_total", replica=str(i), reason="turn") for i in (0, 1)] == [2, 2]
    finally:
        assert server.stop() == 0


def test_ray_backend_without_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    import sys

    from conveyor.config import ConfigError

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match="pip install ray"):
        build_replica_set(kwargs(tiny_model), RouterConfig(data_parallel_backend="ray"))


def test_a_cache_reset_runs_on_every_replica(tiny_model: Path) -> None:
    """`reset_prefix_cache` (vLLM's route and AsyncLLM call) forgets every replica's prefixes;
    a call that reads one engine's state (`list_loras`) is not run across replicas."""
    replicas = build_replica_set(kwargs(tiny_model), RouterConfig(data_parallel_size=2, router_policy="round_robin"),
                                 engine_process=False, metrics=ServerMetrics("tiny"))
    prompt = list(range(100, 140))

    async def body(rs: ReplicaSet) -> None:
        for i in range(2):  # one on each replica (round robin)
            await collect(await rs.add([EngineRequest(f"r{i}", prompt, GREEDY)]))
        assert all(r.engine.scheduler.block_manager.num_cached_blocks for r in rs.replicas)
        assert await rs.call_engine("reset_prefix_cache") is True
        assert not any(r.engine.scheduler.block_manager.num_cached_blocks for r in rs.replicas)
        assert await rs.call_engine("reset_mm_cache") is True
        with pytest.raises(NotImplementedError):
            await rs.call_engine("list_loras")

    run(replicas, body)


def test_served_kv_events_routing_reads_engine_processes_events(tiny_model: Path, tmp_path: Path) -> None:
    """`conveyor serve --router-policy kv_events`: each engine process publishes its events at
    an IPC socket of its own; the front reads them, so a follow-up goes where its document is
    held ("cache"; what was sent where is "history"). Two routers take turns, so the second
    follow-up's router never sent its document anywhere."""
    pytest.importorskip("zmq")
    server = ServerProcess(
        ["--model", str(tiny_model), "--max-num-seqs", "4", "--num-kv-blocks", "1024",
         "--data-parallel-size", "2", "--router-policy", "kv_events", "--router-instances", "2"],
        tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        docs = [list(range(100 + 64 * k, 164 + 64 * k)) for k in range(2)]

        def ask(prompt: list[int]) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60.0)
            assert r.status_code == 200, r.text
            return r.json()

        for doc in docs:
            ask([*doc, 1])
        deadline = time.monotonic() + 30  # (the events cross a socket: wait until the router has read them)
        while sum(v for (name, _), v in scrape(server.url).items() if name == "conveyor:router_kv_event_batches_total") < 2:
            assert time.monotonic() < deadline, f"the router read no KV events:\n{server.log()}"
            time.sleep(0.1)
        follow = [ask([*doc, 2, 3]) for doc in docs]
        assert [f["usage"]["prompt_tokens_details"]["cached_tokens"] for f in follow] == [64, 64]
        m = scrape(server.url)
        assert sum(sample(m, "conveyor:router_requests_total", replica=str(i), reason="cache") for i in (0, 1)) == 2
    finally:
        assert server.stop() == 0


def test_pause_and_resume_reach_every_replica(tiny_model: Path) -> None:
    from conveyor.server.async_engine import pause_front

    replicas = build_replica_set(kwargs(tiny_model), RouterConfig(data_parallel_size=2, router_policy="round_robin"),
                                 engine_process=False)

    async def body(rs: ReplicaSet) -> list[bool]:
        await pause_front(rs, "keep")
        states = [e.engine.is_paused() for e in rs.replicas]  # type: ignore[attr-defined]
        assert await rs.call_engine("is_paused")
        await rs.call_engine("resume_generation")
        return [*states, not await rs.call_engine("is_paused")]

    assert run(replicas, body) == [True, True, True]
