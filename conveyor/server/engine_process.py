"""The engine in its own process: the server outlives an engine that dies, and resumes its work.

`ProcessAsyncEngine` is `AsyncEngine` with the `Engine` moved to a child process (spawned, so a
restart never forks a process holding threads or a CUDA context). The HTTP front end, its
streams and its metrics stay in the server's process; the child builds the engine and steps it.

Why a process (DESIGN.md §8):
- a crash of the engine (a CUDA error, an out-of-memory kill, a bug on one input) no longer
  ends the server: the child is started again and every request that was in flight goes on
  from its last token delivered, as a recompute-preempted sequence does; clients see a pause,
  not an error;
- a request in flight through more deaths than `max_replays` allows ends with an error (it may
  be what kills the engine), so one poisonous request cannot stall the server forever;
- the event loop's Python (HTTP, JSON, SSE) no longer takes the engine's GIL.

Wire (both ways `multiprocessing` connections; the child's reader thread drains commands at
once, so neither side blocks the other):
- parent -> child: `("add", add_id, [_AddItem], arrival, check_queue)`, `("abort", ids)`,
  `("stop",)`;
- child -> parent: `("ready", _Facts)` or `("load_failed", text)` once; then `("added", add_id,
  error)` per add, `("step", [_Update], StepRecord | None, QueueCounts)` per step or command
  batch, and `("failed", text)` before a child whose step raised exits.
Each `_Update` carries only what is new (tokens, text, logprobs, timestamps), whatever
`output_kind` the caller asked for: the parent keeps each request's whole output, builds the
outputs the caller asked for from it, and has what a resume needs when the child dies.

Greedy and seeded requests continue with the tokens an uninterrupted engine would give;
unseeded sampled ones go on sampling from where they stood.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from conveyor.kv_transfer import KVHandoff
from conveyor.lora import LoRARequest
from conveyor.multimodal import ImageProcessor, ImageToken
from conveyor.outputs import CompletionOutput, ParallelChoices, RequestOutput, TokenLogprob
from conveyor.sampling_params import InvalidRequestError, SamplingParams
from conveyor.scoring import ModelHead
from conveyor.sequence import RequestMetrics
from conveyor.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    EngineShuttingDownError,
    OutputStream,
    Prompt,
    QueueFullError,
    _AbortAll,
    _Add,
    _Call,
    _Command,
    queue_limit_error,
)
from conveyor.server.metrics import QueueCounts, queue_counts

if TYPE_CHECKING:
    from conveyor.engine import Engine, Resume, StepRecord
    from conveyor.server.metrics import ServerMetrics
    from conveyor.tokenizer import Tokenizer

logger = logging.getLogger("conveyor.server")


class Child(Protocol):
    """The engine's host as the front end handles it: a process, or a Ray actor (`ray_engine`)."""

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...


class Wire(Protocol):
    """The front end's end of the connection to its engine (a `multiprocessing` connection)."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the child's error is in the message)."""


class RequestFailedError(EngineDeadError):
    """The engine died under this request more often than `max_replays` allows (HTTP 500; the
    server goes on serving the others)."""


# -- the wire ------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Facts:
    """What the front end needs of the engine, sent once the child has built it."""

    tokenizer: Tokenizer | None
    max_model_len: int
    head: ModelHead
    model_path: str | None
    model_arg: str | None
    pid: int
    image_token: ImageToken | None = None
    image_processor: ImageProcessor | None = None


@dataclass(slots=True)
class _AddItem:
    request_id: str
    prompt: Prompt
    params: SamplingParams  # with output_kind "delta": the child sends only what is new
    prompt_text: str | None
    resume: Resume | None = None
    lora_request: LoRARequest | None = None
    export_kv: bool = False
    kv_handoff: KVHandoff | None = None


