"""Scores as a bi-encoder gives them (vLLM's `LLM.score` and `/score` for an embedding model):
the cosine similarity of two texts' embeddings. Shared by `LLM.score` and the server."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.sampling_params import InvalidRequestError


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
