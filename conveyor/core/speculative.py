"""Speculative decoding, the draft side: a proposer guesses a decoding sequence's next tokens,
and the model verifies them all in the sequence's share of one step.

The scheduler grants a sequence with drafts `1 + k` tokens to compute (its last token and the
`k` drafts), out of the same step budget as everything else. The runner samples a token at each
of the `1 + k` positions and keeps them while each draft equals the token sampled before it:
the accepted drafts plus one token of the model's own. A draft that is a fixed guess (not
sampled from a draft distribution) makes this exactly speculative sampling's rejection rule
(Leviathan et al. 2023; Chen et al. 2023): a draft `d` is accepted with probability `p(d)`,
and on a rejection the token is drawn from `p` without `d`. So greedy requests get the same
tokens as without drafts, and sampled ones the same distribution (seeded ones the same tokens:
each position draws its own row of noise, as `runner/sampler.py` does one row a token).

Proposers are chosen by name (`speculative_method`). `ngram` is prompt lookup decoding
(Saxena 2023; vLLM's "ngram" method): no second model, so nothing costs GPU memory or time
but the verification. `draft_model` is a smaller model's greedy guesses (vLLM's
"draft_model"): its proposals are `deferred`, placeholders the engine's drafter
(`runner/drafter.py`) fills once the step's blocks are allocated, by running the draft model
over every drafting sequence of the step at once. A greedy draft is a fixed guess given its
context, so the same rule verifies it.

With `speculative_token_tree` the drafts branch (`TokenTree`): each node is one of the drafter's
ranked candidates after its parent, every node is verified in the step under its branch's mask,
and the runner keeps the branch whose every guess equals the token sampled at its parent (with
fixed guesses, SpecInfer's multi-candidate rule: the same outputs as without drafts). With
`speculative_eagle_topk` an EAGLE head draws the tree anew each step from its own confidence
(`DynamicTree`, EAGLE-2's), and the same rule verifies it. No torch here.
"""

from __future__ import annotations

import ast
import math
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from conveyor.config import SchedulerConfig
from conveyor.core.registry import Registry
from conveyor.sequence import PLACEHOLDER, Sequence

_PROPOSERS: Registry[Proposer] = Registry("speculative method")

# The methods whose drafts may branch (`speculative_token_tree`): each node is one of the
# drafter's ranked candidates after its parent (Medusa's heads rank every depth in one pass; an
# EAGLE head runs a step a depth over the nodes that have children).
TREE_METHODS = ("medusa", "eagle", "eagle3", "ngram")


