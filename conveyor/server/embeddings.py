"""/v1/embeddings, /tokenize and /detokenize: the API requests that generate nothing.

An embedding request's inputs run as engine requests with `SamplingParams.for_pooling`,
batched by the scheduler with every other request (the prompt computed, its hidden states
pooled; conveyor/runner/model_runner.py `_pool`). Every check that can fail runs before the
engine sees any input; a client that goes away aborts the inputs still running.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.outputs import RequestOutput
from conveyor.sampling_params import (
    POOLING_TYPES,
    InvalidRequestError,
    PoolingParams,
    SamplingParams,
)
from conveyor.server.async_engine import EngineDeadError, EngineRequest, EngineShuttingDownError
from conveyor.server.errors import APIError
from conveyor.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from conveyor.server.serving import ChatCompletionHandler, ServerState, _abort_on_disconnect

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingHandler:
    def __init__(self, state: ServerState, body: EmbeddingRequest) -> None:
        self.state = state
        self.body = body
        self.request_id = f"embd-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.lora = None if body.model is None else state.loras.get(body.model)
        self.model_name = state.model_name if self.lora is None else self.lora.lora_name

    def pooling(self) -> PoolingParams:
        b = self.body
        kind = b.pooling_type or "last"
        if kind not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling_type={kind!r}: must be one of {', '.join(POOLING_TYPES)}",
                                      param="pooling_type")
        return PoolingParams(kind, True if b.normalize is None else b.normalize, b.dimensions)

    def prompts(self) -> list[list[int]]:
        b = self.body
        items: list[Any] = [b.input] if isinstance(b.input, str) or (
            b.input and isinstance(b.input[0], int)) else list(b.input)
        if not items:
            raise InvalidRequestError("input must not be empty", param="input")
        if len(items) > MAX_INPUTS:
            raise InvalidRequestError(f"input has {len(items)} items; at most {MAX_INPUTS}", param="input")
        tokenizer = self.state.engine.tokenizer
        out: list[list[int]] = []
        for item in items:
            if isinstance(item, str):
                if tokenizer is None:
                    raise InvalidRequestError("this model has no tokenizer; send token ids as the input", param="input")
                item = tokenizer.encode(item, add_special_tokens=b.add_special_tokens)
            out.append(self.truncate(list(item)))
        return out

    def truncate(self, ids: list[int]) -> list[int]:
        k = self.body.truncate_prompt_tokens
        limit = self.state.engine.max_model_len
        if k is None:
            if limit is not None and len(ids) > limit:
                raise InvalidRequestError(
                    f"an input has {len(ids)} tokens, but this model embeds at most {limit}; shorten it, "
                    "or set truncate_prompt_tokens to keep its last ones", param="input",
                )
            return ids
        if k == -1:
            k = limit or len(ids)
        if k < 1 or (limit is not None and k > limit):
            raise InvalidRequestError(
                f"truncate_prompt_tokens={self.body.truncate_prompt_tokens}: must be -1 or in [1, {limit}]",
                param="truncate_prompt_tokens",
            )
        return ids[-k:]

    def engine_requests(self) -> list[EngineRequest]:
        b = self.body
        params = SamplingParams.for_pooling(self.pooling(), b.priority, b.user)
        return [EngineRequest(f"{self.request_id}-{i}", ids, params, None, self.lora)
                for i, ids in enumerate(self.prompts())]

    async def run(self, raw: Request) -> Response:
        requests = self.engine_requests()
        stream = await self.state.engine.add(requests)
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
        if any(finals[r.request_id].embedding is None for r in requests):
            if self.state.shutting_down:
                raise EngineShuttingDownError("the server shut down before this request finished; it was aborted")
            raise APIError(500, "an input was aborted before its embedding was computed", "internal_server_error")
        data = [
            {"index": i, "object": "embedding", "embedding": self.encode(finals[r.request_id].embedding or [])}
            for i, r in enumerate(requests)
        ]
        prompt_tokens = sum(len(r.prompt) for r in requests)
        return JSONResponse({
            "id": self.request_id,
            "object": "list",
            "created": self.created,
            "model": self.model_name,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
        })

    def encode(self, vector: list[float]) -> list[float] | str:
        if self.body.encoding_format == "base64":  # OpenAI's: the float32 values' bytes, little-endian
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return vector


def tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer", param="prompt")
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        if body.add_special_tokens:
            raise InvalidRequestError("add_special_tokens applies to a prompt; a chat template writes its own",
                                      param="add_special_tokens")
        chat = ChatCompletionRequest.model_validate({
            "messages": body.messages, "tools": body.tools, "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message, "chat_template_kwargs": body.chat_template_kwargs,
        })
        ids = ChatCompletionHandler(state, chat).prompts()[0].token_ids
    return {
        "count": len(ids),
        "max_model_len": state.engine.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }


def detokenize(state: ServerState, body: DetokenizeRequest) -> dict[str, Any]:
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer", param="tokens")
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                                  param="tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
