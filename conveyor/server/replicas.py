"""`ReplicaSet`: several engine replicas behind one router (data parallelism on one machine).

Each replica is a whole engine, with its own scheduler, KV cache and prefix cache: an
`AsyncEngine` in a process of its own (the default; each survives its own death as a single
engine does), in a Ray actor (`ray_engine`, on any machine of a Ray cluster), or in a thread. The router (`conveyor.core.routing`) picks one per API request;
the n choices of a request go together, so they share their prompt's cached prefix.

What the set adds to its replicas:
- load: a replica's load is its engine requests in flight, counted where they are delivered
  (exact, with no lag behind the replica);
- a replica that refuses a request because its queue is full (HTTP 429) passes it on to the
  next least loaded one; only when every replica is full does the client get 429;
- a replica that stops accepting (its engine could not be started again) gets no more
  requests; the set serves while any replica does;
- a replica started again has lost its prefix cache: the router forgets what it sent there.

On one GPU per replica: replica i runs on `cuda:i`. On CPU the cores are split between them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from conveyor.config import ConfigError
from conveyor.core.routing import RouterConfig, RoutingPolicy, make_router
from conveyor.multimodal import ImageProcessor, ImagePrompt, ImageToken, as_image_prompt
from conveyor.server.async_engine import (
    EVERY_ENGINE,
    RANKED_CALLS,
    AsyncEngine,
    EngineDeadError,
    EngineFront,
    EngineRequest,
    EngineShuttingDownError,
    OutputStream,
    QueueFullError,
)

if TYPE_CHECKING:
    from conveyor.core.kv_events import KVEventSubscriber
    from conveyor.scoring import ModelHead
    from conveyor.server.metrics import ServerMetrics
    from conveyor.tokenizer import Tokenizer

logger = logging.getLogger("conveyor.server")


class ReplicaSet(EngineFront):
    """Engine replicas behind a routing policy, served as one engine.

    `replicas[i].replica_index == i`; they share one `ServerMetrics` (their queue gauges add
    up). Facts (tokenizer, max_model_len, model) are the first replica's: all replicas are
    built from the same options.
    """

    def __init__(self, replicas: Sequence[AsyncEngine], router: RoutingPolicy, metrics: ServerMetrics | None = None,
                 kv_events: KVEventSubscriber | None = None) -> None:
        if not replicas:
            raise ValueError("a ReplicaSet needs at least one replica")
        if router.num_replicas != len(replicas):
            raise ValueError(f"the router routes over {router.num_replicas} replicas, not {len(replicas)}")
        self.replicas = list(replicas)
        self.router = router
        for i, r in enumerate(self.replicas):
            r.replica_index = i
        self._restarts_seen = [r.restarts for r in self.replicas]
        self.metrics = metrics
        # The replicas' KV events (router_policy kv_events): read before each routing decision.
        self.kv_events = kv_events
        self._kv_events_task: asyncio.Task[None] | None = None
        self._kv_events_missed = 0

    @property
    def metrics(self) -> ServerMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, value: ServerMetrics | None) -> None:
        self._metrics = value
        for r in self.replicas:
            r.metrics = value

    # -- facts -------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def head(self) -> ModelHead:
        return self.replicas[0].head

    @property
    def image_token(self) -> ImageToken | None:
        return self.replicas[0].image_token

    @property
    def image_processor(self) -> ImageProcessor | None:
        return self.replicas[0].image_processor

    @property
    def model_path(self) -> str | None:
        return self.replicas[0].model_path

    @property
    def model_arg(self) -> str | None:
        return self.replicas[0].model_arg

    # -- state -------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def accepting(self) -> bool:
        return any(r.accepting for r in self.replicas)

    @property
    def dead(self) -> BaseException | None:
        deaths = [r.dead for r in self.replicas]
        return deaths[0] if all(d is not None for d in deaths) else None

    @property
    def num_open_streams(self) -> int:
        return sum(r.num_open_streams for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    def loads(self) -> list[int]:
        return [r.num_in_flight for r in self.replicas]

    # -- life cycle --------------------------------------------------------------------------
    def launch(self) -> None:
        """Build every replica's engine at once (process replicas load in parallel); raises the
        first replica's error if any cannot be built, after stopping the others."""
        from conveyor.server.engine_process import ProcessAsyncEngine

        processes = [r for r in self.replicas if isinstance(r, ProcessAsyncEngine)]
        if not processes:
            return
        with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:
            futures = [pool.submit(r.launch) for r in processes]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            for r in processes:
                r.kill()
            raise errors[0]

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        if self.kv_events is not None:
            self.kv_events.rejoin()  # (the replicas have bound their sockets by now)
            # Read between requests too: a long quiet spell of decoding would otherwise fill the
            # sockets' queues (events past their high-water mark are lost).
            self._kv_events_task = asyncio.get_running_loop().create_task(self._read_kv_events_every(0.05))

    async def _read_kv_events_every(self, seconds: float) -> None:
        while True:
            self._read_kv_events()
            await asyncio.sleep(seconds)

    def stop_accepting(self) -> None:
        for r in self.replicas:
            r.stop_accepting()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        results = await asyncio.gather(*(r.wait_idle(timeout) for r in self.replicas))
        return all(results)

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()

    async def stop(self, timeout: float = 5.0) -> None:
        await asyncio.gather(*(r.stop(timeout) for r in self.replicas))
        if self.kv_events is not None:
            if self._kv_events_task is not None:
                self._kv_events_task.cancel()
            self.kv_events.close()

    # -- requests ----------------------------------------------------------------------------
    async def call_engine(self, name: str, *args: Any) -> Any:
        """A call that reads the model (Whisper's `cross_weights`): the first replica that takes
        requests runs it (they hold the same weights). A cache reset runs on every replica (True
        if each did). Other calls that change an engine (adapters) are not run across replicas."""
        if name in RANKED_CALLS:  # replica i joins as rank rank_offset + i
            return all(await asyncio.gather(*(r.call_engine(name, *args[:2], args[2] + i, *args[3:])
                                              for i, r in enumerate(self.replicas))))
        if name in EVERY_ENGINE:
            return all(await asyncio.gather(*(r.call_engine(name, *args) for r in self.replicas)))
        if name not in ("cross_weights", "get_weight_version"):
            raise NotImplementedError(f"{name}: not run across replicas")
        live = [r for r in self.replicas if r.accepting] or self.replicas
        return await live[0].call_engine(name, *args)

    async def add(self, requests: Sequence[EngineRequest]) -> OutputStream:
        candidates = [i for i, r in enumerate(self.replicas) if r.accepting]
        if not candidates:
            dead = self.dead
            if dead is not None:
                raise EngineDeadError(f"every engine replica has failed: {dead!r}")
            raise EngineShuttingDownError("the server is shutting down; no new requests")
        self._forget_restarted()
        if self.kv_events is not None:
            self._read_kv_events()
        loads = self.loads()
        prompt = as_image_prompt(requests[0].prompt)  # (a prompt with images routes by its text or ids)
        if isinstance(prompt, dict):  # (embeddings: no tokens to route by)
            prompt = []
        decision = self.router.route(prompt.prompt if isinstance(prompt, ImagePrompt) else prompt, loads, candidates)
        if self.metrics is not None:
            self.metrics.on_routed(decision.replica, decision.reason)
        # The chosen replica first; if its queue is full, the others, least loaded first.
        order = [decision.replica, *sorted((i for i in candidates if i != decision.replica), key=lambda i: (loads[i], i))]
        full: QueueFullError | None = None
        refused: Exception | None = None
        for i in order:
            try:
                return await self.replicas[i].add(requests)
            except QueueFullError as e:
                full = full or e
            except (EngineShuttingDownError, EngineDeadError) as e:  # it stopped since we looked
                refused = refused or e
        if full is not None:
            raise QueueFullError(f"every replica's waiting queue is full (the first: {full})")
        assert refused is not None
        raise refused

    def abort(self, request_ids: Sequence[str]) -> None:
        # Unknown ids are ignored by each replica: no map from id to replica is needed.
        for r in self.replicas:
            r.abort(request_ids)

    def _read_kv_events(self) -> None:
        router = self.router
        if router.tokenize is None and (tokenizer := self.tokenizer) is not None:
            router.use_tokenizer(tokenizer.encode)  # (a text prompt's ids, as the engine makes them)
        subscriber = self.kv_events
        assert subscriber is not None
        for replica, batch in subscriber.poll():
            router.on_kv_events(replica, batch.events)
            if self.metrics is not None:
                self.metrics.on_kv_events(replica)
        if subscriber.missed > self._kv_events_missed:
            logger.warning("KV events: %d batches lost on their way to the router, past what the replay sockets "
                           "keep (its view of the replicas' caches may be stale until those blocks change again)",
                           subscriber.missed - self._kv_events_missed)
            self._kv_events_missed = subscriber.missed

    def _forget_restarted(self) -> None:
        for i, r in enumerate(self.replicas):
            n = r.restarts
            if n != self._restarts_seen[i]:
                self._restarts_seen[i] = n
                self.router.on_replica_reset(i)


