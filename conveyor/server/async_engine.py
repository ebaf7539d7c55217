"""`AsyncEngine`: the synchronous `Engine` stepping in one background thread, fed by asyncio;
and `EngineFront`, the interface the HTTP layer serves from (an `AsyncEngine`, or a `ReplicaSet`).

Threading contract (the whole reason this file exists):
- Exactly one thread, the engine thread, touches the `Engine` (it is not thread-safe). Torch
  compute blocks, so it must not run on the event loop either.
- The event loop talks to it only through `_commands` (a list guarded by `_cond`): adds, aborts,
  stop. The engine thread drains the list between steps, so an abort frees its KV blocks before
  the next step starts.
- Outputs travel back with one `loop.call_soon_threadsafe` per step, into each request group's
  `asyncio.Queue`; only the loop thread touches those queues.
- When nothing is queued or running, the engine thread sleeps on `_cond` (no busy loop).

Every request runs with `stream=True` inside the engine, streaming or not, so the text a client
gets is produced by one code path: the streamed deltas always concatenate to the final text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.kv_transfer import KVHandoff
from conveyor.lora import LoRARequest
from conveyor.multimodal import ImageProcessor, ImagePrompt, ImageToken
from conveyor.outputs import ParallelChoices, RequestOutput
from conveyor.sampling_params import InvalidRequestError, SamplingParams
from conveyor.scoring import ModelHead
from conveyor.server.metrics import queue_counts

if TYPE_CHECKING:
    from conveyor.engine import Engine, Resume
    from conveyor.server.metrics import ServerMetrics
    from conveyor.tokenizer import Tokenizer

logger = logging.getLogger("conveyor.server")

Prompt = str | list[int] | ImagePrompt | dict[str, Any]  # (the dict: vLLM's, with "multi_modal_data")


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_queued_requests` already (HTTP 429)."""


class EngineShuttingDownError(RuntimeError):
    """The engine accepts no new requests: it is draining or stopped (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """A step raised; the engine's state can no longer be trusted (HTTP 500 / 503)."""


def queue_limit_error(num_new: int, num_waiting: int, limit: int | None) -> Exception | None:
    """Why a group of `num_new` requests may not join a queue of `num_waiting` (None: it may)."""
    if limit is None:
        return None
    if num_new > limit:
        return InvalidRequestError(
            f"this request asks for {num_new} sequences, but at most {limit} may wait in the "
            "queue (--max-queued-requests)",
            param="n",
        )
    if num_waiting + num_new > limit:
        return QueueFullError(
            f"the waiting queue is full ({num_waiting} of {limit} requests waiting); retry later"
        )
    return None


