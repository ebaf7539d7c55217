"""Speculative decoding with Medusa heads (`speculative_method="medusa"`; conveyor/models/medusa.py):
each drafting sequence's guesses are the heads' top tokens over one row, the model's hidden
state at the position before the step's input (kept by the target's runner as its steps compute
it: `HiddenStore`). One batched pass over the heads fills every sequence's placeholders; the
heads keep no cache, so there is nothing to catch up on after a rejection, a preemption or a
swap. A row the store does not hold (never, as the model computes the position before every
decode's input in the step before it) would read zeros: worse guesses, never other tokens.
"""

from __future__ import annotations

import time

import torch

from conveyor.core.scheduler import SchedulerOutput
from conveyor.models.medusa import MedusaHeads
from conveyor.runner.mtp import HiddenStore


class MedusaDrafter:
    """Fills a step's draft placeholders with the Medusa heads' guesses."""

    def __init__(self, heads: MedusaHeads, store: HiddenStore, device: torch.device, dtype: torch.dtype) -> None:
        self.heads = heads
        self.store = store
        self.device, self.dtype = device, dtype
        self.num_fed_tokens = 0  # rows the heads have read
        self.last_duration_s = 0.0  # the last `fill`'s pass over the heads

    @torch.inference_mode()
    def fill(self, scheduler_output: SchedulerOutput) -> None:
        """Write each drafting sequence's guesses into its `token_ids[1:]` (placeholders). (The
        target's runner drops a finished sequence's rows from the shared store.)"""
        self.last_duration_s = 0.0
        drafting = [it for it in scheduler_output.scheduled if it.num_draft]
        if not drafting:
            return
        start = time.perf_counter()
        width = self.heads.spec.hidden_size
        rows = torch.cat([self.store.rows(it.seq_id, it.start_pos - 1, it.start_pos, width).to(self.device, self.dtype)
                          for it in drafting])
        tree = next((it.tree for it in drafting if it.tree is not None), None)
        if tree is None:
            most = max(it.num_draft for it in drafting)
            guesses = self.heads(rows, most).tolist()
            for it, mine in zip(drafting, guesses, strict=True):
                it.token_ids[1:] = mine[: it.num_draft]
        else:  # a token tree: node (r1, ..., rd) is head d's candidate of rank rd
            widths = [tree.width(d) for d in range(1, tree.depth + 1)]
            offset = [sum(widths[:d]) for d in range(len(widths))]
            ranked = self.heads.ranked(rows, widths).tolist()
            for it, mine in zip(drafting, ranked, strict=True):
                assert it.tree is tree, "one tree for the engine"
                it.token_ids[1:] = [mine[offset[len(p) - 1] + p[-1]] for p in tree.paths[: it.num_draft]]
        for it in drafting:
            self.store.trim(it.seq_id, it.start_pos - 1)  # (earlier positions are never read again)
        self.num_fed_tokens += len(drafting)
        self.last_duration_s = time.perf_counter() - start
