"""Speculative decoding with DeepSeek's MTP layer (`speculative_method="mtp"`) or an EAGLE
head (`"eagle"`, `"eagle3"`: conveyor/models/eagle.py, whose rows read the same shifted inputs):
the target's hidden states kept for the drafter, the layer's own runner and cache, and the
drafter's rounds. An EAGLE-3 head's "hidden states" are the three streams it reads, kept as one
row a position and put through its `fc` as the drafter feeds them (`combine`).

The drafter differs from a draft model's (conveyor/runner/drafter.py) in what a row reads: the
MTP row at position i takes token i + 1 and the target's hidden state at i (`HiddenStore`, kept
by the target's runner as its steps compute them), so a round first feeds every known position
the layer lacks up to the one before the last known token (whose guess is the round's first),
then its own guesses with its own outputs as the hidden states. Rows fed from guesses never
count as known: their hidden states were the layer's, not the target's, so the next round feeds
those positions again. Positions whose target hidden states the store never held (a prefix-cache
hit the target did not compute, a swap that moved the blocks) are not fed: the layer then reads
whatever its cache holds there, which makes its guesses worse, never the output different.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from conveyor.core.scheduler import ScheduledSequence, SchedulerOutput
from conveyor.core.speculative import rerank
from conveyor.models.attention import build_metadata, path_decodes
from conveyor.models.eagle import EagleHead
from conveyor.models.mtp import MTPLayer
from conveyor.runner.drafter import Drafter, _Fed


class HiddenStore:
    """Each sequence's target hidden states by position, from its last computed run of positions
    (a step's rows overwrite from their first position on)."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (first position, rows)
        self.num_missing = 0  # rows asked for and not held (zeros given instead)

    def put(self, seq_id: int, start: int, rows: torch.Tensor) -> None:
        kept = self._rows.get(seq_id)
        if kept is not None and kept[0] <= start <= kept[0] + kept[1].shape[0]:
            base, old = kept
            self._rows[seq_id] = (base, torch.cat((old[: start - base], rows)))
        else:
            self._rows[seq_id] = (start, rows)

    def put_step(self, items: list[ScheduledSequence], num_new: list[int], hidden: torch.Tensor) -> None:
        """A target step's hidden states `[T, hidden]`, its items' rows in order."""
        at = 0
        for it, n in zip(items, num_new, strict=True):
            self.put(it.seq_id, it.start_pos, hidden[at : at + n].detach())
            at += n

    def follow(self, seq_id: int, start: int, rows: list[int]) -> None:
        """A token tree's verification kept the nodes at `rows` (row k held position start + k):
        their states move to the positions they now hold, start + 0, 1, ..."""
        kept = self._rows.get(seq_id)
        if kept is None or not kept[0] <= start or start + max(rows) >= kept[0] + kept[1].shape[0]:
            return
        at = start - kept[0]
        held = kept[1]
        held[at : at + len(rows)] = held[[at + r for r in rows]]

    def first(self, seq_id: int) -> int | None:
        """The first position held (None: none)."""
        kept = self._rows.get(seq_id)
        return None if kept is None else kept[0]

    def rows(self, seq_id: int, start: int, end: int, width: int) -> torch.Tensor:
        """Positions [start, end); zeros for those not held (after a swap: guesses worse, the
        output the same)."""
        kept = self._rows.get(seq_id)
        if kept is not None and kept[0] <= start and end <= kept[0] + kept[1].shape[0]:
            base, rows = kept
            return rows[start - base : end - base]
        out = torch.zeros(end - start, width)
        held = 0
        if kept is not None:
            base, rows = kept
            lo, hi = max(start, base), min(end, base + rows.shape[0])
            if lo < hi:
                out = out.to(rows)
                out[lo - start : hi - start] = rows[lo - base : hi - base]
                held = hi - lo
        self.num_missing += end - start - held
        return out

    def trim(self, seq_id: int, before: int) -> None:
        """Drop the rows before `before` (the drafter has fed them)."""
        kept = self._rows.get(seq_id)
        if kept is not None and before > kept[0]:
            base, rows = kept
            self._rows[seq_id] = (before, rows[before - base :])

    def drop(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)


@dataclass(slots=True)
class _DraftOutput:
    sampled: dict[int, int]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> its last row's output
    duration_s: float = 0.0
    logits: dict[int, torch.Tensor] | None = None  # (`keep_logits`: each row's, over the model's vocabulary)


class MTPRunner:
    """Runs the MTP layer over a step of draft rows, with a one-layer latent cache of its own
    over the target's block ids; greedy guesses."""

    def __init__(self, layer: MTPLayer | EagleHead, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
        self.layer = layer
        self.keep_logits = False  # (the drafter's: a step whose guesses it draws keeps their logits)
        self.block_size = block_size
        self.dtype, self.device = dtype, device
        slots = (num_blocks + 1) * block_size
        self.kv_cache = torch.zeros((2, slots, *layer.arch.kv_cache_shape), dtype=kv_dtype or dtype, device=device)
        self._kv_nbytes = 0

    def release_kv(self) -> None:
        """Give the layer's cache's memory back (sleep mode; `ModelRunner.release_kv`)."""
        storage = self.kv_cache.untyped_storage()
        self._kv_nbytes = storage.nbytes()
        storage.resize_(0)

    def restore_kv(self) -> None:
        self.kv_cache.untyped_storage().resize_(self._kv_nbytes)
        self.kv_cache.zero_()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, previous: dict[int, torch.Tensor], guess: bool = True) -> _DraftOutput:
        """`previous[seq_id]`: the hidden state each of the item's rows reads, `[rows, hidden]`.
        Without `guess`, no logits: only the last rows' outputs (a token tree ranks them)."""
        start = time.perf_counter()
        items = sorted(out.scheduled, key=lambda s: len(s.token_ids) > 1)  # decodes first
        num_new = [len(it.token_ids) for it in items]
        ids = torch.tensor([t for it in items for t in it.token_ids], device=self.device)
        hidden = torch.cat([previous[it.seq_id].to(self.device, self.dtype) for it in items])
        meta = build_metadata([it.block_table for it in items], [it.start_pos for it in items], num_new,
                              self.block_size, self.device, None, self.dtype)
        h = self.layer(ids, hidden, meta.positions, self.kv_cache, meta)
        last = torch.tensor(num_new, device=self.device).cumsum(0) - 1
        rows = h[last]
        kept = None
        if guess and self.keep_logits:
            logits = self.layer.compute_logits(rows)
            tokens = self.layer.pick(logits).tolist()
            full = self.layer.spread(logits)
            kept = {it.seq_id: full[i] for i, it in enumerate(items)}
        else:
            tokens = self.layer.guess(rows).tolist() if guess else [0] * len(items)
        return _DraftOutput(
            sampled={it.seq_id: tok for it, tok in zip(items, tokens, strict=True)},
            hidden={it.seq_id: rows[i : i + 1] for i, it in enumerate(items)},
            duration_s=time.perf_counter() - start,
            logits=kept,
        )


    @torch.inference_mode()
    def execute_nodes(self, nodes: list[tuple[ScheduledSequence, int]], previous: torch.Tensor) -> torch.Tensor:
        """One drafting step over token-tree nodes: `(item, row k)` each, its input the guess at
        row k, `previous` `[rows, hidden]` its parent's output. The root's row (the last of the
        round's first step) sits at position start_pos - 1, so node k's row at start_pos - 1 +
        depth(k), its K/V in the slot of start_pos - 1 + k, attending to the context up to the
        root and to its branch (`path_decodes`). Returns the rows' outputs."""
        tables, positions, writes, paths, ids = [], [], [], [], []
        for it, k in nodes:
            assert it.tree is not None
            base = it.start_pos - 1
            tables.append(it.block_table)
            positions.append(base + it.tree.depths[k])
            writes.append(base + k)
            paths.append([base + r for r in it.tree.branch(k)])
            ids.append(it.token_ids[k])
        return self.execute_rows(tables, positions, writes, paths, ids, previous)

    @torch.inference_mode()
    def execute_rows(self, tables: list[list[int]], positions: list[int], writes: list[int], paths: list[list[int]],
                     ids: list[int], previous: torch.Tensor) -> torch.Tensor:
        """One drafting step over rows that need not be a sequence's next positions (`path_decodes`):
        row r reads token `ids[r]` and state `previous[r]` at `positions[r]`, writes its K/V at
        `writes[r]` and attends to the context before its branch and to `paths[r]`."""
        meta = path_decodes(tables, positions, writes, paths, self.block_size, self.device, self.dtype)
        return self.layer(torch.tensor(ids, device=self.device), previous.to(self.device, self.dtype), meta.positions,
                          self.kv_cache, meta)


class MTPDrafter(Drafter):
    """`Drafter`'s rounds with the MTP layer's inputs: shifted tokens and hidden states."""

    def __init__(self, runner: MTPRunner, store: HiddenStore) -> None:
        super().__init__(runner)  # type: ignore[arg-type]
        self.store = store
        self.mtp = runner
        self.width = runner.layer.feature_width  # a row of the target's states as the store holds it
        self._own: dict[int, torch.Tensor] = {}  # the layer's last output a sequence, this round
        # The last dynamic tree's scores by sequence, a node's log confidence each (in row order;
        # `benchmarks/eagle_confidence.py` sets them against what the model accepts).
        self.scores: dict[int, list[float]] = {}

    def forget(self, seq_ids: list[int]) -> None:
        super().forget(seq_ids)
        for seq_id in seq_ids:
            self.store.drop(seq_id)

    def fill(self, scheduler_output: SchedulerOutput) -> None:
        self._own = {}
        drafting = [it for it in scheduler_output.scheduled if it.num_draft]
        if any(it.tree_depth for it in drafting):
            self._fill_dynamic(scheduler_output, drafting)
        elif any(it.tree is not None for it in drafting):
            self._fill_tree(scheduler_output, drafting)
        else:
            super().fill(scheduler_output)

    def _roots(self, scheduler_output: SchedulerOutput, drafting: list[ScheduledSequence]) -> _DraftOutput:
        """A tree's first step, as a chain's: the head over the positions it lacks, up to the
        root's; its last row's output (`hidden`) ranks the root's children."""
        self.forget(scheduler_output.finished_seq_ids)
        self.forget(scheduler_output.preempted_seq_ids)
        batch = [self._first(it) for it in drafting]
        self.num_fed_tokens += sum(len(d.token_ids) for d in batch)
        self._ranking = True
        try:
            out = self._run(scheduler_output.step_id, batch)
        finally:
            self._ranking = False
        self.last_duration_s = out.duration_s
        return out

    def _fill_tree(self, scheduler_output: SchedulerOutput, drafting: list[ScheduledSequence]) -> None:
        """A token tree's guesses (`speculative_token_tree`, an EAGLE head's: vLLM's static tree):
        the round's first step as a chain's, whose last row's output ranks the root's children;
        then a step a depth over the nodes with children, each reading its parent's output and
        its own branch, whose outputs rank their children (the candidates of rank r for a child
        of rank r)."""
        out = self._roots(scheduler_output, drafting)
        start = time.perf_counter()
        head = self.mtp.layer
        assert isinstance(head, EagleHead), "token trees: an EAGLE head's"
        trees = {it.seq_id: it.tree for it in drafting if it.tree is not None}  # (every one: the engine's)
        # Per sequence, the head's output after each expanded row (row 0: the root).
        outputs = {it.seq_id: {0: out.hidden[it.seq_id]} for it in drafting}
        depth = 0
        while True:
            parents = [(it, k) for it in drafting for k in outputs[it.seq_id] if trees[it.seq_id].depths[k] == depth]
            kids = [[c for c in trees[it.seq_id].children[k] if c <= it.num_draft] for it, k in parents]
            width = max((1 + max(trees[it.seq_id].paths[c - 1][-1] for c in cs)
                         for (it, _), cs in zip(parents, kids, strict=True) if cs), default=0)
            if not width:
                break
            ranked = head.ranked(torch.cat([outputs[it.seq_id][k] for it, k in parents]), width).tolist()
            for (it, _), cs, mine in zip(parents, kids, ranked, strict=True):
                for c in cs:
                    it.token_ids[c] = mine[trees[it.seq_id].paths[c - 1][-1]]
            depth += 1
            nodes = [(it, c) for (it, _), cs in zip(parents, kids, strict=True) for c in cs
                     if any(g <= it.num_draft for g in trees[it.seq_id].children[c])]
            if not nodes:
                break
            previous = torch.cat([outputs[it.seq_id][trees[it.seq_id].parents[c]] for it, c in nodes])
            rows = self.mtp.execute_nodes(nodes, previous)
            self.num_fed_tokens += len(nodes)
            for i, (it, c) in enumerate(nodes):
                outputs[it.seq_id][c] = rows[i : i + 1]
        self.last_duration_s += time.perf_counter() - start
        for it in drafting:
            self._fed[it.seq_id] = self._after(it, [])

    def _fill_dynamic(self, scheduler_output: SchedulerOutput, drafting: list[ScheduledSequence]) -> None:
        """EAGLE-2's dynamic tree (`speculative_eagle_topk`; `DynamicTree`): the root's output
        ranks topk children, each scored by the log of the head's probability; then, a depth at a
        time while the item's `tree_depth` allows, the topk best-scored candidates of the depth
        are expanded in one step over every sequence (each attending to its own branch: its
        ancestors' rows, written at the slots of start_pos - 1 + 1, 2, ... in the order they
        were expanded, as many as the item's step holds), their outputs ranking topk children
        each; then the item's `num_draft` best candidates of all become its tree (`rerank`)."""
        out = self._roots(scheduler_output, drafting)
        start = time.perf_counter()
        head = self.mtp.layer
        assert isinstance(head, EagleHead), "dynamic trees: an EAGLE head's"
        topk = self.topk
        # Per item: candidates (parent, rank, score), their tokens, and the expanded ones' slots
        # (1, 2, ...: written at start_pos - 1 + slot) and outputs.
        cands: list[list[tuple[int, int, float]]] = [[] for _ in drafting]
        tokens: list[list[int]] = [[] for _ in drafting]
        slot: list[dict[int, int]] = [{} for _ in drafting]
        made: list[dict[int, torch.Tensor]] = [{} for _ in drafting]

        def rank(rows: torch.Tensor, owners: list[tuple[int, int]]) -> list[list[int]]:
            """Each row's topk children into its owner's candidates `(item, parent)`; the new
            candidates' indices, by item."""
            ids, logp = head.top_logprobs(rows, topk)
            new: list[list[int]] = [[] for _ in drafting]
            for (i, parent), mine, lp in zip(owners, ids.tolist(), logp.tolist(), strict=True):
                base = cands[i][parent][2] if parent >= 0 else 0.0
                for r in range(topk):
                    new[i].append(len(cands[i]))
                    cands[i].append((parent, r, base + lp[r]))
                    tokens[i].append(mine[r])
            return new

        frontier = rank(torch.cat([out.hidden[it.seq_id] for it in drafting]), [(i, -1) for i in range(len(drafting))])
        for depth in range(1, max(it.tree_depth for it in drafting)):
            chosen: list[tuple[int, int]] = []  # (item, candidate) expanded at this depth
            for i, it in enumerate(drafting):
                room = it.num_draft + 1 - len(slot[i])  # (slots start_pos .. start_pos + num_draft)
                if depth >= it.tree_depth or room <= 0:
                    continue
                mine = sorted(frontier[i], key=lambda c: (-cands[i][c][2], c))
                for c in mine[: min(topk, room)]:
                    slot[i][c] = len(slot[i]) + 1
                    chosen.append((i, c))
            if not chosen:
                break
            tables, positions, writes, paths, ids, previous = [], [], [], [], [], []
            for i, c in chosen:
                it, base = drafting[i], drafting[i].start_pos - 1
                branch = [c]
                while (p := cands[i][branch[-1]][0]) >= 0:
                    branch.append(p)
                tables.append(it.block_table)
                positions.append(base + depth)
                writes.append(base + slot[i][c])
                paths.append([base + slot[i][b] for b in reversed(branch)])
                ids.append(tokens[i][c])
                parent = cands[i][c][0]
                previous.append(out.hidden[it.seq_id] if parent < 0 else made[i][parent])
            rows = self.mtp.execute_rows(tables, positions, writes, paths, ids, torch.cat(previous))
            self.num_fed_tokens += len(chosen)
            for r, (i, c) in enumerate(chosen):
                made[i][c] = rows[r : r + 1]
            frontier = rank(rows, chosen)
        self.scores = {}
        for i, it in enumerate(drafting):
            tree, picked = rerank(cands[i], it.num_draft)
            it.tree = tree
            it.token_ids[1:] = [tokens[i][c] for c in picked]
            self.scores[it.seq_id] = [cands[i][c][2] for c in picked]
            self._fed[it.seq_id] = self._after(it, [])
        self.last_duration_s += time.perf_counter() - start

    topk = 2  # (the engine sets `speculative_eagle_topk`)

    def _run(self, step_id: int, batch: list[ScheduledSequence]) -> _DraftOutput:
        previous = {}
        for d in batch:
            own = self._own.get(d.seq_id)
            if own is not None:  # a guess: the layer's own output before it
                previous[d.seq_id] = own
            else:  # known tokens: the target's hidden states at the positions before them
                end = d.start_pos + len(d.token_ids)
                rows = self.store.rows(d.seq_id, d.start_pos, end, self.width)
                previous[d.seq_id] = self.mtp.layer.combine(rows.to(self.mtp.device, self.mtp.dtype))
                self.store.trim(d.seq_id, d.start_pos + len(d.token_ids))
        out = self.mtp.execute(SchedulerOutput(step_id, batch), previous, guess=not self._ranking)
        self._own.update(out.hidden)
        return out

    _ranking = False  # (a token tree's first step: its outputs are ranked, not guessed from)

    def _first(self, it: ScheduledSequence) -> ScheduledSequence:
        """Rows for the known positions the layer lacks, up to the one before the step's input:
        at position p, token p + 1 (the target's hidden state at p comes with it in `_run`)."""
        num_known = it.start_pos + 1
        fed = self._fed.get(it.seq_id)
        valid = fed.num_known if fed is not None and fed.table is it.block_table else 0
        first = self.store.first(it.seq_id)
        valid = max(valid, first if first is not None else num_known - 2)
        valid = min(valid, num_known - 2)
        known = it.all_token_ids
        return ScheduledSequence(it.seq_id, known[valid + 1 : num_known], valid, it.block_table, True,
                                 it.sampling_params, known, it.prompt_len)

    def _after(self, it: ScheduledSequence, guesses: list[int]) -> _Fed:
        """Known: the positions fed from the target's states (all but the step's input's)."""
        return _Fed(it.block_table, it.start_pos, [])
