"""Scores (vLLM's `LLM.score`, `/score` and `/rerank`), shared by `LLM.score` and the server.

A bi-encoder (an embedding model) scores a pair by the cosine similarity of the two texts'
embeddings; a cross-encoder (a sequence classifier with one class: a reranker) reads the pair
as one input, joined by the tokenizer's pair template, and scores it by its class's logit put
through the activation its sentence-transformers config names (a sigmoid where it names none)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.sampling_params import InvalidRequestError

if TYPE_CHECKING:
    from conveyor.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelHead:
    """What a model pools and classifies with, as the API layers need to know it: a
    classifier's class names (empty for a model that generates or only embeds), whether its
    head classifies every token, and the text a cross-encoder's (query, document) pair is
    rendered as (None: the tokenizer's pair template)."""

    labels: tuple[str, ...] = ()
    token_classifier: bool = False
    score_template: str | None = None
    score_activation: str | None = None  # a cross-encoder's (`SCORE_ACTIVATIONS`); None: a sigmoid
    lexical: bool = False  # BGE-M3's sparse head: `classify` over "all" gives each token's weight


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


# The activations a sentence-transformers CrossEncoder's config may name (vLLM reads the same
# `activation_fn`, restricted to torch.nn.modules), on one logit.
SCORE_ACTIVATIONS: dict[str, Callable[[float], float]] = {
    "torch.nn.modules.activation.Sigmoid": _sigmoid,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.Tanh": math.tanh,
    "torch.nn.modules.activation.ReLU": lambda x: max(x, 0.0),
    "torch.nn.modules.activation.GELU": lambda x: 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))),
    "torch.nn.modules.activation.Softsign": lambda x: x / (1.0 + abs(x)),
}


def cross_encoder_score(logit: float, head: ModelHead) -> float:
    """A cross-encoder's score of one pair from its class's logit."""
    return SCORE_ACTIVATIONS[head.score_activation or "torch.nn.modules.activation.Sigmoid"](logit)


def top_label(probs: Sequence[float], labels: Sequence[str]) -> str:
    """The most probable class's name (a one-class model's only one)."""
    return labels[max(range(len(probs)), key=probs.__getitem__)] if probs and labels else ""


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The pairs to score: one `text_1` against each `text_2`, or pairwise (as many of each)."""
    one = [text_1] if isinstance(text_1, str) else list(text_1)
    two = [text_2] if isinstance(text_2, str) else list(text_2)
    if not one or not two:
        raise InvalidRequestError("text_1 and text_2 must not be empty", param="text_1" if not one else "text_2")
    if len(one) == 1:
        one = one * len(two)
    if len(one) != len(two):
        raise InvalidRequestError(
            f"text_1 has {len(one)} texts and text_2 {len(two)}: give one text_1, or as many as text_2",
            param="text_2",
        )
    return list(zip(one, two, strict=True))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The dot product of two unit vectors (normalized embeddings)."""
    return sum(x * y for x, y in zip(a, b, strict=True))


def cross_encoder_inputs(pairs: Sequence[tuple[str, str]], head: ModelHead,
                         tokenizer: Tokenizer | None) -> list[list[int]]:
    """Each pair as a cross-encoder's one input (the model's score template filled in, or the
    tokenizer's pair template), or the reason this classifier cannot score: a score is one
    class's relevance."""
    if len(head.labels) != 1 or head.token_classifier:
        raise InvalidRequestError(
            f"this classifier has {len(head.labels)} classes{' a token' if head.token_classifier else ''}; "
            "a cross-encoder's score is a one-class model's relevance: use classify", param="model",
        )
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer to join the pairs", param="text_1")
    template = head.score_template
    if template is not None:
        return [tokenizer.encode(template.replace("{query}", a).replace("{document}", b)) for a, b in pairs]
    return [tokenizer.encode_pair(a, b) for a, b in pairs]


def lexical_weights(token_ids: Sequence[int], weights: Sequence[float] | Sequence[Sequence[float]],
                    skip: Sequence[int] = ()) -> dict[int, float]:
    """BGE-M3's lexical weights of a text (FlagEmbedding's `lexical_weights`): each distinct
    token's largest weight, the tokens of `skip` (special tokens) and weights of zero left out.
    `weights` is one a token of `token_ids` (a row of one value each, as `encode` gives them,
    or the values)."""
    out: dict[int, float] = {}
    if len(token_ids) != len(weights):
        raise ValueError(f"{len(token_ids)} tokens and {len(weights)} weights: give one weight a token")
    left_out = set(skip)
    for token, w in zip(token_ids, weights, strict=True):
        value = float(w) if isinstance(w, int | float) else float(w[0])  # type: ignore[index]
        if token not in left_out and value > 0 and value > out.get(token, 0.0):
            out[token] = value
    return out


def lexical_matching_score(a: dict[int, float], b: dict[int, float]) -> float:
    """Two texts' lexical match (BGE-M3's sparse score): the sum over their shared tokens of the
    products of their weights."""
    return sum(w * b[t] for t, w in a.items() if t in b)


def colbert_score(query: Sequence[Sequence[float]], document: Sequence[Sequence[float]]) -> float:
    """Late interaction (ColBERT's MaxSim, BGE-M3's multi-vector score): the mean over the
    query's token vectors of each one's largest dot product with a document's."""
    if not query or not document:
        raise ValueError("a ColBERT score needs a vector a token on both sides")
    return sum(max(sum(x * y for x, y in zip(q, d, strict=True)) for d in document) for q in query) / len(query)
