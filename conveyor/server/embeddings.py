"""/v1/embeddings, /classify, /score, /rerank, /tokenize and /detokenize: the API requests that
generate nothing.

An embedding or classification request's inputs run as engine requests with
`SamplingParams.for_pooling`, batched by the scheduler with every other request (the prompt
computed, its hidden states pooled; conveyor/runner/model_runner.py `_pool`; a classifier's
head over them). Scores and reranking are a cross-encoder's where the model is a one-class
classifier (each pair one input), else a bi-encoder's: the cosine similarity of two texts'
embeddings (conveyor/scoring.py). Every check that can fail runs before the engine sees any
input; a client that goes away aborts the inputs still running.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.multimodal import ImagePrompt
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import InvalidRequestError, PoolingParams, SamplingParams
from conveyor.scoring import (
    cosine,
    cross_encoder_inputs,
    cross_encoder_score,
    score_pairs,
    top_label,
)
from conveyor.server.async_engine import EngineRequest
from conveyor.server.protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingInputs,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from conveyor.server.serving import ChatCompletionHandler, ServerState, run_to_end

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class _PoolingHandler:
    """What the API requests that embed share: inputs to token ids (truncated or refused past
    the context), one engine request an input, the vectors back (or the request's error)."""

    id_prefix = ""
    input_param = "input"  # the field an input's error names

    def __init__(self, state: ServerState, body: Any) -> None:
        self.state = state
        self.body = body
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.lora = None if body.model is None else state.loras.get(body.model)
        self.model_name = state.model_name if self.lora is None else self.lora.lora_name
        self.num_prompt_tokens = 0

    def pooling(self) -> PoolingParams:
        if self.state.engine.head.labels:  # a cross-encoder's score: its one class's logit, activated below
            return PoolingParams(task="classify", activation=False)
        return PoolingParams()

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self.state.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send token ids", param=self.input_param)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def truncate(self, ids: list[int]) -> list[int]:
        k = self.body.truncate_prompt_tokens
        limit = self.state.engine.max_model_len
        if k is None:
            if limit is not None and len(ids) > limit:
                raise InvalidRequestError(
                    f"an input has {len(ids)} tokens, but this model embeds at most {limit}; shorten it, "
                    "or set truncate_prompt_tokens to keep its last ones", param=self.input_param,
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

    async def embed(self, raw: Request, prompts: Sequence[list[int] | ImagePrompt]) -> list[list[float]]:
        """Each prompt's vector, the prompts run side by side with whatever else the engine has."""
        return [o.embedding or [] for o in await self.run_pooled(raw, prompts)]

    async def run_pooled(self, raw: Request, prompts: Sequence[list[int] | ImagePrompt]) -> list[RequestOutput]:
        b = self.body
        params = SamplingParams.for_pooling(self.pooling(), b.priority, b.user)
        requests = [EngineRequest(f"{self.request_id}-{i}", ids, params, None, self.lora)
                    for i, ids in enumerate(prompts)]
        outs = await run_to_end(self.state, raw, requests, "an input")
        # (a prompt with images: as many tokens as the engine expanded it to)
        self.num_prompt_tokens = sum(len(p) if isinstance(p, list) else len(o.prompt_token_ids)
                                     for p, o in zip(prompts, outs, strict=True))
        return outs

    def usage(self) -> dict[str, int]:
        n = self.num_prompt_tokens
        return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


class _InputsHandler(_PoolingHandler):
    """A request of `PoolingInputs`: one engine request an input (or its chat `messages`)."""

    body: PoolingInputs

    async def prompts(self) -> list[list[int] | ImagePrompt]:
        b = self.body
        if (b.input is None) == (b.messages is None):
            raise InvalidRequestError("give exactly one of input and messages", param="input")
        if b.messages is not None:
            return [await self.chat_input()]
        assert b.input is not None
        items: list[Any] = [b.input] if isinstance(b.input, str) or (
            b.input and isinstance(b.input[0], int)) else list(b.input)
        if not items:
            raise InvalidRequestError("input must not be empty", param="input")
        if len(items) > MAX_INPUTS:
            raise InvalidRequestError(f"input has {len(items)} items; at most {MAX_INPUTS}", param="input")
        return [self.truncate(self.encode_text(it, b.add_special_tokens) if isinstance(it, str) else list(it))
                for it in items]

    async def chat_input(self) -> list[int] | ImagePrompt:
        """The request's `messages` as the chat completions render them; with images or videos,
        those fetched and made pixels here (as a chat's are) and the prompt with them."""
        chat = chat_handler(self.state, self.body)
        await chat.fetch_images()
        prompt = chat.prompts()[0]
        if not prompt.images:
            return self.truncate(prompt.token_ids)
        if self.body.truncate_prompt_tokens is not None:
            raise InvalidRequestError("truncate_prompt_tokens would cut a prompt with images",
                                      param="truncate_prompt_tokens")
        limit = self.state.engine.max_model_len
        if limit is not None and prompt.num_tokens > limit:
            raise InvalidRequestError(f"the messages are {prompt.num_tokens} tokens with their images, but this "
                                      f"model embeds at most {limit}", param="messages")
        return ImagePrompt(prompt.token_ids, prompt.images, prompt.processor_kwargs)


class EmbeddingHandler(_InputsHandler):
    id_prefix = "embd"
    body: EmbeddingRequest

    def pooling(self) -> PoolingParams:  # (PoolingParams refuses a bad pooling_type, naming it)
        b = self.body
        return PoolingParams(b.pooling_type, True if b.normalize is None else b.normalize, b.dimensions)

    async def run(self, raw: Request) -> Response:
        self.pooling()  # (a bad pooling_type is the request's error before anything runs)
        vectors = await self.embed(raw, await self.prompts())
        return JSONResponse({
            "id": self.request_id,
            "object": "list",
            "created": self.created,
            "model": self.model_name,
            "data": [{"index": i, "object": "embedding", "embedding": self.encode(v)} for i, v in enumerate(vectors)],
            "usage": self.usage(),
        })

    def encode(self, vector: list[float]) -> list[float] | str:
        if self.body.encoding_format == "base64":  # OpenAI's: the float32 values' bytes, little-endian
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return vector


class ClassifyHandler(_InputsHandler):
    id_prefix = "classify"
    body: ClassifyRequest

    def pooling(self) -> PoolingParams:
        b = self.body
        return PoolingParams(b.pooling_type, task="classify", activation=b.activation is not False)

    async def run(self, raw: Request) -> Response:
        labels = self.state.engine.head.labels
        if not labels:
            raise InvalidRequestError("this model has no classification head: /classify needs a "
                                      "*ForSequenceClassification model", param="model")
        if self.state.engine.head.token_classifier:
            raise InvalidRequestError("this model classifies each token: /pooling gives its rows", param="model")
        self.pooling()
        results = await self.embed(raw, await self.prompts())
        return JSONResponse({
            "id": self.request_id,
            "object": "list",
            "created": self.created,
            "model": self.model_name,
            "data": [{"index": i, "label": top_label(p, labels), "probs": p, "num_classes": len(p)}
                     for i, p in enumerate(results)],
            "usage": self.usage(),
        })


class PoolingHandler(_InputsHandler):
    id_prefix = "pool"
    body: PoolingRequest

    def pooling(self) -> PoolingParams:
        b = self.body
        engine = self.state.engine
        head = engine.head
        task = b.task or ("token_classify" if head.token_classifier else "classify" if head.labels else "embed")
        tokens = task.startswith("token_")
        if tokens and b.pooling_type not in (None, "all", "step"):
            raise InvalidRequestError(f"task={task!r} pools tokens: pooling_type must be 'all', 'step' or unset",
                                      param="pooling_type")
        kind = (b.pooling_type or "all") if tokens else b.pooling_type
        if task.endswith("classify"):
            return PoolingParams(kind, task="classify", activation=b.activation is not False, step_tag_id=b.step_tag_id)
        return PoolingParams(kind, True if b.normalize is None else b.normalize, b.dimensions,
                             step_tag_id=b.step_tag_id)

    async def run(self, raw: Request) -> Response:
        self.pooling()
        outs = await self.run_pooled(raw, await self.prompts())
        return JSONResponse({
            "id": self.request_id,
            "object": "list",
            "created": self.created,
            "model": self.model_name,
            "data": [{"index": i, "object": "pooling",
                      "data": o.token_embeddings if o.token_embeddings is not None else o.embedding or []}
                     for i, o in enumerate(outs)],
            "usage": self.usage(),
        })


class _SimilarityHandler(_PoolingHandler):
    """Scores: a cross-encoder's where the model is a one-class classifier (each pair read as
    one input, its class's logit through the model's activation: `cross_encoder_score`), else a bi-encoder's, the cosine similarity of two texts'
    embeddings (the last token's hidden state, normalized), each distinct text embedded once."""

    async def similarities(self, raw: Request, pairs: list[tuple[str, str]]) -> list[float]:
        labels = self.state.engine.head.labels
        if labels:
            inputs = [self.truncate(ids)
                      for ids in cross_encoder_inputs(pairs, self.state.engine.head, self.state.engine.tokenizer)]
            head = self.state.engine.head
            return [cross_encoder_score(p[0], head) for p in await self.embed(raw, inputs)]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        if len(texts) > MAX_INPUTS:
            raise InvalidRequestError(f"{len(texts)} distinct texts; at most {MAX_INPUTS}", param=self.input_param)
        vectors = dict(zip(texts, await self.embed(raw, [self.truncate(self.encode_text(t)) for t in texts]),
                           strict=True))
        return [cosine(vectors[a], vectors[b]) for a, b in pairs]


class ScoreHandler(_SimilarityHandler):
    id_prefix = "score"
    input_param = "text_1"
    body: ScoreRequest

    async def run(self, raw: Request) -> Response:
        scores = await self.similarities(raw, score_pairs(self.body.text_1, self.body.text_2))
        return JSONResponse({
            "id": self.request_id,
            "object": "list",
            "created": self.created,
            "model": self.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": self.usage(),
        })


class RerankHandler(_SimilarityHandler):
    id_prefix = "rerank"
    input_param = "documents"
    body: RerankRequest

    async def run(self, raw: Request) -> Response:
        b = self.body
        if not b.documents:
            raise InvalidRequestError("documents must not be empty", param="documents")
        if b.top_n is not None and b.top_n < 0:
            raise InvalidRequestError(f"top_n={b.top_n}: must be >= 0 (0: every document)", param="top_n")
        scores = await self.similarities(raw, [(b.query, d) for d in b.documents])
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: b.top_n or None]
        return JSONResponse({
            "id": self.request_id,
            "model": self.model_name,
            "usage": {"total_tokens": self.num_prompt_tokens},
            "results": [{"index": i, "document": {"text": b.documents[i]}, "relevance_score": scores[i]}
                        for i in order],
        })


def chat_handler(state: ServerState, body: PoolingInputs | TokenizeRequest,
                 tools: list[dict[str, Any]] | None = None) -> ChatCompletionHandler:
    """A request's chat `messages` as the chat completions render them (the template, tools,
    the images and videos and their `mm_processor_kwargs`)."""
    chat = ChatCompletionRequest.model_validate({
        "messages": body.messages, "tools": tools, "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message, "chat_template_kwargs": body.chat_template_kwargs,
        "mm_processor_kwargs": body.mm_processor_kwargs,
    })
    return ChatCompletionHandler(state, chat)


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
        # (an image or video as the one token the template writes for it, as vLLM's /tokenize has it)
        ids = chat_handler(state, body, tools=body.tools).prompts()[0].token_ids
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