@dataclass(frozen=True, slots=True)
class TokenTree:
    """The shape of a sequence's drafts when they branch (a token tree: Medusa's candidates, as
    SpecInfer and Medusa verify them; vLLM's `speculative_token_tree`). A node is the path of
    candidate ranks that leads to it from the sequence's last token: `(0,)` the top guess for
    the next token, `(1,)` the second, `(0, 2)` the third guess for the token after the top one.

    Rows are the step's tokens for the sequence: row 0 its last token (the root), row k >= 1 the
    node `paths[k - 1]`. Nodes are kept breadth first (by depth, then by path), so a node's
    parent row comes before it and any first `n` nodes form a tree of their own: the scheduler
    cuts a tree to what fits by keeping a prefix."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]  # per row: its parent's row (-1 for the root)
    depths: tuple[int, ...]  # per row: its distance from the root (0 for the root)
    children: tuple[tuple[int, ...], ...]  # per row: its children's rows, in order

    @classmethod
    def parse(cls, spec: Any) -> TokenTree:
        """A tree from its paths: a list of tuples of ranks, or its text (`"[(0,), (1,), (0, 0)]"`,
        as vLLM's `--speculative-config` takes it). Every proper prefix of a path must be a
        path too (a node's parent), and no path twice."""
        if isinstance(spec, str):
            try:
                spec = ast.literal_eval(spec)
            except (ValueError, SyntaxError) as e:
                raise ValueError(f"speculative_token_tree {spec!r} is not a list of tuples: {e}") from None
        if not isinstance(spec, list | tuple) or not spec:
            raise ValueError("speculative_token_tree must be a non-empty list of paths, e.g. [(0,), (1,), (0, 0)]")
        paths = []
        for path in spec:
            if (not isinstance(path, list | tuple) or not path
                    or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
                raise ValueError(f"speculative_token_tree: {path!r} is not a path (a non-empty tuple of ranks >= 0)")
            paths.append(tuple(path))
        if len(set(paths)) != len(paths):
            raise ValueError("speculative_token_tree names a path twice")
        known = set(paths)
        for path in paths:
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"speculative_token_tree: {path} has no parent {path[:-1]} in the tree")
        paths.sort(key=lambda p: (len(p), p))
        row = {p: k + 1 for k, p in enumerate(paths)}
        parents = (-1, *(row[p[:-1]] if len(p) > 1 else 0 for p in paths))
        children = tuple(tuple(k for k in range(1, len(parents)) if parents[k] == r) for r in range(len(parents)))
        return cls(tuple(paths), parents, (0, *(len(p) for p in paths)), children)

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return self.depths[-1]

    @property
    def is_chain(self) -> bool:
        """One guess a depth (the top one): drafts as a plain list of guesses are."""
        return all(all(r == 0 for r in p) for p in self.paths) and self.num_nodes == self.depth

    def width(self, depth: int) -> int:
        """Candidates the drafter ranks at `depth` (1-based): the highest rank asked there, plus one."""
        return 1 + max((p[-1] for p in self.paths if len(p) == depth), default=-1)

    def cut(self, max_depth: int, max_nodes: int) -> int:
        """How many of the first nodes (a tree) fit in `max_depth` and `max_nodes`."""
        n = 0
        while n < min(max_nodes, self.num_nodes) and self.depths[n + 1] <= max_depth:
            n += 1
        return n

    def branch(self, row: int) -> list[int]:
        """The rows from depth 1 down to `row` (empty for the root): the guesses `row` follows."""
        out = []
        while row > 0:
            out.append(row)
            row = self.parents[row]
        out.reverse()
        return out


@dataclass(frozen=True, slots=True)
class DynamicTree:
    """EAGLE-2's dynamic draft tree (Li et al. 2024; SGLang's `speculative_eagle_topk`,
    `speculative_num_steps`, `speculative_num_draft_tokens`): a token tree drawn anew each step
    from the head's confidence instead of a fixed shape. A candidate's score is the log of the
    head's probability of its branch (the product along it), which tracks how often a branch is
    accepted. The root ranks `topk` children; at each depth below `steps` the `topk` candidates
    with the highest scores are expanded, each ranking `topk` children of its own; then the
    `nodes` highest-scoring candidates of all are verified (`rerank`). A child never outscores
    its parent, so they form a tree."""

    topk: int
    steps: int
    nodes: int

    def most_nodes(self, depth: int) -> int:
        """The candidates a tree `depth` deep holds: topk at depth 1, topk x topk below."""
        return 0 if depth < 1 else self.topk + (depth - 1) * self.topk * self.topk

    def expected(self, rates: tuple[float, ...] | list[float], depth: int, count: int) -> tuple[TokenTree, list[int]]:
        """The tree this rule grows, `depth` deep and `count` nodes, when every node's rank-r
        candidate has probability `rates[r]` (0 past the list): the shape a head whose
        confidence is its acceptance reaches, the same every step (the simulator's). Also the
        nodes expanded at each depth from 1 (the head's rows a step), as the drafter expands
        them: at most `count + 1` in all, the slots its step holds."""
        lp = [math.log(r) if r > 0 else -math.inf for r in rates[: self.topk]]
        lp += [-math.inf] * (self.topk - len(lp))
        cands = [(-1, r, lp[r]) for r in range(self.topk)]
        frontier, expanded = list(range(self.topk)), list[int]()
        for _ in range(1, depth):
            best = sorted(frontier, key=lambda c: (-cands[c][2], c))[: min(self.topk, count + 1 - sum(expanded))]
            if not best:
                break
            expanded.append(len(best))
            frontier = []
            for c in best:
                for r in range(self.topk):
                    frontier.append(len(cands))
                    cands.append((c, r, cands[c][2] + lp[r]))
        return rerank(cands, count)[0], expanded


def rerank(candidates: list[tuple[int, int, float]], count: int) -> tuple[TokenTree, list[int]]:
    """EAGLE-2's reranking: the `count` best of `candidates` as a token tree, and for each of its
    rows after the root the candidate it is. A candidate is `(parent, rank, score)`: its parent's
    index in the list (-1: the root; parents come first), its rank among its parent's children,
    and its branch's score (its parent's plus its own log probability, so never above the
    parent's). The best are by score, then the shallower, then the earlier (SGLang's order
    where scores are equal), so each one's parent is among them."""
    depth: list[int] = []
    for parent, _, _ in candidates:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    best = sorted(range(len(candidates)), key=lambda i: (-candidates[i][2], depth[i], i))[:count]
    path: dict[int, tuple[int, ...]] = {}
    for i in sorted(best):  # (parents first)
        parent, rank, _ = candidates[i]
        if parent >= 0 and parent not in path:
            raise ValueError(f"rerank: candidate {i} outscores its parent {parent}")
        path[i] = (*path.get(parent, ()), rank)
    tree = TokenTree.parse([path[i] for i in sorted(best)])
    of = {p: i for i, p in path.items()}
    return tree, [of[p] for p in tree.paths]


def register_proposer(name: str) -> Callable[[type[Proposer]], type[Proposer]]:
    return _PROPOSERS.register(name)


def available_proposers() -> list[str]:
    return _PROPOSERS.names()


def make_proposer(config: SchedulerConfig) -> Proposer | None:
    """The configured proposer (`SchedulerConfig` has checked that its name is registered)."""
    if config.speculative_method is None:
        return None
    return _PROPOSERS[config.speculative_method](config)


class Proposer(ABC):
    """Guesses the tokens that follow a sequence. Holds per-sequence state at most until
    `on_finished`."""

    name: ClassVar[str] = ""
    # The proposals are placeholders, filled after scheduling by the engine (`runner/drafter.py`).
    deferred: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    @abstractmethod
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to `max_tokens` (>= 1) guesses of the tokens after `seq.token_ids` (all known:
        no placeholder), or none."""

    def on_finished(self, seq: Sequence) -> None:  # noqa: B027 - optional hook
        """`seq` has ended: forget it."""


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Prompt lookup: the longest suffix of the sequence, from `prompt_lookup_max` tokens down
    to `prompt_lookup_min`, that occurred before in it; the proposal is what followed its most
    recent earlier occurrence. That occurrence says the text repeats with a period (the
    distance between the two), so the proposal goes on with that period where the tokens after
    the occurrence run out (`a b a b` proposes `a b a b ...`, not just `a b`).

    The search is `bytearray.rfind` over each sequence's token ids as 4-byte integers, kept
    and grown in place from step to step: C speed, no per-step copy of a long context.

    With a token tree (`tree`, set by the scheduler), the proposal branches over the latest
    `MAX_MATCHES` occurrences of that suffix: each continues as above, and a node's candidates
    are the tokens the continuations that reach its parent hold at its depth, the most frequent
    first, then the latest (a trie of the matches, as SGLang's n-gram drafts; a node the matches
    do not reach takes the latest match's token at its depth)."""

    MAX_MATCHES = 8
    tree: TokenTree | None = None

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._bytes: dict[int, bytearray] = {}

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        tokens = seq.token_ids
        n_tokens = len(tokens)
        if n_tokens <= self.min_n:
            return []
        hay = self._bytes.get(seq.seq_id)
        if hay is None or len(hay) > 4 * n_tokens:  # new, or its tokens were cut (a stop string)
            hay = self._bytes[seq.seq_id] = bytearray(array("i", tokens).tobytes())
        elif len(hay) < 4 * n_tokens:
            hay.extend(array("i", tokens[len(hay) // 4 :]).tobytes())
        limit = 4 * (n_tokens - 1)  # an earlier occurrence ends before the last token
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            needle = hay[4 * (n_tokens - n) :]
            end = limit
            starts: list[int] = []  # the occurrences' continuations, latest first
            while (at := hay.rfind(needle, 0, end)) >= 0:
                if at % 4 == 0:  # aligned on a token, not straddling two
                    if self.tree is None:
                        return self._follow(tokens, at // 4 + n, n_tokens, max_tokens)
                    starts.append(at // 4 + n)
                    if len(starts) == self.MAX_MATCHES:
                        break
                end = at + len(needle) - 1
            if starts:
                assert self.tree is not None
                depth = self.tree.depths[max_tokens]
                return self._branches([self._follow(tokens, s, n_tokens, depth) for s in starts], max_tokens)
        return []

    def _branches(self, matches: list[list[int]], count: int) -> list[int]:
        """The first `count` nodes of the tree over `matches` (continuations, latest first)."""
        assert self.tree is not None
        tree = self.tree
        reach: dict[int, list[list[int]]] = {0: matches}  # row -> the matches down its branch
        out: list[int] = []
        for k in range(1, count + 1):
            d, rank = tree.depths[k], tree.paths[k - 1][-1]
            here = reach.get(tree.parents[k], [])
            seen: dict[int, int] = {}  # token -> matches holding it, in first-seen order
            for m in here:
                seen[m[d - 1]] = seen.get(m[d - 1], 0) + 1
            ranked = sorted(seen, key=lambda t: -seen[t])  # (stable: ties keep the latest first)
            token = ranked[rank] if rank < len(ranked) else matches[0][d - 1]
            reach[k] = [m for m in here if m[d - 1] == token] if rank < len(ranked) else []
            out.append(token)
        return out

    @staticmethod
    def _follow(tokens: list[int], start: int, n_tokens: int, max_tokens: int) -> list[int]:
        """`max_tokens` tokens from `start` on, repeating with period `n_tokens - start`."""
        period = n_tokens - start
        return [tokens[start + i % period] for i in range(max_tokens)]

    def on_finished(self, seq: Sequence) -> None:
        self._bytes.pop(seq.seq_id, None)


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    """A draft model's guesses: always `max_tokens` of them, placeholders until the engine's
    drafter has run the draft model over the step (`Drafter.fill`)."""

    deferred = True

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        return [PLACEHOLDER] * max_tokens


@register_proposer("mtp")
class MTPProposer(DraftModelProposer):
    """DeepSeek-V3's multi-token-prediction layer's guesses (conveyor/runner/mtp.py), filled
    in as a draft model's are."""


@register_proposer("eagle")
class EagleProposer(DraftModelProposer):
    """An EAGLE-1 head's guesses from the model's last hidden states (conveyor/models/eagle.py),
    filled in as a draft model's are."""


@register_proposer("eagle3")
class Eagle3Proposer(DraftModelProposer):
    """An EAGLE-3 head's guesses from three of the model's layers (conveyor/models/eagle.py)."""


@register_proposer("medusa")
class MedusaProposer(DraftModelProposer):
    """Medusa heads' guesses from the model's last hidden state, one head a guess
    (conveyor/models/medusa.py)."""

