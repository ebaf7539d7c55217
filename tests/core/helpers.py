"""Shared test doubles for the scheduler tests: a deterministic model and a fake runner.

The fake runner stands in for the model and its KV cache: it writes each computed token into
the slot its block table names and, before computing, reads back every earlier position of the
sequence. The sampled token is a hash of what it read. So a step that skips tokens, computes
them twice into the wrong place, reads another sequence's blocks, resumes after preemption
without recomputing, or swaps the wrong blocks (or forgets to swap) gives a different token or
a failed read, and the outputs differ from a reference that generates each request alone.
With prefix caching, reading another sequence's K/V is right when it holds the same tokens:
the runner then tags each slot with its token prefix alone, which is what real K/V depend on.
No torch.
"""

from __future__ import annotations

from typing import Any

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager, HybridLayout
from conveyor.core.disk_tier import DiskTier
from conveyor.core.scheduler import Scheduler, SchedulerOutput
from conveyor.lora import LoRARequest
from conveyor.models.attention import HostBlockTables
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import PLACEHOLDER, FinishReason, Sequence

VOCAB = 16
EOS = 0
STOP_TOKEN = 7

Tag = tuple[int, ...]  # (key of the tokens at positions 0..pos, pos[, sliding group])


# -- the model: a deterministic next-token function of the whole context ------------------
def next_token(context: list[int]) -> int:
    h = 17
    for t in context:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % VOCAB


def make_prompt(index: int, length: int) -> list[int]:
    return [(index * 31 + j * 17 + 1) % VOCAB for j in range(length)]