@dataclass(slots=True)
class _Update:
    """One request's news from one step."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_preemptions: int
    num_cached_tokens: int
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]  # new since the last update
    prompt: str | None = None  # the first update only
    prompt_token_ids: list[int] | None = None  # the first update only
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the first that has them only
    kv_handoff: KVHandoff | None = None  # an export_kv request's last update
    embedding: list[float] | None = None  # an embedding request's last update
    token_embeddings: list[list[float]] | None = None  # ... with pooling_type "all"


_ERRORS: dict[str, type[Exception]] = {
    "InvalidRequestError": InvalidRequestError,
    "QueueFullError": QueueFullError,
}


def _wire_error(e: BaseException) -> tuple[str, str, str | None]:
    """An exception as plain data (InvalidRequestError's `param` does not survive pickling)."""
    return type(e).__name__, str(e), getattr(e, "param", None)


def _error_from_wire(kind: str, message: str, param: str | None) -> Exception:
    cls = _ERRORS.get(kind)
    if cls is InvalidRequestError:
        return InvalidRequestError(message, param=param)
    if cls is not None:
        return cls(message)
    return RuntimeError(f"{kind}: {message}")


# -- the child -----------------------------------------------------------------------------------
def _child_main(
    engine_kwargs: dict[str, Any],
    conn: mpc.Connection,
    max_queued_requests: int | None,
    idle_poll_s: float,
    log_level: int,
    own_process: bool = True,
) -> None:
    """The engine process: build the engine, then step it until told to stop or orphaned.
    `own_process=False`: the same in a thread of a process that is not ours (a Ray actor)."""
    if own_process:
        # Signals are the front end's to act on (it drains, then stops us); a Ctrl-C reaches
        # the whole process group, and must not kill the engine under a draining server.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (engine): %(message)s")
    from conveyor.config import EngineConfig
    from conveyor.engine import Engine

    try:
        engine = Engine.from_config(EngineConfig.from_kwargs(**engine_kwargs))
    except BaseException as e:
        conn.send(("load_failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", _Facts(
        engine.tokenizer, engine.max_model_len, engine.head, getattr(engine, "model_path", None),
        engine.config.model.model, os.getpid(), engine.image_token, engine.image_processor,
    )))
    _EngineCore(engine, conn, max_queued_requests, idle_poll_s).run()


class _EngineCore:
    """The child's loop: commands in (a reader thread queues them), one step, news out."""

    def __init__(
        self, engine: Engine, conn: mpc.Connection, max_queued_requests: int | None, idle_poll_s: float
    ) -> None:
        self.engine = engine
        self.conn = conn
        self.max_queued_requests = max_queued_requests
        self.idle_poll_s = idle_poll_s
        self.cond = threading.Condition()
        self.inbox: list[tuple[Any, ...]] = []
        self.stop = False
        self.times_sent: dict[str, int] = {}  # token_times already sent, per request
        self.unannounced: set[str] = set()  # requests whose prompt was not sent yet
        # Adds whose new grammars compile meanwhile (the loop keeps stepping the running
        # requests), each with its compile; each is added when its compile is done.
        self.compiler = ThreadPoolExecutor(1, thread_name_prefix="conveyor-grammar")
        self.deferred: list[tuple[Future[None], tuple[Any, ...]]] = []
        self.dropped: set[str] = set()  # ids aborted while their grammar compiled

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the front end is gone: nobody to serve
                msg = ("stop",)
            with self.cond:
                if msg[0] == "stop":
                    self.stop = True
                else:
                    self.inbox.append(msg)
                self.cond.notify()
            if msg[0] == "stop":
                return

    def run(self) -> None:
        threading.Thread(target=self._read, name="conveyor-engine-inbox", daemon=True).start()
        engine = self.engine
        has_work = False
        try:
            while True:
                with self.cond:
                    while not self.inbox and not has_work and not self.stop and not self._compiled():
                        self.cond.wait()
                    commands, self.inbox = self.inbox, []
                    if self.stop:
                        self.compiler.shutdown(wait=False, cancel_futures=True)
                        return  # the front end ends what was in flight itself
                outputs: list[RequestOutput] = []
                for cmd in commands:
                    if cmd[0] == "add":
                        self._add_or_defer(cmd)
                    elif cmd[0] == "call":  # one of ENGINE_CALLS
                        _, call_id, name, args = cmd
                        answer: tuple[Any, ...]
                        try:
                            answer = ("called", call_id, getattr(engine, name)(*args), None)
                        except Exception as e:
                            answer = ("called", call_id, None, _wire_error(e))
                        self.conn.send(answer)
                    else:  # abort
                        for rid in cmd[1]:
                            out = engine.abort_request(rid)
                            if out is not None:
                                outputs.append(out)
                            elif self.deferred:
                                self.dropped.add(rid)
                self._add_compiled()
                record = None
                if engine.has_unfinished_requests():
                    before = engine.last_step
                    outputs += engine.step()
                    if engine.last_step is not before:
                        record = engine.last_step
                    else:  # a policy holds the batch back: nap, woken by a command
                        with self.cond:
                            if not self.inbox and not self.stop:
                                self.cond.wait(self.idle_poll_s)
                if outputs or record is not None or commands:
                    updates = [self._update(out) for out in outputs]
                    self.conn.send(("step", updates, record, queue_counts(engine.scheduler)))
                has_work = engine.has_unfinished_requests()
        except BaseException:
            text = traceback.format_exc()
            logger.error("the engine failed:\n%s", text)
            with contextlib.suppress(Exception):
                self.conn.send(("failed", text))
            # Not a clean return: the state is not to be trusted, and the front end starts anew.
            os._exit(1)

    def _add_or_defer(self, cmd: tuple[Any, ...]) -> None:
        """Add now, or, if the requests bring grammars not compiled yet, once they are
        compiled (`Engine.compile_grammars`, from a worker thread, in the grammar worker
        process): a schema's compile then holds no other request's tokens."""
        specs = self.engine.uncompiled_grammars(it.params for it in cmd[2])
        if not specs:
            self._add(*cmd[1:])
            return
        future = self.compiler.submit(self.engine.compile_grammars, specs)
        future.add_done_callback(self._wake)
        self.deferred.append((future, cmd))

    def _wake(self, _future: Future[None]) -> None:
        with self.cond:
            self.cond.notify()

    def _compiled(self) -> bool:
        return any(future.done() for future, _ in self.deferred)

    def _add_compiled(self) -> None:
        """Add the deferred requests whose grammars are ready; a grammar that cannot be
        built refuses its add with the error adding it would have raised."""
        done = [d[0].done() for d in self.deferred]  # once: a compile may end between two looks
        ready = [d for d, ok in zip(self.deferred, done, strict=True) if ok]
        self.deferred = [d for d, ok in zip(self.deferred, done, strict=True) if not ok]
        for future, (_, add_id, items, arrival, check_queue) in ready:
            items = [it for it in items if it.request_id not in self.dropped]
            error = future.exception()
            if error is not None:
                self.conn.send(("added", add_id, _wire_error(error)))
            else:
                self._add(add_id, items, arrival, check_queue)
        if not self.deferred:
            self.dropped.clear()

    def _add(self, add_id: int, items: list[_AddItem], arrival: float, check_queue: bool) -> None:
        engine = self.engine
        error: tuple[str, str, str | None] | None = None
        if check_queue:
            refusal = queue_limit_error(len(items), len(engine.scheduler.waiting), self.max_queued_requests)
            error = _wire_error(refusal) if refusal is not None else None
        if error is None:
            added: list[str] = []
            try:
                for it in items:
                    engine.add_request(
                        it.request_id, it.prompt, it.params, arrival_time=arrival, stream=True,
                        prompt_text=it.prompt_text, resume=it.resume, lora_request=it.lora_request,
                        export_kv=it.export_kv, kv_handoff=it.kv_handoff,
                    )
                    added.append(it.request_id)
                    self.times_sent[it.request_id] = len(it.resume.metrics.token_times) if it.resume else 0
                    self.unannounced.add(it.request_id)
            except Exception as e:  # InvalidRequestError mostly: the caller's to see
                error = _wire_error(e)
                for rid in added:
                    engine.abort_request(rid)
                    self.times_sent.pop(rid, None)
                    self.unannounced.discard(rid)
        self.conn.send(("added", add_id, error))

    def _update(self, out: RequestOutput) -> _Update:
        rid = out.request_id
        c = out.outputs[0]
        m = out.metrics
        sent = self.times_sent.get(rid, 0)
        if out.finished:
            self.times_sent.pop(rid, None)
        else:
            self.times_sent[rid] = len(m.token_times)
        first = rid in self.unannounced
        if first:
            self.unannounced.discard(rid)
        return _Update(
            rid, c.delta_token_ids, c.delta_text, c.logprobs, c.finish_reason, c.stop_reason,
            out.num_preemptions, out.num_cached_tokens, m.first_scheduled_time,
            m.first_token_time, m.finished_time, m.token_times[sent:],
            out.prompt if first else None, out.prompt_token_ids if first else None, out.prompt_logprobs,
            out.kv_handoff, out.embedding, out.token_embeddings,
        )


# -- the front end -------------------------------------------------------------------------------
@dataclass(slots=True)
class _Tracked:
    """A request in flight, as the front end knows it: enough to answer and to resume it."""

    request: EngineRequest
    stream: OutputStream
    arrival: float
    kind: str  # the output_kind the caller asked for
    add_id: int
    metrics: RequestMetrics
    aborting: bool = False
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    deaths: int = 0  # engine deaths this request was in flight through
    # for ServerMetrics.on_output (RequestProgress)
    saw_first_token: bool = False
    token_times_seen: int = 0

    def output(self, completion: CompletionOutput, fresh_prompt_logprobs: bool = False) -> RequestOutput:
        prompt_ids = self.prompt_token_ids
        if prompt_ids is None:  # it never reached an engine
            prompt_ids = list(self.request.prompt) if isinstance(self.request.prompt, list) else []
        return RequestOutput(
            request_id=self.request.request_id,
            prompt=self.prompt if self.prompt is not None else self.request.prompt_text,
            prompt_token_ids=prompt_ids,
            outputs=[completion],
            finished=completion.finish_reason is not None,
            metrics=self.metrics,
            num_preemptions=self.metrics.num_preemptions,
            num_cached_tokens=self.metrics.num_cached_tokens,
            # as the engine gives them: once in a delta stream, in every other output
            prompt_logprobs=self.prompt_logprobs if fresh_prompt_logprobs or self.kind != "delta" else None,
        )


class ProcessAsyncEngine(AsyncEngine):
    """`AsyncEngine` over an engine in a child process, started again if it dies.

    `launch()` starts the child and waits until its engine is built (a load error raises
    there, with the child's message); `start()` launches it if that was not done and starts the
    thread that talks to it. Everything else is `AsyncEngine`'s interface. A request with
    `n > 1` runs as n requests of one choice each (`ParallelChoices`: choice i of a seeded
    request with seed + i, as the engine makes them), each resumed on its own after a restart,
    whose outputs the stream merges into the request's; aborting the request's id aborts every
    choice.
    """

    parallel_sampling = True  # (made into choices here, merged by the stream)

    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        max_queued_requests: int | None = None,
        metrics: ServerMetrics | None = None,
        idle_poll_s: float = 0.002,
        max_replays: int = 1,
        start_timeout: float = 600.0,
    ) -> None:
        if max_replays < 0:
            raise ValueError(f"max_replays={max_replays} must be >= 0")
        self.engine_kwargs = dict(engine_kwargs)
        self.max_replays = max_replays
        self.start_timeout = start_timeout
        self._init_front(max_queued_requests, metrics, idle_poll_s)
        self._facts: _Facts | None = None
        self._proc: Child | None = None
        self._conn: Wire | None = None
        # Wakes the supervisor from its wait on the child: a byte per queued command, never
        # blocking (a full pipe already holds a wake-up).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._tracked: dict[str, _Tracked] = {}  # supervisor thread only (in arrival order)
        self._adds: dict[int, _Add] = {}  # sent, not yet answered
        self._calls: dict[int, _Call] = {}  # engine calls sent, not yet answered
        self._call_ids = itertools.count(1)
        # The adapters added and pinned through `call_engine`: added and pinned again in an
        # engine started after a death, before any request resumes.
        self._added_loras: dict[int, Any] = {}
        self._pinned_loras: set[int] = set()
        # The last `update_weights_from_disk` (loaded again in an engine started after a death),
        # and whether tensors were sent after it (they are not kept here: lost in such an engine).
        self._weights_call: tuple[Any, ...] | None = None
        self._weights_sent = False
        self._add_ids = itertools.count()
        self._choice_ids: dict[str, list[str]] = {}  # a request with n > 1: its choices' ids (loop)

    # -- facts -------------------------------------------------------------------------------
    def _known(self) -> _Facts:
        if self._facts is None:
            raise RuntimeError("ProcessAsyncEngine: launch() or start() first")
        return self._facts

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._known().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._known().max_model_len

    @property
    def head(self) -> ModelHead:
        return self._known().head

    @property
    def image_token(self) -> ImageToken | None:
        return self._known().image_token

    @property
    def image_processor(self) -> ImageProcessor | None:
        return self._known().image_processor

    @property
    def model_path(self) -> str | None:
        return self._known().model_path

    @property
    def model_arg(self) -> str | None:
        return self._known().model_arg

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (it changes when the engine is started again)."""
        return self._facts.pid if self._facts is not None else None

    async def _compile_grammars(self, requests: Sequence[EngineRequest]) -> None:
        """Nothing here: the engine process compiles new grammars itself, off its loop."""

    def _split_choices(
        self, requests: Sequence[EngineRequest]
    ) -> tuple[Sequence[EngineRequest], dict[str, tuple[ParallelChoices, int]]]:
        """A request with n > 1 as its choices' requests (each replayed on its own after a
        death); the stream merges their outputs."""
        if all(r.params.n == 1 for r in requests):
            return requests, {}
        out: list[EngineRequest] = []
        choices: dict[str, tuple[ParallelChoices, int]] = {}
        for r in requests:
            if r.params.n == 1:
                out.append(r)
                continue
            if r.export_kv or r.kv_handoff is not None or r.resume is not None:
                raise InvalidRequestError("K/V are handed over and a request resumed for one choice (n=1)",
                                          param="kv_transfer")
            if r.request_id in self._choice_ids:
                raise InvalidRequestError(f"request id {r.request_id!r} is already in use", param="request_id")
            parent = ParallelChoices.of(r.request_id, r.params.n, r.params.output_kind)
            for i, (child_id, params) in enumerate(zip(parent.child_ids, r.params.choices(), strict=True)):
                out.append(dataclasses.replace(r, request_id=child_id, params=params))
                choices[child_id] = (parent, i)
        for parent, _ in choices.values():
            self._choice_ids[parent.request_id] = parent.child_ids
        return out, choices

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by id (a request with n > 1: every choice); unknown ids are ignored."""
        super().abort([c for rid in request_ids for c in self._choice_ids.get(rid, [rid])])

    def _stream_closed(self, stream: OutputStream) -> None:
        for parent, _ in stream.choices.values():
            self._choice_ids.pop(parent.request_id, None)
        super()._stream_closed(stream)

    def _clock(self) -> float:
        return time.perf_counter()  # the engine's clock; system-wide, so the child's too

    def _wake(self) -> None:
        self._cond.notify()
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"w")

    # -- life cycle --------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the engine process and wait for its engine (raises if it cannot be built)."""
        if self._conn is None:
            self._spawn()

    def _spawn(self) -> None:
        child, parent = self._start_child()
        try:
            if not parent.poll(self.start_timeout):
                raise EngineStartError(f"the engine process was not ready within {self.start_timeout:.0f} s")
            msg = parent.recv()
        except (EOFError, OSError):
            child.join(5.0)  # its end of the pipe closes a moment before its exit status is known
            msg = ("load_failed", f"the engine process exited with status {child.exitcode}")
        except BaseException:
            child.kill()
            raise
        if msg[0] != "ready":
            child.join(5.0)
            raise EngineStartError(f"the engine process could not start: {msg[1]}")
        self._proc, self._conn, self._facts = child, parent, msg[1]
        logger.info("engine process %d ready", self._facts.pid)

    def _start_child(self) -> tuple[Child, Wire]:
        """Start the engine somewhere; the child, and our end of the connection to it (its first
        message is "ready" or "load_failed"; its end reads as EOF once it is gone)."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_child_main,
            args=(self.engine_kwargs, child, self.max_queued_requests, self.idle_poll_s,
                  logging.getLogger().getEffectiveLevel()),
            name="conveyor-engine",
            daemon=True,
        )
        proc.start()
        child.close()  # ours: with it closed, the child's death reads as EOF
        return proc, parent

    def kill(self) -> None:
        """End the engine process at once, if there is one (a launch that must be undone)."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self.launch()
        self._start_thread(self._supervise, "conveyor-engine-io")

    # -- the supervisor thread ---------------------------------------------------------------
    def _supervise(self) -> None:
        try:
            while True:
                with self._cond:
                    commands, self._commands = self._commands, []
                    stopping = self._stop_requested
                for cmd in commands:
                    self._forward(cmd)
                if stopping:
                    self._shutdown()
                    return
                assert self._conn is not None
                conn_fd = self._conn.fileno()
                ready = mpc.wait([conn_fd, self._wake_r])
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 4096):
                            pass
                if conn_fd in ready:
                    try:
                        while self._conn.poll():
                            self._handle(self._conn.recv())
                    except (EOFError, OSError):
                        self._recover("the engine process died")
        except BaseException as e:
            logger.exception("the engine could not go on; no further requests will be served")
            self._fail_all(e)

    def _send(self, msg: tuple[Any, ...]) -> None:
        assert self._conn is not None
        with contextlib.suppress(OSError):  # a dead child: its EOF is read and handled next
            self._conn.send(msg)

    def _forward(self, cmd: _Command) -> None:
        if isinstance(cmd, _Call):
            call_id = next(self._call_ids)
            self._calls[call_id] = cmd
            self._send(("call", call_id, cmd.name, cmd.args))
            return
        if isinstance(cmd, _Add):
            add_id = next(self._add_ids)
            self._adds[add_id] = cmd
            items = []
            for r in cmd.requests:
                tr = self._tracked[r.request_id] = _Tracked(
                    r, cmd.stream, cmd.arrival_time, r.params.output_kind, add_id,
                    RequestMetrics(arrival_time=cmd.arrival_time),
                    logprobs=[] if r.params.logprobs is not None else None,
                )
                if r.resume is not None:  # handed over by a prefill engine: it holds what went out
                    tr.token_ids, tr.text = list(r.resume.output_token_ids), [r.resume.text]
                    tr.metrics = dataclasses.replace(r.resume.metrics, token_times=list(r.resume.metrics.token_times))
                items.append(self._item(tr, r.resume))
            self._send(("add", add_id, items, cmd.arrival_time, True))
        else:
            ids = list(self._tracked) if isinstance(cmd, _AbortAll) else cmd.request_ids
            ids = [rid for rid in ids if rid in self._tracked]
            for rid in ids:
                self._tracked[rid].aborting = True
            if ids:
                self._send(("abort", ids))

    @staticmethod
    def _item(tr: _Tracked, resume: Resume | None = None) -> _AddItem:
        r = tr.request
        params = dataclasses.replace(r.params, output_kind="delta")
        # A handoff's K/V are of a prefix of the prompt: still right after a restart.
        return _AddItem(r.request_id, r.prompt, params, r.prompt_text, resume, r.lora_request, r.export_kv,
                        r.kv_handoff)

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "step":
            _, updates, record, counts = msg
            self._on_step(updates, record, counts)
        elif kind == "added":
            _, add_id, error = msg
            self._on_added(add_id, error)
        elif kind == "called":
            _, call_id, result, error = msg
            self._on_called(call_id, result, error)
        elif kind == "failed":
            raise EOFError  # the child exits next: handled as its death

    def _on_called(self, call_id: int, result: Any, error: tuple[str, str, str | None] | None) -> None:
        cmd = self._calls.pop(call_id, None)
        if cmd is None:  # (a replay's, after a death: nobody waits for it)
            return
        if error is not None:
            self._resolve(cmd.future, _error_from_wire(*error))
            return
        if cmd.name == "add_lora":
            self._added_loras[cmd.args[0].lora_int_id] = cmd.args[0]
        elif cmd.name == "pin_lora":
            self._pinned_loras.add(cmd.args[0])
        elif cmd.name == "remove_lora":
            self._added_loras.pop(cmd.args[0], None)
            self._pinned_loras.discard(cmd.args[0])
        elif cmd.name == "update_weights_from_disk":
            self._weights_call, self._weights_sent = cmd.args, False
        elif cmd.name in ("update_weights_from_tensor", "update_weights_from_distributed"):
            self._weights_sent = True
        self._resolve(cmd.future, None, result)

    def _on_added(self, add_id: int, error: tuple[str, str, str | None] | None) -> None:
        cmd = self._adds.pop(add_id, None)
        if error is None:
            if cmd is not None:
                self._resolve(cmd.future, None)
            return
        members = [tr for tr in self._tracked.values() if tr.add_id == add_id]
        exc = _error_from_wire(*error)
        for tr in members:
            del self._tracked[tr.request.request_id]
        if cmd is not None:  # a new request: its caller gets the error from `add()`
            self._call_in_loop(self._stream_closed, cmd.stream)
            self._resolve(cmd.future, exc)
        elif members:  # a resumed one: its stream ends with it
            self._fail_streams({tr.stream for tr in members}, exc)

    def _on_step(self, updates: list[_Update], record: StepRecord | None, counts: QueueCounts) -> None:
        routed: list[tuple[OutputStream, RequestOutput]] = []
        for upd in updates:
            tr = self._tracked.get(upd.request_id)
            if tr is None:
                continue
            out = self._absorb(tr, upd)
            if upd.finish_reason is not None:
                del self._tracked[upd.request_id]
            if self.metrics is not None and self.count_requests:
                self.metrics.on_output(out, tr)
            if out.finished or tr.kind != "final_only":
                routed.append((tr.stream, out))
        if self.metrics is not None:
            if record is not None:
                self.metrics.on_step(record)
            self.metrics.on_queues(counts, self.replica_index)
        self._deliver(routed)

    @staticmethod
    def _absorb(tr: _Tracked, upd: _Update) -> RequestOutput:
        """Add one update to what `tr` holds; the output its caller's `output_kind` makes."""
        if upd.prompt_token_ids is not None:
            tr.prompt, tr.prompt_token_ids = upd.prompt, upd.prompt_token_ids
        fresh = upd.prompt_logprobs is not None and tr.prompt_logprobs is None  # (a resumed request's come again)
        if fresh:
            tr.prompt_logprobs = upd.prompt_logprobs
        tr.token_ids += upd.token_ids
        if upd.text:
            tr.text.append(upd.text)
        if tr.logprobs is not None and upd.logprobs:
            tr.logprobs += upd.logprobs
        m = tr.metrics
        if m.first_scheduled_time is None:
            m.first_scheduled_time = upd.first_scheduled_time
        if m.first_token_time is None:
            m.first_token_time = upd.first_token_time
        m.finished_time = upd.finished_time
        m.token_times += upd.token_times
        if m.token_times:
            m.last_token_time = m.token_times[-1]
        m.num_preemptions, m.num_cached_tokens = upd.num_preemptions, upd.num_cached_tokens
        if tr.kind == "delta":
            text, ids, logprobs = upd.text, upd.token_ids, upd.logprobs
        else:
            text = "".join(tr.text)
            tr.text[:] = [text]
            ids = list(tr.token_ids)
            logprobs = list(tr.logprobs) if tr.logprobs is not None else None
        out = tr.output(CompletionOutput(
            0, text, ids, upd.finish_reason, upd.stop_reason, logprobs, upd.text, upd.token_ids,
        ), fresh)
        out.kv_handoff = upd.kv_handoff
        out.embedding = upd.embedding
        out.token_embeddings = upd.token_embeddings
        return out

    # -- deaths ------------------------------------------------------------------------------
    def _recover(self, why: str) -> None:
        """The child died: end the requests it may have died of, start another, resume the rest."""
        proc = self._proc
        if proc is not None:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        code = proc.exitcode if proc is not None else None
        with self._cond:
            stopping = self._stop_requested
        if stopping:
            return  # `_shutdown` ends everything
        self.restarts += 1
        n = len(self._tracked)
        logger.error("%s (exit status %s) with %d request(s) in flight; starting it again", why, code, n)
        if self.metrics is not None:
            self.metrics.engine_restarts.inc()
        poisoned: list[_Tracked] = []
        for tr in list(self._tracked.values()):
            tr.deaths += 1
            if tr.aborting:  # its abort may not have been seen: it ends now, as asked
                del self._tracked[tr.request.request_id]
                self._deliver([(tr.stream, self._final(tr, "abort"))])
            elif tr.deaths > self.max_replays:
                del self._tracked[tr.request.request_id]
                poisoned.append(tr)
        if poisoned:
            logger.error(
                "%d request(s) failed: in flight through %d engine death(s)", len(poisoned), self.max_replays + 1
            )
            self._fail_requests(poisoned, RequestFailedError(
                f"the engine died {self.max_replays + 1} time(s) while serving this request; "
                "it was not retried again"
            ))
        if self._conn is not None:
            self._conn.close()
        self._conn = None
        self._spawn()  # raises if the engine cannot be built again: everything fails
        if self._weights_call is not None:  # the weights last loaded from disk, before any request
            self._send(("call", 0, "update_weights_from_disk", self._weights_call))
        if self._weights_sent:
            logger.error("the engine started again serves the weights of its checkpoint: the tensors sent to the one "
                         "that died are lost (send them again; /get_weight_version names the weights it serves)")
        for lora in self._added_loras.values():  # the adapters as they were, before any request
            self._send(("call", 0, "add_lora", (lora,)))
        for lora_id in sorted(self._pinned_loras):
            self._send(("call", 0, "pin_lora", (lora_id,)))
        for call_id, call in self._calls.items():  # never answered: sent again
            self._send(("call", call_id, call.name, call.args))
        resumed = 0
        for tr in list(self._tracked.values()):  # in arrival order: the oldest first
            if tr.add_id in self._adds:
                continue
            tr.add_id = next(self._add_ids)
            self._send(("add", tr.add_id, [self._item(tr, self._resume_of(tr))], tr.arrival, False))
            resumed += 1
        for add_id, cmd in list(self._adds.items()):  # never answered: sent again, as they were
            members = [self._tracked[r.request_id] for r in cmd.requests if r.request_id in self._tracked]
            if len(members) < len(cmd.requests):  # a member failed: so does the group
                self._adds.pop(add_id)
                for tr in members:
                    del self._tracked[tr.request.request_id]
                self._call_in_loop(self._stream_closed, cmd.stream)
                self._resolve(cmd.future, RequestFailedError("the engine died while accepting this request"))
                continue
            self._send(("add", add_id, [self._item(tr, tr.request.resume) for tr in members], cmd.arrival_time, True))
        if self.metrics is not None:
            self.metrics.requests_replayed.inc(resumed)

    @staticmethod
    def _resume_of(tr: _Tracked) -> Resume | None:
        from conveyor.engine import Resume

        if not tr.token_ids:
            return None if tr.metrics.first_scheduled_time is None else Resume([], 0, tr.metrics)
        emitted = sum(len(piece) for piece in tr.text)
        return Resume(list(tr.token_ids), emitted, tr.metrics, tr.metrics.num_preemptions)

    def _final(self, tr: _Tracked, reason: str) -> RequestOutput:
        """`tr`'s last output, made here (the engine that would have made it is gone)."""
        tr.metrics.finished_time = self._clock()
        delta = tr.kind == "delta"
        text = "" if delta else "".join(tr.text)
        ids = [] if delta else list(tr.token_ids)
        logprobs = ([] if delta else list(tr.logprobs)) if tr.logprobs is not None else None
        out = tr.output(CompletionOutput(0, text, ids, reason, None, logprobs, "", []))
        if self.metrics is not None and self.count_requests:
            self.metrics.on_output(out, tr)
        return out

    def _fail_requests(self, members: list[_Tracked], error: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.requests_failed.inc(len(members))
        self._fail_streams({tr.stream for tr in members}, error)
        # Their group mates are ended too: a stream that failed delivers nothing more.
        for stream in {tr.stream for tr in members}:
            for rid in stream.request_ids:
                self._tracked.pop(rid, None)

    def _fail_streams(self, streams: set[OutputStream], error: BaseException) -> None:
        def fail() -> None:
            for s in streams:
                s._put(error)

        self._call_in_loop(fail)

    def _shutdown(self) -> None:
        """Stop: every request still in flight ends as aborted, then the child exits."""
        self._send(("stop",))
        routed = [(tr.stream, self._final(tr, "abort")) for tr in self._tracked.values()]
        self._tracked.clear()
        for cmd in self._adds.values():
            self._call_in_loop(self._stream_closed, cmd.stream)
            self._resolve(cmd.future, EngineShuttingDownError("the server is shutting down; no new requests"))
        self._adds.clear()
        for call in self._calls.values():
            self._resolve(call.future, EngineShuttingDownError("the engine is shutting down"))
        self._calls.clear()
        self._deliver(routed)
        proc = self._proc
        if proc is not None:
            proc.join(10.0)
            if proc.is_alive():
                logger.warning("the engine process did not stop; killing it")
                proc.kill()
                proc.join()

    def _fail_all(self, error: BaseException) -> None:
        self._accepting = False
        dead = EngineDeadError(f"the engine failed: {error!r}")
        streams = {tr.stream for tr in self._tracked.values()}
        self._tracked.clear()
        with self._cond:
            self._dead = error
            pending, self._commands = self._commands, []
        for cmd in [*pending, *self._adds.values(), *self._calls.values()]:
            if isinstance(cmd, _Add):
                streams.add(cmd.stream)
            if isinstance(cmd, _Add | _Call):
                self._resolve(cmd.future, dead)
        self._adds.clear()
        self._calls.clear()
        self._fail_streams(streams, dead)
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

