"""Speculative decoding with a draft model: the drafts of a step, filled in before it runs.

The scheduler gives each drafting sequence `k` placeholder drafts and the blocks for them
(`DraftModelProposer`); `Drafter.fill` then runs the draft model over all of the step's
drafting sequences at once, `k` batched steps, and writes its guesses into the placeholders:
greedy ones, which the target keeps where they equal the tokens it samples (`core/speculative.py`),
or, for a sampled request (not seeded, no logprobs), guesses drawn from the draft's own
distribution at the request's temperature, top-k and top-p, which the target keeps by
speculative sampling (`ModelRunner._speculative_sampling`): more of them are kept than of greedy
guesses, and the tokens are distributed as the target's.

The draft has a KV cache of its own, in the target's blocks: the same block ids, the same
slots, another tensor (vLLM's draft worker shares the target's block tables the same way). So
the scheduler's allocation serves both, and a sequence's draft K/V are as far along as the
draft has been fed its tokens. Step `j` of a round feeds the draft its `j`-th guess, so after
the target accepts `m` of `k` guesses the draft holds K/V for the tokens up to the last
accepted one (or the one before, if all were accepted); the next round's first draft step
feeds it what it lacks (the model's own token, and the last guess if all were kept) in one
varlen step beside everyone else's. A new sequence's first round feeds it the whole prompt.

The draft's K/V are valid while the sequence keeps its block table: the scheduler's contract
(`HostBlockTables`) is that a table list only grows in place, and a preemption, a swap or a
prefix-cache hit that starts a sequence anew gives it another list. Then the draft is fed from
the first token again (its own prefix is never taken from the prefix cache: the blocks the
target found cached need not hold the draft's K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.core.scheduler import ScheduledSequence, SchedulerOutput
from conveyor.runner.base import Runner
from conveyor.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class _Fed:
    """What the draft's cache holds of a sequence: K/V written through `table` for the
    sequence's first `num_known` tokens (known tokens, which never change), then for `guesses`
    (its last round's guesses but the final one, which may or may not have been accepted)."""

    table: list[int]
    num_known: int
    guesses: list[int]


def draws_guesses(params: SamplingParams) -> bool:
    """Whether a request's guesses are drawn from the draft's distribution (speculative
    sampling): sampled, unseeded (a seeded request's tokens stay those of decoding one at a
    time), and without logprobs (its kept tokens' would be the target's draws')."""
    return not params.greedy and params.seed is None and params.logprobs is None


class Drafter:
    """Fills a step's draft placeholders with a draft model's guesses."""

    def __init__(self, runner: Runner) -> None:
        # The draft model's own runner and KV cache (`ModelRunner`), or a simulator's runner
        # that prices the draft's steps (`conveyor/sim/engine.py`): no torch here.
        self.runner = runner
        self.draw = True  # sampled requests' guesses drawn from the draft (`speculative_draw_guesses`)
        self._fed: dict[int, _Fed] = {}
        self.num_fed_tokens = 0  # tokens the draft has computed (its prefills and guesses)
        self.last_duration_s = 0.0  # the last `fill`'s draft steps, as their runner timed them

    def forget(self, seq_ids: list[int]) -> None:
        tables = getattr(self.runner, "host_tables", None)
        for seq_id in seq_ids:
            self._fed.pop(seq_id, None)
            if tables is not None:
                tables.drop(seq_id)

    def fill(self, scheduler_output: SchedulerOutput) -> None:
        """Write each drafting sequence's guesses into its `token_ids[1:]` (placeholders)."""
        self.forget(scheduler_output.finished_seq_ids)
        self.forget(scheduler_output.preempted_seq_ids)
        self.last_duration_s = 0.0
        drafting = [it for it in scheduler_output.scheduled if it.num_draft]
        if not drafting:
            return
        batch = [self._first(it) for it in drafting]
        want = {it.seq_id: it.num_draft for it in drafting}
        guesses: dict[int, list[int]] = {it.seq_id: [] for it in drafting}
        params = {it.seq_id: it.sampling_params for it in drafting}
        drawn: dict[int, list[Any]] = {it.seq_id: [] for it in drafting
                                        if self.draw and it.tree is None and draws_guesses(it.sampling_params)}
        if hasattr(self.runner, "keep_logits"):  # (the logits rows a drawn guess comes from)
            self.runner.keep_logits = bool(drawn)
        step_id = scheduler_output.step_id
        while batch:
            self.num_fed_tokens += sum(len(d.token_ids) for d in batch)
            out = self._run(step_id, batch)
            self.last_duration_s += out.duration_s
            sampled = out.sampled
            following = []
            for d in batch:
                mine = guesses[d.seq_id]
                token = sampled[d.seq_id]
                logits = getattr(out, "logits", None)  # (a draft model's runner keeps them; a head's, none)
                if d.seq_id in drawn and logits is not None:
                    token = self._draw(logits[d.seq_id], params[d.seq_id], drawn[d.seq_id])
                mine.append(token)
                if len(mine) < want[d.seq_id]:
                    following.append(
                        ScheduledSequence(d.seq_id, [token], d.context_len, d.block_table, True,
                                          GREEDY, d.all_token_ids, d.prompt_len)
                    )
            batch = following
        for it in drafting:
            mine = guesses[it.seq_id]
            it.token_ids[1:] = mine
            self._fed[it.seq_id] = self._after(it, mine)
            rows = drawn.get(it.seq_id)
            if rows and len(rows) == len(mine):
                import torch

                it.draft_probs = torch.stack(rows)

    def _draw(self, logits: Any, params: SamplingParams, rows: list[Any]) -> int:
        """A guess drawn from the draft's distribution for `params` (its temperature, top-k and
        top-p over `logits`), that distribution kept in `rows`."""
        import torch

        from conveyor.runner.sampler import Sampler

        scaled = logits.float()[None] / params.temperature
        if params.top_k > 0 or params.top_p < 1.0:
            scaled = Sampler._top_k_top_p(scaled, [params])
        q = torch.softmax(scaled[0], dim=-1)
        rows.append(q)
        generator = getattr(getattr(self.runner, "sampler", None), "generator", None)
        return int(torch.multinomial(q, 1, generator=generator))

    def _run(self, step_id: int, batch: list[ScheduledSequence]) -> Any:
        """One draft step over `batch` (its `sampled` and `duration_s` are read)."""
        return self.runner.execute(SchedulerOutput(step_id, batch))

    def _after(self, it: ScheduledSequence, guesses: list[int]) -> _Fed:
        """What the draft's cache holds of `it` after its round. The final guess was never fed:
        its K/V are not in the cache."""
        return _Fed(it.block_table, it.start_pos + 1, guesses[:-1])

    def _first(self, it: ScheduledSequence) -> ScheduledSequence:
        """The draft's first step of a round for `it`: every known token its cache lacks, the
        last one (`it`'s input) always, so the draft's guess follows it."""
        num_known = it.start_pos + 1  # the tokens before the placeholders
        known = it.all_token_ids
        fed = self._fed.get(it.seq_id)
        valid = 0
        if fed is not None and fed.table is it.block_table:
            valid = fed.num_known
            for guess in fed.guesses:  # the guesses the target kept are known tokens now
                if valid >= num_known or known[valid] != guess:
                    break
                valid += 1
        valid = min(valid, num_known - 1)
        return ScheduledSequence(it.seq_id, known[valid:num_known], valid, it.block_table, True,
                                 GREEDY, known, it.prompt_len)