def reference(
    prompt: list[int], params: SamplingParams, max_model_len: int
) -> tuple[list[int], FinishReason]:
    """What a request generates alone: the spec the scheduled run must reproduce."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= params.min_tokens and (
            (not params.ignore_eos and t == EOS) or t in params.stop_token_ids
        ):
            return out, FinishReason.STOP
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, FinishReason.LENGTH


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# -- the fake runner -----------------------------------------------------------------------
class FakeRunner:
    """A KV cache of tagged slots, with a CPU swap pool of the same layout.

    A tag is (key, pos): the key chains the tokens at positions 0..pos from a seed. Without
    `shared_prefixes` the seed is (seq_id, epoch): a sequence preempted by recompute gets a new
    epoch, so KV left over from before does not count as computed, and a swapped-out sequence
    keeps its epoch, so its KV must come back through the swap pool intact. With
    `shared_prefixes` (prefix caching) the seed is the same for all: a slot is right for any
    sequence whose tokens up to that position are the same, as real K/V are.

    Runner contract, as `ModelRunner.execute`: every swap-out of a step (device -> swap) is
    copied before any swap-in (swap -> device), and both before computing, since a device
    block freed by a swap-out may be handed to another sequence in the same step. The source
    of every copy is then cleared: a freed block holds nothing anyone may read. With
    `shared_prefixes` a swapped-out device block is kept: another table may share it, and a
    freed block keeps its K/V for later prefix hits.

    With `num_offload_blocks` (KV offloading's tier, `BlockManager`): host blocks after the swap
    blocks; a store (`blocks_to_store`) runs with the swap-outs, a load (`blocks_to_load`) with
    the swap-ins, and leaves the tier's copy in place for later hits. With a `disk` tier
    (`DiskTier`): a write (`disk_writes`) keeps a tier block's tags under its hash after the
    stores, and a read (`disk_reads`, through the file the lookup opened) puts them back into a
    tier block before the loads.

    With `cross_tokens` (an encoder-decoder's cross-attention blocks, `BlockManager.cross_pages`):
    a sequence's first step (start 0) writes the encoder's `cross_tokens` positions into the
    slots of its cross table, tagged with the sequence and its epoch, and every later step reads
    them all back, as Whisper's cross-attention does.
    """

    def __init__(
        self, num_blocks: int, block_size: int, num_swap_blocks: int = 0, shared_prefixes: bool = False,
        window: int = 0, sliding_global: bool = False, cross_tokens: int = 0, num_offload_blocks: int = 0,
        disk: DiskTier | None = None,
    ) -> None:
        self.block_size = block_size
        self.disk = disk
        self.disk_slots: dict[bytes, list[Tag | None]] = {}  # what each written file holds
        self.num_swap_blocks = num_swap_blocks
        self.cross_tokens = cross_tokens
        # A hybrid cache (`HybridLayout`): each sliding group's table is read over the window
        # before the step's first query only, its slots tagged with the group too; an entry
        # out of the window is the null block (`num_blocks`), which nothing reads or writes.
        self.window = window
        self.sliding_global = sliding_global  # every layer slides: so does the block table
        self.null_block = num_blocks
        self.window_host_tables: dict[int, HostBlockTables] = {}
        self.shared_prefixes = shared_prefixes
        self.slots: list[Tag | None] = [None] * (num_blocks * block_size)
        self.swap_slots: list[Tag | None] = [None] * ((num_swap_blocks + num_offload_blocks) * block_size)
        self.epoch: dict[int, int] = {}
        # Each sequence's device block table as of its latest computed step: a preempted
        # sequence is swapped iff all of these blocks are swap-out sources of the step.
        self.tables: dict[int, list[int]] = {}
        self.swapped_out: list[int] = []  # sequences the latest step swapped out
        self.recomputed: list[int] = []  # sequences the latest step dropped to recompute
        self.blocks_copied = 0
        self.host_tables = HostBlockTables()
        # Speculative decoding, as `ModelRunner`: a token is sampled after each draft too, and
        # the tokens after the first that the drafts led to are the latest step's `accepted`.
        self.accepted: dict[int, list[tuple[int, None]]] = {}

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _copy(
        self, src: list[Tag | None], dst: list[Tag | None], pairs: list[tuple[int, int]], clear: bool = True
    ) -> None:
        bs = self.block_size
        sources = [a for a, _ in pairs]
        targets = [b for _, b in pairs]
        # A device block shared by prefix caching goes out once with each holder swapped out
        # in the step (swap blocks are never shared); it is kept (not cleared) for that.
        assert clear is False or len(set(sources)) == len(sources), f"a block is copied out twice: {pairs}"
        assert len(set(targets)) == len(targets), f"a block is copied into twice: {pairs}"
        for a, b in pairs:
            for k in range(bs):
                dst[b * bs + k] = src[a * bs + k]
                if clear:
                    src[a * bs + k] = None
        self.blocks_copied += len(pairs)

    def __call__(self, out: SchedulerOutput) -> dict[int, int]:
        out_sources = {a for a, _ in out.blocks_to_swap_out}
        self.swapped_out, self.recomputed = [], []
        for seq_id in out.preempted_seq_ids:
            table = self.tables.pop(seq_id, [])
            if self.sliding_global:  # (blocks of its last table may have left the window since)
                table = [b for b in table if b != self.null_block][-1:]
            if table and all(b in out_sources for b in table):
                self.swapped_out.append(seq_id)
            else:
                self.recomputed.append(seq_id)
                self.epoch[seq_id] = self.epoch.get(seq_id, 0) + 1
        self._copy(self.slots, self.swap_slots, out.blocks_to_swap_out, clear=not self.shared_prefixes)
        self._copy(self.slots, self.swap_slots, out.blocks_to_store, clear=False)
        bs = self.block_size
        for tier, h in out.disk_writes:
            assert self.disk is not None
            self.disk_slots[h] = self.swap_slots[tier * bs:(tier + 1) * bs]
            self.disk.write(h, memoryview(bytes(self.disk.block_bytes)))
        for h, tier in out.disk_reads:
            assert self.disk is not None
            self.disk.take_read(h, memoryview(bytearray(self.disk.block_bytes)))
            self.swap_slots[tier * bs:(tier + 1) * bs] = self.disk_slots[h]
        self._copy(self.swap_slots, self.slots, out.blocks_to_swap_in)
        self._copy(self.swap_slots, self.slots, out.blocks_to_load, clear=False)
        sampled: dict[int, int] = {}
        self.accepted = {}
        # The tables as the model runner reads them: its rows kept from step to step, which
        # must equal the scheduler's lists (every slot below is read and written through them).
        rows = self.host_tables.rows([it.seq_id for it in out.scheduled], [it.block_table for it in out.scheduled])
        # As an attention backend: the whole step's K/V are written before any is read. A step
        # of decodes only may run in one fused kernel that writes and reads per sequence, so
        # there no sequence may read a slot that another writes in the same step.
        reads: list[tuple[int, int, int, Tag]] = []  # (seq_id, pos, slot, expected tag)
        written: set[int] = set()
        for item, row in zip(out.scheduled, rows, strict=True):
            assert row.tolist() == item.block_table, f"seq {item.seq_id}: host row {row} for {item.block_table}"
            table = row.tolist()
            windows = []
            for g, wt in enumerate(item.window_tables, 1):
                host = self.window_host_tables.setdefault(g, HostBlockTables())
                wrow = host.rows([item.seq_id], [wt])[0].tolist()
                assert wrow == wt, f"seq {item.seq_id}: group {g}'s host row {wrow} for {wt}"
                assert len(wt) == len(table), (item, g)
                windows.append((g, wt))
            if item.num_draft:  # the drafts are not the sequence's tokens (yet)
                assert item.all_token_ids[item.start_pos + 1 :] == [PLACEHOLDER], item
                context = item.all_token_ids[: item.start_pos] + item.token_ids
            else:
                context = item.all_token_ids[: item.context_len]
            assert context[item.start_pos :] == item.token_ids
            # Real K/V depend on the adapter too: a block shared across adapters reads wrong.
            salt = 0 if item.lora_request is None else hash(item.lora_request.lora_name)
            key = salt if self.shared_prefixes else hash((item.seq_id, self.epoch.get(item.seq_id, 0)))
            first_read = item.start_pos - self.window + 1  # the first query's window
            for pos, token in enumerate(context):
                key = hash((key, token))
                if pos < first_read and self.sliding_global:
                    continue  # out of every query's window: the table may hold the null block
                slot = self._slot(table, pos)
                if pos < item.start_pos:
                    reads.append((item.seq_id, pos, slot, (key, pos)))
                else:
                    self.slots[slot] = (key, pos)
                    written.add(slot)
                if pos < first_read:
                    continue
                for g, wt in windows:
                    assert wt[pos // self.block_size] != self.null_block, f"seq {item.seq_id} pos {pos}: released"
                    slot = self._slot(wt, pos)
                    if pos < item.start_pos:
                        reads.append((item.seq_id, pos, slot, (key, pos, g)))
                    else:
                        self.slots[slot] = (key, pos, g)
                        written.add(slot)
            if self.cross_tokens:
                assert item.cross_table, f"seq {item.seq_id} runs without its cross table"
                cross_key = ("cross", item.seq_id, self.epoch.get(item.seq_id, 0))
                for pos in range(self.cross_tokens):
                    slot = self._slot(item.cross_table, pos)
                    if item.start_pos == 0:
                        self.slots[slot] = (hash(cross_key), pos)
                        written.add(slot)
                    else:
                        reads.append((item.seq_id, -1 - pos, slot, (hash(cross_key), pos)))
            self.tables[item.seq_id] = list(item.block_table)
            if item.num_draft:
                n = item.start_pos + 1
                tokens = [next_token(context[: n + i]) for i in range(1 + item.num_draft)]
                keep = 1
                while keep <= item.num_draft and tokens[keep - 1] == item.token_ids[keep]:
                    keep += 1
                sampled[item.seq_id] = tokens[0]
                if keep > 1:
                    self.accepted[item.seq_id] = [(t, None) for t in tokens[1:keep]]
            elif item.sample:
                sampled[item.seq_id] = next_token(context)
        decodes_only = all(len(item.token_ids) == 1 for item in out.scheduled)
        for seq_id, pos, slot, expected in reads:
            tag = self.slots[slot]
            assert tag == expected, f"seq {seq_id} pos {pos}: KV slot holds {tag}"
            assert not (decodes_only and slot in written), (
                f"seq {seq_id} pos {pos}: reads a slot written in the same step of decodes only"
            )
        for seq_id in out.finished_seq_ids:
            self.tables.pop(seq_id, None)
            self.host_tables.drop(seq_id)
            for host in self.window_host_tables.values():
                host.drop(seq_id)
        return sampled


# -- a deterministic driver: one scheduler, one fake runner, a fake clock ------------------
class Driver:
    """Runs a scheduler step by step on a fake clock and records what every step held."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_swap_blocks: int = 0,
        max_model_len: int | None = None,
        dt: float = 1.0,
        prefix_caching: bool = False,
        layout: HybridLayout | None = None,
        cross_tokens: int = 0,
        num_offload_blocks: int = 0,
        **config: Any,
    ) -> None:
        self.config = SchedulerConfig(**config)
        self.bm = BlockManager(num_blocks, block_size, num_swap_blocks, enable_prefix_caching=prefix_caching,
                               layout=layout, cross_tokens=cross_tokens, num_offload_blocks=num_offload_blocks)
        capacity = (num_blocks - self.bm.cross_pages) * block_size if layout is None else min(
            layout.capacity(num_blocks, block_size, self.config.kv_chunk), 1 << 20)
        self.max_model_len = max_model_len or capacity
        self.sched = Scheduler(self.config, self.bm, self.max_model_len, frozenset({EOS}))
        self.runner = FakeRunner(num_blocks, block_size, num_swap_blocks, shared_prefixes=prefix_caching,
                                 window=layout.window if layout else 0,
                                 sliding_global=layout is not None and layout.all_sliding, cross_tokens=cross_tokens,
                                 num_offload_blocks=num_offload_blocks)
        self.now = 0.0
        self.dt = dt
        self.seqs: dict[int, Sequence] = {}
        self.log: list[SchedulerOutput] = []
        self.times: list[float] = []
        self.finish_order: list[int] = []

    def add(
        self,
        seq_id: int,
        prompt_len: int,
        max_tokens: int,
        *,
        priority: int = 0,
        expected: int | None = None,
        at: float | None = None,
        prompt: list[int] | None = None,
        lora: LoRARequest | None = None,
        **params_kw: Any,
    ) -> Sequence:
        # ignore_eos: these tests count steps and tokens, an early EOS would change them.
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            priority=priority,
            expected_output_tokens=expected,
            **params_kw,  # other SamplingParams fields (tenant, slo_ttft_ms, ...)
        )
        arrival = self.now if at is None else at
        tokens = make_prompt(seq_id, prompt_len) if prompt is None else prompt
        seq = Sequence(seq_id, f"r{seq_id}", tokens, params, arrival, lora)
        self.seqs[seq_id] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule(self.now)
        self.sched.check_integrity()
        live = [s for s in self.seqs.values() if not s.is_finished]
        sampled = self.runner(out)
        self.sched.update(out, sampled, self.now, accepted=self.runner.accepted)
        self.sched.check_integrity()
        self.finish_order += [s.seq_id for s in live if s.is_finished]
        self.log.append(out)
        self.times.append(self.now)
        self.now += self.dt
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps")

    def first_step_of(self, seq_id: int) -> int:
        """Index of the first step that computed anything for `seq_id`."""
        return next(i for i, out in enumerate(self.log) if seq_id in ids(out))

    def check_outputs(self) -> None:
        """Every finished request generated exactly what it generates alone."""
        for seq in self.seqs.values():
            if seq.is_finished and seq.finish_reason is not FinishReason.ABORT:
                want, reason = reference(seq.prompt_token_ids, seq.sampling_params, self.max_model_len)
                assert seq.output_token_ids == want, f"seq {seq.seq_id}"
                assert seq.finish_reason is reason


def ids(out: SchedulerOutput) -> list[int]:
    return [item.seq_id for item in out.scheduled]
