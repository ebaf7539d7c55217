"""Prefix caching in the block manager: hits name blocks that hold exactly the prefix asked for.

The stateful test drives one manager with admissions (look up, take the hits, allocate and
"write" the rest), frees, memory pressure and resets, against a model that knows what every
block holds (the token prefix whose K/V its last writer computed) and which prefixes are
registered. A hit must hold the same tokens as the sequence that takes it, and be the longest
registered prefix; `check_integrity` must hold after every operation.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from conveyor.core.block_manager import DISK_HIT, BlockManager, chain_hashes
from conveyor.core.disk_tier import DiskTier
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import PLACEHOLDER, Sequence

SHARED = [5, 3, 8, 1, 9, 2, 7, 4, 6, 0, 5, 5, 3, 1, 2, 8, 9, 9, 4, 1]  # a "system prompt"


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(), arrival_time=0.0)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler does for a waiting sequence that fits: hits, then the rest; then the
    runner writes the rest and the scheduler registers the full blocks."""
    hits = bm.match_prefix(seq)
    bm.acquire(seq, hits)
    assert bm.allocate(seq, seq.num_tokens)
    bm.cache_blocks(seq, seq.block_table, len(hits), seq.num_tokens // bm.block_size)
    return hits


# -- unit tests ----------------------------------------------------------------------------
def test_chained_hashes_name_the_whole_prefix() -> None:
    a = chain_hashes([1, 2, 3, 4], 2, [], 2)
    b = chain_hashes([9, 9, 3, 4], 2, [], 2)
    assert a[1] != b[1], "equal blocks after different prefixes must not share a hash"
    assert chain_hashes([1, 2, 3, 4, 5, 6], 2, list(a), 3)[:2] == a


def test_a_second_sequence_takes_the_first_ones_full_blocks() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = seq_of(0, SHARED[:10])
    assert admit(bm, a) == []
    b = seq_of(1, [*SHARED[:9], 0, 0])
    hits = admit(bm, b)
    assert hits == a.block_table[:2]  # two full blocks of 4 in common; the third differs
    assert all(bm.ref_count(x) == 2 for x in hits)
    assert bm.num_queried_tokens == 21 and bm.num_hit_tokens == 8
    bm.check_integrity([a.block_table, b.block_table])


def test_a_hit_leaves_the_last_token_to_compute() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    admit(bm, seq_of(0, SHARED[:8]))
    assert len(bm.match_prefix(seq_of(1, SHARED[:8]))) == 1  # not 2: the 8th token must run
    assert len(bm.match_prefix(seq_of(2, SHARED[:9]))) == 2


def test_placeholders_are_not_hashed() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    admit(bm, seq_of(0, SHARED[:12]))
    seq = seq_of(1, SHARED[:7])
    seq.token_ids += [PLACEHOLDER, PLACEHOLDER]  # two sampled tokens not back yet
    seq.num_pending = 2
    assert len(bm.match_prefix(seq)) == 1


def test_freed_blocks_stay_cached_until_handed_out_again() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = seq_of(0, SHARED[:9])
    admit(bm, a)
    first_two = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = seq_of(1, SHARED[:9])
    assert bm.num_evictable(bm.match_prefix(b)) == 2
    assert admit(bm, b) == first_two
    bm.free(b)
    # Memory pressure: a sequence of 4 new blocks evicts every cached one.
    c = seq_of(2, [0] * 16)
    assert admit(bm, c) == []
    assert set(first_two) <= set(c.block_table)
    bm.free(c)
    assert bm.match_prefix(seq_of(3, SHARED[:9])) == []


def test_least_recently_freed_blocks_are_evicted_first() -> None:
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    old, new = seq_of(0, [1, 1, 1, 1, 1]), seq_of(1, [2, 2, 2, 2, 2])
    admit(bm, old)
    admit(bm, new)
    bm.free(old)
    bm.free(new)
    filler = seq_of(2, [3, 3, 3])
    assert bm.allocate(filler, 4)  # two blocks from the front of the pool: never `new`'s
    assert len(bm.match_prefix(seq_of(3, [2, 2, 2, 2, 2]))) == 2


def test_off_means_no_hits_and_no_cache() -> None:
    bm = BlockManager(8, 4)
    admit(bm, seq_of(0, SHARED[:12]))
    assert bm.match_prefix(seq_of(1, SHARED[:12])) == [] and bm.num_cached_blocks == 0


def test_reset_forgets_every_prefix_and_keeps_blocks_in_use() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = seq_of(0, SHARED[:12])
    admit(bm, a)
    assert bm.reset_prefix_cache() == 3
    assert bm.match_prefix(seq_of(1, SHARED[:12])) == []
    bm.check_integrity([a.block_table])


def test_a_cache_salt_shares_blocks_only_with_the_same_salt() -> None:
    """vLLM's cache_salt: the first block chains onto it, so a request with another salt, or
    none, finds nothing of these tokens; one with the same salt finds all of them."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)

    def salted(seq_id: int, salt: str | None) -> Sequence:
        return Sequence(seq_id, f"r{seq_id}", SHARED[:13], SamplingParams(cache_salt=salt), arrival_time=0.0)

    admit(bm, salted(0, "alice-secret"))
    assert bm.match_prefix(salted(1, "bob-secret")) == []
    assert bm.match_prefix(salted(2, None)) == []
    assert len(bm.match_prefix(salted(3, "alice-secret"))) == 3
    admit(bm, salted(4, None))
    assert len(bm.match_prefix(salted(5, None))) == 3 and bm.match_prefix(salted(6, "x")) == []


# -- KV offloading: the prefix cache's host tier -------------------------------------------
def test_an_evicted_block_is_stored_and_a_later_prompt_loads_it_back() -> None:
    bm = BlockManager(3, 4, num_swap_blocks=2, enable_prefix_caching=True, num_offload_blocks=4)
    a = seq_of(0, SHARED[:9])  # two full blocks and one token
    admit(bm, a)
    held = list(a.block_table)
    bm.free(a)
    assert bm.take_copies() == ([], [])
    # Three new blocks evict a's two cached ones: each is copied to the tier (blocks 2.. of
    # the host tensor, after the 2 swap blocks) before its new holder writes it.
    c = seq_of(1, [0] * 12)
    admit(bm, c)
    stores, loads = bm.take_copies()
    assert sorted(d for d, _ in stores) == sorted(held[:2]) and loads == []
    assert all(2 <= t < 6 for _, t in stores)
    assert bm.num_offloaded_blocks == 2 and bm.num_offload_stores == 2
    bm.check_integrity([c.block_table])
    bm.free(c)
    # The prefix is gone from the device and found in the tier: two hits, each a load into a
    # new device block, registered there at once (a third request hits the device).
    b = seq_of(2, SHARED[:9])
    hits = bm.match_prefix(b)
    assert [~h for h in hits] == [t for _, t in sorted(stores, key=lambda p: held.index(p[0]))]
    assert bm.admission_need(b, hits, 9) == 3  # two to load into, one for the rest
    admit(bm, b)
    stores, loads = bm.take_copies()
    assert [(t, d) for t, d in loads] == [(~hits[0], b.block_table[0]), (~hits[1], b.block_table[1])]
    assert bm.num_hit_tokens == 8 and bm.num_offload_hit_tokens == 8
    assert bm.match_prefix(seq_of(3, SHARED[:9])) == b.block_table[:2]
    bm.check_integrity([b.block_table])


def test_the_tier_evicts_its_least_recently_used_block() -> None:
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_offload_blocks=2)
    for i, t in enumerate([[1, 1, 1], [2, 2, 2], [3, 3, 3]]):
        s = seq_of(i, t)
        admit(bm, s)
        bm.free(s)
        bm.take_copies()
    # [1, 1]'s block went to the tier first, then [2, 2]'s: the tier is full.
    assert bm.num_offloaded_blocks == 2
    touched = seq_of(10, [1, 1, 1])
    assert bm.match_prefix(touched)[0] < 0
    admit(bm, touched)  # loads [1, 1] back (the tier keeps it, now most recently used) ...
    bm.free(touched)
    bm.take_copies()
    filler = seq_of(11, [4, 4, 4, 4])
    admit(bm, filler)  # ... and evicts [3, 3] and [1, 1] from the device: [2, 2] leaves the tier
    bm.take_copies()
    assert bm.match_prefix(seq_of(12, [2, 2, 2])) == []
    assert bm.match_prefix(seq_of(13, [1, 1, 1]))[0] < 0 and bm.match_prefix(seq_of(14, [3, 3, 3]))[0] < 0
    bm.check_integrity([filler.block_table])


def test_a_block_evicted_in_the_step_that_registers_it_is_not_stored() -> None:
    """Its K/V are written by the step being scheduled, after the step's copies: a store would
    copy what the block held before."""
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_offload_blocks=4)
    a = seq_of(0, [1, 1, 1])
    assert bm.allocate(a, 3)
    bm.cache_blocks(a, a.block_table, 0, 1, written=False)
    bm.free(a)
    filler = seq_of(1, [2, 2, 2, 2])
    assert bm.allocate(filler, 4)
    assert bm.take_copies() == ([], [])
    assert bm.num_offloaded_blocks == 0


def test_a_tier_block_a_step_copies_is_not_evicted_in_that_step() -> None:
    """A load reads its tier block after the step's stores: a store into it would replace the
    K/V it loads. With a tier of one block that the step loads from, an eviction is dropped."""
    bm = BlockManager(3, 2, enable_prefix_caching=True, num_offload_blocks=1)
    a = seq_of(0, [1, 1, 1])
    admit(bm, a)
    bm.free(a)
    admit(bm, filler := seq_of(1, [2] * 6))  # evicts [1, 1] to the tier
    bm.free(filler)
    bm.take_copies()
    b = seq_of(2, [1, 1, 1])
    hits = bm.match_prefix(b)
    assert hits[0] < 0
    admit(bm, b)  # its load takes a device block, evicting a cached [2, 2]: the tier is pinned
    stores, loads = bm.take_copies()
    assert stores == [] and loads == [(~hits[0], b.block_table[0])]
    bm.check_integrity([b.block_table])


def test_reset_empties_the_tier_too() -> None:
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_offload_blocks=2)
    a = seq_of(0, [1, 1, 1])
    admit(bm, a)
    bm.free(a)
    admit(bm, seq_of(1, [2, 2, 2, 2]))
    assert bm.num_offloaded_blocks == 1
    assert bm.reset_prefix_cache() == 3  # one block in the tier, the filler's two on the device
    assert bm.num_offloaded_blocks == 0 and bm.match_prefix(seq_of(2, [1, 1, 1])) == []


def test_write_through_stores_a_block_the_step_after_its_step() -> None:
    """write_through: a block registered by the step being scheduled is stored at the next
    schedule's end (its K/V written by then), so an eviction later copies nothing."""
    bm = BlockManager(4, 2, enable_prefix_caching=True, num_offload_blocks=4, offloading_policy="write_through")
    a = seq_of(0, [1, 1, 2, 2, 3])
    hits = bm.match_prefix(a)
    bm.acquire(a, hits)
    assert bm.allocate(a, 5)
    bm.cache_blocks(a, a.block_table, 0, 2, written=False)
    assert bm.take_copies() == ([], [])  # not written yet
    stores, _ = bm.take_copies()  # the next schedule's end
    assert [d for d, _ in stores] == a.block_table[:2] and bm.num_offloaded_blocks == 2
    bm.free(a)
    filler = seq_of(1, [7] * 8)
    assert bm.allocate(filler, 8)  # evicts both: the tier holds them already
    assert bm.take_copies() == ([], [])
    assert [h < 0 for h in bm.match_prefix(seq_of(2, [1, 1, 2, 2, 3]))] == [True, True]
    bm.check_integrity([filler.block_table])


def test_write_through_selective_stores_only_a_reused_block() -> None:
    """write_through_selective: a block is stored once a later request hits it on the device
    (SGLang's second use); one no one reused is dropped when evicted."""
    bm = BlockManager(4, 2, enable_prefix_caching=True, num_offload_blocks=4,
                      offloading_policy="write_through_selective")
    a = seq_of(0, [1, 1, 2, 2, 3])
    admit(bm, a)
    bm.free(a)
    assert bm.take_copies() == ([], [])
    b = seq_of(1, [1, 1, 5, 5, 5])  # hits [1, 1] on the device: a second use
    admit(bm, b)
    stores, _ = bm.take_copies()
    assert [d for d, _ in stores] == [b.block_table[0]]
    bm.free(b)
    filler = seq_of(2, [7] * 8)
    assert bm.allocate(filler, 8)  # evicts [1, 1] (stored), [2, 2] and [5, 5] (dropped)
    assert bm.take_copies() == ([], [])
    assert bm.num_offloaded_blocks == 1
    assert [h < 0 for h in bm.match_prefix(seq_of(3, [1, 1, 2, 2, 3]))] == [True]


def test_a_disk_tier_takes_every_tier_store_and_gives_it_back(tmp_path) -> None:
    """A block stored into the host tier is written to disk; when the host tier has evicted it
    too, a lookup finds it on disk: a read into a host tier block, then a load from it."""
    disk = DiskTier(str(tmp_path), "layout", 8, 16)
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_offload_blocks=1, disk=disk)
    a = seq_of(0, [1, 1, 1])
    admit(bm, a)
    bm.free(a)
    admit(bm, filler := seq_of(1, [2, 2, 2, 2]))  # evicts [1, 1] to the tier: written to disk
    (_, tier), = bm.take_copies()[0]
    writes, reads = bm.take_disk_copies()
    assert writes == [(tier, a.block_hashes[0])] and reads == []
    disk.write(a.block_hashes[0], memoryview(bytes(16)))
    bm.free(filler)
    admit(bm, filler2 := seq_of(2, [3, 3, 3, 3]))  # evicts [2, 2] to the tier: [1, 1] leaves it
    bm.take_copies()
    disk.write(bm.take_disk_copies()[0][0][1], memoryview(bytes(16)))
    bm.free(filler2)
    b = seq_of(3, [1, 1, 1])
    hits = bm.match_prefix(b)
    assert hits == [DISK_HIT] and bm.admission_need(b, hits, 3) == 2
    admit(bm, b)
    _, loads = bm.take_copies()
    _, reads = bm.take_disk_copies()
    assert reads == [(b.block_hashes[0], loads[0][0])] and loads[0][1] == b.block_table[0]
    buf = bytearray(16)
    disk.take_read(b.block_hashes[0], memoryview(buf))
    assert bm.num_disk_hit_tokens == 2 and bm.num_offload_hit_tokens == 2
    bm.check_integrity([b.block_table])


