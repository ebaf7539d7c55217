"""The hybrid KV cache's block manager (`HybridLayout`): a table a layer group, sliding blocks
released as the window moves on, swaps and prefix hits over every group. The switchboard's
property test runs the same over random schedules (test_switchboard.py); these pin the
arithmetic down on small, known cases."""

from __future__ import annotations

import pytest

from conveyor.core.block_manager import BlockManager, HybridLayout
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import Sequence

GEMMA3 = [1024] * 5 + [0]  # five sliding layers to one global, as Gemma 3's pattern


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(), arrival_time=0.0)


def check(bm: BlockManager, *seqs: Sequence, swapped: tuple[Sequence, ...] = ()) -> None:
    bm.check_integrity((t for s in seqs for t in bm.tables_of(s)), (t for s in swapped for t in bm.tables_of(s)))


def step(bm: BlockManager, seq: Sequence, num_new: int) -> bool:
    """Allocate for `num_new` tokens from the computed ones, then count them computed (as the
    scheduler's `_emit` does)."""
    ok = bm.allocate(seq, seq.num_computed_tokens + num_new)
    if ok:
        seq.num_computed_tokens += num_new
    return ok


# -- the layout ----------------------------------------------------------------------------
def test_layout_groups_the_layers_by_kind() -> None:
    gemma3_4b = (GEMMA3 * 6)[:34]  # 34 layers: 5 global, 29 sliding
    layout = HybridLayout.of(gemma3_4b)
    assert (layout.window, layout.page_layers, layout.num_window_groups) == (1024, 5, 6)  # (one slot padded)
    placed = layout.groups_of(gemma3_4b)
    assert [p for p, w in zip(placed, gemma3_4b, strict=True) if not w] == [(0, i) for i in range(5)]
    sliding = [p for p, w in zip(placed, gemma3_4b, strict=True) if w]
    assert sliding[:6] == [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (2, 0)]
    assert len(set(sliding)) == 29 and max(g for g, _ in sliding) == 6
    gpt_oss = [128, 0] * 12
    assert HybridLayout.of(gpt_oss) == HybridLayout(128, 12, 1)


@pytest.mark.parametrize("windows", [[0, 0, 0], [512, 1024, 0]], ids=["global", "two-windows"])
def test_layout_needs_one_window(windows: list[int]) -> None:
    with pytest.raises(ValueError, match="within one sliding window"):
        HybridLayout.of(windows)


