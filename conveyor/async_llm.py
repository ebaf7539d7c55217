"""`AsyncLLM`: the engine for asyncio programs (vLLM's `AsyncLLM`): requests arrive as they
come, each one's outputs stream back as the batch makes them, and the engine steps in a thread
of its own (`conveyor/server/async_engine.py`, what `conveyor serve` runs on), or in a process
of its own with `engine_process=True` (`conveyor/server/engine_process.py`, what `conveyor
serve --engine-process` runs on: the event loop's Python no longer shares the engine's GIL, and
an engine that dies is started again with the requests in flight resumed).

    >>> llm = AsyncLLM()  # SmolLM2-135M-Instruct, embedded
    >>> async for out in llm.generate("Hello", SamplingParams(max_tokens=8), request_id="a"):
    ...     print(out.outputs[0].text)
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from conveyor.config import EngineConfig
from conveyor.engine import Engine
from conveyor.llm import (
    Message,
    chat_prompt,
    classification_output,
    classify_pooling,
    default_pooling,
    pooling_output,
)
from conveyor.lora import LoRARequest
from conveyor.outputs import ClassificationRequestOutput, PoolingRequestOutput, RequestOutput
from conveyor.sampling_params import PoolingParams, SamplingParams
from conveyor.scoring import (
    ModelHead,
    cosine,
    cross_encoder_inputs,
    cross_encoder_score,
    score_pairs,
)
from conveyor.server.async_engine import AsyncEngine, EngineRequest, Prompt
from conveyor.server.engine_process import ProcessAsyncEngine
from conveyor.tokenizer import Tokenizer

T = TypeVar("T")


class AsyncLLM:
    """Load a model once; serve requests from asyncio code with continuous batching.

    `generate` (and `chat`, through the model's chat template) streams one request's outputs
    (`output_kind`: "cumulative" each time, "delta" only what is new, "final_only" one output at
    the end); `n > 1` gives its choices in one output (choice i of a seeded request with
    seed + i, as `LLM.generate`). `encode` pools a prompt, `classify` and `score` are
    `LLM.classify`'s and `LLM.score`'s, awaited. Leaving the loop early, or cancelling the task,
    aborts the request and frees its KV blocks. A request the engine refuses raises
    `InvalidRequestError` (`QueueFullError` past `max_queued_requests`) before any output, and
    the others go on.

    The engine runs in a thread of this process (`engine`), or with `engine_process=True` in a
    child process (`engine` is None there; the model is loaded before this returns, and a load
    error raises here), which is started again if it dies, the requests in flight going on from
    their last token delivered (a request in flight through more than `max_replays` deaths ends
    with an error). It starts serving on the first request and serves that event loop from then
    on; `shutdown()` (or `async with`) ends it.
    """

    def __init__(self, model: str | None = None, *, max_queued_requests: int | None = None,
                 engine_process: bool = False, max_replays: int = 1, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)  # (a bad option raises here)
        self.engine: Engine | None = None
        self._front: AsyncEngine
        if engine_process:
            process = ProcessAsyncEngine(dict(kwargs, model=model), max_queued_requests=max_queued_requests,
                                         max_replays=max_replays)
            process.launch()
            self._front = process
        else:
            self.engine = Engine.from_config(self.config)
            self._front = AsyncEngine(self.engine, max_queued_requests=max_queued_requests)
        self._ids = itertools.count()
        self._started = False
        self._stopped = False

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._front.tokenizer

    @property
    def head(self) -> ModelHead:
        """What the model classifies with: its class names, whether it classifies each token."""
        return self._front.head

    @property
    def engine_process(self) -> ProcessAsyncEngine | None:
        """The front end of the engine's process (`engine_process=True`): its `engine_pid`,
        its `restarts`."""
        return self._front if isinstance(self._front, ProcessAsyncEngine) else None

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """One request's outputs as the engine makes them (text or token ids as the prompt)."""
        self._start()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        stream = await self._front.add([EngineRequest(rid, prompt, sampling_params or SamplingParams(),
                                                      lora_request=lora_request)])
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def chat(
        self,
        messages: list[Message],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """One conversation's outputs, its messages put through the model's chat template, or
        `chat_template` (as `LLM.chat`)."""
        prompt = chat_prompt(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs,
                             self._front.image_token, mm_processor_kwargs, chat_template)
        async for out in self.generate(prompt, sampling_params, request_id, lora_request=lora_request):
            yield out

    async def encode(
        self,
        prompt: Prompt,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A prompt's pooled output (vLLM's `AsyncLLM.encode`, one output once the prompt is
        computed): a vector, or one a prompt token with `pooling_type="all"` (a token classifier's
        probabilities by default), as `LLM.encode`."""
        out = await self._pooled(prompt, pooling_params or default_pooling(self.head), request_id, lora_request)
        yield pooling_output(out)

    async def classify(
        self,
        prompt: Prompt,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> ClassificationRequestOutput:
        """A prompt's class probabilities from a sequence classifier (`LLM.classify`):
        `out.outputs.probs`, `out.label` the likeliest class's name."""
        pooling = classify_pooling(self.head, pooling_params)
        return classification_output(await self._pooled(prompt, pooling, request_id, lora_request), self.head)

    async def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        lora_request: LoRARequest | None = None,
    ) -> list[float]:
        """`LLM.score`: one `text_1` against each `text_2`, or pairwise; a cross-encoder's
        relevance of each pair, or an embedding model's cosine similarity. The pairs (or the
        distinct texts) run as concurrent requests; one refused cancels the others."""
        pairs = score_pairs(text_1, text_2)
        if self.head.labels:
            inputs = cross_encoder_inputs(pairs, self.head, self.tokenizer)
            logits = PoolingParams(task="classify", activation=False)
            outs = await _all([self.classify(p, logits, lora_request=lora_request) for p in inputs])
            return [cross_encoder_score(o.outputs.probs[0], self.head) for o in outs]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        pooled = await _all([self._pooled(t, PoolingParams(), None, lora_request) for t in texts])
        vectors = {t: o.embedding or [] for t, o in zip(texts, pooled, strict=True)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs]

    async def _pooled(self, prompt: Prompt, pooling: PoolingParams, request_id: str | None,
                      lora_request: LoRARequest | None) -> RequestOutput:
        """One pooling request's final output (the engine fills in the model's own pooling)."""
        params = SamplingParams.for_pooling(pooling)
        async for out in self.generate(prompt, params, request_id, lora_request=lora_request):
            if out.finished:
                return out
        raise RuntimeError("a pooling request ended without its final output")  # (never: a stream ends with it)

    def _start(self) -> None:
        if not self._started:  # (bound to this event loop from now on)
            self._front.start()
            self._started = True

    async def _call(self, name: str, *args: Any) -> Any:
        self._start()
        return await self._front.call_engine(name, *args)

    # -- caches (vLLM's AsyncLLM.reset_prefix_cache, reset_mm_cache) ---------------------------
    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, the KV offloading tier's too (`Engine.reset_prefix_cache`)."""
        return bool(await self._call("reset_prefix_cache"))

    async def reset_mm_cache(self) -> bool:
        """Forget every media item's encoder output (`Engine.reset_mm_cache`)."""
        return bool(await self._call("reset_mm_cache"))

    # -- pause and resume (vLLM's AsyncLLM.pause_generation, resume_generation, is_paused) -----
    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop generating while, say, an RL trainer updates the weights: "abort" ends every
        request in flight, "wait" returns once they are done, "keep" freezes them; requests
        sent meanwhile wait for `resume_generation` (`Engine.pause_generation`)."""
        from conveyor.server.async_engine import pause_front

        self._start()
        await pause_front(self._front, mode, clear_cache)

    async def resume_generation(self) -> None:
        await self._call("resume_generation")

    async def is_paused(self) -> bool:
        return bool(await self._call("is_paused"))

    async def sleep(self, level: int = 1) -> bool:
        """Give memory back while idle (`Engine.sleep`: level 1 the KV cache, 2 the weights too)."""
        return bool(await self._call("sleep", level))

    async def wake_up(self) -> bool:
        return bool(await self._call("wake_up"))

    async def is_sleeping(self) -> bool:
        return bool(await self._call("is_sleeping"))

    async def update_weights_from_disk(self, model_path: str) -> bool:
        """New weights of the same architecture, idle or paused (`Engine.update_weights_from_disk`)."""
        return bool(await self._call("update_weights_from_disk", model_path))

    async def update_weights_from_tensor(self, named_tensors: Any, flush_cache: bool = True,
                                         weight_version: str | None = None) -> bool:
        """New values of some or all of the model's tensors by their HF names, idle or paused
        (`Engine.update_weights_from_tensor`; to an engine process they travel pickled)."""
        from conveyor.weight_sync import named_items

        return bool(await self._call("update_weights_from_tensor", named_items(named_tensors), flush_cache,
                                     weight_version))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str | None = None) -> bool:
        """Join a trainer's weight-update group (`Engine.init_weights_update_group`)."""
        return bool(await self._call("init_weights_update_group", master_address, master_port, rank_offset,
                                     world_size, group_name, backend))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group",
                                              flush_cache: bool = True, weight_version: str | None = None,
                                              bucket_bytes: int = 0) -> bool:
        """Receive and load what the trainer broadcasts (`Engine.update_weights_from_distributed`)."""
        return bool(await self._call("update_weights_from_distributed", names, dtypes, shapes, group_name,
                                     flush_cache, weight_version, bucket_bytes))

    async def get_weight_version(self) -> str:
        return str(await self._call("get_weight_version"))

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> bool:
        return bool(await self._call("destroy_weights_update_group", group_name))

    # -- adapters (vLLM's AsyncLLM.add_lora, remove_lora, list_loras, pin_lora) ---------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter before any request names it (a bad one raises here); `Engine.add_lora`."""
        return bool(await self._call("add_lora", lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop the adapter of that id from the engine's memory, and its pin."""
        return bool(await self._call("remove_lora", lora_int_id))

    async def list_loras(self) -> set[int]:
        """The ids of the adapters in the engine's memory."""
        return set(await self._call("list_loras"))

    async def pin_lora(self, lora_int_id: int) -> bool:
        """Keep a loaded adapter in memory whatever else runs, until `remove_lora`. With
        `engine_process=True`, an engine started again after a death adds and pins the
        adapters added and pinned here before any request resumes."""
        return bool(await self._call("pin_lora", lora_int_id))

    def abort(self, request_id: str) -> None:
        """Stop a request now (an unknown or finished id is ignored); its stream ends with its
        output so far, finish reason "abort"."""
        self._front.abort([request_id])

    @property
    def num_unfinished_requests(self) -> int:
        return self._front.num_in_flight

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Abort what is in flight and end the engine thread (and its process)."""
        if self._stopped:
            return
        self._stopped = True
        if self._started:
            await self._front.stop(timeout)
        elif isinstance(self._front, ProcessAsyncEngine):
            self._front.kill()  # launched, never served: nothing in flight

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


async def _all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Every call's result, run concurrently; if one raises, the others are cancelled (their
    requests aborted) and its error raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