def replica_engine_kwargs(engine_kwargs: dict[str, Any], size: int, gpus: int | None = None) -> list[dict[str, Any]]:
    """Each replica's engine options: on CUDA replica i gets `cuda:i`; on CPU each of its ranks
    (`tensor_parallel_size`) gets its share of the cores unless `num_threads` was given. `gpus` is the number of visible GPUs (None:
    asked of torch when the device may be a GPU)."""
    if size == 1:
        return [dict(engine_kwargs)]
    device = engine_kwargs.get("device", "auto")
    if device != "cpu":
        if device.startswith("cuda:"):
            raise ConfigError(f"device={device!r}: with data_parallel_size={size}, give 'cuda' (replica i runs on cuda:i)")
        if gpus is None:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            if gpus < size:
                raise ConfigError(f"data_parallel_size={size} needs {size} GPUs, one per replica; {gpus} visible")
            return [{**engine_kwargs, "device": f"cuda:{i}"} for i in range(size)]
        if device == "cuda":
            raise ConfigError("device='cuda' but no GPU is visible")
    ranks = size * int(engine_kwargs.get("tensor_parallel_size") or 1)  # a replica's ranks share its cores
    threads = engine_kwargs.get("num_threads") or max(1, (os.cpu_count() or 1) // ranks)
    return [{**engine_kwargs, "device": "cpu", "num_threads": threads} for _ in range(size)]


def build_replica_set(
    engine_kwargs: dict[str, Any],
    router_config: RouterConfig,
    engine_process: bool = True,
    max_queued_requests: int | None = None,
    max_replays: int = 1,
    metrics: ServerMetrics | None = None,
    gpus: int | None = None,
    per_replica: list[dict[str, Any]] | None = None,
) -> ReplicaSet:
    """`router_config.data_parallel_size` replicas of the engine `engine_kwargs` describes, not
    yet launched (with `engine_process`) or built and ready to start (without: the weights are
    loaded once and shared by every replica's runner). `per_replica`: each replica's own
    options, where the caller has split the devices (`replica_engine_kwargs`) itself."""
    size = router_config.data_parallel_size
    if router_config.replica_migration:
        raise ConfigError("replica_migration is simulated only (conveyor simulate); the server does not move requests "
                          "between replicas yet")
    replicas: list[AsyncEngine] = []
    router = make_router(router_config)
    subscriber = None
    if router.wants_kv_events:
        engine_kwargs, subscriber = _kv_events_options(engine_kwargs, router_config)
    if router_config.data_parallel_backend == "ray":
        if not engine_process:
            raise ConfigError("replicas on Ray run in actors, not in threads: leave out --no-engine-process")
        from conveyor.server.ray_engine import RayAsyncEngine, init_ray, ray_replica_options

        init_ray(router_config.ray_address)
        replicas = [RayAsyncEngine({**kw, "data_parallel_rank": i}, actor_options=opts,
                                   max_queued_requests=max_queued_requests, max_replays=max_replays)
                    for i, (kw, opts) in enumerate(ray_replica_options(engine_kwargs, size))]
        return ReplicaSet(replicas, router, metrics)
    if per_replica is None:
        per_replica = replica_engine_kwargs(engine_kwargs, size, gpus)
    if size > 1:  # (a replica's KV events carry its number, and it publishes them at its own endpoint)
        per_replica = [{**kw, "data_parallel_rank": i} for i, kw in enumerate(per_replica)]
    if engine_process:
        from conveyor.server.engine_process import ProcessAsyncEngine

        replicas = [ProcessAsyncEngine(kw, max_queued_requests=max_queued_requests, max_replays=max_replays)
                    for kw in per_replica]
    else:
        from conveyor.config import EngineConfig
        from conveyor.engine import Engine

        if size > 1 and per_replica[0]["device"] != "cpu":
            raise ConfigError("replicas in threads share one copy of the weights: on GPUs, run them in processes "
                              "(leave out --no-engine-process)")

        first = Engine.from_config(EngineConfig.from_kwargs(**per_replica[0]))
        engines = [first] + [
            # `runner.model` is how `Engine.from_model` documents sharing one load.
            Engine.from_model(EngineConfig.from_kwargs(**kw), first.runner.model,  # type: ignore[attr-defined]
                              first.tokenizer, getattr(first, "model_path", None))
            for kw in per_replica[1:]
        ]
        replicas = [AsyncEngine(e, max_queued_requests=max_queued_requests) for e in engines]
    return ReplicaSet(replicas, router, metrics, subscriber)


def _kv_events_options(engine_kwargs: dict[str, Any], router_config: RouterConfig) -> tuple[dict[str, Any], KVEventSubscriber]:
    """The engine options with which each replica publishes its KV events, and a subscriber to
    all, for a router that reads them. Without an endpoint of the user's, the replicas publish
    at IPC sockets in a temporary directory (replica i at `...-i`, vLLM's offsets)."""
    import tempfile

    from conveyor.config import kv_events_options
    from conveyor.core.kv_events import KVEventSubscriber, offset_endpoint

    if router_config.data_parallel_backend == "ray":
        raise ConfigError("router_policy='kv_events' over Ray replicas is not built (their events' sockets are on "
                          "other machines); use --data-parallel-backend mp")
    kwargs = dict(engine_kwargs)
    if (spec := kwargs.pop("kv_events_config", None)) is not None:
        kwargs.update(kv_events_options(spec, kwargs))
    if kwargs.get("kv_events_publisher", "zmq") != "zmq":
        raise ConfigError("router_policy='kv_events' reads the replicas' published events: leave "
                          "kv_events_publisher at zmq")
    kwargs.update(enable_kv_cache_events=True, kv_events_publisher="zmq")
    if "kv_events_endpoint" not in kwargs:
        folder = tempfile.mkdtemp(prefix="conveyor-kv-events-")
        kwargs["kv_events_endpoint"] = "ipc://" + os.path.join(folder, "replica")
        kwargs.setdefault("kv_events_replay_endpoint", "ipc://" + os.path.join(folder, "replay"))
    from conveyor.config import CacheConfig

    endpoint = kwargs.get("kv_events_endpoint", CacheConfig.kv_events_endpoint)
    replay = kwargs.get("kv_events_replay_endpoint")
    topic = kwargs.get("kv_events_topic", "")
    n = router_config.data_parallel_size
    try:
        subscriber = KVEventSubscriber([offset_endpoint(endpoint, i) for i in range(n)], topic,
                                       None if replay is None else [offset_endpoint(replay, i) for i in range(n)])
    except ImportError:
        raise ConfigError("router_policy='kv_events' needs pyzmq and msgpack: pip install conveyor[kv-events]") from None
    return kwargs, subscriber