def test_the_disk_tier_outlives_its_engine_and_is_shared(tmp_path) -> None:
    """Files are named by the prefix hash (the same in every process): a new tier over the
    directory finds them, least recently used beyond its size deleted; another engine deleting
    a file a lookup found leaves the open file readable."""
    first = DiskTier(str(tmp_path), "layout", 4, 16)
    hashes = chain_hashes(list(range(12)), 2, [], 6)
    for i, h in enumerate(hashes):
        assert first.write_scheduled(h)
        first.write(h, memoryview(bytes([i]) * 16))
        first.end_step()
    assert len(first) == 4  # the two oldest deleted
    again = DiskTier(str(tmp_path), "layout", 3, 16)  # a restart with a smaller tier
    assert len(again) == 3 and not again.find(hashes[2]) and again.find(hashes[5])
    other = DiskTier(str(tmp_path), "layout", 3, 16)
    assert other.find(hashes[4])
    again.clear()  # deletes every file it knows of, the one `other` found included
    other.read_scheduled(hashes[4])
    buf = bytearray(16)
    other.take_read(hashes[4], memoryview(buf))
    assert buf == bytes([4]) * 16
    assert not DiskTier(str(tmp_path), "layout", 3, 16).find(hashes[4])
    assert not DiskTier(str(tmp_path), "other-layout", 3, 16).find(hashes[5])


