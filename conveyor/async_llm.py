"""`AsyncLLM`: the engine for asyncio programs (vLLM's `AsyncLLM`): requests arrive as they
come, each one's outputs stream back as the batch makes them, and the engine steps in a thread
of its own (`conveyor/server/async_engine.py`, what `conveyor serve` runs on).

    >>> llm = AsyncLLM()  # SmolLM2-135M-Instruct, embedded
    >>> async for out in llm.generate("Hello", SamplingParams(max_tokens=8), request_id="a"):
    ...     print(out.outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

from conveyor.config import EngineConfig
from conveyor.engine import Engine
from conveyor.llm import Message, chat_prompt, default_pooling, pooling_output
from conveyor.lora import LoRARequest
from conveyor.outputs import PoolingRequestOutput, RequestOutput
from conveyor.sampling_params import PoolingParams, SamplingParams
from conveyor.server.async_engine import AsyncEngine, EngineRequest, Prompt
from conveyor.tokenizer import Tokenizer


class AsyncLLM:
    """Load a model once; serve requests from asyncio code with continuous batching.

    `generate` (and `chat`, through the model's chat template) streams one request's outputs (`output_kind`: "cumulative" each time, "delta"
    only what is new, "final_only" one output at the end); `n > 1` gives its choices in one
    output (choice i of a seeded request with seed + i, as `LLM.generate`). Leaving the loop
    early, or cancelling the task, aborts the request and frees its KV blocks. A request the
    engine refuses raises `InvalidRequestError` (`QueueFullError` past `max_queued_requests`)
    before any output, and the others go on. The engine thread starts on the first request and
    serves that event loop from then on; `shutdown()` (or `async with`) ends it.
    """

    def __init__(self, model: str | None = None, *, max_queued_requests: int | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = Engine.from_config(self.config)
        self._front = AsyncEngine(self.engine, max_queued_requests=max_queued_requests)
        self._ids = itertools.count()
        self._started = False

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """One request's outputs as the engine makes them (text or token ids as the prompt)."""
        if not self._started:  # (bound to this event loop from now on)
            self._front.start()
            self._started = True
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
    ) -> AsyncIterator[RequestOutput]:
        """One conversation's outputs, its messages put through the model's chat template (as
        `LLM.chat`)."""
        prompt = chat_prompt(self.engine, messages, add_generation_prompt, chat_template_kwargs)
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
        params = SamplingParams.for_pooling(pooling_params or default_pooling(self.engine))
        async for out in self.generate(prompt, params, request_id, lora_request=lora_request):
            if out.finished:
                yield pooling_output(out)

    def abort(self, request_id: str) -> None:
        """Stop a request now (an unknown or finished id is ignored); its stream ends with its
        output so far, finish reason "abort"."""
        self._front.abort([request_id])

    @property
    def num_unfinished_requests(self) -> int:
        return self._front.num_in_flight

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Abort what is in flight and end the engine thread."""
        if self._started:
            await self._front.stop(timeout)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()
