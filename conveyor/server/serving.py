"""One API request's life: prompts -> engine requests -> a JSON body or server-sent events.

`CompletionHandler` and `ChatCompletionHandler` share `_Handler`: validation, sampling
parameters, the context-length check, fan-out of `n` choices, streaming, disconnect handling
and usage. They differ only in how prompts are built and how outputs are rendered.

Invariants: every check that can fail runs before the response starts; the streamed deltas of
a choice concatenate to exactly the text its non-streamed response has (both read the engine's
streaming output); a client that goes away aborts every engine request of its API request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from conveyor.audio import Audio
from conveyor.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, candidates
from conveyor.lora import FilesystemResolver, LoRARequest, LoRAResolver, lora_resolver
from conveyor.multimodal import (
    ImagePrompt,
    ImageToken,
    Pixels,
    chat_images,
    image_bytes,
    load_image,
)
from conveyor.outputs import CompletionOutput, RequestOutput, TokenLogprob
from conveyor.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputParams
from conveyor.sequence import RequestMetrics
from conveyor.server.async_engine import (
    EngineDeadError,
    EngineFront,
    EngineRequest,
    EngineShuttingDownError,
    OutputStream,
)
from conveyor.server.config import ServerConfig
from conveyor.server.errors import APIError, error_body
from conveyor.server.metrics import ServerMetrics
from conveyor.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from conveyor.server.reasoning import (
    HARMONY,
    HARMONY_FINAL,
    TAGS,
    ReasoningStream,
    keeps_special_tokens,
    reasoning_stream,
    split_reasoning,
)
from conveyor.server.tool_parsers import ToolParser, make_tool_parser
from conveyor.server.tools import Tools, ToolStream, history_for_template
from conveyor.video import Video

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp the same way


@dataclass
class ServerState:
    """What the routes share. `shutting_down` flips once, when a drain starts."""

    engine: EngineFront
    config: ServerConfig
    model_names: tuple[str, ...]
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    max_lora_rank: int | None = None  # the engines' (what an adapter loaded at run time is checked for)
    loras: dict[str, LoRARequest] = field(init=False)  # the adapters, by the model name requests send
    tool_parser: ToolParser = field(init=False)  # --tool-call-parser
    next_lora_id: int = field(init=False)  # an adapter loaded at run time takes the next id
    resolvers: list[tuple[str, LoRAResolver]] = field(init=False)  # --lora-resolver-dir, --lora-resolver
    _resolving: dict[str, asyncio.Lock] = field(init=False)
    # The completions and chat requests in flight, by their response id and their own
    # (`request_id`, X-Request-Id): what POST /abort_request ends.
    inflight: dict[str, OutputStream] = field(init=False)
    pinned_loras: set[int] = field(init=False)  # the ids of the adapters loaded with `pinned`

    def __post_init__(self) -> None:
        self.inflight = {}
        self.pinned_loras = set()
        self.loras = self.config.lora_requests
        self.next_lora_id = len(self.loras) + 1
        self.tool_parser = make_tool_parser(self.config.tool_call_parser)
        self.resolvers = [] if self.config.lora_resolver_dir is None else [
            ("--lora-resolver-dir", FilesystemResolver(self.config.lora_resolver_dir))]
        self.resolvers += [(name, lora_resolver(name)) for name in self.config.lora_resolver]
        self._resolving = {}

    async def resolve_lora(self, name: str) -> LoRARequest | None:
        """An adapter no one loaded, found by the resolvers for the model name `name` (vLLM's
        LoRA resolvers): checked against the model and served under that name from now on,
        with an id of its own. None if no resolver knows the name; APIError 400 if what they
        found cannot serve (each one's reason), 503 if none found it and one failed (an
        adapter store down). One lookup a name at a time."""
        if not self.resolvers:
            return None
        lock = self._resolving.setdefault(name, asyncio.Lock())
        async with lock:
            if name in self.loras:  # resolved by a request that held the lock before this one
                return self.loras[name]
            base = self.engine.model_arg or self.engine.model_path or self.model_name
            reasons: list[str] = []
            failures: list[str] = []
            for label, resolver in self.resolvers:
                try:
                    found = await resolver.resolve_lora(base, name)
                except Exception as e:  # a plugin's failure: the next one may know the name
                    failures.append(f"the resolver {label} failed: {type(e).__name__}: {e}")
                    continue
                if found is None:
                    continue
                request = LoRARequest(name, self.next_lora_id, found.lora_path)
                self.next_lora_id += 1  # (taken now: a lookup of another name meanwhile takes the next)
                try:
                    await asyncio.to_thread(verify_adapter, request, self.engine.model_path, self.max_lora_rank)
                except InvalidRequestError as e:
                    reasons.append(f"{label}: {e}")
                    continue
                if name in self.loras:  # loaded by the load route meanwhile
                    return self.loras[name]
                self.loras[name] = request
                return request
            self._resolving.pop(name, None)
            if reasons:
                raise APIError(400, f"The LoRA adapter {name!r} was found but cannot serve: "
                               + "; ".join(reasons + failures), param="model")
            if failures:
                raise APIError(503, f"The LoRA adapter {name!r} could not be looked up: " + "; ".join(failures),
                               "service_unavailable_error", param="model", code="lora_resolver_failed")
            return None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def begin_shutdown(self) -> None:
        self.shutting_down = True
        self.engine.stop_accepting()


def verify_adapter(request: LoRARequest, model_path: str | None, max_rank: int | None) -> None:
    """Read an adapter's config and weights as an engine would, against the model's shapes;
    InvalidRequestError with the reason if it cannot serve."""
    from conveyor.models.lora import check_adapter  # torch: only when an adapter is loaded

    check_adapter(request, model_path, max_rank)


def _media_url(item: Any) -> tuple[str, str] | None:
    """A chat's image, video or audio clip given by a data or http(s) URL: ("image", "video" or
    "audio", the URL); a clip given as its file's bytes (OpenAI's `input_audio`): ("audio bytes",
    their digest)."""
    kind, source = ("video", item.source) if isinstance(item, Video) else \
        ("audio", item.source) if isinstance(item, Audio) else ("image", item)
    if isinstance(source, str) and source.startswith(("data:", "http://", "https://")):
        return kind, source
    if kind == "audio" and isinstance(source, bytes):
        return "audio bytes", hashlib.sha256(source).hexdigest()
    return None


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None
    images: tuple[Any, ...] = ()  # one a `<image>` among token_ids (conveyor/multimodal.py)
    image_token: ImageToken | None = None  # ... and what each becomes
    processor_kwargs: dict[str, Any] | None = None  # (the request's `mm_processor_kwargs`)
    embeds: Any = None  # a prompt given as embeddings (`token_ids` its placeholders)

    @property
    def num_tokens(self) -> int:
        """Its length once each image token is expanded: what the context holds (at least,
        for an image the front end has not made pixels)."""
        if self.image_token is None:
            return len(self.token_ids)
        return len(self.token_ids) + sum(self.image_token.count(image) - 1 for image in self.images)

    @property
    def engine_prompt(self) -> list[int] | ImagePrompt | dict[str, Any]:
        if self.embeds is not None:
            return {"prompt_embeds": self.embeds}
        return ImagePrompt(self.token_ids, self.images, self.processor_kwargs) if self.images else self.token_ids


@dataclass
class _Choice:
    """Progress of one choice (engine request) while its outputs stream in."""

    index: int
    prompt: _Prompt
    started: bool = False
    final: RequestOutput | None = None
    num_tokens: int = 0
    text_sent: int = 0  # characters of completion text streamed so far
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    tool_stream: ToolStream | None = None  # a chat choice's tool calls as its text streams
    reasoning_stream: ReasoningStream | None = None  # and its reasoning, with a reasoning parser
    ids_sent: bool = False  # return_token_ids: the prompt's ids went out (in its first chunk)


class _Handler:
    """One API request: prompts -> engine requests -> response (JSON or events).

    Subclasses say how prompts are built and how outputs are rendered.
    """

    object_name = ""  # OpenAI's `object` of the full response ...
    chunk_object = ""  # ... and of a streamed chunk
    id_prefix = ""  # "cmpl" / "chatcmpl"
    prompt_param = "prompt"  # the field a context-length error names
    named_by_client = True  # `request_id` / X-Request-Id name the response (not the Responses API's ids)

    def __init__(self, state: ServerState, body: SamplingRequest) -> None:
        self.state = state
        self.body = body
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self._names: list[str] = []  # what the in-flight registry knows it by (`run`)
        self.created = int(time.time())
        self.tokenizer = state.engine.tokenizer
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self.choices: list[_Choice] = []
        self._fetched: dict[tuple[str, str], Pixels | bytes] = {}  # media made pixels (or fetched) by URL
        self.lora = None if body.model is None else state.loras.get(body.model)
        self.model_name = state.model_name if self.lora is None else self.lora.lora_name

    # subclass hooks
    def prompts(self) -> list[_Prompt]:
        raise NotImplementedError

    async def fetch_images(self) -> None:
        """Fetch and process the request's images (a chat's), off the event loop and before the
        engine sees them, so that no engine step waits on the network or on decoding pictures."""

    def max_tokens(self) -> int | None:
        raise NotImplementedError

    def logprobs(self) -> int | None:
        raise NotImplementedError

    def prompt_logprobs(self) -> int | None:
        """How many top logprobs each prompt token's entry holds (None: no entries)."""
        return self.body.prompt_logprobs

    def validate(self) -> None:
        body = self.body
        if body.stream_options is not None and not body.stream:
            raise InvalidRequestError(
                "stream_options may only be set when stream is true", param="stream_options"
            )
        self.logit_bias  # noqa: B018 (parsed now: a bad key is the request's error, before any choice)

    keeps_special_tokens = False

    # -- building the engine requests --------------------------------------------------------
    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        b = self.body
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "ignore_eos": b.ignore_eos,
            "min_tokens": b.min_tokens,
            # (a reasoning parser that reads special tokens gets them: it returns none of them)
            "skip_special_tokens": b.skip_special_tokens and not self.keeps_special_tokens,
            "include_stop_str_in_output": b.include_stop_str_in_output,
            "priority": b.priority,
            "logprobs": self.logprobs(),
            "prompt_logprobs": self.prompt_logprobs(),
            "expected_output_tokens": b.expected_output_tokens,
            "slo_ttft_ms": b.slo_ttft_ms,
            "slo_tpot_ms": b.slo_tpot_ms,
            # A stream's chunks are what is new since the last (the engine copies nothing
            # cumulative a token); a response waits for the end and its one output.
            "output_kind": "delta" if b.stream else "final_only",
        }
        optional = {
            "temperature": b.temperature,
            "top_p": b.top_p,
            "top_k": b.top_k,
            "min_p": b.min_p,
            "repetition_penalty": b.repetition_penalty,
            "presence_penalty": b.presence_penalty,
            "frequency_penalty": b.frequency_penalty,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        if b.stop is not None:
            kwargs["stop"] = (b.stop,) if isinstance(b.stop, str) else tuple(b.stop)
        if b.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(b.stop_token_ids)
        if b.seed is not None:
            # Choices of one request must differ, and stay reproducible: seed, seed+1, ...
            kwargs["seed"] = b.seed + choice
        if b.user is not None:
            kwargs["extra"] = {"user": b.user}
            kwargs["tenant"] = b.user
        if b.cache_salt is not None:
            kwargs["cache_salt"] = b.cache_salt
        if b.vllm_xargs is not None:
            kwargs["extra_args"] = dict(b.vllm_xargs)
        kwargs["structured_outputs"] = self.structured_outputs
        kwargs["logit_bias"] = self.logit_bias
        if b.allowed_token_ids is not None:
            kwargs["allowed_token_ids"] = tuple(b.allowed_token_ids)
        if b.bad_words:
            kwargs["bad_words"] = tuple(b.bad_words)
        try:
            return SamplingParams(**kwargs)
        except InvalidRequestError as e:
            if e.param == "max_tokens":  # name the field the client actually sent
                raise InvalidRequestError(str(e), self.max_tokens_param()) from None
            raise

    @functools.cached_property
    def logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias, its keys token ids written as strings, as SamplingParams takes it."""
        if not self.body.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, bias in self.body.logit_bias.items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias: key {key!r} is not a token id (an integer written as a string)", param="logit_bias"
                ) from None
        return out

    def max_tokens_param(self) -> str:
        return "max_tokens"

    @property
    def structured_outputs(self) -> StructuredOutputParams | None:
        """What the request's output must match."""
        return self.requested_outputs

    @functools.cached_property
    def requested_outputs(self) -> StructuredOutputParams | None:
        """What the request's output must match, from whichever field says it (one at most):
        built once, shared by every prompt and choice of the request."""
        b = self.body
        given: list[tuple[str, dict[str, Any]]] = []
        rf = b.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                schema = (rf.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise InvalidRequestError(
                        "response_format json_schema needs json_schema.schema, an object", param="response_format"
                    )
                given.append(("response_format", {"json": schema}))
            elif kind == "structural_tag":  # vLLM's: {"type", "structures", "triggers"} or {"type", "format"}
                given.append(("response_format", {"structural_tag": {k: v for k, v in rf.items() if k != "type"}}))
            elif kind != "text":
                raise InvalidRequestError(
                    f"response_format type {kind!r}: must be text, json_object, json_schema or structural_tag",
                    param="response_format",
                )
        if b.structured_outputs:
            unknown = set(b.structured_outputs) - {"json", "regex", "choice", "json_object", "grammar", "structural_tag"}
            if unknown:
                raise InvalidRequestError(
                    f"structured_outputs: {', '.join(sorted(unknown))} not supported "
                    "(json, regex, choice, json_object, grammar or structural_tag)", param="structured_outputs",
                )
            given.append(("structured_outputs", dict(b.structured_outputs)))
        for name, key in (
            ("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
            ("guided_grammar", "grammar"), ("ebnf", "grammar"),
        ):
            value = getattr(b, name)
            if value is not None:
                given.append((name, {key: value}))
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequestError(
                f"{' and '.join(n for n, _ in given)}: give at most one output constraint", param=given[1][0]
            )
        name, spec = given[0]
        try:
            return StructuredOutputParams(**spec)
        except (InvalidRequestError, TypeError) as e:
            raise InvalidRequestError(str(e), param=name) from None

    def truncated_prompts(self) -> list[_Prompt]:
        """The prompts, each cut to its last `truncate_prompt_tokens` (vLLM's; -1: as many as
        leave room for one token), its text then the kept tokens' (an echo shows what ran)."""
        k = self.body.truncate_prompt_tokens
        prompts = self.prompts()
        if k is None:
            return prompts
        if isinstance(k, bool) or not (k == -1 or k >= 1):
            raise InvalidRequestError(f"truncate_prompt_tokens={k!r}: must be -1 (as many as fit) or >= 1",
                                      param="truncate_prompt_tokens")
        if k == -1:
            k = self.state.engine.max_model_len - 1
        out = []
        for p in prompts:
            if p.images:
                raise InvalidRequestError("truncate_prompt_tokens would cut a prompt with images",
                                          param="truncate_prompt_tokens")
            if len(p.token_ids) > k:
                ids = p.token_ids[-k:]
                p = _Prompt(ids, None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=False))
            out.append(p)
        return out

    def fit(self, prompt: _Prompt) -> int:
        """The max_tokens to run with; raises if the prompt and completion cannot fit."""
        limit = self.state.engine.max_model_len
        n_prompt = prompt.num_tokens
        asked = self.max_tokens()
        if asked is None:
            room = limit - n_prompt
            if room < 1:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, your prompt "
                    f"has {n_prompt} tokens, which leaves no room for the completion. Please "
                    "shorten the prompt.",
                    param=self.prompt_param,
                    code="context_length_exceeded",
                )
            return room
        if asked >= 1 and n_prompt + asked > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + asked} tokens ({n_prompt} in the prompt, {asked} in the completion). "
                "Please reduce the prompt or the completion length.",
                param=self.prompt_param,
                code="context_length_exceeded",
            )
        return asked

    def engine_requests(self) -> list[EngineRequest]:
        self.validate()
        requests: list[EngineRequest] = []
        n = self.body.n
        for prompt in self.truncated_prompts():
            max_tokens = self.fit(prompt)
            for i in range(n):
                index = len(self.choices)
                params = self.sampling_params(max_tokens, i)
                self.choices.append(_Choice(index, prompt))
                requests.append(
                    EngineRequest(f"{self.request_id}-{index}", prompt.engine_prompt, params, prompt.text, self.lora)
                )
        return requests

    # -- running -----------------------------------------------------------------------------
    async def run(self, raw: Request) -> Response:
        own = (self.body.request_id or raw.headers.get("x-request-id") or None) if self.named_by_client else None
        if own is not None:
            self.request_id = f"{self.id_prefix}-{own}"
        names = [n for n in (self.request_id, own) if n is not None]
        if any(n in self.state.inflight for n in names):
            raise InvalidRequestError(f"request_id {own!r} is in flight already", param="request_id")
        if self.body.use_beam_search:
            return await self._run_beam_search(raw)
        await self.fetch_images()
        requests = self.engine_requests()
        by_id = {r.request_id: c for r, c in zip(requests, self.choices, strict=True)}
        stream = await self.state.engine.add(requests)
        for n in names:
            self.state.inflight[n] = stream
        self._names = names
        # Watch from here, not from inside the event generator: a client gone before the
        # stream starts would otherwise leave its requests running.
        watcher = asyncio.create_task(_abort_on_disconnect(raw, stream))
        id_header = {"X-Request-Id": self.request_id} if self.state.config.enable_request_id_headers else {}
        if self.body.stream:
            return StreamingResponse(
                self._events(stream, by_id, watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **id_header},
            )
        try:
            async for out in stream:
                choice = by_id[out.request_id]
                choice.num_tokens = len(out.outputs[0].token_ids)
                choice.cached_tokens = out.num_cached_tokens
                if out.finished:
                    choice.final = out
        except EngineDeadError as e:
            raise APIError(500, str(e), "internal_server_error") from e
        finally:
            watcher.cancel()
            stream.abort()
            self._forget(stream)
        if self.state.shutting_down and any(
            c.final is not None and c.final.outputs[0].finish_reason == "abort" for c in self.choices
        ):
            raise EngineShuttingDownError(
                "the server shut down before this request finished; it was aborted"
            )
        return JSONResponse(self.full_response(), headers=id_header)

    # -- beam search (vLLM's use_beam_search) ------------------------------------------------
    async def _run_beam_search(self, raw: Request) -> Response:
        """The best `n` beams of each prompt as its choices (conveyor/beam_search.py); the
        prompts' searches run side by side, each round's beams batched by the engine."""
        b = self.body
        self.validate()
        if b.stream:
            raise InvalidRequestError("beam search is not streamed: its best beams are known at the end", param="stream")
        if self.structured_outputs is not None or self.logprobs() is not None or self.prompt_logprobs() is not None:
            raise InvalidRequestError(
                "beam search ranks the model's own distribution: structured outputs and logprobs do not apply",
                param="use_beam_search",
            )
        jobs = []
        for prompt in self.truncated_prompts():
            if prompt.images:
                raise InvalidRequestError("beam search over a prompt with images is not built over HTTP "
                                          "(LLM.beam_search takes one)", param="use_beam_search")
            try:
                jobs.append((prompt, BeamSearchParams(b.n, self.fit(prompt), b.ignore_eos, b.length_penalty)))
            except InvalidRequestError as e:  # name the field the client sent: n is the beam width
                raise InvalidRequestError(str(e).replace("beam_width", "n"), "n" if e.param == "beam_width"
                                          else self.max_tokens_param()) from None
        results = await asyncio.gather(*(self._beam_search(raw, k, p, params) for k, (p, params) in enumerate(jobs)))
        now = time.time()
        for (prompt, _), result in zip(jobs, results, strict=True):
            for seq in result.sequences:
                choice = _Choice(len(self.choices), prompt)
                ids = seq.output_token_ids
                text = "" if self.tokenizer is None else self.tokenizer.decode(ids, b.skip_special_tokens)
                choice.num_tokens = len(ids)
                choice.final = RequestOutput(
                    f"{self.request_id}-{choice.index}", prompt.text, prompt.token_ids,
                    [CompletionOutput(0, text, ids, seq.finish_reason)], True, RequestMetrics(now),
                )
                self.choices.append(choice)
        return JSONResponse(self.full_response())

    async def _beam_search(self, raw: Request, k: int, prompt: _Prompt, params: BeamSearchParams) -> BeamSearchOutput:
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset()
        search = BeamSearch(prompt.token_ids, params, eos)
        one = dataclasses.replace(params.round_params(), priority=self.body.priority, tenant=self.body.user)
        while not search.done:
            requests = [EngineRequest(f"{self.request_id}-{k}-{search.rounds}-{i}", beam.tokens, one, None, self.lora)
                        for i, beam in enumerate(search.beams)]
            outs = await run_to_end(self.state, raw, requests, "a beam's request")
            search.advance([candidates(o) for o in outs])
        return search.result()

    async def _events(
        self, stream: OutputStream, by_id: dict[str, _Choice], watcher: asyncio.Task[None]
    ) -> AsyncIterator[str]:
        try:
            for chunk in self.opening_chunks():
                yield _sse(chunk)
            async for out in stream:
                choice = by_id[out.request_id]
                choice.num_tokens += len(out.outputs[0].token_ids)  # output_kind "delta"
                choice.cached_tokens = out.num_cached_tokens
                if out.finished:
                    choice.final = out
                delta = self.delta_chunk(choice, out)
                if delta is not None:
                    if self.continuous_usage:
                        delta["usage"] = self.usage()
                    yield _sse(delta)
            for chunk in self.closing_chunks():
                yield _sse(chunk)
            if self.include_usage:
                yield _sse(self.chunk([], usage=self.usage()))
            yield "data: [DONE]\n\n"
        except EngineDeadError as e:
            # The response has started: the status is sent; report the failure in-band.
            yield _sse(error_body(str(e), "internal_server_error"))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            stream.abort()
            self._forget(stream)

    def _forget(self, stream: OutputStream) -> None:
        """Out of the in-flight registry (`/abort_request`), where this request's stream is."""
        for n in self._names:
            if self.state.inflight.get(n) is stream:
                del self.state.inflight[n]

    # -- rendering ---------------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        prompts = {id(c.prompt): len(c.final.prompt_token_ids) if c.final is not None and c.final.prompt_token_ids
                   else c.prompt.num_tokens for c in self.choices}
        prompt_tokens = sum(prompts.values())  # a prompt counts once, however many choices
        completion_tokens = sum(c.num_tokens for c in self.choices)
        cached: dict[int, int] = {}  # per prompt, the least any of its choices was served
        for c in self.choices:
            cached[id(c.prompt)] = min(cached.get(id(c.prompt), c.cached_tokens), c.cached_tokens)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }
        if self.include_usage or self.continuous_usage:
            chunk["usage"] = usage
        return chunk

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def closing_chunks(self) -> list[dict[str, Any]]:
        """Events after the last output, before `[DONE]` (the Responses API's closing events)."""
        return []

    def delta_chunk(self, choice: _Choice, out: RequestOutput) -> dict[str, Any] | None:
        raise NotImplementedError

    def full_response(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model_name,
            "choices": [self.final_choice(c) for c in self.choices],
            "usage": self.usage(),
        }

    def final_choice(self, choice: _Choice) -> dict[str, Any]:
        raise NotImplementedError

    def token_ids_fields(self, choice: _Choice, out: RequestOutput) -> dict[str, list[int]]:
        """return_token_ids, streamed: the new ids, and the prompt's in the choice's first chunk."""
        fields = {"token_ids": list(out.outputs[0].token_ids)}
        if not choice.ids_sent:
            choice.ids_sent = True
            fields["prompt_token_ids"] = list(out.prompt_token_ids or [])
        return fields

    def new_logprobs(self, out: RequestOutput) -> list[TokenLogprob]:
        """A streamed output's logprobs: only the new ones (output_kind "delta")."""
        return out.outputs[0].logprobs or []

    def prompt_logprobs_field(self, out: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs` of a choice: per prompt token, None for the first, else
        each of its id and its position's top ids (as strings) to its logprob, rank and text."""
        if self.body.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        field: list[dict[str, Any] | None] = []
        for e in out.prompt_logprobs:
            if e is None:
                field.append(None)
                continue
            entry = {str(e.token_id): {"logprob": _clamp(e.logprob), "rank": e.rank,
                                       "decoded_token": self.token_text(e.token_id)}}
            for rank, (t, lp) in enumerate(e.top or [], start=1):
                entry.setdefault(str(t), {"logprob": _clamp(lp), "rank": rank, "decoded_token": self.token_text(t)})
            field.append(entry)
        return field

    @functools.cached_property
    def ids_as_tokens(self) -> bool:
        """return_tokens_as_token_ids: the request's, else the server's (read when logprobs are)."""
        asked = self.body.return_tokens_as_token_ids
        return self.state.config.return_tokens_as_token_ids if asked is None else asked

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or `token_id:N` (no tokenizer, or
        `return_tokens_as_token_ids`)."""
        if self.tokenizer is not None and self.ids_as_tokens:
            return f"token_id:{token_id}"
        return self.decoded(token_id)  # (`token_id:N` too, without a tokenizer)

    def decoded(self, token_id: int) -> str:
        """A token's text (what offsets count), whatever `token_text` names it."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionHandler(_Handler):
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"
    body: CompletionRequest

    def validate(self) -> None:
        super().validate()
        b = self.body
        if b.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if b.best_of is not None and b.best_of != b.n:
            raise InvalidRequestError("best_of must be unset or equal to n", param="best_of")

    def prompts(self) -> list[_Prompt]:
        embedded = self._embedded()
        p = self.body.prompt
        if p is None:
            if not embedded:
                raise InvalidRequestError("a prompt (or prompt_embeds) is needed", param="prompt")
            return embedded
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        out: list[_Prompt] = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError("the prompt is empty", param="prompt")
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        "this model has no tokenizer; send token ids as the prompt", param="prompt"
                    )
                out.append(_Prompt(self.tokenizer.encode(item), item))
            else:
                text = None
                if self.body.echo and self.tokenizer is not None:
                    text = self.tokenizer.decode(item, skip_special_tokens=False)
                out.append(_Prompt(list(item), text))
        return embedded + out

    def _embedded(self) -> list[_Prompt]:
        """vLLM's `prompt_embeds`: each a base64 `torch.save` of a `[tokens, hidden]` tensor (a
        leading batch dimension of 1 dropped), read with `weights_only` (tensors, no code)."""
        import base64
        import binascii
        import io

        import torch

        raw = self.body.prompt_embeds
        if raw is None:
            return []
        if self.body.echo:
            raise InvalidRequestError("echo needs the prompt's text: not with prompt_embeds", param="echo")
        out = []
        for item in [raw] if isinstance(raw, str) else raw:
            try:
                tensor = torch.load(io.BytesIO(base64.b64decode(item, validate=True)), weights_only=True,
                                    map_location="cpu")
            except (binascii.Error, ValueError, RuntimeError, EOFError, OSError) as e:
                raise InvalidRequestError(f"prompt_embeds: not a base64 torch.save of a tensor ({e})",
                                          param="prompt_embeds") from None
            except Exception as e:  # (pickle's own errors: weights_only refuses anything but tensors)
                raise InvalidRequestError(f"prompt_embeds: not a tensor ({type(e).__name__})",
                                          param="prompt_embeds") from None
            if not isinstance(tensor, torch.Tensor):
                raise InvalidRequestError("prompt_embeds: each must be a tensor", param="prompt_embeds")
            tensor = tensor.to_dense()
            if tensor.dim() == 3 and tensor.shape[0] == 1:
                tensor = tensor[0]
            if tensor.dim() != 2:
                raise InvalidRequestError(f"prompt_embeds: a [tokens, hidden] tensor, not {tuple(tensor.shape)}",
                                          param="prompt_embeds")
            out.append(_Prompt([0] * int(tensor.shape[0]), None, embeds=tensor))
        if not out:
            raise InvalidRequestError("prompt_embeds: empty", param="prompt_embeds")
        return out

    def max_tokens(self) -> int | None:
        return self.body.max_tokens

    def logprobs(self) -> int | None:
        return self.body.logprobs

    def prompt_logprobs(self) -> int | None:
        # echo with logprobs (OpenAI's legacy API): the echoed prompt's tokens have them too
        b = self.body
        wanted = [k for k in (b.prompt_logprobs, b.logprobs if b.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def _logprobs_block(
        self, entries: list[TokenLogprob], offset: int, prompt: tuple[list[int], list[TokenLogprob | None]] | None = None
    ) -> dict[str, Any]:
        """OpenAI's completion logprobs, the output's text offsets from `offset`; `prompt`
        (echo): the prompt's ids and entries first, from offset 0, the first token's logprob
        and top ones null, the top ones cut to `logprobs` (prompt_logprobs may ask more)."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []

        def put(token_id: int, e: TokenLogprob | None, at: int, k: int | None) -> int:
            tokens.append(self.token_text(token_id))
            values.append(None if e is None else _clamp(e.logprob))
            tops.append(None if e is None else {self.token_text(t): _clamp(lp) for t, lp in (e.top or [])[:k]})
            offsets.append(at)
            return at + len(self.decoded(token_id))

        at = 0
        for token_id, e in zip(*prompt, strict=True) if prompt is not None else ():
            at = put(token_id, e, at, self.body.logprobs or 0)
        for e in entries:
            offset = put(e.token_id, e, offset, None)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _echoed(self, out: RequestOutput) -> tuple[list[int], list[TokenLogprob | None]] | None:
        if not (self.body.echo and self.body.logprobs is not None and out.prompt_logprobs is not None):
            return None
        return out.prompt_token_ids, out.prompt_logprobs

    def delta_chunk(self, choice: _Choice, out: RequestOutput) -> dict[str, Any] | None:
        c = out.outputs[0]
        text = c.delta_text
        first = not choice.started
        if first:
            choice.started = True
            if self.body.echo and choice.prompt.text:
                text = choice.prompt.text + text
                choice.text_sent += len(choice.prompt.text)
        logprobs = None
        if self.body.logprobs is not None:
            new = self.new_logprobs(out)
            prompt = self._echoed(out) if first else None
            if new or prompt:
                logprobs = self._logprobs_block(new, choice.text_sent, prompt)
        choice.text_sent += len(c.delta_text)
        ids = self.body.return_token_ids and bool(c.token_ids)
        if not text and logprobs is None and not out.finished and not ids:
            return None
        fields: dict[str, Any] = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason if out.finished else None,
            "stop_reason": c.stop_reason if out.finished else None,
        }
        if first and (prompt_lps := self.prompt_logprobs_field(out)) is not None:
            fields["prompt_logprobs"] = prompt_lps
        if self.body.return_token_ids:
            fields.update(self.token_ids_fields(choice, out))
        return self.chunk([fields])

    def final_choice(self, choice: _Choice) -> dict[str, Any]:
        assert choice.final is not None
        c = choice.final.outputs[0]
        text = c.text
        if self.body.echo and choice.prompt.text:
            text = choice.prompt.text + text
        logprobs = None
        if self.body.logprobs is not None:
            offset = len(text) - len(c.text)  # into the text returned (after an echoed prompt)
            logprobs = self._logprobs_block(c.logprobs or [], offset, self._echoed(choice.final))
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "prompt_logprobs": self.prompt_logprobs_field(choice.final),
            **({"prompt_token_ids": list(choice.final.prompt_token_ids), "token_ids": list(c.token_ids)}
               if self.body.return_token_ids else {}),
        }


class ChatCompletionHandler(_Handler):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    body: ChatCompletionRequest

    def validate(self) -> None:
        super().validate()
        b = self.body
        if b.top_logprobs is not None and not b.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if b.top_logprobs is not None and not 0 <= b.top_logprobs <= 20:
            raise InvalidRequestError(f"top_logprobs={b.top_logprobs}: must be in [0, 20]", param="top_logprobs")
        self.tools  # noqa: B018 (parsed now: bad tools are the request's error)

    @property
    def writable(self) -> Callable[[str], bool] | None:
        """Whether a text is ordinary tokens of the served tokenizer (a strict tool tag's markers
        must be, to be written under a grammar)."""
        return None if self.tokenizer is None else self.tokenizer.writes_as_text

    @functools.cached_property
    def tools(self) -> Tools | None:
        b = self.body
        tools = Tools.parse(b.tools, b.tool_choice, b.parallel_tool_calls, self.state.tool_parser)
        if tools is not None and self.requested_outputs is not None and tools.constraint(self.writable) is not None:
            raise InvalidRequestError(
                f"tool_choice {b.tool_choice or 'auto'!r} holds the output to the tools' schemas"
                + (" (a strict function)" if tools.choice == "auto" else "")
                + ": it cannot be combined with another output constraint", param="tool_choice",
            )
        return tools

    @functools.cached_property
    def tool_constraint(self) -> StructuredOutputParams | None:
        """What the tools hold the output to (`Tools.constraint`), if anything."""
        tools = self.tools
        return tools.constraint(self.writable) if tools is not None else None

    @functools.cached_property
    def structured_outputs(self) -> StructuredOutputParams | None:
        """The tools' schema where tool_choice holds the output to it, else what was asked;
        under a reasoning parser of tags, it holds the answer after the thinking block as the
        parser reads it (`StructuredOutputParams.reasoning`)."""
        constraint = self.tool_constraint
        spec = constraint if constraint is not None else self.requested_outputs
        parser = self.state.config.reasoning_parser
        if spec is not None and parser in TAGS:
            opening, closing, inside = TAGS[parser]
            spec = dataclasses.replace(spec, reasoning=("" if inside else opening, closing))
        elif spec is not None and parser == HARMONY and not self._holds_messages:
            # gpt-oss's analysis (and any other messages) first, free; the grammar holds the
            # final message's text, which the parser gives as the content.
            spec = dataclasses.replace(spec, reasoning=("", HARMONY_FINAL))
        return spec

    @property
    def _holds_messages(self) -> bool:
        """Whether the grammar is the harmony tool parser's strict tag, which holds the whole
        output as harmony messages itself (`ToolParser.HOLDS_MESSAGES`, under "auto")."""
        tools = self.tools
        return (tools is not None and tools.choice == "auto" and tools.parser.HOLDS_MESSAGES
                and self.tool_constraint is not None)

    def prompts(self) -> list[_Prompt]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer, so no chat template", param="messages")
        b = self.body
        kwargs = dict(b.chat_template_kwargs or {})
        if b.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", b.reasoning_effort)
        if b.continue_final_message:
            kwargs["continue_final_message"] = True
        template = self.tokenizer.chat_template or ""
        if self.tools is not None and self.tools.shown and "tools" in template:
            kwargs["tools"] = self.tools.template_tools()
        messages, images = self._chat
        try:
            ids = self.tokenizer.apply_chat_template(
                history_for_template(messages, self.tools, template),
                add_generation_prompt=b.add_generation_prompt and not b.continue_final_message,
                **kwargs,
            )
        except Exception as e:  # the template rejects these messages: the client's to fix
            raise InvalidRequestError(f"the chat template cannot render these messages: {e}", param="messages") from None
        if not images:
            return [_Prompt(ids, None)]
        token = self.state.engine.image_token
        assert token is not None  # (`chat_images` refuses images for a model without one)
        fetched = self._fetched
        return [_Prompt(ids, None, tuple(fetched.get(_media_url(i) or ("", ""), i) for i in images), token,
                        self.body.mm_processor_kwargs)]

    @functools.cached_property
    def _chat(self) -> tuple[list[dict[str, Any]], list[Any]]:
        """The messages as the template reads them, and their images (`chat_images`)."""
        token = self.state.engine.image_token
        template = "" if self.tokenizer is None else self.tokenizer.chat_template or ""
        return chat_images(self.body.message_dicts(), template, token)

    async def fetch_images(self) -> None:
        # Data and http(s) URLs become pixels here, a video decoded and its frames sampled (off
        # the engine's loop); a local file is the engine's to read (it knows the allowed path),
        # and so is any image where the front end has no processor.
        items = self._chat[1]
        found = {k: i for i in items if (k := _media_url(i)) is not None}
        urls = list(found)
        processor = self.state.engine.image_processor
        if not urls or processor is None:
            return
        videos = sum(isinstance(i, Video) for i in items)
        clips = sum(isinstance(i, Audio) for i in items)
        processor.check_counts(len(items) - videos - clips, videos, clips)  # (before anything is fetched)
        processor = processor.overridden(self.body.mm_processor_kwargs)

        def pixels(url: tuple[str, str]) -> Pixels | bytes:
            kind, source = url
            if kind == "video":
                return processor.video(Video(source))
            if kind.startswith("audio"):
                return processor.audio(found[url])
            data = image_bytes(source, domains=processor.allowed_media_domains)
            if processor.pan_and_scan:  # (the engine crops the picture itself: the bytes, fetched)
                return data
            return processor(load_image(data))

        self._fetched = dict(zip(urls, await asyncio.gather(*(asyncio.to_thread(pixels, url) for url in urls)),
                                 strict=True))

    def max_tokens(self) -> int | None:
        b = self.body
        return b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.body.max_completion_tokens is not None else "max_tokens"

    def logprobs(self) -> int | None:
        b = self.body
        return (b.top_logprobs or 0) if b.logprobs else None

    def _logprobs_block(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in (e.top or [])]}
                for e in entries
            ]
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        # OpenAI's first chunk of each choice names the role and carries no text.
        parser = self.reasoning_parser
        for c in self.choices:
            c.tool_stream = ToolStream(self.tools) if self.tools is not None else None
            c.reasoning_stream = reasoning_stream(parser) if parser is not None else None
        return [
            self.chunk([{
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }])
            for c in self.choices
        ]

    def delta_chunk(self, choice: _Choice, out: RequestOutput) -> dict[str, Any] | None:
        c = out.outputs[0]
        logprobs = None
        if self.body.logprobs:
            new = self.new_logprobs(out)
            if new:
                logprobs = self._logprobs_block(new)
        if not c.delta_text and logprobs is None and not out.finished:
            return None
        text, thought = c.delta_text, ""
        if choice.reasoning_stream is not None:
            thought, text = choice.reasoning_stream.feed(text, out.finished)
        called = False
        if choice.tool_stream is not None:
            delta = choice.tool_stream.feed(text, out.finished)
            called = choice.tool_stream.calls > 0
        else:
            delta = {"content": text} if text else {}
        if thought:
            delta = {"reasoning_content": thought, **delta}
        if not delta and logprobs is None and not out.finished and not (self.body.return_token_ids and c.token_ids):
            return None
        fields: dict[str, Any] = {
            "index": choice.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": self._finish_reason(c.finish_reason, called) if out.finished else None,
            "stop_reason": c.stop_reason if out.finished else None,
        }
        if (prompt_lps := self.prompt_logprobs_field(out)) is not None:  # (in a choice's first output only)
            fields["prompt_logprobs"] = prompt_lps
        if not self.body.return_token_ids:
            return self.chunk([fields])
        ids = self.token_ids_fields(choice, out)  # (the prompt's at the chunk's top, as vLLM's chat)
        fields["token_ids"] = ids["token_ids"]
        chunk = self.chunk([fields])
        if "prompt_token_ids" in ids:
            chunk["prompt_token_ids"] = ids["prompt_token_ids"]
        return chunk

    def final_choice(self, choice: _Choice) -> dict[str, Any]:
        assert choice.final is not None
        c = choice.final.outputs[0]
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        parser = self.reasoning_parser
        if parser is not None:
            reasoning, message["content"] = split_reasoning(c.text, parser)
            message["reasoning_content"] = reasoning
        if self.tools is not None:
            content, calls = self.tools.calls(message["content"] or "")
            message.update(content=content, tool_calls=calls)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs_block(c.logprobs or []) if self.body.logprobs else None,
            "finish_reason": self._finish_reason(c.finish_reason, bool(message.get("tool_calls"))),
            "stop_reason": c.stop_reason,
            "prompt_logprobs": self.prompt_logprobs_field(choice.final),
            **({"token_ids": list(c.token_ids)} if self.body.return_token_ids else {}),
        }

    def full_response(self) -> dict[str, Any]:
        response = super().full_response()
        if self.body.return_token_ids and self.choices and self.choices[0].final is not None:
            response["prompt_token_ids"] = list(self.choices[0].final.prompt_token_ids)  # (one prompt)
        return response

    @property
    def keeps_special_tokens(self) -> bool:  # type: ignore[override]
        """Whether the text keeps special tokens: for a reasoning parser that reads them, or a
        tool parser whose markers the served tokenizer holds as special tokens."""
        tools = self.tools
        return keeps_special_tokens(self.reasoning_parser) or (
            tools is not None and self.tokenizer is not None and tools.keeps_special_tokens(self.tokenizer.is_special))

    @property
    def reasoning_parser(self) -> str | None:
        """The server's reasoning parser, which splits the output as ever: a grammar holds the
        answer after a parser of tags' thinking block, and under gpt-oss's harmony the final
        message's text (or, the harmony tool parser's strict tag, the messages themselves)."""
        return self.state.config.reasoning_parser

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """"tool_calls" where the model chose to call ("auto", "required") and ended; a named
        function's call ends with "stop", as OpenAI's does."""
        if called and reason == "stop" and self.tools is not None and self.tools.choice != "named":
            return "tool_calls"
        return reason


# -- helpers ---------------------------------------------------------------------------------
async def run_to_end(state: ServerState, raw: Request, requests: list[EngineRequest], what: str) -> list[RequestOutput]:
    """Run engine requests whose outputs matter only at their end (embeddings, a round of beam
    search): each one's final output, in order. A client gone aborts them all; an aborted one
    is this API request's error."""
    stream = await state.engine.add(requests)
    watcher = asyncio.create_task(_abort_on_disconnect(raw, stream))
    finals: dict[str, RequestOutput] = {}
    try:
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out
    except EngineDeadError as e:
        raise APIError(500, str(e), "internal_server_error") from e
    finally:
        watcher.cancel()
        stream.abort()
    outs = [finals[r.request_id] for r in requests]
    if any(o.outputs[0].finish_reason == "abort" for o in outs):
        if state.shutting_down:
            raise EngineShuttingDownError("the server shut down before this request finished; it was aborted")
        raise APIError(500, f"{what} was aborted", "internal_server_error")
    return outs


async def _abort_on_disconnect(raw: Request, stream: OutputStream) -> None:
    """Abort `stream` when the client goes away. Cancelled once the response is complete.

    The request body is read already, so the next ASGI message is `http.disconnect`: it comes
    when the client closes the connection, or (harmlessly, after cancel) when the response ends.
    """
    try:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                break
    except Exception:  # a broken receive channel means the client is gone too
        pass
    stream.abort()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)