def test_a_failed_disk_write_loses_only_that_block(tmp_path, caplog) -> None:
    """A full disk or a directory gone: the write is logged and the block forgotten (a later
    lookup misses it), nothing raised, the next writes go on."""
    disk = DiskTier(str(tmp_path), "layout", 8, 16)
    h1, h2 = chain_hashes([1, 1, 2, 2], 2, [], 2)
    assert disk.write_scheduled(h1)
    real = disk.dir
    disk.dir = str(tmp_path / "gone" / "away")  # (so the write cannot open its file)
    disk.write(h1, memoryview(bytes(16)))
    disk.dir = real
    assert disk.num_write_errors == 1 and "write failed" in caplog.text
    assert len(disk) == 0 and not disk.find(h1)
    assert disk.write_scheduled(h2)
    disk.write(h2, memoryview(bytes(16)))
    assert disk.find(h2)


def test_a_disk_hit_needs_a_free_or_unpinned_tier_block(tmp_path) -> None:
    """A disk hit is read into a host tier block: a chain stops where the tier has none left
    that this step's copies do not use."""
    disk = DiskTier(str(tmp_path), "layout", 8, 16)
    bm = BlockManager(8, 2, enable_prefix_caching=True, num_offload_blocks=1, disk=disk)
    tokens = [1, 1, 2, 2, 3]
    for h in chain_hashes(tokens, 2, [], 2):
        disk.write(h, memoryview(bytes(16)))
    assert bm.match_prefix(seq_of(0, tokens)) == [DISK_HIT]  # one tier block: one disk hit
    bm.take_copies()
    bm2 = BlockManager(8, 2, enable_prefix_caching=True, num_offload_blocks=2, disk=disk)
    assert bm2.match_prefix(seq_of(0, tokens)) == [DISK_HIT, DISK_HIT]


