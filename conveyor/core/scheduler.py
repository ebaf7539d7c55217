"""The scheduler: builds each step over a paged KV cache from independent, named choices.

Continuous (iteration-level) batching by default: running sequences first (their decode or
next prefill chunk), then waiting sequences in policy order while the step's token budget, the
seat limit and free KV blocks allow. Static and dynamic batching, the three prefill modes, the
admission triggers, the queue policies, recompute/swap preemption and KV reservation are all
choices of `SchedulerConfig`; `Scheduler` documents the order in which they apply.

Preemption by recompute frees a sequence's blocks and sends it back to the waiting queue with
all its tokens (prompt and output) to compute again; by swap, its blocks are copied to CPU swap
space and back, and its computed tokens stay computed.

Invariants (tests hold them over random request streams):
- a step never holds more than `max_num_seqs` sequences or `max_num_batched_tokens` tokens;
- every scheduled sequence owns blocks for all the tokens it will hold after the step;
- a finished or aborted sequence owns no block.
No torch here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import SchedulerConfig
from conveyor.core.batching import QueueState, make_batching
from conveyor.core.block_manager import BlockManager
from conveyor.core.policies import QueuePolicy, SortKey, make_policy
from conveyor.core.speculative import DynamicTree, NgramProposer, TokenTree, make_proposer
from conveyor.lora import LoRARequest
from conveyor.multimodal import ImageSpan
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """What the runner needs to compute one sequence's share of a step.

    `token_ids` are the tokens to compute at positions `start_pos .. start_pos+len-1`;
    `sample` says whether the step ends the sequence's known tokens, so one token is sampled.
    `all_token_ids` and `block_table` are read-only views for the runner (penalties, attention).
    With speculative decoding, the last `num_draft` of `token_ids` are draft tokens, not yet
    the sequence's: a token is sampled after each position (`core/speculative.py`). With `tree`,
    they are the first `num_draft` nodes of that token tree (row k at position start_pos +
    tree.depths[k], its K/V in the slot of start_pos + k), not a chain. With `tree_depth`
    (EAGLE-2's dynamic tree), the drafter grows a tree of `num_draft` nodes at most that deep
    and sets `tree` before the runner sees it.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    all_token_ids: list[int]
    prompt_len: int
    num_draft: int = 0
    lora_request: LoRARequest | None = None
    # A hybrid KV cache's sliding layer groups' tables (`HybridLayout`); empty otherwise.
    window_tables: list[list[int]] = field(default_factory=list)
    tree: TokenTree | None = None
    tree_depth: int = 0
    images: tuple[ImageSpan, ...] = ()  # where the prompt's image tokens are (conveyor/multimodal.py)
    # An encoder-decoder's (Whisper's): the blocks of its clip's cross-attention keys and values
    # (`BlockManager.cross_pages`), which the runner fills at the sequence's first step (start_pos 0).
    cross_table: list[int] = field(default_factory=list)
    # The distributions the drafter drew the guesses from (`[num_draft, vocab]`: a draft
    # model's, an EAGLE head's, an MTP layer's): the target keeps them by speculative sampling.
    # None: greedy guesses, each kept where it equals the token the target samples.
    draft_probs: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_depth(self) -> int:
        """How far the drafts reach past the last token (num_draft for a chain)."""
        return self.num_draft if self.tree is None else self.tree.depths[self.num_draft]

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
    # KV offloading (`BlockManager`): (device, tier) copies of evicted cached blocks and (tier,
    # device) copies for prefix hits; the tier's blocks follow the swap blocks in one host
    # pool. Stores run with the swap-outs, before anything else; loads with the swap-ins.
    blocks_to_store: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)
    # KV offloading's disk tier (`DiskTier`): (tier block, hash) written to disk after the
    # stores, (hash, tier block) read from disk before the loads.
    disk_writes: list[tuple[int, bytes]] = field(default_factory=list)
    disk_reads: list[tuple[bytes, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to copy (a swap must run even in an idle step)."""
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.blocks_to_store or self.blocks_to_load or self.disk_writes or self.disk_reads)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled if len(s.token_ids) > 1 and not s.num_draft)

    @property
    def num_decode_tokens(self) -> int:
        """Decodes, a token each, and with speculative decoding their drafts too."""
        return sum(len(s.token_ids) for s in self.scheduled if len(s.token_ids) == 1 or s.num_draft)

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_draft for s in self.scheduled)


@dataclass(slots=True)
class SequenceUpdate:
    """One new token of a sequence (or none: a prefill chunk that samples nothing), as seen by
    the engine. A step of speculative decoding gives a sequence several, in order, all but the
    last with `last=False`; `index` is the token's place in `seq.token_ids`."""

    seq: Sequence
    new_token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    last: bool = True
    index: int = 0


class Scheduler:
    """Builds every step from the configured axes (see `SchedulerConfig`):

    1. order: running, swapped and waiting queues are sorted by the queue policy's key;
    2. displacement: under a preemptive policy, better waiting requests preempt worse running
       ones when seats or blocks are full;
    3. running sequences get their decode or next prefill chunk, preempting the least valuable
       running sequence (recompute or swap) when a block is missing;
    4. swapped sequences come back before anyone new is admitted (under prefill_first, a
       swapped decode comes back in a decode step, never beside a prefill);
    5. waiting sequences the batching mode and admission trigger allow are admitted in order,
       as the prefill mode allows (chunked, whole prompts, or prefill-only steps).
    """

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
        self.policy = policy or make_policy(config)
        self.proposer = make_proposer(config)
        # Drafts that branch (`speculative_token_tree`); a tree of top guesses only is a chain.
        tree = None if config.speculative_token_tree is None else TokenTree.parse(config.speculative_token_tree)
        self.token_tree = None if tree is None or tree.is_chain else tree
        if isinstance(self.proposer, NgramProposer):  # (it branches its proposals itself)
            self.proposer.tree = self.token_tree
        # EAGLE-2's dynamic tree (`speculative_eagle_topk`): shaped by the drafter each step.
        self.dynamic_tree = None if config.speculative_eagle_topk is None else DynamicTree(
            config.speculative_eagle_topk, config.speculative_num_steps or 1, config.num_speculative_tokens)
        self._depth = 0  # the last `_drafts`' depth bound
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and those accepted
        self.num_accepted_tokens = 0
        # Adaptive drafting (`speculative_draft_cost`): per sequence, [drafts accepted, drafts
        # rejected] (after a rejection the later drafts of the step say nothing).
        self._acceptance: dict[int, list[int]] = {}
        self.batching = make_batching(config)
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        # kv_reservation='estimate' (SGLang's new-token ratio): the share of each running
        # request's remaining max_tokens that admission expects it to still generate.
        self._first_ratio, self._least_ratio = config.new_token_ratios  # (schedule_conservativeness's)
        self.new_token_ratio = self._first_ratio
        self._ratio_decay = (self._first_ratio - self._least_ratio) / config.new_token_ratio_decay_steps
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._by_id: dict[int, Sequence] = {}
        self._finished_since_last_step: list[int] = []
        self._step_id = 0
        self._decode_steps_since_admission = 0
        self.num_preemptions = 0
        self.num_swaps_out = 0
        self.num_swaps_in = 0
        # Pipeline parallelism (the simulator's): up to `pipeline_depth` batches in flight. A
        # sequence whose sampled token is still in the pipeline waits for it (its next input;
        # async scheduling's one step ahead reads it on the device instead), while a prompt's
        # next chunk may follow the one in flight. A batch takes at most 1/depth of the
        # sequences there are (seats at most): one batch with all of them would leave the
        # other stages idle (vLLM V1's underused pipeline, vllm-project/vllm#27462); V0's
        # virtual engines and SGLang's micro-batches balance them the same way.
        self.pipeline_depth = 1
        self._batch_cap = 1 << 62
        # The encoder's budget (`max_num_encoder_input_tokens`): what is left of it this step,
        # the digests charged this step (one encoding serves every sequence with the item),
        # and the engine's view of the runner's encoder cache (an item there costs nothing).
        self._encoder_left: int | None = None
        self._encoded_now: set[bytes] = set()
        # max_num_partial_prefills > 1 (vLLM's partial prefills): this step's cap on a prompt
        # chunk (None: none), and the prefills and long ones that may still start in it.
        self._chunk_share: int | None = None
        self._prefill_slots = self._long_slots = 0
        self.long_prompt_tokens = config.long_prefill_token_threshold or int(0.04 * max_model_len)
        self.encoder_cached: Callable[[bytes], bool] | None = None

    # -- queue -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def can_receive(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`, the K/V of its first `num_tokens` tokens computed by another engine,
        could be queued now: a seat, swap space for them, and a place for its adapter."""
        if len(self.running) + len(self.swapped) >= self.config.max_num_seqs:
            return False
        if seq.lora_request is not None and not self._adapter_fits(seq, self._adapters()):
            return False
        return self.block_manager.can_receive(num_tokens)

    def receive(self, seq: Sequence, num_tokens: int) -> None:
        """Queue `seq` swapped out, the K/V of its first `num_tokens` tokens in swap space (the
        runner writes them there): it comes in as any swapped sequence does, before anyone new,
        and computes only the rest (prefill/decode disaggregation, conveyor/kv_transfer.py)."""
        assert 0 < num_tokens < seq.num_tokens and self.can_receive(seq, num_tokens), (seq, num_tokens)
        self.block_manager.receive(seq, num_tokens)
        seq.num_computed_tokens = num_tokens
        seq.status = SequenceStatus.SWAPPED
        self.swapped.append(seq)
        self._by_id[seq.seq_id] = seq

    def get(self, seq_id: int) -> Sequence | None:
        return self._by_id.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def all_sequences(self) -> Iterator[Sequence]:
        yield from self.waiting
        yield from self.running
        yield from self.swapped

    def next_wakeup(self) -> float | None:
        """When waiting work becomes schedulable by time alone (a dynamic batch's window)."""
        deadline = getattr(self.batching, "next_deadline", None)
        return deadline(self.waiting) if deadline is not None and not self.running else None

    def finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        """End `seq` now (stop condition, abort) and free everything it holds."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free_swapped(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = now
        self._by_id.pop(seq.seq_id, None)
        self._finished_since_last_step.append(seq.seq_id)
        self.policy.on_finished(seq)
        self.batching.on_finished(seq)
        if self.proposer is not None:
            self.proposer.on_finished(seq)
            self._acceptance.pop(seq.seq_id, None)

    def abort(self, seq_id: int, now: float) -> Sequence | None:
        seq = self._by_id.get(seq_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT, now)
        return seq

    # -- one step --------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id, scheduled=[])
        out.finished_seq_ids = self._finished_since_last_step
        self._finished_since_last_step = []

        self.policy.prepare(self.waiting, self.block_manager)
        policy_key = self.policy.key

        def key(s: Sequence) -> SortKey:
            return policy_key(s, now)

        self.running.sort(key=key)
        self.swapped.sort(key=key)
        self.waiting.sort(key=key)
        if self.pipeline_depth > 1:
            there = min(len(self.running) + len(self.swapped) + len(self.waiting), self.batching.seat_limit())
            self._batch_cap = max(1, -(-there // self.pipeline_depth))
        eligible = self.batching.eligible(
            QueueState(now, self.waiting, len(self.running) + len(self.swapped), self._decode_steps_since_admission)
        )
        # Displacement only while nothing is swapped out: swapped sequences come back before
        # anyone new, so room made now would go to them, not to the better waiting request.
        if self.policy.preemptive and self.config.kv_reservation != "reserve" and not self.swapped:
            self._displace(out, eligible, now)
        displaced = len(out.preempted_seq_ids)
        if displaced:  # the victims wait at least a step (`eligible` may be `self.waiting` itself)
            gone = set(out.preempted_seq_ids)
            eligible = [s for s in eligible if s.seq_id not in gone]

        budget = self.config.max_num_batched_tokens
        self._encoder_left = self.config.max_num_encoder_input_tokens
        self._encoded_now.clear()
        if self.config.max_num_partial_prefills > 1:
            self._plan_partial_prefills(eligible)
        admitted_fresh = False
        if self.config.prefill_mode == "prefill_first":
            # A step of prefills alone if there is any prefill to run; decodes wait for it.
            # A swapped sequence comes back in a step of its own kind (decodes: vLLM v0).
            budget = self._schedule_running(out, budget, now, only="prefill")
            admitted_fresh = self._admit(out, budget, eligible, now, displaced, only="prefill")
            if not out.scheduled:
                budget = self._schedule_running(
                    out, self.config.max_num_batched_tokens, now, only="decode"
                )
                if len(out.preempted_seq_ids) <= displaced:
                    self._swap_in(out, budget, now, only="decode")
        else:
            budget = self._schedule_running(out, budget, now)
            admitted_fresh = self._admit(out, budget, eligible, now, displaced)

        if admitted_fresh:
            self._decode_steps_since_admission = 0
        elif out.num_decode_tokens:
            self._decode_steps_since_admission += 1
        if self.config.kv_reservation == "estimate":
            self._adjust_ratio(out, len(out.preempted_seq_ids) > displaced)
        if self.block_manager.num_offload_blocks:
            out.blocks_to_store, out.blocks_to_load = self.block_manager.take_copies()
            if self.block_manager.disk is not None:
                out.disk_writes, out.disk_reads = self.block_manager.take_disk_copies()
        return out

    def _plan_partial_prefills(self, eligible: list[Sequence]) -> None:
        """vLLM's partial prefills: the running prompts go on, and waiting ones may start up to
        `max_num_partial_prefills` in all, of which at most `max_long_partial_prefills` longer
        than `long_prompt_tokens`; each chunk is at most the step's budget over the number of
        prompts expected to prefill in it (those running, and those waiting that would start)."""
        cfg, long = self.config, self.long_prompt_tokens
        most, most_long = cfg.max_num_partial_prefills, cfg.max_long_partial_prefills
        running = [s for s in (*self.running, *self.swapped) if s.num_uncomputed_tokens > 1]
        prefills = len(running)
        longs = sum(1 for s in running if s.num_uncomputed_tokens > long)
        self._prefill_slots, self._long_slots = most - prefills, most_long - longs
        waiting_longs = 0
        for seq in eligible:
            if prefills >= most:
                break
            if seq.num_uncomputed_tokens > long:
                if longs + waiting_longs >= most_long:
                    continue
                waiting_longs += 1
            prefills += 1
        self._chunk_share = max(1, cfg.max_num_batched_tokens // max(1, min(prefills, most)))

    def _admit(
        self,
        out: SchedulerOutput,
        budget: int,
        eligible: list[Sequence],
        now: float,
        displaced: int,
        only: str | None = None,
    ) -> bool:
        """Swap in, then admit waiting sequences. Returns whether a fresh request joined.

        `displaced` preemptions of this step made room for better waiting sequences on purpose;
        any further one means running sequences are short of memory.
        """
        if len(out.preempted_seq_ids) > displaced:
            return False  # memory is short this step: admitting now would only thrash
        budget = self._swap_in(out, budget, now, only)
        if self.swapped:
            return False  # swapped sequences come back before anyone new
        return self._schedule_waiting(out, budget, eligible, now)

    def _displace(self, out: SchedulerOutput, eligible: list[Sequence], now: float) -> None:
        """Preemptive policies: a waiting sequence with a better key than the worst running
        one takes its place when seats or blocks are full.

        Victims are recomputed, never swapped: a swapped victim would come back before anyone
        new (step 4), ahead of the very request it made room for.

        Under kv_reservation='estimate' the room counts as admission counts it: the candidate's
        blocks and those it is expected to take later, beside what the running sequences are
        expected to take yet (a victim's expected blocks leave with it).
        """
        bm = self.block_manager
        seats = self.batching.seat_limit() - len(self.running) - len(self.swapped)
        free = bm.num_free_blocks - self.watermark_blocks
        adapters = self._adapters()
        estimate = self.config.kv_reservation == "estimate"
        expected = sum(map(self._expected_blocks, self.running)) if estimate else 0
        for cand in eligible:
            if not self._adapter_fits(cand, adapters):
                continue  # admission would pass it by: preempting for it would make room for nobody
            first = min(cand.num_tokens, self.config.max_num_batched_tokens)
            need = bm.pages_for_tokens(first)
            later = bm.pages_per_block * max(0, bm.blocks_for_tokens(self._expected_tokens(cand))
                                             - bm.blocks_for_tokens(first)) if estimate else 0
            # Aging reorders admission only: aged requests neither displace nor are displaced
            # (were they to displace, their victims would age in turn and displace them back).
            if self.policy.is_aged(cand, now):
                return
            victims = [s for s in self.running if not self.policy.is_aged(s, now)]
            while (seats < 1 or need + later + expected > free) and victims:
                victim = self._pick_victim(victims)
                if not self.policy.key(cand, now) < self.policy.key(victim, now):
                    return  # the queue is ordered: no later candidate beats this victim either
                victims.remove(victim)
                if estimate:
                    expected -= self._expected_blocks(victim)
                self.running.remove(victim)
                free += bm.num_held(victim)
                self._preempt(victim, out, allow_swap=False)
                seats += 1
            if seats < 1 or need + later + expected > free:
                return
            seats -= 1
            free -= need
            expected += later

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, now: float, only: str | None = None
    ) -> int:
        """Give running sequences their next tokens; `only` restricts to prefills or decodes."""
        kept: list[Sequence] = []
        queue = deque(self.running)  # sorted most valuable first: victims come off the end
        allocate, emit = self.block_manager.allocate, self._emit  # once: this loop runs per sequence
        drafting = self.proposer is not None and (
            (limit := self.config.speculative_disable_by_batch_size) is None or len(self.running) < limit
        )
        # `speculative_draft_budget`: each running sequence's even share of a step's drafts.
        share = None if (cap := self.config.speculative_draft_budget) is None else cap // max(1, len(self.running))
        while queue:
            seq = queue.popleft()
            in_prefill = len(seq.token_ids) - seq.num_computed_tokens > 1
            if (only is not None and in_prefill != (only == "prefill")) or (
                seq.num_pending and (self.pipeline_depth > 1 or self._owes_last_token(seq))
            ) or len(out.scheduled) >= self._batch_cap:
                kept.append(seq)
                continue
            num_new = self._prefill_chunk(seq, budget) if in_prefill else min(1, budget)
            if num_new <= 0:
                kept.append(seq)
                continue
            if drafting and not in_prefill and budget > 1 and (
                drafts := self._drafts(seq, budget - 1 if share is None else min(budget - 1, share))
            ):
                kept.append(seq)
                self._emit_drafts(out, seq, drafts)
                budget -= 1 + len(drafts)
                continue
            while not allocate(seq, seq.num_computed_tokens + num_new):
                victim = self._pick_victim(queue) if queue else seq
                if victim is not seq:
                    queue.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                kept.append(seq)
                emit(out, seq, num_new)
                budget -= num_new
        self.running = kept
        return budget

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for decoding `seq` this step, with blocks allocated for them; none if
        its next token ends it, or if the drafts would need blocks the watermark keeps."""
        if seq.num_pending:  # (only with async scheduling, which speculative decoding refuses)
            return []
        params = seq.sampling_params
        n = len(seq.token_ids)
        # The step's tokens (1 + drafts) must not overrun max_tokens or the model's length.
        tree, dynamic = self.token_tree, self.dynamic_tree
        deepest = (tree.depth if tree is not None else dynamic.steps if dynamic is not None
                   else self.config.num_speculative_tokens)
        most = min(deepest, budget, params.max_tokens - (n - seq.prompt_len) - 1, self.max_model_len - n - 1)
        if self.config.speculative_draft_cost:
            most = self._worth_drafting(seq, most)
        if most < 1:
            return []
        self._depth = most  # (a dynamic tree's bound, for `_emit_drafts`)
        if tree is not None:  # `most` bounds the depth; the nodes within it that fit the budget
            most = tree.cut(most, budget)
        elif dynamic is not None:  # as many candidates as a tree that deep can hold
            most = min(dynamic.nodes, budget, dynamic.most_nodes(most))
        assert self.proposer is not None
        drafts = self.proposer.propose(seq, most)[:most]
        if not drafts:
            return []
        bm = self.block_manager
        room = len(seq.block_table) * bm.block_size - n  # slots held beyond the last token
        spare = max(bm.num_free_blocks - self.watermark_blocks, 0) // bm.pages_per_block * bm.block_size
        drafts = drafts[: max(room + spare, 0)]  # drafts never preempt anyone
        if drafts and not bm.allocate(seq, n + len(drafts)):
            return []
        return drafts

    def _worth_drafting(self, seq: Sequence, most: int) -> int:
        """Adaptive drafting: draft position j is accepted with probability a^j (every draft
        before it accepted too), where a is the sequence's acceptance so far (a Beta(1, 1)
        prior: one half before any evidence). Verifying it costs `speculative_draft_cost` of
        a step, so the sequence drafts the positions whose a^j is at least that.

        A sequence that stops drafting gathers no more evidence, so it does not start again."""
        accepted, rejected = self._acceptance.get(seq.seq_id, (0, 0))
        rate = (accepted + 1) / (accepted + rejected + 2)
        cost = self.config.speculative_draft_cost
        k, p = 0, rate
        while k < most and p >= cost:
            k += 1
            p *= rate
        return k

    def _emit_drafts(self, out: SchedulerOutput, seq: Sequence, drafts: list[int]) -> None:
        """A decode with drafts (`_drafts`): its last token and the drafts are computed, one
        token is sampled at each. Only the last token counts as computed until `update` knows
        which drafts the model accepted."""
        start = seq.num_computed_tokens
        tokens = seq.token_ids
        out.scheduled.append(
            ScheduledSequence(
                seq.seq_id, [tokens[start], *drafts], start, seq.block_table, True,
                seq.sampling_params, tokens, seq.prompt_len, len(drafts), seq.lora_request, seq.window_tables,
                self.token_tree, self._depth if self.dynamic_tree is not None else 0, cross_table=seq.cross_table,
            )
        )
        seq.num_computed_tokens = start + 1
        tokens.append(PLACEHOLDER)
        seq.num_pending += 1

    def _prefill_chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens a sequence with more than one uncomputed token may compute this step."""
        num_new = seq.num_uncomputed_tokens
        if self.config.prefill_mode == "chunked":
            cap = self.config.long_prefill_token_threshold
            if cap:
                num_new = min(num_new, cap)
            if self._chunk_share is not None:
                num_new = min(num_new, self._chunk_share)
            return self._encoder_cut(seq, self._whole_images(seq, min(num_new, budget), budget))
        if num_new <= budget:
            return num_new if self._encoder_cut(seq, num_new) == num_new else 0
        # Whole prompts only; but a sequence resumed after preemption may have outgrown the
        # whole step budget, and unless it is recomputed in chunks it would wait forever.
        if seq.num_output_tokens > 0 and num_new > self.config.max_num_batched_tokens:
            return self._encoder_cut(seq, self._whole_images(seq, budget, budget))
        return 0

    def _encoder_cut(self, seq: Sequence, num_new: int) -> int:
        """A chunk of `num_new` tokens, cut to stop before the first media item it reaches
        whose embeddings the step's encoder budget can no longer pay for (vLLM's
        `max_num_encoder_input_tokens`): each item not yet encoded costs its tokens once,
        nothing if the encoder cache holds it or a sequence of this step pays for it. 0: the
        sequence waits (its chunk would start inside such an item)."""
        left = self._encoder_left
        if left is None or not seq.images or num_new <= 0:
            return num_new
        start = seq.num_computed_tokens
        for span in self._unpaid(seq, start + num_new, set(self._encoded_now)):
            if span.length > left:
                return max(0, span.offset - start)
            left -= span.length
        return num_new

    def _charge_encoder(self, seq: Sequence, end: int) -> None:
        """Charge the step's encoder budget for the media items the chunk up to `end` reaches
        (`_encoder_cut` has made it fit)."""
        assert self._encoder_left is not None
        for span in self._unpaid(seq, end, self._encoded_now):
            self._encoder_left -= span.length
        seq.images_charged = sum(1 for span in seq.images if span.offset < end)

    def _unpaid(self, seq: Sequence, end: int, paid: set[bytes]) -> Iterator[ImageSpan]:
        """The media items of `seq` not charged yet that its chunk up to `end` must encode: not
        passed before the chunk (a prefix-cache hit), not in the encoder cache, not among `paid`
        digests (each one yielded joins them)."""
        start = seq.num_computed_tokens
        cached = self.encoder_cached
        for span in seq.images[seq.images_charged :]:
            if span.offset >= end:
                break
            digest = span.pixels.digest
            if span.end <= start or digest in paid or span.pixels.embeds or (cached is not None and cached(digest)):
                continue
            paid.add(digest)
            yield span

    @staticmethod
    def _whole_images(seq: Sequence, num_new: int, budget: int) -> int:
        """A chunk of `num_new` tokens, cut so that it ends in no image whose tokens see each
        other both ways (Gemma 3's): it ends before the image, or (starting inside or at it, the
        tokens before it cached) takes the rest of it whole, or waits for a step with the room."""
        start = seq.num_computed_tokens
        end = start + num_new
        for span in seq.images:
            if span.bidirectional and span.offset < end < span.end:
                if span.offset > start:
                    return span.offset - start
                return span.end - start if span.end - start <= budget else 0
        return num_new

    def _swap_in(self, out: SchedulerOutput, budget: int, now: float, only: str | None = None) -> int:
        """Bring swapped sequences back in policy order; `only` restricts to prefills or decodes
        (head of line: the queue's order is kept)."""
        bm = self.block_manager
        seats = self.batching.seat_limit()
        while self.swapped and budget > 0 and len(self.running) < seats and len(out.scheduled) < self._batch_cap:
            seq = self.swapped[0]
            in_prefill = seq.num_uncomputed_tokens > 1
            if only is not None and in_prefill != (only == "prefill"):
                break
            num_new = self._prefill_chunk(seq, budget) if in_prefill else 1
            if num_new <= 0:
                break
            extra = bm.num_new_blocks_needed(seq, seq.num_computed_tokens + num_new)
            if not bm.can_swap_in(seq, extra):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(bm.swap_in(seq))
            bm.allocate(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.num_swaps_in += 1
            self.running.append(seq)
            self._emit(out, seq, num_new)
            budget -= num_new
        return budget

    # -- kv_reservation='estimate' (SGLang's admission by new-token ratio) -------------------
    ESTIMATE_CLIP = 4096  # remaining max_tokens counted at most this many (SGLang's clip)

    def _expected_tokens(self, seq: Sequence) -> int:
        """The tokens `seq` is expected to hold in the end: its known tokens and the ratio's
        share of what it may still generate (clipped, and within the model's length)."""
        known = len(seq.token_ids) - seq.num_pending
        left = min(seq.sampling_params.max_tokens - (known - seq.prompt_len), self.ESTIMATE_CLIP,
                   self.max_model_len - known)
        return known + math.ceil(self.new_token_ratio * max(left, 0))

    def _expected_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` is expected to take beyond those it holds (`_expected_tokens`)."""
        bm = self.block_manager
        return bm.pages_per_block * max(0, bm.blocks_for_tokens(self._expected_tokens(seq)) - len(seq.block_table))

    def _adjust_ratio(self, out: SchedulerOutput, short: bool) -> None:
        """After a step's schedule: a preemption for memory means the ratio was too low; it is
        raised to the running requests' share so far of their max_tokens, with 20 more steps
        each (SGLang's retraction). A step of decodes lowers it by one decay step, to its least;
        an empty engine starts again from the first value."""
        if short and self.running:
            decoded = sum(s.num_output_tokens for s in self.running)
            most = sum(min(s.sampling_params.max_tokens, self.ESTIMATE_CLIP) for s in self.running)
            self.new_token_ratio = min(1.0, max(self._least_ratio, (decoded + 20 * len(self.running)) / (most + 1)))
        elif not (self.running or self.swapped):
            self.new_token_ratio = self._first_ratio
        elif out.num_decode_tokens:
            self.new_token_ratio = max(self.new_token_ratio - self._ratio_decay, self._least_ratio)

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, eligible: list[Sequence], now: float
    ) -> bool:
        bm = self.block_manager
        seats = self.batching.seat_limit()
        reserve = self.config.kv_reservation == "reserve"
        # 'estimate': blocks the running sequences are expected to take yet, kept free.
        expected = (sum(map(self._expected_blocks, self.running))
                    if self.config.kv_reservation == "estimate" and eligible else None)
        admitted: list[Sequence] = []
        fresh = False
        caching = bm.enable_prefix_caching
        adapters: set[tuple[str, int]] | None = None  # the adapters running or swapped out, once one is asked for
        for seq in eligible:
            if budget <= 0 or len(self.running) >= seats or len(out.scheduled) >= self._batch_cap:
                break
            if seq.lora_request is not None:
                if adapters is None:
                    adapters = self._adapters()
                if not self._adapter_fits(seq, adapters):
                    continue  # others (the base model, the adapters running) go ahead; it keeps its place
            partial = self._chunk_share is not None  # (a waiting sequence's admission is a prefill)
            is_long = partial and seq.num_uncomputed_tokens > self.long_prompt_tokens
            if partial:
                if self._prefill_slots <= 0:
                    break  # max_num_partial_prefills prompts prefill this step already
                if is_long and self._long_slots <= 0:
                    continue  # a long one waits for a long slot, in its place; shorter ones go ahead
            # A prefix-cache hit is computed already: the sequence starts after it (a waiting
            # sequence holds no blocks and has computed nothing, fresh or preempted). One
            # that asks for its prompt's logprobs, or pools every prompt position (an
            # embedding's mean), computes the prompt whole, until it has them.
            sp = seq.sampling_params
            wants_prompt = (sp.prompt_logprobs is not None or (sp.pooling is not None and sp.pooling.whole_prompt)
                            ) and not seq.num_output_tokens
            hits = [] if wants_prompt else bm.match_prefix(seq)
            seq.num_computed_tokens = len(hits) * bm.block_size
            num_new = self._prefill_chunk(seq, budget) if seq.num_uncomputed_tokens > 1 else 1
            target = seq.num_computed_tokens + num_new
            if reserve:
                remaining = seq.sampling_params.max_tokens - seq.num_output_tokens
                target = max(target, min(seq.num_tokens + remaining, self.max_model_len))
            # Cached blocks in the free pool leave it when taken: they count as new.
            need = bm.admission_need(seq, hits, target)
            # 'estimate': and the blocks it is expected to take after this step's.
            later = 0 if expected is None else bm.pages_per_block * max(
                0, bm.blocks_for_tokens(self._expected_tokens(seq)) - bm.blocks_for_tokens(target))
            # Keep a watermark of blocks for running decodes (and, estimating, what they and
            # this one are expected to take), unless the cache is otherwise idle.
            if num_new <= 0 or need > bm.num_free_blocks or (
                not reserve and need + self.watermark_blocks + later + (expected or 0) > bm.num_free_blocks
                and self.running
            ):
                seq.num_computed_tokens = 0
                break  # head-of-line: keep the policy's order
            if caching:
                bm.acquire(seq, hits)
            bm.allocate(seq, target)
            if partial:
                self._prefill_slots -= 1
                self._long_slots -= is_long
            if expected is not None:
                expected += self._expected_blocks(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                seq.metrics.num_cached_tokens = len(hits) * bm.block_size
            fresh = fresh or seq.num_output_tokens == 0
            self.running.append(seq)
            if adapters is not None and seq.lora_request is not None:
                adapters.add(seq.lora_request.key)
            self.batching.on_admitted(seq)
            self.policy.on_admitted(seq)
            admitted.append(seq)
            self._emit(out, seq, num_new)
            budget -= num_new
        if admitted:
            chosen = {id(s) for s in admitted}
            self.waiting = [s for s in self.waiting if id(s) not in chosen]
        return fresh

    def _adapters(self) -> set[tuple[str, int]]:
        """The LoRA adapters of the running and swapped-out sequences: at most `max_loras`."""
        return {s.lora_request.key for q in (self.running, self.swapped) for s in q if s.lora_request is not None}

    def _adapter_fits(self, seq: Sequence, adapters: set[tuple[str, int]]) -> bool:
        """Whether `seq` may run beside `adapters` (vLLM's max_loras: a step adds two small
        products per projection and adapter, and the runner keeps max_cpu_loras loaded)."""
        lora = seq.lora_request
        return lora is None or lora.key in adapters or len(adapters) < self.config.max_loras

    def _emit(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        """Put `num_new` tokens of `seq` into the step. They count as computed from now on, and
        a token to be sampled is appended as a placeholder (`Sequence`): the next schedule,
        before or after `update`, sees the sequence as the step leaves it."""
        start = seq.num_computed_tokens
        tokens = seq.token_ids
        end = start + num_new
        sample = end == len(tokens)
        if self._encoder_left is not None and seq.images and seq.images_charged < len(seq.images):
            self._charge_encoder(seq, end)
        # Positional, in the fields' order: this runs once per sequence and step.
        out.scheduled.append(
            ScheduledSequence(
                seq.seq_id,
                tokens[start:end],
                start,
                # The list itself, not a snapshot, also with async scheduling: the runner reads
                # it when the step is launched, before the next schedule can append to it
                # (and HostBlockTables keeps a row per list object).
                seq.block_table,
                sample,
                seq.sampling_params,
                tokens,
                seq.prompt_len,
                0,
                seq.lora_request,
                seq.window_tables,
                images=seq.images,
                cross_table=seq.cross_table,
            )
        )
        seq.num_computed_tokens = end
        if num_new > 1 and self.block_manager.enable_prefix_caching:
            # The full blocks this prefill chunk completes are hits from now on, for requests
            # admitted later in this very step too: every layer writes the whole step's K/V
            # before any attention reads them (`AttentionBackend`), and later steps run after
            # this one. Not for a one-token item: a step of decodes only may run in one fused
            # kernel that writes and reads K/V per sequence; its blocks wait for `update`.
            bs = self.block_manager.block_size
            known = min(end, len(tokens) - seq.num_pending)  # a placeholder has no id to hash
            if known // bs > start // bs:
                self.block_manager.cache_blocks(seq, seq.block_table, start // bs, known // bs, written=False)
        if sample:
            tokens.append(PLACEHOLDER)
            seq.num_pending += 1

    def _pick_victim(self, candidates: Iterable[Sequence]) -> Sequence:
        """The least valuable candidate (the last in policy order), sparing sequences already
        preempted `max_preemptions` times while an unprotected one exists (thrash guard)."""
        ordered = list(candidates)
        for seq in reversed(ordered):
            if seq.num_preemptions < self.config.max_preemptions:
                return seq
        return ordered[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput, allow_swap: bool = True) -> bool:
        """Take `seq` off the device: swap its blocks out, or drop them to recompute later.

        Returns True if it was swapped. The caller has already removed it from `running`.
        """
        seq.num_preemptions += 1
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_seq_ids.append(seq.seq_id)
        mode = self.config.preemption_mode
        wants_swap = allow_swap and (
            mode == "swap"
            or (mode == "auto" and seq.num_computed_tokens >= self.config.auto_swap_min_tokens)
        )
        if wants_swap and seq.block_table and self.block_manager.can_swap_out(seq):
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.num_swaps_out += 1
            return True
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.images_charged = 0  # (computed again: its media encoded again, or found in the encoder cache)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        return False

    # -- after the runner ------------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[int, int],
        now: float,
        logprobs: dict[int, tuple[float, list[tuple[int, float]] | None]] | None = None,
        accepted: dict[int, list[tuple[int, tuple[float, list[tuple[int, float]] | None] | None]]] | None = None,
    ) -> list[SequenceUpdate]:
        """Put the sampled tokens in place of their placeholders, finish on EOS / length limits.

        `accepted` holds, for a sequence that verified drafts, the tokens after its first one
        (the drafts the model accepted, then one of its own), with their logprobs if asked.

        With async scheduling the next step has already been scheduled: a sequence finished
        here has a useless share in it, which the next `update` skips."""
        updates: list[SequenceUpdate] = []
        progressed: list[Sequence] = []
        by_id, stop_reason = self._by_id, self._stop_reason  # once: this loop runs per sequence
        bm = self.block_manager
        block_size = bm.block_size if bm.enable_prefix_caching else 0
        for item in out.scheduled:
            seq = by_id.get(item.seq_id)
            if seq is None:
                continue  # finished or aborted while the step ran
            if item.num_draft:
                self._update_drafts(seq, item, sampled[item.seq_id], now, logprobs, accepted, updates, progressed)
                continue
            # Blocks this step filled have their K/V written now: register those not yet
            # registered (a decode's; a prefill chunk's were when it was scheduled, but for a
            # placeholder's block), unless the table was freed or swapped since (async: a new
            # list object).
            if (
                block_size
                and (start := item.start_pos) % block_size + len(item.token_ids) >= block_size
                and seq.block_table is item.block_table
            ):
                bm.cache_blocks(seq, item.block_table, start // block_size, (start + len(item.token_ids)) // block_size)
            if not item.sample:
                updates.append(SequenceUpdate(seq, None))
                continue
            # The token counts even if the next schedule (async) has preempted the sequence
            # since: this step ran on its blocks before anything could reuse them.
            token = sampled[item.seq_id]
            seq.resolve(token)
            metrics = seq.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.token_times.append(now)
            index = len(seq.token_ids) - seq.num_pending - 1  # the token just resolved
            if logprobs and (lp := logprobs.get(item.seq_id)) is not None:
                updates.append(SequenceUpdate(seq, token, lp[0], lp[1], True, index))
            else:
                updates.append(SequenceUpdate(seq, token, None, None, True, index))
            progressed.append(seq)
            reason = stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason, now)
        self.policy.on_step(s for s in progressed if s.status is not SequenceStatus.FINISHED)
        return updates

    def _update_drafts(
        self,
        seq: Sequence,
        item: ScheduledSequence,
        first: int,
        now: float,
        logprobs: dict[int, tuple[float, list[tuple[int, float]] | None]] | None,
        accepted: dict[int, list[tuple[int, tuple[float, list[tuple[int, float]] | None] | None]]] | None,
        updates: list[SequenceUpdate],
        progressed: list[Sequence],
    ) -> None:
        """A decode that verified drafts: its first token replaces the placeholder, each token
        after it (an accepted draft's successor) makes the draft before it computed, up to the
        first token that ends the sequence."""
        lp = logprobs.get(item.seq_id) if logprobs else None
        more = accepted.get(item.seq_id, []) if accepted else []
        self.num_draft_tokens += item.num_draft
        self.num_accepted_tokens += len(more)
        if self.config.speculative_draft_cost:
            counts = self._acceptance.setdefault(seq.seq_id, [0, 0])
            counts[0] += len(more)
            counts[1] += len(more) < item.draft_depth
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        tokens = seq.token_ids
        for i, (token, token_lp) in enumerate([(first, lp), *more]):
            if i == 0:
                seq.resolve(token)
            else:
                seq.num_computed_tokens += 1
                tokens.append(token)
            metrics.token_times.append(now)
            reason = self._stop_reason(seq, token)
            last = reason is not None or i == len(more)
            if token_lp is None:
                updates.append(SequenceUpdate(seq, token, last=last, index=len(tokens) - 1))
            else:
                updates.append(SequenceUpdate(seq, token, token_lp[0], token_lp[1], last, len(tokens) - 1))
            progressed.append(seq)
            if reason is not None:
                self.finish(seq, reason, now)
                return
        bm = self.block_manager
        if bm.enable_prefix_caching and seq.block_table is item.block_table:
            # The blocks filled by the last token and the accepted drafts (known tokens now).
            bs, start = bm.block_size, item.start_pos
            bm.cache_blocks(seq, item.block_table, start // bs, seq.num_computed_tokens // bs)

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.sampling_params
        known = len(seq.token_ids) - seq.num_pending  # the prompt and the outputs returned
        n_out = known - seq.prompt_len  # num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = None
                return FinishReason.STOP
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return FinishReason.STOP
        if n_out >= params.max_tokens or known >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _owes_last_token(self, seq: Sequence) -> bool:
        """Whether a pending token will end `seq` by length, so it must not be scheduled again
        (only with async scheduling is a sequence scheduled while a token is pending)."""
        n = len(seq.token_ids)  # num_tokens; less prompt_len, num_scheduled_outputs
        return seq.num_pending > 0 and (
            n - seq.prompt_len >= seq.sampling_params.max_tokens or n >= self.max_model_len
        )

    # -- checks ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        bm = self.block_manager
        bm.check_integrity(
            (t for s in (*self.waiting, *self.running) for t in bm.tables_of(s)),
            (t for s in self.swapped for t in bm.tables_of(s)),
        )
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING, seq
            assert not seq.block_table and not seq.window_tables and not seq.cross_table, f"waiting {seq} holds blocks"
        for seq in self.swapped:
            assert seq.status is SequenceStatus.SWAPPED, seq
        for seq in (*self.running, *self.swapped):
            # A hybrid cache's sliding tables: as long as the global one, null before the
            # window of the next query (none of the blocks a query still reads released).
            if bm.hybrid and seq.block_table:
                assert len(seq.window_tables) == bm.num_window_groups, seq
                assert all(len(t) == len(seq.block_table) for t in seq.window_tables), seq
                assert seq.window_start <= bm._dead(seq.num_computed_tokens), seq
            else:
                assert not seq.window_tables and not seq.window_start, seq
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, seq
            covered = len(seq.block_table) * bm.block_size
            assert covered >= seq.num_computed_tokens, seq
            assert len(seq.cross_table) == (bm.cross_pages if seq.block_table else 0), seq
        assert len(self.running) + len(self.swapped) <= self.config.max_num_seqs
        assert len(self._adapters()) <= self.config.max_loras, self._adapters()
