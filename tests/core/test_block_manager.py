"""BlockManager: all-or-nothing allocation, ref counts, and `check_integrity` as a real oracle.

The stateful test keeps its own model of who holds which block and compares it with the
manager after every operation, so `check_integrity` is not the only judge of itself.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from conveyor.core.block_manager import BlockManager
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import Sequence


def make_seq(seq_id: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", [1], SamplingParams(), arrival_time=0.0)


def tables(*seqs: Sequence) -> list[list[int]]:
    return [s.block_table for s in seqs]


# -- unit tests ----------------------------------------------------------------------------
def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_allocate_grows_table_to_cover_tokens() -> None:
    bm = BlockManager(8, 4)
    seq = make_seq(0)
    assert bm.allocate(seq, 5)
    assert len(seq.block_table) == 2
    # Covering fewer or the same tokens again must not take more blocks.
    assert bm.allocate(seq, 8)
    assert bm.allocate(seq, 3)
    assert len(seq.block_table) == 2
    assert bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_count(b) == 1 for b in seq.block_table)
    bm.check_integrity(tables(seq))


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(4, 2)
    a, b = make_seq(0), make_seq(1)
    assert bm.allocate(a, 5)  # 3 blocks
    before = list(a.block_table)
    assert not bm.allocate(b, 4)  # needs 2, only 1 free
    assert b.block_table == []
    assert not bm.allocate(a, 9)  # needs 2 more, only 1 free
    assert a.block_table == before
    assert bm.num_free_blocks == 1
    bm.check_integrity(tables(a, b))
    assert bm.allocate(b, 2)
    assert bm.num_free_blocks == 0
    bm.check_integrity(tables(a, b))


def test_free_returns_every_block() -> None:
    bm = BlockManager(6, 3)
    a, b = make_seq(0), make_seq(1)
    bm.allocate(a, 7)
    bm.allocate(b, 6)
    held_by_b = list(b.block_table)
    bm.free(a)
    assert a.block_table == []
    assert bm.num_free_blocks == 6 - len(held_by_b)
    bm.check_integrity(tables(a, b))
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 0 and bm.usage == 0.0
    assert all(bm.ref_count(i) == 0 for i in range(6))
    bm.check_integrity(tables(a, b))


def test_share_counts_references() -> None:
    bm = BlockManager(4, 2)
    a, b = make_seq(0), make_seq(1)
    bm.allocate(a, 4)
    first = a.block_table[0]
    bm.share(first)
    b.block_table.append(first)
    assert bm.ref_count(first) == 2
    bm.check_integrity(tables(a, b))
    bm.free(a)
    # b still holds the shared block: it must not go back to the pool.
    assert bm.ref_count(first) == 1
    assert bm.num_free_blocks == 3
    bm.check_integrity(tables(a, b))
    bm.free(b)
    assert bm.ref_count(first) == 0 and bm.num_free_blocks == 4
    bm.check_integrity(tables(a, b))


def test_share_of_free_block_raises() -> None:
    bm = BlockManager(2, 2)
    with pytest.raises(ValueError):
        bm.share(0)


def test_double_free_raises() -> None:
    bm = BlockManager(4, 2)
    seq = make_seq(0)
    bm.allocate(seq, 4)
    stale = list(seq.block_table)
    bm.free(seq)
    seq.block_table = stale  # a bug elsewhere hands the freed blocks back to the table
    with pytest.raises(RuntimeError):
        bm.free(seq)


def test_free_of_empty_table_is_a_no_op() -> None:
    bm = BlockManager(2, 2)
    seq = make_seq(0)
    bm.free(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 2


# -- the swap pool -------------------------------------------------------------------------
def test_swap_out_moves_a_table_to_swap_blocks_and_frees_the_device_blocks() -> None:
    bm = BlockManager(6, 2, num_swap_blocks=4)
    a, b = make_seq(0), make_seq(1)
    bm.allocate(a, 5)  # 3 blocks
    bm.allocate(b, 2)
    device = list(a.block_table)
    assert bm.can_swap_out(a)
    pairs = bm.swap_out(a)
    # One copy per block, in table order; the table now names the swap blocks.
    assert [d for d, _ in pairs] == device
    assert a.block_table == [s for _, s in pairs]
    assert len(set(a.block_table)) == 3 and all(0 <= s < 4 for s in a.block_table)
    assert bm.num_free_swap_blocks == 1
    assert bm.num_free_blocks == 5  # a's device blocks are free for anyone
    assert all(bm.ref_count(d) == 0 for d in device)
    bm.check_integrity(tables(b), tables(a))


def test_swap_in_brings_a_table_back_and_frees_the_swap_blocks() -> None:
    bm = BlockManager(4, 2, num_swap_blocks=4)
    a, b = make_seq(0), make_seq(1)
    bm.allocate(a, 4)
    bm.swap_out(a)
    bm.allocate(b, 6)  # b takes 3 of the 4 device blocks meanwhile
    swapped = list(a.block_table)
    assert not bm.can_swap_in(a)  # 2 blocks needed, 1 free
    with pytest.raises(RuntimeError):
        bm.swap_in(a)
    assert a.block_table == swapped
    bm.free(b)
    assert bm.can_swap_in(a, extra_blocks=2) and not bm.can_swap_in(a, extra_blocks=3)
    pairs = bm.swap_in(a)
    assert [s for s, _ in pairs] == swapped
    assert a.block_table == [d for _, d in pairs]
    assert all(bm.ref_count(d) == 1 for d in a.block_table)
    assert bm.num_free_swap_blocks == 4 and bm.num_free_blocks == 2
    bm.check_integrity(tables(a, b))
    # Back on the device, the table grows as usual.
    assert bm.allocate(a, 7) and len(a.block_table) == 4


def test_swap_out_needs_room_for_the_whole_table() -> None:
    bm = BlockManager(6, 1, num_swap_blocks=2)
    a = make_seq(0)
    bm.allocate(a, 3)
    before = list(a.block_table)
    assert not bm.can_swap_out(a)
    with pytest.raises(RuntimeError):
        bm.swap_out(a)
    assert a.block_table == before and bm.num_free_swap_blocks == 2
    bm.check_integrity(tables(a))


def test_without_swap_space_nothing_can_be_swapped_out() -> None:
    bm = BlockManager(4, 2)
    a, empty = make_seq(0), make_seq(1)
    bm.allocate(a, 1)
    assert bm.num_swap_blocks == 0 and bm.num_free_swap_blocks == 0
    assert not bm.can_swap_out(a)
    assert bm.can_swap_out(empty)  # an empty table fits anywhere (and copies nothing)
    assert bm.swap_out(empty) == []


def test_free_swapped_returns_the_swap_blocks() -> None:
    bm = BlockManager(4, 2, num_swap_blocks=3)
    a = make_seq(0)
    bm.allocate(a, 6)
    bm.swap_out(a)
    assert bm.num_free_swap_blocks == 0
    bm.free_swapped(a)
    assert a.block_table == [] and bm.num_free_swap_blocks == 3 and bm.num_free_blocks == 4
    bm.check_integrity(tables(a), tables(a))


def _one_swapped() -> tuple[BlockManager, Sequence, Sequence]:
    bm = BlockManager(6, 2, num_swap_blocks=4)
    a, b = make_seq(0), make_seq(1)
    bm.allocate(a, 4)
    bm.allocate(b, 2)
    bm.swap_out(a)
    bm.check_integrity(tables(b), tables(a))
    return bm, a, b


def test_integrity_catches_a_swap_block_held_twice() -> None:
    bm, a, b = _one_swapped()
    c = make_seq(2)
    c.block_table = [a.block_table[0]]
    with pytest.raises(AssertionError, match="swap block is held twice"):
        bm.check_integrity(tables(b), tables(a, c))


def test_integrity_catches_a_held_swap_block_that_is_also_free() -> None:
    bm, a, b = _one_swapped()
    bm._swap_free.append(a.block_table[0])
    with pytest.raises(AssertionError, match="also free"):
        bm.check_integrity(tables(b), tables(a))


def test_integrity_catches_a_leaked_swap_block() -> None:
    bm, a, b = _one_swapped()
    a.block_table.pop()  # dropped without free_swapped
    with pytest.raises(AssertionError, match="swap blocks leaked"):
        bm.check_integrity(tables(b), tables(a))


def test_integrity_catches_a_swapped_table_passed_as_a_device_table() -> None:
    bm, a, b = _one_swapped()
    with pytest.raises(AssertionError):
        bm.check_integrity(tables(a, b), [])


# -- check_integrity must catch injected corruption ----------------------------------------
def _two_seqs() -> tuple[BlockManager, Sequence, Sequence]:
    bm = BlockManager(6, 2)
    a, b = make_seq(0), make_seq(1)
    bm.allocate(a, 4)
    bm.allocate(b, 2)
    bm.check_integrity(tables(a, b))
    return bm, a, b


def test_integrity_catches_block_held_twice_without_share() -> None:
    bm, a, b = _two_seqs()
    b.block_table.append(a.block_table[0])
    with pytest.raises(AssertionError, match="ref count 1 but held by 2"):
        bm.check_integrity(tables(a, b))


def test_integrity_catches_table_holding_a_free_block() -> None:
    bm, a, b = _two_seqs()
    free_block = next(i for i in range(bm.num_blocks) if bm.ref_count(i) == 0)
    b.block_table.append(free_block)
    with pytest.raises(AssertionError, match="ref count 0 but held by 1"):
        bm.check_integrity(tables(a, b))


def test_integrity_catches_leaked_block() -> None:
    bm, a, b = _two_seqs()
    b.block_table = []  # dropped without free: the block is used but nobody holds it
    with pytest.raises(AssertionError, match="ref count 1 but held by 0"):
        bm.check_integrity(tables(a, b))


def test_integrity_catches_out_of_range_block() -> None:
    bm, a, b = _two_seqs()
    b.block_table.append(bm.num_blocks)
    with pytest.raises(AssertionError, match="out of range"):
        bm.check_integrity(tables(a, b))


def test_integrity_catches_used_block_in_free_pool() -> None:
    bm, a, b = _two_seqs()
    bm._free[a.block_table[0]] = None
    with pytest.raises(AssertionError, match="disagrees with free pool"):
        bm.check_integrity(tables(a, b))


def test_integrity_catches_wrong_ref_count() -> None:
    bm, a, b = _two_seqs()
    bm._ref_counts[a.block_table[0]] += 1
    with pytest.raises(AssertionError, match="ref count 2 but held by 1"):
        bm.check_integrity(tables(a, b))


def test_integrity_catches_block_missing_from_free_pool() -> None:
    bm, a, b = _two_seqs()
    bm._free.popitem(last=False)
    with pytest.raises(AssertionError, match="disagrees with free pool"):
        bm.check_integrity(tables(a, b))


# -- stateful: random allocate / free / share against a model ------------------------------
NUM_SEQS = 5


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives one manager with random operations; a model says what each table must hold."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(1, 1)  # replaced by `create` before any rule runs
        self.seqs = [make_seq(i) for i in range(NUM_SEQS)]
        self.swapped: set[int] = set()  # indices of sequences whose tables name swap blocks

    def device_seqs(self) -> list[Sequence]:
        return [s for i, s in enumerate(self.seqs) if i not in self.swapped]

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4, 16]),
        num_swap_blocks=st.integers(0, 12),
    )
    def create(self, num_blocks: int, block_size: int, num_swap_blocks: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, num_swap_blocks)

    @rule(i=st.integers(0, NUM_SEQS - 1), num_tokens=st.integers(0, 80))
    def allocate(self, i: int, num_tokens: int) -> None:
        if i in self.swapped:
            return
        seq = self.seqs[i]
        before_table, before_free = list(seq.block_table), self.bm.num_free_blocks
        need = max(0, -(-num_tokens // self.bm.block_size) - len(before_table))
        assert self.bm.num_new_blocks_needed(seq, num_tokens) == need
        assert self.bm.can_allocate(need) == (need <= before_free)
        ok = self.bm.allocate(seq, num_tokens)
        assert ok == (need <= before_free)
        if ok:
            assert seq.block_table[: len(before_table)] == before_table
            assert len(seq.block_table) == len(before_table) + need
            assert self.bm.num_free_blocks == before_free - need
            assert len(seq.block_table) * self.bm.block_size >= num_tokens
        else:
            assert seq.block_table == before_table
            assert self.bm.num_free_blocks == before_free

    @rule(i=st.integers(0, NUM_SEQS - 1))
    def free(self, i: int) -> None:
        if i in self.swapped:
            return
        seq = self.seqs[i]
        # Blocks no other table holds must come back; shared ones must stay used.
        others = Counter(b for s in self.device_seqs() if s is not seq for b in s.block_table)
        returned = {b for b in seq.block_table if others[b] == 0}
        before_free = self.bm.num_free_blocks
        self.bm.free(seq)
        assert seq.block_table == []
        assert self.bm.num_free_blocks == before_free + len(returned)
        assert all(self.bm.ref_count(b) == 0 for b in returned)

    @rule(src=st.integers(0, NUM_SEQS - 1), dst=st.integers(0, NUM_SEQS - 1), k=st.integers(0, 15))
    def share(self, src: int, dst: int, k: int) -> None:
        source, target = self.seqs[src], self.seqs[dst]
        if src == dst or not source.block_table or {src, dst} & self.swapped:
            return
        block = source.block_table[k % len(source.block_table)]
        if block in target.block_table:
            return
        before = self.bm.ref_count(block)
        self.bm.share(block)
        target.block_table.append(block)
        assert self.bm.ref_count(block) == before + 1

    @rule(block=st.integers(0, 11))
    def share_free_block_raises(self, block: int) -> None:
        if block >= self.bm.num_blocks or self.bm.ref_count(block) > 0:
            return
        with pytest.raises(ValueError):
            self.bm.share(block)
        assert self.bm.ref_count(block) == 0

    @rule(i=st.integers(0, NUM_SEQS - 1))
    def swap_out(self, i: int) -> None:
        seq = self.seqs[i]
        if i in self.swapped:
            return
        table, free, free_swap = list(seq.block_table), self.bm.num_free_blocks, self.bm.num_free_swap_blocks
        others = Counter(b for s in self.device_seqs() if s is not seq for b in s.block_table)
        if len(table) > free_swap:
            assert not self.bm.can_swap_out(seq)
            with pytest.raises(RuntimeError):
                self.bm.swap_out(seq)
            assert seq.block_table == table
            return
        assert self.bm.can_swap_out(seq)
        pairs = self.bm.swap_out(seq)
        self.swapped.add(i)
        assert [d for d, _ in pairs] == table and seq.block_table == [s for _, s in pairs]
        assert self.bm.num_free_swap_blocks == free_swap - len(table)
        # A device block returns to the pool unless another table still shares it.
        assert self.bm.num_free_blocks == free + sum(1 for b in table if others[b] == 0)

    @rule(i=st.integers(0, NUM_SEQS - 1), extra=st.integers(0, 3))
    def swap_in(self, i: int, extra: int) -> None:
        seq = self.seqs[i]
        if i not in self.swapped:
            return
        table, free, free_swap = list(seq.block_table), self.bm.num_free_blocks, self.bm.num_free_swap_blocks
        assert self.bm.can_swap_in(seq, extra) == (len(table) + extra <= free)
        if len(table) > free:
            with pytest.raises(RuntimeError):
                self.bm.swap_in(seq)
            assert seq.block_table == table
            return
        pairs = self.bm.swap_in(seq)
        self.swapped.discard(i)
        assert [s for s, _ in pairs] == table and seq.block_table == [d for _, d in pairs]
        assert self.bm.num_free_blocks == free - len(table)
        assert self.bm.num_free_swap_blocks == free_swap + len(table)
        assert all(self.bm.ref_count(b) == 1 for b in seq.block_table)

    @rule(i=st.integers(0, NUM_SEQS - 1))
    def free_swapped(self, i: int) -> None:
        seq = self.seqs[i]
        if i not in self.swapped:
            return
        n, free_swap = len(seq.block_table), self.bm.num_free_swap_blocks
        self.bm.free_swapped(seq)
        self.swapped.discard(i)
        assert seq.block_table == [] and self.bm.num_free_swap_blocks == free_swap + n

    @invariant()
    def consistent(self) -> None:
        on_device = self.device_seqs()
        swapped = [self.seqs[i] for i in self.swapped]
        self.bm.check_integrity(tables(*on_device), tables(*swapped))
        assert len({b for s in swapped for b in s.block_table}) + self.bm.num_free_swap_blocks == self.bm.num_swap_blocks
        held = Counter(b for s in on_device for b in s.block_table)
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.bm.num_blocks
        assert self.bm.num_used_blocks == len(held)
        for block in range(self.bm.num_blocks):
            assert self.bm.ref_count(block) == held[block]
        for seq in self.seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), "a table holds a block twice"


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