def test_tier_hits_after_a_disk_hit_leave_it_its_tier_block(tmp_path) -> None:
    """A chain on disk for its first block and in a full tier of two for the next two: the disk
    hit's read takes a tier block the later tier hits would pin, so the chain stops after one of
    them (the property test found the second taken too, and no tier block left for the read)."""
    disk = DiskTier(str(tmp_path), "layout", 8, 16)
    bm = BlockManager(8, 2, enable_prefix_caching=True, num_offload_blocks=2, disk=disk)
    tokens = [1, 1, 2, 2, 3, 3, 4]
    h1, h2, h3 = chain_hashes(tokens, 2, [], 3)
    disk.write(h1, memoryview(bytes(16)))
    for tier, h in enumerate((h2, h3)):
        bm._host_free.remove(tier)
        bm._host_cached[h], bm._host_lru[tier] = tier, h
    seq = seq_of(0, tokens)
    hits = bm.match_prefix(seq)
    assert hits == [DISK_HIT, ~0]
    admit(bm, seq)  # the read evicts h3's tier block, the one no hit pins
    _, loads = bm.take_copies()
    _, reads = bm.take_disk_copies()
    assert reads == [(h1, 1)] and [t for t, _ in loads] == [1, 0]
    bm.check_integrity([seq.block_table])