def test_a_model_whose_every_layer_slides_has_one_sliding_table() -> None:
    layout = HybridLayout.of([4096] * 32)  # Mistral-7B-v0.1
    assert layout == HybridLayout(4096, 32, 0, all_sliding=True) and layout.num_sliding_tables == 1
    assert layout.groups_of([4096] * 32) == [(0, i) for i in range(32)]
    assert layout.pages_for(32768, 16, 2048) == -(-(2048 + 4095) // 16) + 1  # a window and a chunk, whatever the length
    assert layout.capacity(400, 16, 2048) == 1 << 62
    assert layout.capacity(100, 16, 2048) == 1600  # less than a window and a chunk: what it holds
    assert layout.capacity(1000, 16, 1 << 62) == 16000  # whole prompts: every block at once


def test_capacity_is_the_longest_sequence_its_pages_hold() -> None:
    layout = HybridLayout(window=8, page_layers=1, num_window_groups=2)
    for pages in range(1, 80):
        for chunk in (1, 4, 16, 1 << 40):
            cap = layout.capacity(pages, 4, chunk)
            assert cap % 4 == 0
            assert cap == 0 or layout.pages_for(cap, 4, chunk) <= pages
            assert layout.pages_for(cap + 4, 4, chunk) > pages


# -- release -------------------------------------------------------------------------------
def test_a_decode_holds_its_window_and_every_global_block() -> None:
    layout = HybridLayout(window=6, page_layers=1, num_window_groups=2)
    bm = BlockManager(100, 4, layout=layout)
    seq = seq_of(0, list(range(10)))
    assert step(bm, seq, 10)
    assert seq.window_start == 0 and bm.num_used_blocks == 3 * 3  # 3 blocks a table: all read by the prompt
    for _ in range(30):  # decodes up to 40 tokens
        assert step(bm, seq, 1)
        check(bm, seq)
        # The next query (position 40) reads positions 35.. of each sliding table.
        assert all(b == bm.null_block for t in seq.window_tables for b in t[: seq.window_start])
    assert seq.num_computed_tokens == 40 and len(seq.block_table) == 10
    assert seq.window_start == (39 - 6 + 1) // 4 == 8  # blocks 0-7 hold positions 0-31, before 34
    assert bm.num_used_blocks == 10 + 2 * 2
    bm.free(seq)
    assert bm.num_free_blocks == 100 and not seq.window_tables and seq.window_start == 0
    check(bm)


def test_allocation_is_all_or_nothing_over_the_groups() -> None:
    bm = BlockManager(8, 4, layout=HybridLayout(window=100, page_layers=1, num_window_groups=3))
    seq = seq_of(0, list(range(12)))
    assert not step(bm, seq, 12)  # 3 blocks a table, 4 tables: 12 > 8
    assert bm.num_free_blocks == 8 and not seq.block_table and not seq.window_tables
    assert step(bm, seq, 8)
    assert bm.num_free_blocks == 0
    check(bm, seq)


def test_a_released_block_is_what_lets_a_sequence_grow() -> None:
    """Near the pool's limit a sequence still decodes: each block it enters in its sliding
    table is paid for by one it leaves. Six blocks of two tokens, a window of two: eight
    tokens fit (four global blocks, at most two sliding ones), where keeping the sliding
    table whole would stop at six."""
    bm = BlockManager(6, 2, layout=HybridLayout(window=2, page_layers=1, num_window_groups=1))
    seq = seq_of(0, [1, 2])
    assert step(bm, seq, 2)
    while step(bm, seq, 1):
        check(bm, seq)
        assert len(seq.window_tables[0]) - seq.window_start <= 2
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 4
    check(bm, seq)


# -- swap ----------------------------------------------------------------------------------
def test_swap_moves_the_live_blocks_and_keeps_the_null_ones() -> None:
    bm = BlockManager(40, 4, num_swap_blocks=40, layout=HybridLayout(window=5, page_layers=1, num_window_groups=2))
    seq = seq_of(0, list(range(20)))
    assert step(bm, seq, 20)
    assert step(bm, seq, 1)  # releases what position 20's window no longer reads
    held = bm.num_held(seq)
    assert seq.window_start == (20 - 5 + 1) // 4 == 4 and held == 6 + 2 * 2
    before = [list(t) for t in (seq.block_table, *seq.window_tables)]
    out = bm.swap_out(seq)
    assert len(out) == held and bm.num_free_blocks == 40 and bm.num_free_swap_blocks == 40 - held
    check(bm, swapped=(seq,))
    assert all(t[:4] == [bm.null_block] * 4 for t in seq.window_tables)
    back = bm.swap_in(seq)
    moved = dict(out)
    returned = dict(back)
    after = [seq.block_table, *seq.window_tables]
    for old, new in zip(before, after, strict=True):
        for b_old, b_new in zip(old, new, strict=True):
            # each live block came back through its own swap block; null stays null
            assert b_new == b_old == bm.null_block or returned[moved[b_old]] == b_new
    check(bm, seq)
    bm.free(seq)
    assert bm.num_free_blocks == 40 and bm.num_free_swap_blocks == 40


# -- prefix hits ---------------------------------------------------------------------------
def test_a_prefix_hit_takes_the_windows_blocks_of_every_group() -> None:
    layout = HybridLayout(window=6, page_layers=1, num_window_groups=2)
    bm = BlockManager(64, 4, enable_prefix_caching=True, layout=layout)
    prompt = list(range(100, 124))  # 6 blocks
    first = seq_of(0, [*prompt, 1])
    assert step(bm, first, 25)
    bm.cache_blocks(first, first.block_table, 0, 6)
    bm.free(first)  # blocks keep their hashes in the free pool
    second = seq_of(1, [*prompt, 2, 3])
    hits = bm.match_prefix(second)
    assert len(hits) == 6
    # a hit of 6 blocks computes from position 24, whose window starts at 19: block 4 on
    need = bm.admission_need(second, hits, 27)
    assert need == 3 * 1 + 6 + 2 * 2  # a new block a table, and the cached ones out of the free pool
    bm.acquire(second, hits)
    second.num_computed_tokens = 24
    assert second.window_start == 4
    assert all(t[:4] == [bm.null_block] * 4 and bm.null_block not in t[4:] for t in second.window_tables)
    assert step(bm, second, 3)
    check(bm, second)
    assert bm.num_used_blocks == need


def evict(bm: BlockManager, block: int) -> None:
    """Drop a free block's hash from the prefix cache, as `_take_free` does when it hands it out."""
    h = bm._block_hash[block]
    assert h is not None and bm.ref_count(block) == 0
    del bm._cached[h]
    bm._block_hash[block] = None


def test_a_hit_stops_before_a_window_block_the_cache_lost() -> None:
    """The search from the right: a sliding block missing at block i allows a hit of at most i
    blocks, whose own window must then be whole."""
    layout = HybridLayout(window=6, page_layers=1, num_window_groups=1)
    bm = BlockManager(64, 4, enable_prefix_caching=True, layout=layout)
    prompt = list(range(200, 232))  # 8 blocks
    first = seq_of(0, [*prompt, 1])
    assert step(bm, first, 33)
    bm.cache_blocks(first, first.block_table, 0, 8)
    lost = first.window_tables[0][6]  # block 6 of the sliding group
    bm.free(first)
    assert len(bm.match_prefix(seq_of(1, [*prompt, 2]))) == 8
    evict(bm, lost)
    hits = bm.match_prefix(seq_of(2, [*prompt, 2]))
    assert len(hits) == 6  # a hit of 7 or 8 blocks reads block 6; of 6, blocks 4-5
    check(bm)


def test_a_window_longer_than_the_hit_needs_every_block() -> None:
    layout = HybridLayout(window=1000, page_layers=2, num_window_groups=1)
    bm = BlockManager(64, 4, enable_prefix_caching=True, layout=layout)
    first = seq_of(0, list(range(17)))
    assert step(bm, first, 17)
    bm.cache_blocks(first, first.block_table, 0, 4)
    lost = first.window_tables[0][0]
    bm.free(first)
    evict(bm, lost)
    assert bm.match_prefix(seq_of(1, list(range(17)))) == []
    check(bm)


def test_when_every_layer_slides_the_block_table_itself_releases() -> None:
    """Mistral-7B-v0.1's kind: one table, which holds a window's blocks however long the
    sequence grows; a swap and a prefix hit skip its null entries, and a hit needs only the
    window's blocks (the chain of hashes may have gaps before it)."""
    layout = HybridLayout(window=6, page_layers=3, num_window_groups=0, all_sliding=True)
    bm = BlockManager(16, 4, num_swap_blocks=16, enable_prefix_caching=True, layout=layout)
    prompt = list(range(300, 340))  # 10 blocks
    seq = seq_of(0, prompt)
    for _ in range(10):  # chunks of 4
        assert step(bm, seq, 4)
        bm.cache_blocks(seq, seq.block_table, seq.num_computed_tokens // 4 - 1, seq.num_computed_tokens // 4)
        assert bm.num_held(seq) <= 3
        check(bm, seq)
    # (released when the last chunk, from position 36, was allocated: its window starts at 31)
    assert seq.block_table[:7] == [bm.null_block] * 7 and seq.window_start == 7
    out = bm.swap_out(seq)
    assert len(out) == bm.num_held(seq) == 3
    check(bm, swapped=(seq,))
    bm.swap_in(seq)
    check(bm, seq)
    bm.free(seq)
    other = seq_of(1, [*prompt, 7])
    hits = bm.match_prefix(other)  # 10 blocks: blocks 8 and 9 hold the window of position 40
    assert len(hits) == 10 and hits[:8] == [bm.null_block] * 8
    assert bm.admission_need(other, hits, 41) == 1 + 2  # a new block, and the two cached ones
    bm.acquire(other, hits)
    other.num_computed_tokens = 40
    assert other.window_start == 8 and step(bm, other, 1)
    check(bm, other)
