"""`DisaggregatedSet`: prefill/decode disaggregation behind one front (DistServe, Splitwise;
vLLM's and SGLang's "PD" serving), on the engine replicas of this machine.

Two pools of replicas (`ReplicaSet`s): prefill replicas run each request's prompt and its first
token (`export_kv`, `max_tokens=1`), decode replicas take it from there with the prompt's K/V
(`kv_handoff`, conveyor/kv_transfer.py) and generate the rest. So a decode step never waits
for a long prompt (the interference DistServe removes), and each pool can be sized and
configured for its phase. The set routes a request's choices to a prefill replica by the
configured policy (its prefix cache holds the prompt), and each choice's handoff to the least
loaded decode replica; the client sees one stream: the first token as soon as the prefill
replica has it, then the decode replica's.

What travels: the K/V of the prompt, in the prefill engine's KV dtype, through the engine
processes' pipes (about 46 KB a token for SmolLM2 in float32). A request that ends with its
first token (EOS, a stop, `max_tokens=1`) never leaves its prefill replica. Request metrics are
counted once: by the decode replicas for what they finish, by the set for what ends at a
prefill replica; both pools' steps and queues are recorded. Not built: the transfer over RDMA
or NVLink (NIXL, Mooncake), layer by layer while the prompt computes, and replicas on Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from conveyor.config import ConfigError
from conveyor.core.routing import RouterConfig
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.server.async_engine import (
    EVERY_ENGINE,
    RANKED_CALLS,
    EngineFront,
    EngineRequest,
    OutputStream,
)
from conveyor.server.replicas import ReplicaSet, build_replica_set

if TYPE_CHECKING:
    from conveyor.scoring import ModelHead
    from conveyor.server.metrics import ServerMetrics
    from conveyor.tokenizer import Tokenizer

logger = logging.getLogger("conveyor.server")

# What a decode replica keeps for handed-over K/V when --kv-receive-space is not given.
DEFAULT_RECEIVE_SPACE = 1 << 30


@dataclasses.dataclass(slots=True)
class _Progress:
    """ServerMetrics' view of a request that ends at its prefill replica."""

    saw_first_token: bool = False
    token_times_seen: int = 0


@dataclasses.dataclass(slots=True)
class _Member:
    """One choice on its way through both pools, and what the client has been sent."""

    request: EngineRequest
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[Any] | None = None
    decode_stream: OutputStream | None = None


class _Stream(OutputStream):
    """The client's stream of one API request: fed by the set's task, not by an engine."""

    def __init__(self, front: DisaggregatedSet, request_ids: Sequence[str]) -> None:
        super().__init__(front, request_ids)  # type: ignore[arg-type]  # it has what a stream calls
        self.task: asyncio.Task[None] | None = None
        self.aborted = False  # a member between its stages is not handed over after this

    def abort(self) -> None:
        self.aborted = True
        super().abort()