def test_lfu_keeps_a_prefix_many_requests_hit_over_newer_one_offs() -> None:
    """eviction_policy="lfu": the cached block hit the most outlives blocks freed after it,
    which LRU would keep instead; blocks with no hash go first either way."""
    for policy, kept in [("lru", False), ("lfu", True)]:
        bm = BlockManager(4, 2, enable_prefix_caching=True, eviction_policy=policy)
        hot = seq_of(0, [1, 1, 9])
        admit(bm, hot)
        bm.free(hot)
        for i in range(3):  # three requests hit [1, 1]
            again = seq_of(1 + i, [1, 1, 5 + i])
            assert admit(bm, again)
            bm.free(again)
        cold = seq_of(9, [7, 7, 8, 8, 3])  # two one-off blocks, freed after the hot one
        admit(bm, cold)
        bm.free(cold)
        # The pool: [1, 1] (hit three times), then the cold prompt's last (plain), [8, 8], [7, 7].
        filler = seq_of(10, [4] * 5)  # takes 3: LRU the first three, LFU the plain one and the cold two
        assert bm.allocate(filler, 5)
        assert (bm.match_prefix(seq_of(11, [1, 1, 0])) != []) is kept
        assert (bm.match_prefix(seq_of(12, [7, 7, 8, 8, 0])) == []) is kept
        bm.check_integrity([filler.block_table])


