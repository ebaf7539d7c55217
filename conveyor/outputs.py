"""What a caller gets back, in the shape vLLM users know."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from conveyor.kv_transfer import KVHandoff
from conveyor.sequence import RequestMetrics


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None  # the top-k (token id, logprob), best first
    rank: int | None = None  # a prompt token's place in its position's distribution (1: the likeliest)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""  # text new since the previous output of this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp.logprob for lp in self.logprobs)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # Engine.add_request(export_kv=True): the K/V of the prompt, for a decode engine to take
    # over (conveyor/kv_transfer.py); on the final output only.
    kv_handoff: KVHandoff | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing
    # comes before it). With output_kind "delta", only in the request's first output.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # SamplingParams.pooling (an embedding request): the pooled vector, on the final output;
    # a classification's (task "classify"): its classes' probabilities (or logits).
    embedding: list[float] | None = None
    # pooling_type "all": one such vector a prompt token (hidden states, or a token
    # classifier's probabilities), in place of `embedding`.
    token_embeddings: list[list[float]] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns for one prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # one a class (a sigmoid's one value for a one-class model), or logits

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """What `LLM.classify` returns for one prompt (vLLM's shape: `.outputs.probs`); `label`
    names the most probable class."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    label: str
    finished: bool = True


@dataclass(slots=True)
class PoolingOutput:
    data: list[float] | list[list[float]]  # a vector, or (pooling_type "all") one a prompt token


@dataclass(slots=True)
class PoolingRequestOutput:
    """What `LLM.encode` returns for one prompt (vLLM's shape: `.outputs.data`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass(slots=True)
class ParallelChoices:
    """A request with n > 1 (vLLM's parallel sampling) as n requests of one choice each,
    `child_ids` (`{request_id}#{i}`, each run with `SamplingParams.choices()[i]`), whose outputs
    merge into the request's own: the engine's (`Engine.add_request`) and an engine process's
    front end's (`ProcessAsyncEngine`) alike."""

    request_id: str
    child_ids: list[str]
    kind: str  # the output_kind asked for
    stream: bool  # streamed: each move may give an output; else only the last
    latest: list[CompletionOutput | None]  # each choice's output so far (cumulative kinds)
    finished: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # choice 0 computes them

    @classmethod
    def of(cls, request_id: str, n: int, kind: str, stream: bool = True) -> ParallelChoices:
        return cls(request_id, [f"{request_id}#{i}" for i in range(n)], kind, stream, [None] * n)

    @property
    def done(self) -> bool:
        return self.finished == len(self.child_ids)

    def merge(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """Choice `index`'s output as the request's: that choice's move alone (output_kind
        "delta"), every choice's so far ("cumulative"), or all n once the last ends (not
        streamed, or "final_only"); None where nothing is due. Metrics are those of the choice
        in question (for the final output, the choice that ended last)."""
        completion = out.outputs[0]
        completion.index = index
        self.latest[index] = completion
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finished += 1
        if self.stream and self.kind == "delta":
            choices, prompt_logprobs = [completion], out.prompt_logprobs
        elif (self.stream and self.kind == "cumulative") or self.done:
            choices = [c for c in self.latest if c is not None]
            prompt_logprobs = self.prompt_logprobs
        else:
            return None
        return dataclasses.replace(out, request_id=self.request_id, outputs=choices, finished=self.done,
                                   prompt_logprobs=prompt_logprobs)
