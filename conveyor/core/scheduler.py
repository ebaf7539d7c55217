"""Continuous (iteration-level) batching over a paged KV cache.

Each call to `schedule()` builds one step: running sequences first (their decode or next
prefill chunk), then waiting sequences in policy order while the step's token budget, the seat
limit and free KV blocks allow. A waiting prompt longer than what is left of the budget is
chunked. When a running sequence needs a block and none is free, the running sequence the
policy values least is preempted (recompute: its blocks are freed and it re-enters the waiting
queue with all its tokens, prompt and output, to be computed again).

Invariants (tests hold them over random request streams):
- a step never holds more than `max_num_seqs` sequences or `max_num_batched_tokens` tokens;
- every scheduled sequence owns blocks for all the tokens it will hold after the step;
- a finished or aborted sequence owns no block.
No torch here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.policies import QueuePolicy, make_policy
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """What the runner needs to compute one sequence's share of a step.

    `token_ids` are the tokens to compute at positions `start_pos .. start_pos+len-1`;
    `sample` says whether the step ends the sequence's known tokens, so one token is sampled.
    `all_token_ids` and `block_table` are read-only views for the runner (penalties, attention).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    all_token_ids: list[int]
    prompt_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """The only thing a runner receives: one step, as plain data."""

    step_id: int
    scheduled: list[ScheduledSequence]
    preempted_seq_ids: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled if len(s.token_ids) > 1)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if len(s.token_ids) == 1)


@dataclass(slots=True)
class SequenceUpdate:
    """One sequence's result of a step, as seen by the engine."""

    seq: Sequence
    new_token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        policy: QueuePolicy | None = None,
        watermark: float = 0.01,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.policy = policy or make_policy(config.policy)
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._by_id: dict[int, Sequence] = {}
        self._finished_since_last_step: list[int] = []
        self._step_id = 0
        self.num_preemptions = 0

    # -- queue -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def get(self, seq_id: int) -> Sequence | None:
        return self._by_id.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def all_sequences(self) -> Iterator[Sequence]:
        yield from self.waiting
        yield from self.running

    def finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        """End `seq` now (stop condition, abort) and free everything it holds."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = now
        self._by_id.pop(seq.seq_id, None)
        self._finished_since_last_step.append(seq.seq_id)
        self.policy.on_finished(seq)

    def abort(self, seq_id: int, now: float) -> Sequence | None:
        seq = self._by_id.get(seq_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT, now)
        return seq

    # -- one step --------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self._step_id += 1
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(step_id=self._step_id, scheduled=[])
        out.finished_seq_ids = self._finished_since_last_step
        self._finished_since_last_step = []

        key = self.policy.sort_key
        self.running.sort(key=lambda s: key(s, now))
        budget = self._schedule_running(out, budget, now)
        if not out.preempted_seq_ids:
            self._schedule_waiting(out, budget, now)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float) -> int:
        # `self.running` is sorted most valuable first: victims are taken from the end.
        kept: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new <= 0:
                kept.append(seq)
                continue
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                kept.append(seq)
                self._emit(out, seq, num_new, now)
                budget -= num_new
        self.running = kept
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        if not self.waiting:
            return
        key = self.policy.sort_key
        self.waiting.sort(key=lambda s: key(s, now))
        admitted: list[Sequence] = []
        for seq in self.waiting:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                # Without chunked prefill a prompt runs whole. But a sequence resumed after
                # preemption may have outgrown the whole step budget: unless it is recomputed
                # in chunks it would wait forever (and block the queue behind it).
                outgrown = (
                    seq.num_output_tokens > 0 and num_new > self.config.max_num_batched_tokens
                )
                if not self.config.enable_chunked_prefill and not outgrown:
                    break
                num_new = budget
            need = self.block_manager.num_new_blocks_needed(seq, seq.num_computed_tokens + num_new)
            # Keep the watermark for running decodes, unless nothing else is running.
            if need + self.watermark_blocks > self.block_manager.num_free_blocks and (
                self.running or need > self.block_manager.num_free_blocks
            ):
                break
            self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            self.running.append(seq)
            admitted.append(seq)
            self._emit(out, seq, num_new, now)
            budget -= num_new
        if admitted:
            chosen = {id(s) for s in admitted}
            self.waiting = [s for s in self.waiting if id(s) not in chosen]

    def _emit(self, out: SchedulerOutput, seq: Sequence, num_new: int, now: float) -> None:
        start = seq.num_computed_tokens
        out.scheduled.append(
            ScheduledSequence(
                seq_id=seq.seq_id,
                token_ids=seq.token_ids[start : start + num_new],
                start_pos=start,
                block_table=seq.block_table,
                sample=start + num_new == seq.num_tokens,
                sampling_params=seq.sampling_params,
                all_token_ids=seq.token_ids,
                prompt_len=seq.prompt_len,
            )
        )

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go back to the waiting queue."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
        out.preempted_seq_ids.append(seq.seq_id)

    # -- after the runner ------------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[int, int],
        now: float,
        logprobs: dict[int, tuple[float, list[tuple[int, float]] | None]] | None = None,
    ) -> list[SequenceUpdate]:
        """Advance computed counts, append sampled tokens, finish on EOS / length limits."""
        updates: list[SequenceUpdate] = []
        for item in out.scheduled:
            seq = self._by_id.get(item.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += len(item.token_ids)
            if not item.sample:
                updates.append(SequenceUpdate(seq, None))
                continue
            token = sampled[item.seq_id]
            seq.token_ids.append(token)
            metrics = seq.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.token_times.append(now)
            lp = logprobs.get(item.seq_id) if logprobs else None
            updates.append(
                SequenceUpdate(seq, token, lp[0] if lp else None, lp[1] if lp else None)
            )
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason, now)
        return updates

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.sampling_params
        n_out = seq.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = None
                return FinishReason.STOP
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return FinishReason.STOP
        if n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    # -- checks ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.block_manager.check_integrity(s.block_table for s in self.all_sequences())
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING, seq
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, seq
            covered = len(seq.block_table) * self.block_manager.block_size
            assert covered >= seq.num_computed_tokens, seq
        assert len(self.running) <= self.config.max_num_seqs