def test_lfu_in_the_tier_keeps_the_block_loaded_most() -> None:
    """eviction_policy="lfu" covers the offloading tier too (SGLang's one policy for both): a
    full tier gives up the block loaded the fewest times, where LRU gives up the least recent."""
    for policy, kept in [("lru", False), ("lfu", True)]:
        bm = BlockManager(2, 2, enable_prefix_caching=True, num_offload_blocks=2, eviction_policy=policy)

        def evict_all(i: int, bm: BlockManager = bm) -> None:  # plain (unregistered) blocks take the device
            filler = seq_of(100 + i, [0] * 4)
            assert bm.allocate(filler, 4)
            bm.free(filler)
            bm.take_copies()

        for i in range(3):  # [1, 1] stored, then loaded back twice (and stored again: already there)
            hot = seq_of(i, [1, 1, 1])
            admit(bm, hot)
            bm.free(hot)
            evict_all(i)
        cold = seq_of(10, [3, 3, 3])  # stored after: the most recently used, never loaded
        admit(bm, cold)
        bm.free(cold)
        evict_all(10)
        other = seq_of(11, [5, 5, 5])  # its store needs a tier block
        admit(bm, other)
        bm.free(other)
        evict_all(11)
        assert (bm.match_prefix(seq_of(12, [1, 1, 1])) != []) is kept
        assert (bm.match_prefix(seq_of(13, [3, 3, 3])) == []) is kept
        bm.check_integrity([])


def test_integrity_catches_a_cache_entry_that_names_the_wrong_block() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = seq_of(0, SHARED[:12])
    admit(bm, a)
    h = next(iter(bm._cached))
    bm._cached[h] = (bm._cached[h] + 1) % 8
    try:
        bm.check_integrity([a.block_table])
    except AssertionError as e:
        assert "another hash" in str(e)
    else:
        raise AssertionError("a wrong cache entry went unnoticed")


