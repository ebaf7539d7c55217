"""Engine replicas as Ray actors (`--data-parallel-backend ray`), on a local Ray instance.

The same front end as engine processes: the replicas give a single engine's tokens; an actor
killed mid-stream is replaced and its request resumes with the tokens of an engine never
killed, while the other replica serves on; an engine that cannot be built is a clear error.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor import SamplingParams
from conveyor.core.routing import RouterConfig
from conveyor.outputs import RequestOutput
from conveyor.server.async_engine import EngineRequest
from conveyor.server.engine_process import EngineStartError
from conveyor.server.metrics import ServerMetrics
from conveyor.server.replicas import ReplicaSet, build_replica_set
from tests.server.conftest import ServerProcess, sample, scrape
from tests.server.test_replicas import kwargs, reference, run

ray = pytest.importorskip("ray")


def test_served_on_ray(tiny_model: Path, tmp_path: Path) -> None:
    """`conveyor serve` starts its own local Ray instance (before this module starts one)."""
    assert not ray.is_initialized()
    server = ServerProcess(
        ["--model", str(tiny_model), "--num-kv-blocks", "256", "--num-threads", "1",
         "--data-parallel-backend", "ray", "--data-parallel-size", "2", "--router-policy", "round_robin"],
        tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
        answers = [httpx.post(server.url + "/v1/completions", json=body, timeout=60.0) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200]
        tokens = [a.json()["choices"][0]["logprobs"]["tokens"] for a in answers]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 6
        m = scrape(server.url)
        assert [sample(m, "conveyor:router_requests_total", replica=str(i), reason="turn") for i in (0, 1)] == [1, 1]
        assert "2 engine replica(s) on ray" in server.log()
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()


def test_an_actor_killed_mid_stream_is_replaced_and_its_request_resumes(local_ray: None, tiny_model: Path) -> None:
    long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True, output_kind="delta", logprobs=1)
    metrics = ServerMetrics("tiny")
    replicas = build_replica_set(kwargs(tiny_model), RouterConfig(data_parallel_size=2, data_parallel_backend="ray",
                                                                  router_policy="round_robin"), metrics=metrics)

    async def body(rs: ReplicaSet) -> tuple[dict[str, list[int]], list[int | None], list[int | None]]:
        pids = [r.engine_pid for r in rs.replicas]  # type: ignore[attr-defined]
        streams = [await rs.add([EngineRequest(rid, [5, 6, 7], long)]) for rid in ("a", "b")]
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        finals: list[RequestOutput] = []

        async def read(stream: Any) -> None:
            async for out in stream:
                tokens[out.request_id] += out.outputs[0].token_ids
                if out.finished:
                    finals.append(out)

        tasks = [asyncio.create_task(read(s)) for s in streams]
        for _ in range(6000):
            if len(tokens["a"]) >= 50:
                break
            await asyncio.sleep(0.01)
        os.kill(pids[0], signal.SIGKILL)  # the actor serving "a" (round robin's first turn)
        await asyncio.gather(*tasks)
        assert all(o.outputs[0].finish_reason == "length" for o in finals)
        return tokens, pids, [r.engine_pid for r in rs.replicas]  # type: ignore[attr-defined]

    tokens, before, after = run(replicas, body)
    ref = reference(tiny_model, {"a": [5, 6, 7]}, SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
    assert tokens["a"] == tokens["b"] == ref["a"]
    assert after[0] != before[0] and after[1] == before[1]  # only the killed replica was replaced
    assert metrics.engine_restarts._value.get() == 1 and metrics.requests_replayed._value.get() == 1


def test_an_engine_that_cannot_be_built_is_a_clear_error(local_ray: None, tmp_path: Path) -> None:
    replicas = build_replica_set({"model": str(tmp_path / "missing"), "num_threads": 1},
                                 RouterConfig(data_parallel_backend="ray"))
    with pytest.raises(EngineStartError, match="missing"):
        replicas.launch()


def test_replicas_take_a_gpu_each_where_the_cluster_has_them(local_ray: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.config import ConfigError
    from conveyor.server.ray_engine import ray_replica_options

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 4.0})
    assert ray_replica_options({"model": "m"}, 4) == [({"model": "m", "device": "cuda"}, {"num_gpus": 1})] * 4
    with pytest.raises(ConfigError, match="needs 8 GPUs"):
        ray_replica_options({"model": "m"}, 8)
    assert ray_replica_options({"model": "m", "device": "cpu"}, 4)[0] == (
        {"model": "m", "device": "cpu", "num_threads": 16}, {"num_cpus": 16})
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(ConfigError, match="no GPU"):
        ray_replica_options({"model": "m", "device": "cuda"}, 1)