class DisaggregatedSet(EngineFront):
    """Prefill replicas and decode replicas served as one engine (the module docstring)."""

    def __init__(self, prefill: ReplicaSet, decode: ReplicaSet, metrics: ServerMetrics | None = None) -> None:
        self.prefill, self.decode = prefill, decode
        for r in prefill.replicas:
            r.count_requests = False  # a request is counted once, where it ends
        self._streams: set[_Stream] = set()
        self._idle: asyncio.Event | None = None
        self.metrics = metrics

    async def call_engine(self, name: str, *args: Any) -> Any:
        """A call every engine runs (cache resets, pauses, new weights), on every prefill and
        decode replica; a weight-update group's ranks, the prefill replicas' first."""
        if name in RANKED_CALLS:
            after = (*args[:2], args[2] + len(self.prefill.replicas), *args[3:])
            return all(await asyncio.gather(self.prefill.call_engine(name, *args), self.decode.call_engine(name, *after)))
        if name == "get_weight_version":
            return await self.decode.call_engine(name)
        if name not in EVERY_ENGINE:
            raise NotImplementedError(f"{name}: not run across prefill and decode replicas")
        return all([await self.prefill.call_engine(name, *args), await self.decode.call_engine(name, *args)])

    @property
    def metrics(self) -> ServerMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, value: ServerMetrics | None) -> None:
        self._metrics = value
        self.prefill.metrics = value
        self.decode.metrics = value
        for i, r in enumerate([*self.prefill.replicas, *self.decode.replicas]):
            r.replica_index = i  # one queue-gauge slot each

    # -- facts -------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.prefill.tokenizer

    @property
    def max_model_len(self) -> int:
        return min(self.prefill.max_model_len, self.decode.max_model_len)

    @property
    def head(self) -> ModelHead:
        return self.prefill.head

    @property
    def model_path(self) -> str | None:
        return self.prefill.model_path

    @property
    def model_arg(self) -> str | None:
        return self.prefill.model_arg

    # -- state -------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.prefill.is_running and self.decode.is_running

    @property
    def accepting(self) -> bool:
        return self.prefill.accepting and self.decode.accepting

    @property
    def dead(self) -> BaseException | None:
        return self.prefill.dead or self.decode.dead

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    @property
    def num_in_flight(self) -> int:
        return self.prefill.num_in_flight + self.decode.num_in_flight

    # -- life cycle --------------------------------------------------------------------------
    def launch(self) -> None:
        self.prefill.launch()
        try:
            self.decode.launch()
        except BaseException:
            self.prefill.abort_all()
            for r in self.prefill.replicas:
                kill = getattr(r, "kill", None)
                if kill is not None:
                    kill()
            raise

    def start(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()
        self.prefill.start()
        self.decode.start()

    def stop_accepting(self) -> None:
        self.prefill.stop_accepting()
        self.decode.stop_accepting()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        assert self._idle is not None, "start() first"
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return all(await asyncio.gather(self.prefill.wait_idle(timeout), self.decode.wait_idle(timeout)))

    def abort_all(self) -> None:
        for s in list(self._streams):
            s.abort()
        self.prefill.abort_all()
        self.decode.abort_all()

    async def stop(self, timeout: float = 5.0) -> None:
        for s in list(self._streams):
            if s.task is not None:
                s.task.cancel()
        await asyncio.gather(self.prefill.stop(timeout), self.decode.stop(timeout))

    # -- requests ----------------------------------------------------------------------------
    async def add(self, requests: Sequence[EngineRequest]) -> OutputStream:
        """The choices' prefill stage is queued before this returns (its errors are raised here:
        a bad request, a full queue); the rest runs in a task of the set's."""
        members = {r.request_id: _Member(r, logprobs=[] if r.params.logprobs is not None else None)
                   for r in requests}
        # An embedding request is done at its prefill replica; it hands nothing over.
        stages = [r if r.params.pooling is not None else dataclasses.replace(
            r, params=dataclasses.replace(r.params, max_tokens=1, output_kind="final_only"), export_kv=True)
            for r in requests]
        prefill_stream = await self.prefill.add(stages)
        stream = _Stream(self, [r.request_id for r in requests])
        self._streams.add(stream)
        if self._idle is not None:
            self._idle.clear()
        stream.task = asyncio.get_running_loop().create_task(self._drive(stream, members, prefill_stream))
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        self.prefill.abort(request_ids)
        self.decode.abort(request_ids)

    def _stream_closed(self, stream: OutputStream) -> None:
        self._streams.discard(stream)
        if not self._streams and self._idle is not None:
            self._idle.set()

    # -- one API request ---------------------------------------------------------------------
    async def _drive(self, stream: _Stream, members: dict[str, _Member], prefill_stream: OutputStream) -> None:
        forwards: list[asyncio.Task[None]] = []
        try:
            async for out in prefill_stream:
                member = members[out.request_id]
                first = out.outputs[0]
                ends = first.finish_reason != "length" or member.request.params.max_tokens == 1 or out.kv_handoff is None
                if ends:  # done at its prefill replica: counted here, where it ended
                    out = dataclasses.replace(out, kv_handoff=None, outputs=[dataclasses.replace(
                        first, delta_text=first.text, delta_token_ids=list(first.token_ids))])
                    if self.metrics is not None:
                        self.metrics.on_output(out, _Progress())
                    self._emit(stream, member, out, final=True)
                    continue
                forwards.append(asyncio.get_running_loop().create_task(self._decode(stream, member, out)))
            await asyncio.gather(*forwards)
        except asyncio.CancelledError:
            for task in forwards:
                task.cancel()
            raise
        except BaseException as e:  # an engine's error: the client's stream ends with it
            for task in forwards:
                task.cancel()
            for m in members.values():
                if m.decode_stream is not None:
                    m.decode_stream.abort()
            stream._put(e)
        finally:
            self._stream_closed(stream)

    async def _decode(self, stream: _Stream, member: _Member, prefill_out: RequestOutput) -> None:
        """Hand one choice over, tell the client its first token, forward the decode replica's."""
        from conveyor.engine import Resume

        first = prefill_out.outputs[0]
        r = member.request
        resume = Resume(list(first.token_ids), len(first.text), prefill_out.metrics, prefill_out.num_preemptions,
                        first.text)
        params = dataclasses.replace(r.params, output_kind="delta", prompt_logprobs=None)
        stage = dataclasses.replace(r, params=params, resume=resume, kv_handoff=prefill_out.kv_handoff)
        self._emit(stream, member, dataclasses.replace(prefill_out, finished=False, kv_handoff=None, outputs=[
            dataclasses.replace(first, finish_reason=None, stop_reason=None, delta_text=first.text,
                                delta_token_ids=list(first.token_ids))]), final=False)
        if self.metrics is not None:
            self.metrics.generation_tokens.inc(len(first.token_ids))  # the decode replica counts the rest
        if stream.aborted:  # between the stages: it ends here, and is counted here
            ended = dataclasses.replace(prefill_out, kv_handoff=None, outputs=[dataclasses.replace(
                first, finish_reason="abort", stop_reason=None, delta_text="", delta_token_ids=[])])
            if self.metrics is not None:
                self.metrics.on_output(ended, _Progress())
            self._emit(stream, member, ended, final=True)
            return
        member.decode_stream = await self.decode.add([stage])
        if stream.aborted:  # while it was being added
            member.decode_stream.abort()
        try:
            async for out in member.decode_stream:
                self._emit(stream, member, out, final=out.finished)
        finally:
            member.decode_stream.abort()

    @staticmethod
    def _emit(stream: _Stream, member: _Member, out: RequestOutput, final: bool) -> None:
        """Pass an output of either stage on as the client's `output_kind` asks: each stage
        gives what is new (`delta_*`); the member keeps everything for the other kinds."""
        c = out.outputs[0]
        member.token_ids += c.delta_token_ids
        member.text.append(c.delta_text)
        new_logprobs = c.logprobs or []  # each stage's outputs hold only their new ones
        if member.logprobs is not None:
            member.logprobs += new_logprobs
        kind = member.request.params.output_kind
        if kind == "final_only" and not final:
            return
        if kind == "delta":
            ids, text = list(c.delta_token_ids), c.delta_text
            logprobs = None if member.logprobs is None else list(new_logprobs)
        else:
            ids, text = list(member.token_ids), "".join(member.text)
            logprobs = None if member.logprobs is None else list(member.logprobs)
        completion = CompletionOutput(c.index, text, ids, c.finish_reason if final else None,
                                      c.stop_reason if final else None, logprobs, c.delta_text, list(c.delta_token_ids))
        stream._put(dataclasses.replace(out, finished=final, outputs=[completion], kv_handoff=None))


def build_disaggregated_set(
    engine_kwargs: dict[str, Any],
    router_config: RouterConfig,
    engine_process: bool = True,
    max_queued_requests: int | None = None,
    max_replays: int = 1,
    metrics: ServerMetrics | None = None,
) -> DisaggregatedSet:
    """`prefill_replicas` + `decode_replicas` engines of `engine_kwargs`, one device each (on
    CUDA the prefill replicas first; on CPU the cores split among all of them); the decode ones
    with `kv_receive_space` (default 1 GiB)."""
    from conveyor.server.replicas import replica_engine_kwargs

    if router_config.data_parallel_backend != "mp":
        raise ConfigError("prefill/decode disaggregation runs its replicas on this machine: leave out "
                          "--data-parallel-backend ray")
    p, d = router_config.prefill_replicas, router_config.decode_replicas
    per_replica = replica_engine_kwargs(engine_kwargs, p + d)
    receive = engine_kwargs.get("kv_receive_space") or DEFAULT_RECEIVE_SPACE
    prefill = build_replica_set(engine_kwargs, router_config.pool("prefill"), engine_process, max_queued_requests,
                                max_replays, per_replica=per_replica[:p])
    decode = build_replica_set(engine_kwargs, router_config.pool("decode"), engine_process, max_queued_requests,
                               max_replays, per_replica=[{**kw, "kv_receive_space": receive} for kw in per_replica[p:]])
    return DisaggregatedSet(prefill, decode, metrics)