@dataclass(slots=True)
class EngineRequest:
    """One engine request: one choice of one prompt of an API request."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    prompt_text: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (the server's --lora-modules)
    # Prefill/decode disaggregation (conveyor/server/disaggregated.py): the prefill stage
    # exports its K/V; the decode stage goes on from the first token with them.
    export_kv: bool = False
    resume: Resume | None = None
    kv_handoff: KVHandoff | None = None


class OutputStream:
    """The outputs of a group of engine requests (the n choices of one API request), in order.

    Iterating yields `RequestOutput`s of any member as they move; it ends once every member has
    yielded its finished output. Members that are choices of one request with n > 1 (`choices`:
    their `ParallelChoices` and index, where the front end made the choices itself) yield the
    request's merged outputs instead. Lives on the event loop; the engine thread only reaches it
    through `loop.call_soon_threadsafe`. The stream counts as open (for `wait_idle`) until the
    engine has delivered every member's final output, whether or not anyone reads them.
    """

    def __init__(self, engine: AsyncEngine, request_ids: Sequence[str],
                 choices: dict[str, tuple[ParallelChoices, int]] | None = None) -> None:
        self._engine = engine
        self.request_ids = list(request_ids)
        self.choices = choices or {}
        self._unread = set(self.request_ids)  # members whose final output was not yet read
        self._undelivered = set(self.request_ids)  # ... not yet delivered by the engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self._unread

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)
        if isinstance(item, BaseException):
            self._undelivered.clear()
        elif item.finished:
            self._undelivered.discard(item.request_id)
        if not self._undelivered:
            self._engine._stream_closed(self)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while self._unread:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._unread.clear()
                raise item
            if item.finished:
                self._unread.discard(item.request_id)
            found = self.choices.get(item.request_id)
            if found is None:
                return item
            merged = found[0].merge(found[1], item)
            if merged is not None:
                return merged
        raise StopAsyncIteration

    def abort(self) -> None:
        """Abort every member still running (idempotent; call from the event loop)."""
        if self._undelivered:
            self._engine.abort(list(self._undelivered))


@dataclass(slots=True)
class _Active:
    """Engine-thread bookkeeping of one running engine request (for routing and metrics)."""

    stream: OutputStream
    saw_first_token: bool = False
    token_times_seen: int = 0


@dataclass(slots=True)
class _Add:
    requests: list[EngineRequest]
    stream: OutputStream
    future: asyncio.Future[None]
    arrival_time: float


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _AbortAll:
    pass


# The engine's own calls a front runs for its caller, between two steps (`call_engine`).
ENGINE_CALLS = frozenset({"add_lora", "remove_lora", "list_loras", "pin_lora", "cross_weights",
                          "reset_prefix_cache", "reset_mm_cache", "pause_generation", "resume_generation",
                          "is_paused", "update_weights_from_disk", "sleep", "wake_up", "is_sleeping",
                          "update_weights_from_tensor", "init_weights_update_group",
                          "update_weights_from_distributed", "destroy_weights_update_group",
                          "get_weight_version"})
# Calls that empty an engine's caches: a front of several engines runs them on every one.
CACHE_RESETS = frozenset({"reset_prefix_cache", "reset_mm_cache"})
# ... as it runs these (the answer: every engine's, `all` of them).
EVERY_ENGINE = CACHE_RESETS | {"add_lora", "pin_lora", "remove_lora",
                               "pause_generation", "resume_generation", "is_paused", "update_weights_from_disk",
                               "sleep", "wake_up", "is_sleeping", "update_weights_from_tensor",
                               "init_weights_update_group", "update_weights_from_distributed",
                               "destroy_weights_update_group"}
# ... each engine as a rank of its own (the argument at 2: the first engine's rank, `rank_offset`).
RANKED_CALLS = frozenset({"init_weights_update_group"})


async def pause_front(front: EngineFront, mode: str = "abort", clear_cache: bool = True, poll_s: float = 0.02) -> None:
    """vLLM's `pause_generation` on a front (every engine behind it): "abort" ends every request
    in flight (each stream ending with finish_reason abort), "wait" returns once the requests
    in flight are done, "keep" freezes them; requests sent meanwhile wait for `resume`.
    `clear_cache` forgets the prefix caches (`Engine.pause_generation`)."""
    from conveyor.engine import PAUSE_MODES

    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"mode={mode!r} is not one of {', '.join(PAUSE_MODES)}", param="mode")
    if mode == "abort":
        front.abort_all()  # (through the streams; the engines' own abort would deliver nothing)
    await front.call_engine("pause_generation", "keep" if mode == "abort" else mode, clear_cache)
    while mode == "wait" and not await front.call_engine("is_paused"):
        await asyncio.sleep(poll_s)


@dataclass(slots=True)
class _Call:
    name: str  # one of ENGINE_CALLS
    args: tuple[Any, ...]
    future: asyncio.Future[Any]


_Command = _Add | _Abort | _AbortAll | _Call


class EngineFront(ABC):
    """What the HTTP layer serves from: one engine (`AsyncEngine`, in a thread or a process) or
    several behind a router (`ReplicaSet`). Everything is called from the event loop."""

    metrics: ServerMetrics | None
    parallel_sampling = False  # whether a request may ask for n > 1 choices (the engine merges them)

    # -- facts (constant once started) -------------------------------------------------------
    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abstractmethod
    def head(self) -> ModelHead:
        """What the model classifies with (conveyor/scoring.py): none for a model that generates."""

    @property
    @abstractmethod
    def model_path(self) -> str | None:
        """The weights' file or folder."""

    @property
    @abstractmethod
    def model_arg(self) -> str | None:
        """`--model` as typed."""

    @property
    def image_token(self) -> ImageToken | None:
        """The model's image token (`Engine.image_token`); None: it reads no images."""
        return None

    @property
    def image_processor(self) -> ImageProcessor | None:
        """What makes the model's images pixels (`Engine.image_processor`): the server makes
        them before a request reaches the engine."""
        return None

    # -- state -------------------------------------------------------------------------------
    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    @property
    @abstractmethod
    def accepting(self) -> bool: ...

    @property
    @abstractmethod
    def dead(self) -> BaseException | None:
        """Why no request can be served any more (None while one can)."""

    @property
    @abstractmethod
    def num_open_streams(self) -> int: ...

    @property
    @abstractmethod
    def num_in_flight(self) -> int:
        """Engine requests accepted (or being accepted) whose final output is not delivered yet."""

    # -- life cycle --------------------------------------------------------------------------
    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop_accepting(self) -> None: ...

    @abstractmethod
    async def wait_idle(self, timeout: float | None = None) -> bool: ...

    @abstractmethod
    def abort_all(self) -> None: ...

    @abstractmethod
    async def stop(self, timeout: float = 5.0) -> None: ...

    # -- requests ----------------------------------------------------------------------------
    @abstractmethod
    async def add(self, requests: Sequence[EngineRequest]) -> OutputStream:
        """Queue a group of engine requests; all are accepted or none (then this raises)."""

    @abstractmethod
    def abort(self, request_ids: Sequence[str]) -> None: ...

    async def call_engine(self, name: str, *args: Any) -> Any:
        """Run one of the engine's calls (`ENGINE_CALLS`) where it runs; its result."""
        raise NotImplementedError(f"{type(self).__name__} runs no engine calls")

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        prompt_text: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the request is aborted if the consumer stops early.

        Errors of `add()` are raised by the first `__anext__`; an HTTP layer that must answer
        before its response starts calls `add()` itself.
        """
        stream = await self.add([EngineRequest(request_id, prompt, params, prompt_text)])
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()


class AsyncEngine(EngineFront):
    """Owns an `Engine` and steps it in a dedicated thread; requests arrive from asyncio.

    A request with `n > 1` is one engine request whose outputs the engine merges (its choices
    as `Engine.add_request` makes them); an engine in another process takes one choice a
    request (`parallel_sampling`).

    `start()` must be called from the event loop that will consume the streams; `stop()` ends
    the thread (aborting whatever is still in flight). `add()` raises `InvalidRequestError`,
    `QueueFullError` or `EngineShuttingDownError` before any output exists, so an HTTP layer can
    answer 400 / 429 / 503 before it starts a response.
    """

    parallel_sampling = True  # (n > 1 in one request)

    def __init__(
        self,
        engine: Engine,
        max_queued_requests: int | None = None,
        metrics: ServerMetrics | None = None,
        idle_poll_s: float = 0.002,
    ) -> None:
        self.engine = engine
        self._init_front(max_queued_requests, metrics, idle_poll_s)

    def _init_front(
        self, max_queued_requests: int | None, metrics: ServerMetrics | None, idle_poll_s: float
    ) -> None:
        """The state every front end has, whichever way its engine runs."""
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.replica_index = 0  # which replica this is behind a router (its queue gauges' slot)
        # Whether its requests count in the server's request metrics (a disaggregated set's
        # prefill replicas leave that to the decode replicas: one request, counted once).
        self.count_requests = True
        self.restarts = 0  # engines started again after one died (an engine process only)
        # Wait this long when the scheduler had work but chose to run nothing (a batching
        # policy collecting a batch): short, and cut short by any new command.
        self.idle_poll_s = idle_poll_s
        self._cond = threading.Condition()
        self._commands: list[_Command] = []
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._dead: BaseException | None = None
        self._open_streams: set[OutputStream] = set()
        self._idle: asyncio.Event | None = None
        self._active: dict[str, _Active] = {}  # engine thread only

    # -- facts the API needs (constant after construction; safe from any thread) -------------
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def head(self) -> ModelHead:
        return self.engine.head

    @property
    def image_token(self) -> ImageToken | None:
        return self.engine.image_token

    @property
    def image_processor(self) -> ImageProcessor | None:
        return self.engine.image_processor

    @property
    def model_path(self) -> str | None:
        """The weights' file or folder."""
        return getattr(self.engine, "model_path", None)

    @property
    def model_arg(self) -> str | None:
        """`--model` as typed."""
        return self.engine.config.model.model

    def _clock(self) -> float:
        return self.engine.clock()

    def _wake(self) -> None:
        """A command is queued (called holding `_cond`): the engine thread waits on `_cond`."""
        self._cond.notify()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    @property
    def dead(self) -> BaseException | None:
        return self._dead

    @property
    def num_open_streams(self) -> int:
        return len(self._open_streams)

    @property
    def num_in_flight(self) -> int:
        return sum(len(s._undelivered) for s in self._open_streams)

    # -- life cycle (event loop) -------------------------------------------------------------
    def start(self) -> None:
        self._start_thread(self._run, "conveyor-engine")

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        """Bind to the running event loop and start the thread that talks to the engine."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """New `add()` calls raise `EngineShuttingDownError`; in-flight work goes on."""
        self._accepting = False

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no stream is open; False if `timeout` passed first."""
        assert self._idle is not None, "start() first"
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def abort_all(self) -> None:
        self._push(_AbortAll())

    async def stop(self, timeout: float = 5.0) -> None:
        """Abort what is left, end the engine thread and wait for it (at most `timeout`)."""
        self._accepting = False
        with self._cond:
            self._stop_requested = True
            self._wake()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, timeout)
            if thread.is_alive():
                logger.warning("the engine thread did not stop within %.1f s", timeout)

    # -- the engine's own calls (event loop) -------------------------------------------------
    async def call_engine(self, name: str, *args: Any) -> Any:
        """Run one of the engine's calls (`ENGINE_CALLS`: its adapters' `add_lora`,
        `remove_lora`, `list_loras`, `pin_lora`; Whisper's `cross_weights`; the cache resets)
        where the engine runs, between two steps; its result, or what it raises."""
        if name not in ENGINE_CALLS:
            raise ValueError(f"{name!r} is not an engine call a front runs ({', '.join(sorted(ENGINE_CALLS))})")
        assert self._loop is not None, "start() first"
        future: asyncio.Future[Any] = self._loop.create_future()
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
            if self._stop_requested:
                raise EngineShuttingDownError("the engine is shutting down")
            self._commands.append(_Call(name, args, future))
            self._wake()
        return await future

    # -- requests (event loop) ---------------------------------------------------------------
    async def add(self, requests: Sequence[EngineRequest]) -> OutputStream:
        """Queue a group of engine requests; all are accepted or none (then this raises)."""
        if any(r.params.n != 1 for r in requests) and not self.parallel_sampling:
            # (the HTTP layer makes its n choices as n requests; `AsyncLLM` passes n on)
            raise InvalidRequestError(
                "an engine request here is one choice: add n requests, one per choice (params.n must be 1)", param="n"
            )
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down; no new requests")
        assert self._loop is not None and self._idle is not None
        await self._compile_grammars(requests)
        requests, choices = self._split_choices(requests)
        stream = OutputStream(self, [r.request_id for r in requests], choices)
        future: asyncio.Future[None] = self._loop.create_future()
        # The HTTP arrival, not the moment the engine thread gets to it: queue time includes the
        # wait for the current step to end. `clock` is a plain function of time (thread-safe).
        arrival = self._clock()
        with self._cond:
            # Checked under the lock the engine thread drains with: a command that gets in is
            # always answered, by the thread or by `_fail_everything`.
            refused: Exception | None = None
            if self._dead is not None:
                refused = EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
            elif self._stop_requested:
                refused = EngineShuttingDownError("the server is shutting down; no new requests")
            if refused is None:
                self._open_streams.add(stream)
                self._idle.clear()
                self._commands.append(_Add(list(requests), stream, future, arrival))
                self._wake()
        if refused is not None:
            self._stream_closed(stream)  # (never opened: forgets its choices)
            raise refused
        try:
            await future
        except asyncio.CancelledError:
            # The caller went away while the engine thread was busy: do not leak the requests.
            stream.abort()
            raise
        except BaseException:
            self._stream_closed(stream)
            raise
        return stream

    def _split_choices(
        self, requests: Sequence[EngineRequest]
    ) -> tuple[Sequence[EngineRequest], dict[str, tuple[ParallelChoices, int]]]:
        """The engine requests to queue for `requests`, and the choices among them that the
        stream merges: none here (this engine merges a request's n choices itself)."""
        return requests, {}

    async def _compile_grammars(self, requests: Sequence[EngineRequest]) -> None:
        """The requests' new grammars, compiled in a worker before they are queued: the
        engine thread goes on stepping meanwhile. Raises InvalidRequestError as adding does."""
        specs = self.engine.uncompiled_grammars(r.params for r in requests)
        if specs:
            await asyncio.to_thread(self.engine.compile_grammars, specs)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by id (unknown or finished ids are ignored); thread-safe."""
        self._push(_Abort(list(request_ids)))

    def _stream_closed(self, stream: OutputStream) -> None:
        self._open_streams.discard(stream)
        if not self._open_streams and self._idle is not None:
            self._idle.set()

    def _push(self, command: _Command) -> None:
        with self._cond:
            self._commands.append(command)
            self._wake()

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        has_work = False
        while True:
            with self._cond:
                while not self._commands and not has_work and not self._stop_requested:
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stop_requested
            try:
                delivered = self._apply(commands)
                if stopping:
                    delivered += self._abort_everything()
                    self._deliver(delivered)
                    self._publish()
                    return
                if engine.has_unfinished_requests():
                    before = engine.last_step
                    delivered += self._route(engine.step())
                    if engine.last_step is before:
                        # The scheduler ran nothing (a policy is holding the batch back):
                        # nap briefly instead of spinning; a new command wakes us at once.
                        with self._cond:
                            if not self._commands:
                                self._cond.wait(self.idle_poll_s)
                    elif self.metrics is not None and engine.last_step is not None:
                        self.metrics.on_step(engine.last_step)
                self._deliver(delivered)
                self._publish()
                has_work = engine.has_unfinished_requests()
            except BaseException as e:  # reported to every waiting client, then the thread ends
                logger.exception("the engine thread failed; no further requests will be served")
                self._fail_everything(e)
                return

    def _apply(self, commands: list[_Command]) -> list[tuple[OutputStream, RequestOutput]]:
        out: list[tuple[OutputStream, RequestOutput]] = []
        for cmd in commands:
            if isinstance(cmd, _Add):
                self._apply_add(cmd)
            elif isinstance(cmd, _Abort):
                for rid in cmd.request_ids:
                    out += self._abort_one(rid)
            elif isinstance(cmd, _Call):
                try:
                    result = getattr(self.engine, cmd.name)(*cmd.args)
                except Exception as e:  # InvalidRequestError mostly: the caller's to see
                    self._resolve(cmd.future, e)
                else:
                    self._resolve(cmd.future, None, result)
            else:
                out += self._abort_everything()
        return out

    def _apply_add(self, cmd: _Add) -> None:
        engine = self.engine
        added: list[str] = []
        error = queue_limit_error(sum(r.params.n for r in cmd.requests), len(engine.scheduler.waiting),
                                  self.max_queued_requests)
        if error is None:
            try:
                for r in cmd.requests:
                    engine.add_request(
                        r.request_id,
                        r.prompt,
                        r.params,
                        arrival_time=cmd.arrival_time,
                        stream=True,
                        prompt_text=r.prompt_text,
                        lora_request=r.lora_request,
                        resume=r.resume,
                        export_kv=r.export_kv,
                        kv_handoff=r.kv_handoff,
                    )
                    added.append(r.request_id)
                    self._active[r.request_id] = _Active(cmd.stream)
            except Exception as e:  # InvalidRequestError mostly; all are the caller's to see
                error = e
                for rid in added:
                    engine.abort_request(rid)
                    self._active.pop(rid, None)
        if error is not None:
            # Closed here too, not only by `add()`: its caller may be cancelled already.
            self._call_in_loop(self._stream_closed, cmd.stream)
        self._resolve(cmd.future, error)

    def _abort_one(self, request_id: str) -> list[tuple[OutputStream, RequestOutput]]:
        active = self._active.get(request_id)
        if active is None:
            return []
        out = self.engine.abort_request(request_id)
        return self._route([out]) if out is not None else []

    def _abort_everything(self) -> list[tuple[OutputStream, RequestOutput]]:
        out: list[tuple[OutputStream, RequestOutput]] = []
        for rid in list(self._active):
            out += self._abort_one(rid)
        return out

    def _route(self, outputs: list[RequestOutput]) -> list[tuple[OutputStream, RequestOutput]]:
        """Pair outputs with their streams; feed the metrics; forget finished requests."""
        routed: list[tuple[OutputStream, RequestOutput]] = []
        for out in outputs:
            active = self._active.get(out.request_id)
            if active is None:
                continue
            if self.metrics is not None and self.count_requests:
                self.metrics.on_output(out, active)
            if out.finished:
                del self._active[out.request_id]
            routed.append((active.stream, out))
        return routed

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.on_queues(queue_counts(self.engine.scheduler), self.replica_index)

    def _deliver(self, routed: list[tuple[OutputStream, RequestOutput]]) -> None:
        if routed and self._loop is not None:
            self._call_in_loop(_deliver_in_loop, routed)

    def _resolve(self, future: asyncio.Future[Any], error: BaseException | None, result: Any = None) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        self._call_in_loop(settle)

    def _call_in_loop(self, fn: Callable[..., object], *args: object) -> None:
        assert self._loop is not None
        # A closed loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    def _fail_everything(self, error: BaseException) -> None:
        self._accepting = False
        streams = {a.stream for a in self._active.values()}
        self._active.clear()
        dead = EngineDeadError(f"the engine failed: {error!r}")
        with self._cond:
            self._dead = error
            pending, self._commands = self._commands, []
        for cmd in pending:
            if isinstance(cmd, _Add):
                streams.add(cmd.stream)
            if isinstance(cmd, _Add | _Call):
                self._resolve(cmd.future, dead)

        def fail() -> None:
            for s in streams:
                s._put(dead)

        self._call_in_loop(fail)


def _deliver_in_loop(routed: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, out in routed:
        stream._put(out)