# -- stateful: random admissions against a model of what each block holds ------------------
NUM_SEQS = 4


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(1, 1, enable_prefix_caching=True)
        self.live: dict[int, Sequence] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # block -> the prefix its K/V belong to
        self.registered: dict[tuple[int, ...], int] = {}  # the model of the prefix cache
        self.next_id = 0

    @initialize(num_blocks=st.integers(2, 16), block_size=st.sampled_from([1, 2, 4]))
    def create(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)

    def expected_hits(self, tokens: list[int]) -> list[int]:
        bs, hits = self.bm.block_size, []
        for j in range((len(tokens) - 1) // bs):
            block = self.registered.get(tuple(tokens[: (j + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits

    @rule(
        shared=st.integers(0, len(SHARED)),
        tail=st.lists(st.integers(0, 3), max_size=6),
    )
    def admit(self, shared: int, tail: list[int]) -> None:
        tokens = SHARED[:shared] + tail
        if not tokens or len(self.live) >= NUM_SEQS:
            return
        bm, bs = self.bm, self.bm.block_size
        seq = seq_of(self.next_id, tokens)
        self.next_id += 1
        hits = bm.match_prefix(seq)
        assert hits == self.expected_hits(tokens)
        for j, block in enumerate(hits):
            assert self.content[block] == tuple(tokens[: (j + 1) * bs]), "a hit holds another prefix"
        need = -(-len(tokens) // bs) - len(hits) + bm.num_evictable(hits)
        free = bm.num_free_blocks
        if need > free:
            return
        bm.acquire(seq, hits)
        assert bm.allocate(seq, len(tokens))
        assert bm.num_free_blocks == free - need
        for j in range(len(hits), len(seq.block_table)):
            block = seq.block_table[j]
            stale = [k for k, b in self.registered.items() if b == block]
            for k in stale:  # handed out again: evicted
                del self.registered[k]
            self.content[block] = tuple(tokens[: (j + 1) * bs])
        end = len(tokens) // bs
        bm.cache_blocks(seq, seq.block_table, len(hits), end)
        for j in range(len(hits), end):
            key = tuple(tokens[: (j + 1) * bs])
            block = seq.block_table[j]
            if key not in self.registered and block not in self.registered.values():
                self.registered[key] = block
        self.live[seq.seq_id] = seq

    @rule(k=st.integers(0, NUM_SEQS - 1))
    def free(self, k: int) -> None:
        if not self.live:
            return
        seq = self.live.pop(sorted(self.live)[k % len(self.live)])
        self.bm.free(seq)
        assert seq.block_table == []

    @rule()
    def reset(self) -> None:
        self.bm.reset_prefix_cache()
        self.registered.clear()

    @invariant()
    def integrity(self) -> None:
        self.bm.check_integrity([s.block_table for s in self.live.values()])
        assert self.bm.num_cached_blocks == len(self.registered)


PrefixCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestPrefixCache = PrefixCacheMachine.TestCase


# -- in the scheduler: when a block becomes a hit -------------------------------------------
def test_a_burst_computes_a_new_prefix_once() -> None:
    """Requests admitted in the same step as the one that writes their shared prefix hit it:
    a prefill chunk's full blocks are registered when it is scheduled (every layer writes the
    step's K/V before any attention reads them)."""
    from tests.core.helpers import Driver, ids

    d = Driver(32, 4, prefix_caching=True, max_num_seqs=8, max_num_batched_tokens=64)
    tails = [[40 + i, 50 + i, 60 + i] for i in range(4)]
    seqs = [d.add(i, 0, 3, prompt=[*SHARED[:12], *tail]) for i, tail in enumerate(tails)]
    out = d.step()
    assert ids(out) == [0, 1, 2, 3]
    assert [item.start_pos for item in out.scheduled] == [0, 12, 12, 12]
    assert [s.metrics.num_cached_tokens for s in seqs] == [0, 12, 12, 12]
    assert out.num_tokens == 15 + 3 * 3
    d.run()
    d.check_outputs()


def test_a_chunked_prefix_is_shared_as_far_as_it_was_scheduled() -> None:
    """A later request hits the blocks of the chunks scheduled so far, this step's included."""
    from tests.core.helpers import Driver

    d = Driver(
        32, 4, prefix_caching=True, max_num_seqs=8, max_num_batched_tokens=12, long_prefill_token_threshold=8
    )
    d.add(0, 0, 2, prompt=SHARED[:18])
    d.step()  # tokens 0..7 of seq 0: blocks 0 and 1
    late = d.add(1, 0, 2, prompt=[*SHARED[:18], 7])
    out = d.step()  # seq 0's tokens 8..15 (blocks 2, 3) first, then seq 1 hits blocks 0..3
    assert late.metrics.num_cached_tokens == 16
    assert [(item.seq_id, item.start_pos) for item in out.scheduled] == [(0, 8), (1, 16)]
    d.run()
    d.check_outputs()


def test_a_block_a_decode_fills_is_a_hit_only_after_its_step() -> None:
    """A step of decodes only may run in one fused kernel that writes and reads K/V per
    sequence: a block completed by a decode is registered after the step, not before."""
    from tests.core.helpers import Driver, ids

    d = Driver(32, 4, prefix_caching=True, max_num_seqs=8, max_num_batched_tokens=64)
    a = d.add(0, 0, 4, prompt=SHARED[:3])
    d.step()  # a's prompt; samples its 4th token
    turn = d.add(1, 0, 2, prompt=[*a.token_ids, 9])  # a's tokens so far, then one more
    out = d.step()  # a's decode fills block 0; the newcomer cannot take it yet
    assert ids(out) == [0, 1] and turn.metrics.num_cached_tokens == 0
    again = d.add(2, 0, 2, prompt=[*a.token_ids[:4], 9])
    d.step()
    assert again.metrics.num_cached_tokens == 4
    d.run()
    d.check_outputs()
