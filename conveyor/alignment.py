"""Whisper's word timestamps: a window's text aligned to its audio by the cross-attention of the
decoder's alignment heads, as OpenAI's whisper aligns it (Radford et al., 2022; its
`timing.py`).

The decoder reads `<|startoftranscript|>`, the language, the task, `<|notimestamps|>`, the
window's text tokens and the end, whole (`Whisper.cross_weights`, a pass of its own); the
alignment heads' cross-attention probabilities over the window's own encoder positions (two
feature frames each, 20 ms) are renormalized there, standardized over the tokens, median-filtered
over time (7 positions), averaged over the heads; the rows of the positions that predict the
text and the end make a cost matrix (its negative) that dynamic time warping walks from the
first token and position to the last. A token's time is where the path first reaches its row.
The text is split into words (at a leading space or a punctuation mark; each character group in
languages written without spaces), punctuation merged into its neighbour; a word starts at its
first token's time and ends at the next word's start (the last at the end's).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

STEP_S = 0.02  # (an encoder position: two 10-ms feature frames)
MEDIAN_WIDTH = 7
PREPENDED = "\"'“¿([{-"  # (punctuation that joins the word after it)
APPENDED = "\"'.。,，!！?？:：”)]}、"  # (... the word before it)
UNSPACED = ("zh", "ja", "th", "lo", "my", "yue")  # (languages written without spaces between words)


@dataclass
class Word:
    word: str  # (with its leading space, as the tokens spell it)
    tokens: list[int]
    start: float = 0.0
    end: float = 0.0


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Each value the median of the `width` around it along the last dimension (reflected at
    the ends)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = torch.nn.functional.pad(x.reshape(-1, 1, x.shape[-1]), (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad].reshape(x.shape)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest path through `cost` (`[rows, columns]`) from the first cell to the last,
    each step one row down, one column right, or both: its rows and columns in order. Ties as
    OpenAI's: a step down and right only where it is strictly the cheapest way in, a step down
    only where it is strictly cheaper than the other two, else a step right. The cells of one
    anti-diagonal depend only on those before it: computed a diagonal at a time."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0.0
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        diag, up, left = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
        step = np.where((diag < up) & (diag < left), 0, np.where((up < diag) & (up < left), 1, 2))
        total[i, j] = cost[i - 1, j - 1] + np.choose(step, [diag, up, left])
        trace[i, j] = step
    trace[0, :], trace[:, 0] = 2, 1
    i, j = n, m
    rows, cols = [], []
    while i > 0 or j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        if trace[i, j] == 0:
            i, j = i - 1, j - 1
        elif trace[i, j] == 1:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1]), np.array(cols[::-1])


def token_times(weights: torch.Tensor, positions: int, text: int) -> np.ndarray:
    """The time (seconds into the window) of each of the last `text` tokens but the end and of
    the end: `weights` are the alignment heads' cross-attention probabilities `[heads, tokens,
    1500]` over the whole decoder input (the prompt, `text` tokens, the end), `positions` the
    window's own encoder positions. The rows read are those that predict these tokens: from
    the prompt's last (`<|notimestamps|>`) to the last text token's."""
    w = weights[:, :, : max(1, positions)].double()
    w = w / w.sum(dim=-1, keepdim=True)  # (the softmax over the window's own positions)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    w = median_filter((w - mean) / std, MEDIAN_WIDTH)
    matrix = w.mean(dim=0)[-text - 2 : -1]
    rows, cols = dtw(-matrix.numpy())
    jumps = np.diff(rows, prepend=-1).astype(bool)
    return cols[jumps] * STEP_S


def split_words(tokens: list[int], decode: Any, language: str) -> list[Word]:
    """The text tokens as words: each token's text is what it adds to the decoded text (a group
    of tokens where one alone would split a character); a group starting with a space or that
    is a punctuation mark starts a word, as does every group in a language without spaces."""
    groups: list[Word] = []
    pending: list[int] = []
    said = ""
    for k, t in enumerate(tokens):
        pending.append(t)
        text = decode(tokens[: k + 1])
        piece = text[len(said):]
        if "\ufffd" in piece and k + 1 < len(tokens):
            continue
        groups.append(Word(piece, pending))
        said, pending = text, []
    if language in UNSPACED:
        return groups
    words: list[Word] = []
    for g in groups:
        if not words or g.word.startswith(" ") or g.word.strip() in string.punctuation:
            words.append(g)
        else:
            words[-1].word += g.word
            words[-1].tokens += g.tokens
    return words


def merge_punctuation(words: list[Word]) -> list[Word]:
    """Opening punctuation joins the word after it, closing punctuation the word before it (each
    keeps the times of the word it joins); the emptied words dropped."""
    joins = len(words) - 1  # (the word opening marks join: marks in a row all join the same)
    for i in range(len(words) - 2, -1, -1):
        w, after = words[i], words[joins]
        if w.word.startswith(" ") and w.word.strip() in PREPENDED:
            after.word, after.tokens = w.word + after.word, w.tokens + after.tokens
            w.word, w.tokens = "", []
        else:
            joins = i
    kept = 0
    for j in range(1, len(words)):
        before, w = words[kept], words[j]
        if before.tokens and not before.word.endswith(" ") and w.word in APPENDED:
            before.word, before.tokens = before.word + w.word, before.tokens + w.tokens
            w.word, w.tokens = "", []
        else:
            kept = j
    return [w for w in words if w.word]


def align(weights: torch.Tensor, positions: int, text: list[int], decode: Any, language: str, offset: float,
          read: int | None = None) -> list[Word]:
    """A window's words with their times (seconds into the clip: `offset` is the window's
    start); `weights` over the prompt, the first `read` of the `text` tokens (all where None)
    and the end; the tokens past those (a window that filled the decoder's positions) take
    the last time."""
    if not text:
        return []
    read = len(text) if read is None else min(read, len(text))
    times = token_times(weights, positions, read)
    times = np.concatenate([times, np.full(len(text) - read, times[-1])])
    words = split_words(text, decode, language)
    bounds = np.cumsum([0] + [len(w.tokens) for w in words])
    for w, lo, hi in zip(words, bounds[:-1], bounds[1:], strict=True):
        w.start, w.end = round(offset + float(times[lo]), 2), round(offset + float(times[hi]), 2)
    return merge_punctuation(words)
