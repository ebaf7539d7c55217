"""Fixed-size KV blocks: a free pool, reference counts, per-sequence block tables and, when
enabled, a prefix cache of full blocks found by chained hashes.

Prefix caching (vLLM's automatic prefix caching, SGLang's radix cache at block granularity):
a full block is registered under a hash of its tokens chained with the hash of the block
before it, so equal hashes mean equal token prefixes. The scheduler registers a block once a
scheduled step writes its K/V before anyone can read them (see `Scheduler._emit`). A new (or recomputed)
sequence takes the cached blocks of its longest registered prefix into its table, shared by
reference count, and computes only what follows. A block keeps its hash when its last holder
frees it: it waits in the free pool, least recently freed first, and loses its hash only when
it is handed out again (evicted). A shared block is never written: a hit covers whole blocks
and leaves at least one token to compute, so writes start in a block of the sequence's own.

KV offloading (vLLM's CPU offloading, SGLang's hierarchical cache with its write-back policy):
with `num_offload_blocks`, a second tier of the prefix cache in host memory. A cached block
evicted from the device is copied there first (a store: a device-to-host copy the runner makes
before the block is reused) unless the tier holds its hash already; a lookup whose chain leaves
the device cache goes on in the tier, and each block found there is copied into a fresh device
block (a load: host to device, before the step's attention reads it) and counts as computed.
The tier evicts least recently used first. Its blocks are numbered after the swap blocks: the
runner keeps one host tensor for both; the copies travel in `SchedulerOutput.blocks_to_store`
and `blocks_to_load` (`take_copies` hands them over at the end of each schedule).
A block registered in this very step (its K/V not written yet) is dropped, not stored, if it is
evicted in the same step; a tier block that a copy of this step reads or writes is not
evicted in the same step (its load would read another block's K/V; two stores into one
block would race).

The write policy (SGLang's `--hicache-write-policy`) says when a block reaches the tier:
`write_back` (the default) when the device evicts it; `write_through` the step after a step
computes it (and at eviction if that comes first), so the tier holds a copy of every cached
block and an eviction costs no copy; `write_through_selective` once a later request hits it on
the device (SGLang's threshold of two uses), a block no one reused being dropped at eviction.
Under the host tier, a disk tier (`DiskTier`, conveyor/core/disk_tier.py) takes a copy of each
block stored into the host tier; a lookup goes on there where the host tier's chain stops, and a
block found is read into a host tier block (a read, before the loads) and loaded from it.

Invariants (checked by `check_integrity`, which tests call after every step):
- every block is either free (ref count 0, in the free pool exactly once) or used (ref count
  equal to the number of block tables that hold it);
- free + used == total;
- a sequence's block table covers at least its computed tokens and never more than it needs
  plus what the current step grants;
- the prefix cache maps each hash to one block and that block back to the same hash; so does
  the offloading tier, whose blocks are each either free or holding one hash.
No torch: this module plans memory, the runner owns the tensors.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Any

from conveyor.config import EVICTION_POLICIES, OFFLOADING_POLICIES
from conveyor.core.disk_tier import DiskTier
from conveyor.core.kv_events import (
    DEVICE,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_hash,
)
from conveyor.multimodal import ImageSpan, span_keys
from conveyor.sequence import Sequence


def chain_hashes(
    token_ids: list[int], block_size: int, hashes: list[bytes], num_blocks: int, salt: bytes = b"",
    images: tuple[ImageSpan, ...] = (),
) -> list[bytes]:
    """Extend `hashes` (those of the first blocks of `token_ids`) to `num_blocks` full blocks.

    Block i's hash is SHA-256 over block i-1's hash and block i's token ids, so it names the
    whole prefix up to the end of block i. A cryptographic hash, as vLLM's default: with a
    64-bit one, a crafted prompt could collide with another user's prefix and read its K/V.
    The first block chains onto `salt`: what else than the tokens makes the K/V (a LoRA adapter).
    """
    parent = hashes[-1] if hashes else salt
    for i in range(len(hashes), num_blocks):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        if images:  # the images whose tokens the block holds: equal image tokens, other pictures
            block += span_keys(images, block_size, i)
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


# `match_prefix`'s mark for a block found in the disk tier (`acquire` reads it into a host tier
# block, then loads it as a host tier hit); host tier hits are `~tier`, always above it.
DISK_HIT = ~(1 << 62)


def _salt(seq: Sequence) -> bytes:
    """What the first block's hash chains onto: the LoRA adapter and the request's cache_salt
    (vLLM's), so that other K/V or another tenant's never share a block with these tokens."""
    salt = b"" if seq.lora_request is None else seq.lora_request.hash_salt
    cache_salt = seq.sampling_params.cache_salt
    return salt if cache_salt is None else salt + b"\x00cache_salt:" + cache_salt.encode()


@dataclass(frozen=True)
class HybridLayout:
    """A hybrid KV cache (vLLM's hybrid KV cache manager; SGLang's SWA memory pool): a model
    whose layers attend either globally or within their last `window` positions (Gemma 2/3,
    gpt-oss) keeps a sliding layer's K/V only while some query can still read them.

    The layers are cut into groups of `page_layers` layers, one group of the global layers and
    `num_window_groups` of the sliding ones (the last padded): a block (a page) holds
    `block_size` tokens of K/V for `page_layers` layers, any group's, out of one pool. A
    sequence holds a table a group: its `block_table` (the global layers'), and
    `window_tables`, whose leading entries turn to `null_block` as their tokens fall out of
    the window (the block returns to the pool). With `page_layers` = the global layers' count,
    a long sequence holds about 1 / (1 + num_window_groups) of a uniform cache's memory.

    A model whose every layer slides (Mistral-7B-v0.1, Phi-3-mini's 2,047; `all_sliding`) has
    one group of all its layers, and its `block_table` is the sliding table (vLLM's
    sliding-window manager): a sequence holds a window's blocks whatever its length.
    """

    window: int
    page_layers: int
    num_window_groups: int
    all_sliding: bool = False

    @classmethod
    def of(cls, windows: Sequence_[int]) -> HybridLayout:
        """The layout for layers attending within `windows` (0: the whole context), or a
        ValueError saying why there is none."""
        sizes = {w for w in windows if w}
        num_global = sum(1 for w in windows if not w)
        if len(sizes) != 1:
            raise ValueError(
                "a hybrid KV cache needs a model whose layers attend within one sliding window, the "
                f"others globally (this one's windows: {sorted(set(windows))})"
            )
        if not num_global:
            return cls(sizes.pop(), len(windows), 0, True)
        num_window = len(windows) - num_global
        return cls(sizes.pop(), num_global, -(-num_window // num_global))

    @property
    def num_sliding_tables(self) -> int:
        """The tables a sequence holds that release blocks as the window moves on."""
        return self.num_window_groups + self.all_sliding

    def groups_of(self, windows: Sequence_[int]) -> list[tuple[int, int]]:
        """Each layer's (group, slot): group 0 the global layers', 1.. the sliding ones' in
        order; slot, which of a page's `page_layers` layer slices it reads and writes."""
        if self.all_sliding:
            return [(0, i) for i in range(len(windows))]
        out, seen = [], [0, 0]
        for w in windows:
            i = seen[bool(w)]
            seen[bool(w)] += 1
            out.append((1 + i // self.page_layers, i % self.page_layers) if w else (0, i))
        return out

    def pages_for(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most pages one sequence of `num_tokens` holds, computing at most `chunk`
        tokens a step: every block of its global layers, and of each sliding group the
        blocks of a step's queries' windows."""
        n = -(-num_tokens // block_size)
        whole = 0 if self.all_sliding else n
        return whole + self.num_sliding_tables * min(n, -(-(chunk + self.window - 1) // block_size) + 1)

    def capacity(self, num_pages: int, block_size: int, chunk: int) -> int:
        """The longest sequence (tokens, whole blocks) `num_pages` pages hold alone (every
        length, `1 << 62`, where every table slides and a window's blocks fit)."""
        cw = -(-(chunk + self.window - 1) // block_size) + 1
        if self.all_sliding:
            return 1 << 62 if num_pages >= cw else num_pages * block_size
        g = self.num_window_groups
        n = num_pages - g * cw if num_pages >= (1 + g) * cw else num_pages // (1 + g)
        return max(n, 0) * block_size


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_swap_blocks: int = 0,
        enable_prefix_caching: bool = False,
        layout: HybridLayout | None = None,
        cross_tokens: int = 0,
        num_offload_blocks: int = 0,
        offloading_policy: str = "write_back",
        disk: DiskTier | None = None,
        eviction_policy: str = "lru",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        if cross_tokens and layout is not None:
            raise ValueError("cross-attention blocks beside a hybrid layout are not built")
        if num_offload_blocks and (layout is not None or not enable_prefix_caching):
            raise ValueError("KV offloading is a tier of a whole (not hybrid) prefix cache")
        if offloading_policy not in OFFLOADING_POLICIES:
            raise ValueError(f"offloading_policy={offloading_policy!r} is not one of {', '.join(OFFLOADING_POLICIES)}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy={eviction_policy!r} is not one of {', '.join(EVICTION_POLICIES)}")
        if disk is not None and not num_offload_blocks:
            raise ValueError("a disk tier lies under the host tier: it needs num_offload_blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A hybrid cache's sliding groups (0: one table a sequence, every layer's K/V a block).
        self.layout = layout
        self.window = layout.window if layout is not None else 0
        self.num_window_groups = layout.num_window_groups if layout is not None else 0
        # Every layer slides: `block_table` is itself a sliding table (`HybridLayout.all_sliding`).
        self.sliding_global = layout is not None and layout.all_sliding
        self.hybrid = layout is not None
        # An encoder-decoder's (Whisper's): blocks each sequence holds for the encoder's
        # `cross_tokens` positions, its cross-attention keys and values (vLLM's cross-attention
        # blocks), beside the blocks of its own tokens: the cache's memory holds them too.
        self.cross_pages = -(-cross_tokens // block_size)
        # What a sliding table holds for a block out of the window: an id no sequence is given
        # (the runner's scratch block, zeroed), read, as padding is, under a mask.
        self.null_block = num_blocks
        # Ordered: handed out from the front, returned to the back (the least recently freed
        # cached block is evicted first); a prefix hit takes a block from anywhere in it.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # eviction_policy="lfu" (SGLang's --radix-eviction-policy lfu): a free block without a
        # hash is taken first, then the cached one hit the fewest times since it was cached,
        # the least recently freed among equals. Both indexes are lazy: an entry is checked
        # against the pool (and the block's release stamp) when it comes up.
        self.lfu = eviction_policy == "lfu"
        self._uses = [0] * num_blocks  # prefix hits since the block was cached
        self._plain: list[int] = list(range(num_blocks - 1, -1, -1))  # free blocks without a hash
        self._by_uses: list[tuple[int, int, int]] = []  # heap of (uses, release stamp, block)
        self._stamps = [0] * num_blocks  # each block's last release
        self._clock = 0
        # ... and in the offloading tier (SGLang's policy covers both tiers): the tier block
        # loaded the fewest times since it was stored goes first, the least recently used among
        # equals; a heap of (loads, stamp, tier block), an entry live while its stamp is the block's.
        self._tier_uses: dict[int, int] = {}
        self._tier_stamps: dict[int, int] = {}
        self._tier_heap: list[tuple[int, int, int]] = []
        self._ref_counts = [0] * num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.num_queried_tokens = 0  # tokens of the sequences looked up at admission
        self.num_hit_tokens = 0  # of those, tokens found in the cache
        # CPU swap space: a second, plain pool (swapped blocks are never shared).
        self.num_swap_blocks = num_swap_blocks
        self._swap_free: deque[int] = deque(range(num_swap_blocks))
        # KV offloading's host tier: blocks num_swap_blocks.. of the runner's host tensor.
        self.num_offload_blocks = num_offload_blocks
        self._host_free: list[int] = list(range(num_swap_blocks + num_offload_blocks - 1, num_swap_blocks - 1, -1))
        self._host_lru: OrderedDict[int, bytes] = OrderedDict()  # tier block -> hash, least recent first
        self._host_cached: dict[bytes, int] = {}
        self._stores: list[tuple[int, int]] = []  # (device block, tier block) copies for this step
        self._loads: list[tuple[int, int]] = []  # (tier block, device block)
        self._unwritten: set[int] = set()  # device blocks registered or loaded in this step
        self._pinned: set[int] = set()  # tier blocks this step's copies read or write
        self.num_offload_hit_tokens = 0  # of num_hit_tokens, those loaded from the tier
        self.num_offload_stores = 0  # blocks copied to the tier
        self.offloading_policy = offloading_policy
        # write_through(_selective): cached blocks to store at the end of this schedule (their
        # K/V written by an earlier step), and those the step being scheduled writes (the next).
        self._through: list[tuple[int, bytes]] = []
        self._through_next: list[tuple[int, bytes]] = []
        self._reused = [False] * num_blocks  # write_through_selective: hit since it was cached
        self.disk = disk
        self._disk_writes: list[tuple[int, bytes]] = []  # (tier block, hash): host to disk
        self._disk_reads: list[tuple[bytes, int]] = []  # (hash, tier block): disk to host
        self.num_disk_hit_tokens = 0  # of num_offload_hit_tokens, those read from disk
        # KV events (conveyor/core/kv_events.py): None unless the engine asks for them; then
        # every change of the cache's hashes, device and host tier, in order, until taken.
        self.kv_events: list[KVEvent] | None = None

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def pages_per_block(self) -> int:
        """Pool blocks a sequence takes for each `block_size` tokens it grows by (its tables)."""
        return 1 + self.num_window_groups

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pool blocks a sequence computing `num_tokens` from scratch in one step takes (its
        cross-attention blocks too, an encoder-decoder's)."""
        return self.pages_per_block * -(-num_tokens // self.block_size) + self.cross_pages

    def num_new_blocks_needed(self, seq: Sequence, num_total_tokens: int) -> int:
        """Blocks to add so that `seq`'s tables cover `num_total_tokens` token slots (before
        what leaves the window is released)."""
        return self.pages_per_block * max(0, self.blocks_for_tokens(num_total_tokens) - len(seq.block_table))

    def _global_start(self, window_start: int) -> int:
        """Where a `block_table` starts holding blocks, its sliding tables' at `window_start`
        (after its own null entries, where it slides too)."""
        return window_start if self.sliding_global else 0

    def num_held(self, seq: Sequence) -> int:
        """Blocks `seq`'s tables hold (device or swap, as they name): `tables_of`'s lengths."""
        ws = seq.window_start
        return (len(seq.block_table) - self._global_start(ws) + sum(len(t) - ws for t in seq.window_tables)
                + len(seq.cross_table))

    def tables_of(self, seq: Sequence) -> Iterable[list[int]]:
        """`seq`'s tables, the null entries of its sliding ones left out: the blocks it holds."""
        yield seq.block_table[self._global_start(seq.window_start):]
        for t in seq.window_tables:
            yield t[seq.window_start:]
        if seq.cross_table:
            yield seq.cross_table

    def _remap(self, seq: Sequence, move: Callable[[int], int]) -> None:
        """Give each of `seq`'s tables new lists, every block it holds replaced by `move(block)`
        and the null entries kept (by position: a swap block's id may be the null's)."""
        gs, ws = self._global_start(seq.window_start), seq.window_start
        seq.block_table = [*seq.block_table[:gs], *(move(b) for b in seq.block_table[gs:])]
        if seq.window_tables:
            seq.window_tables = [[*t[:ws], *(move(b) for b in t[ws:])] for t in seq.window_tables]
        if seq.cross_table:
            seq.cross_table = [move(b) for b in seq.cross_table]

    def _dead(self, start: int) -> int:
        """Leading blocks of a sliding table that no query at position `start` or later reads."""
        return max(0, start - self.window + 1) // self.block_size

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # -- mutations -------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_total_tokens: int) -> bool:
        """Grow `seq`'s table to cover `num_total_tokens` slots. All or nothing. The one change
        made to a table in place, by appends: free and swap assign a new list (the runner
        keeps a row per list object, `HostBlockTables`).

        A hybrid cache first releases the sliding blocks that the step's first query
        (`seq.num_computed_tokens`) and every later one cannot see, then grows every table.
        An encoder-decoder's sequence takes its cross table with its first blocks."""
        if self.hybrid:
            return self._allocate_hybrid(seq, num_total_tokens)
        need = -(-num_total_tokens // self.block_size) - len(seq.block_table)  # num_new_blocks_needed, inline
        if need <= 0:
            return True  # the common case: a decode within its last block
        cross = self.cross_pages if not seq.cross_table else 0
        if need + cross > len(self._free):
            return False
        take, table = self._take_free, seq.block_table
        if cross:
            seq.cross_table = [take() for _ in range(cross)]
        for _ in range(need):
            table.append(take())
        return True

    def _allocate_hybrid(self, seq: Sequence, num_total_tokens: int) -> bool:
        dead = self._dead(seq.num_computed_tokens)
        if dead > seq.window_start and seq.block_table:
            self._release_window(seq, dead)
        need = -(-num_total_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need * self.pages_per_block > len(self._free):
            return False
        take = self._take_free
        if not seq.window_tables:
            seq.window_tables = [[] for _ in range(self.num_window_groups)]
        for table in (seq.block_table, *seq.window_tables):
            for _ in range(need):
                table.append(take())
        return True

    def _release_window(self, seq: Sequence, dead: int) -> None:
        """Turn the sliding tables' entries before block `dead` into the null block, their
        blocks released (new lists: the runner's rows of the old ones stay as they were)."""
        start = seq.window_start
        dead = min(dead, len(seq.block_table))

        def released(table: list[int]) -> list[int]:
            for block in table[start:dead]:
                self._release(block)
            return [self.null_block] * dead + table[dead:]

        seq.window_tables = [released(t) for t in seq.window_tables]
        if self.sliding_global:
            seq.block_table = released(seq.block_table)
        seq.window_start = dead

    def free(self, seq: Sequence) -> None:
        """Release every block `seq` holds; a block returns to the pool at ref count zero."""
        held, *others = self.tables_of(seq)
        for table in (*others, held):  # the sliding (and cross) tables' blocks, then the global one's, each last first
            for block in reversed(table):
                self._release(block)
        seq.block_table, seq.cross_table = [], []
        seq.window_tables, seq.window_start = [], 0

    # -- prefix cache ----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence, disk: bool = True) -> list[int]:
        """The cached blocks of `seq`'s longest registered prefix of full blocks, leaving at
        least its last token to compute (a step must compute a token to sample the next).
        A block of the offloading tier appears as `~tier_block` (negative), one of the disk
        tier (`disk`: looked up there too) as `DISK_HIT`: its file is opened, for `acquire` to
        read in this schedule. Changes nothing else; `acquire` takes them."""
        if not self.enable_prefix_caching:
            return []
        known = len(seq.token_ids) - seq.num_pending  # placeholders have no ids to hash yet
        num_blocks = min(known, len(seq.token_ids) - 1) // self.block_size
        if not num_blocks:
            return []
        hashes = chain_hashes(seq.token_ids, self.block_size, seq.block_hashes, num_blocks, _salt(seq), seq.images)
        hits: list[int] = []
        cached = self._cached
        if self.sliding_global:  # no block before the window is read: the chain may have gaps
            h = num_blocks
        else:
            host = self._host_cached if self.num_offload_blocks else None
            tier_below = self.disk if disk else None
            room: int | None = None  # tier blocks free or unpinned: what the disk hits may take
            taken = 0  # of those, pinned by this chain's hits (a tier hit's own, a disk hit's new one)
            for i in range(num_blocks):
                block = cached.get(hashes[i])
                if block is None:
                    if host is None:
                        break
                    if (tier := host.get(hashes[i])) is not None:
                        block = ~tier  # in the offloading tier: `acquire` loads it
                        if tier not in self._pinned:
                            if room is not None and taken >= room:
                                break  # (after a disk hit: that took the tier block this one would pin)
                            taken += 1
                    elif tier_below is None:
                        break
                    else:
                        if room is None:  # (the pinned blocks are few: count them, not the tier)
                            room = (len(self._host_free) + len(self._host_lru)
                                    - sum(1 for t in self._pinned if t in self._host_lru))
                        if taken >= room or not tier_below.find(hashes[i]):
                            break
                        block = DISK_HIT  # on disk: `acquire` reads it into the tier, then loads it
                        taken += 1
                hits.append(block)
            h = len(hits)
        if self.hybrid:
            # The sliding tables must hold the blocks of the first computed query's window
            # (vLLM's sliding-window hit, searched from the right): a hit of h blocks needs
            # theirs from `_dead(h * block_size)` to h; one missing at i allows at most i.
            while h and (missing := self._missing_window(hashes, h)) >= 0:
                h = missing
        if self.sliding_global:
            dead = self._dead(h * self.block_size)
            return [self.null_block] * dead + [cached[hashes[i]] for i in range(dead, h)]
        del hits[h:]
        return hits

    def _window_key(self, block_hash: bytes, group: int) -> bytes:
        """A block's key in the prefix cache: its hash, and a sliding group's number (the
        global group's, 0, none: the key of a whole cache's block)."""
        return block_hash + group.to_bytes(2, "little") if group else block_hash

    def _missing_window(self, hashes: list[bytes], h: int) -> int:
        """The last block index below `h` whose sliding blocks a hit of `h` blocks needs and
        the cache lacks in some group; -1 if none is missing."""
        cached, key = self._cached, self._window_key
        groups = range(0 if self.sliding_global else 1, 1 + self.num_window_groups)
        for i in range(h - 1, self._dead(h * self.block_size) - 1, -1):
            if any(key(hashes[i], g) not in cached for g in groups):
                return i
        return -1

    def _window_hits(self, seq: Sequence, h: int) -> list[list[int]]:
        """The sliding groups' tables for a hit of `h` blocks (`match_prefix`'s)."""
        dead = self._dead(h * self.block_size)
        hashes, cached, key = seq.block_hashes, self._cached, self._window_key
        return [[self.null_block] * dead + [cached[key(hashes[i], g)] for i in range(dead, h)]
                for g in range(1, 1 + self.num_window_groups)]

    def admission_need(self, seq: Sequence, hits: list[int], num_total_tokens: int) -> int:
        """Free blocks admitting `seq` with the cached `hits` (`match_prefix`) takes to cover
        `num_total_tokens`: new ones, and the cached ones taken out of the free pool."""
        new = self.pages_per_block * (self.blocks_for_tokens(num_total_tokens) - len(hits)) + self.cross_pages
        if self.num_offload_blocks:  # a tier hit takes a new device block to load into
            loads = sum(1 for b in hits if b < 0)
            return new + loads + self.num_evictable(b for b in hits if b >= 0)
        if self.hybrid and hits:
            dead = self._dead(len(hits) * self.block_size)
            return new + self.num_evictable(hits[self._global_start(dead):]) + sum(
                self.num_evictable(t[dead:]) for t in self._window_hits(seq, len(hits)))
        return new + self.num_evictable(hits)

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` sit in the free pool: taking them leaves that many fewer free."""
        counts = self._ref_counts
        return sum(1 for b in blocks if counts[b] == 0)

    def acquire(self, seq: Sequence, blocks: list[int]) -> None:
        """Start `seq`'s (empty) table with the cached `blocks` from `match_prefix`, and count
        the lookup (tokens queried, tokens hit) for the hit rate. The offloading tier's blocks
        among them are loaded into new device blocks, registered at once (`take_copies`)."""
        assert not seq.block_table, f"{seq} already holds blocks"
        window = self._window_hits(seq, len(blocks)) if self.num_window_groups and blocks else []
        dead = self._dead(len(blocks) * self.block_size)
        counts, free = self._ref_counts, self._free
        own = blocks[self._global_start(dead):]
        reused = self._reused if self.offloading_policy == "write_through_selective" else None
        hashes: list[Any] = self._block_hash
        for block in (*own, *(b for table in window for b in table[dead:])):
            if block < 0:
                continue  # in the offloading tier: `_load` gives it a device block
            assert self._block_hash[block] is not None, f"block {block} is not cached"
            if counts[block] == 0:
                del free[block]
            counts[block] += 1
            self._uses[block] += 1
            if reused is not None and not reused[block]:  # a second use: worth a copy in the tier
                reused[block] = True
                pair = (block, hashes[block])
                (self._through_next if block in self._unwritten else self._through).append(pair)
        if own and min(own) < 0:
            blocks = self._load(seq, blocks)
        seq.block_table = list(blocks)
        if self.hybrid and blocks:
            seq.window_tables, seq.window_start = window, dead
        self.num_queried_tokens += len(seq.token_ids) - seq.num_pending
        self.num_hit_tokens += len(blocks) * self.block_size

    def _load(self, seq: Sequence, blocks: list[int]) -> list[int]:
        """`blocks` with each tier block (`~tier`) replaced by a new device block that a load
        fills this step, registered under its hash. The device hits are held already and the
        tier blocks are pinned first: taking a device block may store an evicted one. A disk
        hit takes a tier block first (read from disk into it, then loaded as a tier hit);
        `match_prefix` counted the tier blocks it may take."""
        if DISK_HIT in blocks:
            assert self.disk is not None
            blocks = list(blocks)
            self._pinned.update(~b for b in blocks if b < 0 and b != DISK_HIT)
            for i, b in enumerate(blocks):
                if b == DISK_HIT:
                    h = seq.block_hashes[i]
                    tier = self._take_tier()
                    assert tier is not None, "match_prefix counted a tier block for each disk hit"
                    self._host_cached[h] = tier
                    self._host_lru[tier] = h
                    self._announce_host(h)
                    self._disk_reads.append((h, tier))
                    self.disk.read_scheduled(h)
                    self.num_disk_hit_tokens += self.block_size
                    blocks[i] = ~tier
        self._pinned.update(~b for b in blocks if b < 0)
        out = []
        loaded = []
        for i, b in enumerate(blocks):
            if b < 0:
                loaded.append(i)
                tier, b = ~b, self._take_free()
                self._host_lru.move_to_end(tier)
                if self.lfu:
                    self._touch_tier(tier)
                self._loads.append((tier, b))
                h = seq.block_hashes[i]
                self._cached[h] = b
                self._block_hash[b] = h
                self._unwritten.add(b)
                self.num_offload_hit_tokens += self.block_size
            out.append(b)
        if self.kv_events is not None:
            self._announce(seq, loaded)
        return out

    def cache_blocks(self, seq: Sequence, table: list[int], first: int, end: int, written: bool = True) -> None:
        """Register `table[first:end]`, full blocks of `seq` whose K/V a scheduled step writes
        (`written=False`: the step being scheduled, not yet run). A block already registered,
        or whose prefix another block already holds, is skipped."""
        if not self.enable_prefix_caching:
            return
        hashes = chain_hashes(seq.token_ids, self.block_size, seq.block_hashes, end, _salt(seq), seq.images)
        cached, hashed = self._cached, self._block_hash
        announced: list[int] | None = [] if self.kv_events is not None and table is seq.block_table else None
        for i in range(max(first, self._global_start(seq.window_start)), end):  # (a sliding one's: its blocks)
            block, h = table[i], hashes[i]
            if hashed[block] is None and h not in cached:
                cached[h] = block
                hashed[block] = h
                if announced is not None:
                    announced.append(i)
                if self.num_offload_blocks:
                    if not written:
                        self._unwritten.add(block)
                    if self.offloading_policy == "write_through":
                        (self._through if written else self._through_next).append((block, h))
        if announced:
            self._announce(seq, announced)
        if self.num_window_groups and table is seq.block_table:
            # The sliding groups' blocks of the same tokens, each under the hash and its group.
            key = self._window_key
            for g, window in enumerate(seq.window_tables, 1):
                for i in range(max(first, seq.window_start), min(end, len(window))):
                    block, h = window[i], key(hashes[i], g)
                    if hashed[block] is None and h not in cached:
                        cached[h] = block
                        hashed[block] = h

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, the offloading tier's too (blocks in use stay in use).
        Returns how many were held. Between steps: a load taken and not yet run reads nothing
        the reset changes (the tier's blocks are only returned to its free list)."""
        n = len(self._cached) + len(self._host_cached)
        if self.disk is not None:
            n += self.disk.clear()
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        self._host_free.extend(self._host_lru)
        self._host_lru.clear()
        self._host_cached.clear()
        self._reused = [False] * self.num_blocks
        self._uses = [0] * self.num_blocks
        self._plain, self._by_uses = list(self._free)[::-1], []  # (lfu: every free block is plain now)
        self._tier_uses.clear()
        self._tier_stamps.clear()
        self._tier_heap = []
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return n

    # -- KV offloading ---------------------------------------------------------------------
    @property
    def num_offloaded_blocks(self) -> int:
        """Blocks the offloading tier holds."""
        return len(self._host_cached)

    def _store(self, block: int, h: bytes) -> bool:
        """Copy evicted `block` (cached under `h`) to the tier, unless the tier holds `h` or
        the block's K/V are not written yet; the tier's least recently used block makes room."""
        host = self._host_cached
        tier = host.get(h)
        if tier is not None:
            self._host_lru.move_to_end(tier)
            return True
        if block in self._unwritten:
            return True
        tier = self._take_tier()
        if tier is None:
            return False  # every tier block is copied this step: the block is dropped
        host[h] = tier
        self._host_lru[tier] = h
        self._announce_host(h)
        self._stores.append((block, tier))
        self.num_offload_stores += 1
        if self.disk is not None and self.disk.write_scheduled(h):
            self._disk_writes.append((tier, h))
        return True

    def _take_tier(self) -> int | None:
        """A free tier block, pinned for this step, or the least recently used one no copy of
        this step uses, evicted (the disk tier holds a copy of it already); None if none."""
        tier: int | None
        if self._host_free:
            tier = self._host_free.pop()
        else:
            tier = (self._least_used_tier() if self.lfu
                    else next((t for t in self._host_lru if t not in self._pinned), None))
            if tier is None:
                return None
            gone = self._host_lru.pop(tier)
            del self._host_cached[gone]
            if self.kv_events is not None:
                self._announce_removed(gone, HOST)
        self._pinned.add(tier)  # one copy into a block a step
        if self.lfu:
            self._tier_uses[tier] = -1  # (`_touch_tier` makes it 0: stored, not loaded yet)
            self._touch_tier(tier)
        return tier

    def _touch_tier(self, tier: int) -> None:
        """lfu: one more load of `tier` (or its store): a new heap entry, the old one stale."""
        self._clock += 1
        self._tier_uses[tier] += 1
        self._tier_stamps[tier] = self._clock
        heapq.heappush(self._tier_heap, (self._tier_uses[tier], self._clock, tier))
        if len(self._tier_heap) > 4 * max(1, self.num_offload_blocks):  # stale entries: rebuild
            self._tier_heap = [(self._tier_uses[t], self._tier_stamps[t], t) for t in self._host_lru]
            heapq.heapify(self._tier_heap)

    def _least_used_tier(self) -> int | None:
        """lfu: the tier block no copy of this step uses that was loaded the fewest times."""
        heap, stamps, pinned = self._tier_heap, self._tier_stamps, self._pinned
        kept = []
        found = None
        while heap:
            entry = heapq.heappop(heap)
            _, stamp, tier = entry
            if stamps.get(tier) != stamp or tier not in self._host_lru:
                continue  # stale
            if tier in pinned:
                kept.append(entry)
                continue
            found = tier
            break
        for entry in kept:
            heapq.heappush(heap, entry)
        return found

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (stores, loads), device-to-tier and tier-to-device copies the runner makes
        with the step's swaps (stores first), and a new step begins for `_unwritten`/`_pinned`."""
        hashed = self._block_hash
        # write_through(_selective): the blocks an earlier step wrote (those evicted since were
        # stored or dropped then); one for which no tier block is left waits for the next schedule.
        retry = []
        for block, h in self._through:
            if hashed[block] == h and not self._store(block, h):
                retry.append((block, h))
        self._through, self._through_next = retry + self._through_next, []
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        self._unwritten.clear()
        self._pinned.clear()
        if self.disk is not None:
            self.disk.end_step()
        return stores, loads

    @property
    def has_pending_copies(self) -> bool:
        """Blocks the write policy stores at the next schedule's end (a step with nothing to
        compute makes them: the engine runs one more)."""
        return bool(self._through or self._through_next)

    def take_disk_copies(self) -> tuple[list[tuple[int, bytes]], list[tuple[bytes, int]]]:
        """The step's disk (writes, reads): tier blocks written to disk after the stores fill
        them, and disk blocks read into tier blocks before the loads copy them to the device.
        Called after `take_copies` (whose write-through stores add writes)."""
        writes, reads = self._disk_writes, self._disk_reads
        self._disk_writes, self._disk_reads = [], []
        return writes, reads

    # -- KV events -------------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first (empty when events are off)."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    def _announce(self, seq: Sequence, indices: list[int]) -> None:
        """BlockStored events for `seq`'s blocks `indices` (ascending), new in the device cache:
        one a run of consecutive blocks, chained onto the block before the run."""
        assert self.kv_events is not None
        hashes, size, tokens = seq.block_hashes, self.block_size, seq.token_ids
        lora = None if seq.lora_request is None else seq.lora_request.lora_int_id
        start = 0
        for k in range(1, len(indices) + 1):
            if k == len(indices) or indices[k] != indices[k - 1] + 1:
                first, last = indices[start], indices[k - 1]
                self.kv_events.append(BlockStored(
                    [external_hash(hashes[i]) for i in range(first, last + 1)],
                    external_hash(hashes[first - 1]) if first else None,
                    tokens[first * size:(last + 1) * size], size, lora, DEVICE,
                ))
                start = k

    def _announce_host(self, h: bytes) -> None:
        """A block stored into the host tier: its hash (its tokens went with the device's event)."""
        events = self.kv_events
        if events is None:
            return
        last = events[-1] if events else None
        if isinstance(last, BlockStored) and last.medium == HOST:
            last.block_hashes.append(external_hash(h))
        else:
            events.append(BlockStored([external_hash(h)], None, [], self.block_size, None, HOST))

    def _announce_removed(self, h: bytes, medium: str) -> None:
        events = self.kv_events
        assert events is not None
        last = events[-1] if events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external_hash(h))
        else:
            events.append(BlockRemoved([external_hash(h)], medium))

    def _is_window_key(self, h: bytes) -> bool:
        """A sliding group's key (`_window_key`), not a block hash: no event names it."""
        return self.num_window_groups > 0 and len(h) != 32

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def _take_free(self) -> int:
        """The least recently freed block (`lfu`: the least used one, `_least_used`), evicted
        from the prefix cache, at ref count 1."""
        if self.lfu:
            block = self._least_used()
            del self._free[block]
        else:
            block = self._free.popitem(last=False)[0]
        h = self._block_hash[block]
        if h is not None:
            del self._cached[h]
            self._block_hash[block] = None
            self._uses[block] = 0
            if self.kv_events is not None and not self._is_window_key(h):
                self._announce_removed(h, DEVICE)
            if self.num_offload_blocks:
                if self.offloading_policy != "write_through_selective" or self._reused[block]:
                    self._store(block, h)
                self._reused[block] = False
        self._ref_counts[block] = 1
        return block

    def _least_used(self) -> int:
        """lfu: a free block with no hash, else the free cached block hit the fewest times
        (the least recently freed among equals)."""
        free, hashed = self._free, self._block_hash
        plain = self._plain
        while plain:
            block = plain.pop()
            if block in free and hashed[block] is None:
                return block
        heap, stamps = self._by_uses, self._stamps
        while heap:
            _, stamp, block = heapq.heappop(heap)
            if block in free and stamps[block] == stamp and hashed[block] is not None:
                return block
        return next(iter(free))  # (a block whose entry a reset made stale: any will do)

    # -- swap ------------------------------------------------------------------------------
    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._swap_free)

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.num_held(seq) <= len(self._swap_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq`'s blocks to CPU swap space; its tables then name swap blocks (a sliding
        table's null entries stay null).

        Returns the (device block, swap block) copies the runner must make before the device
        blocks are reused (the runner does every swap-out of a step before anything else).
        """
        if not self.can_swap_out(seq):
            raise RuntimeError(f"not enough swap space for {self.num_held(seq)} blocks")
        mapping: list[tuple[int, int]] = []

        def out(block: int) -> int:
            cpu = self._swap_free.popleft()
            mapping.append((block, cpu))
            self._release(block)
            return cpu

        self._remap(seq, out)
        return mapping

    def can_swap_in(self, seq: Sequence, extra_blocks: int = 0) -> bool:
        return self.num_held(seq) + extra_blocks <= len(self._free)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence's blocks back; returns (swap block, device block) copies."""
        if not self.can_swap_in(seq):
            raise RuntimeError("not enough free device blocks to swap in")
        mapping: list[tuple[int, int]] = []

        def back(cpu: int) -> int:
            block = self._take_free()
            mapping.append((cpu, block))
            self._swap_free.append(cpu)
            return block

        self._remap(seq, back)
        return mapping

    def pages_to_receive(self, num_tokens: int) -> int:
        """Swap blocks the K/V of a sequence's first `num_tokens` tokens take when handed over:
        every block of the global table; of each sliding one, those its next query reads."""
        n = self.blocks_for_tokens(num_tokens)
        live = n - min(n, self._dead(num_tokens)) if self.hybrid else n
        return (live if self.sliding_global else n) + self.num_window_groups * live

    def can_receive(self, num_tokens: int) -> bool:
        return self.pages_to_receive(num_tokens) <= len(self._swap_free)

    def receive(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` (holding no blocks) swap blocks for the K/V of its first `num_tokens`
        tokens, which another engine computed (conveyor/kv_transfer.py): it is then as if
        swapped out, and `swap_in` brings it onto the device. A hybrid cache's sliding tables
        start at the window of the next query (position `num_tokens`)."""
        assert not seq.block_table, f"{seq} already holds blocks"
        if not self.can_receive(num_tokens):
            raise RuntimeError(f"not enough swap space for {num_tokens} tokens")
        n, take = self.blocks_for_tokens(num_tokens), self._swap_free.popleft
        dead = min(n, self._dead(num_tokens)) if self.hybrid else 0
        gs = self._global_start(dead)
        seq.block_table = [self.null_block] * gs + [take() for _ in range(n - gs)]
        if self.hybrid:
            seq.window_tables = [[self.null_block] * dead + [take() for _ in range(n - dead)]
                                 for _ in range(self.num_window_groups)]
            seq.window_start = dead

    def free_swapped(self, seq: Sequence) -> None:
        """Release a swapped sequence's swap blocks (it finished or was aborted while out)."""
        for table in self.tables_of(seq):
            self._swap_free.extend(table)
        seq.block_table, seq.cross_table = [], []
        seq.window_tables, seq.window_start = [], 0

    def share(self, block: int) -> None:
        """Add a reference to a used block (a second table holds it, e.g. a shared prefix)."""
        if self._ref_counts[block] < 1:
            raise ValueError(f"block {block} is free and cannot be shared")
        self._ref_counts[block] += 1

    def _release(self, block: int) -> None:
        count = self._ref_counts[block]
        if count < 1:
            raise RuntimeError(f"block {block} released while already free")
        self._ref_counts[block] = count - 1
        if count == 1:
            self._free[block] = None
            if self.lfu:
                self._clock += 1
                self._stamps[block] = self._clock
                if self._block_hash[block] is None:
                    self._plain.append(block)
                else:
                    heapq.heappush(self._by_uses, (self._uses[block], self._clock, block))
                if len(self._by_uses) > 4 * self.num_blocks:  # stale entries: rebuild from the pool
                    self._by_uses = [(self._uses[b], self._stamps[b], b) for b in self._free
                                     if self._block_hash[b] is not None]
                    heapq.heapify(self._by_uses)

    # -- checks ----------------------------------------------------------------------------
    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_integrity(
        self, block_tables: Iterable[list[int]], swap_tables: Iterable[list[int]] = ()
    ) -> None:
        """Raise AssertionError if the pools and the given tables disagree in any way.

        `block_tables` are the device tables of waiting and running sequences, `swap_tables`
        those of swapped-out sequences (they name swap blocks).
        """
        swap_held = [b for table in swap_tables for b in table]
        assert len(set(swap_held)) == len(swap_held), "a swap block is held twice"
        assert not set(swap_held) & set(self._swap_free), "a held swap block is also free"
        assert len(swap_held) + len(self._swap_free) == self.num_swap_blocks, "swap blocks leaked"
        held = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                assert 0 <= block < self.num_blocks, f"block id {block} out of range"
                held[block] += 1
        free = list(self._free)
        free_set = set(free)
        for block in range(self.num_blocks):
            count = self._ref_counts[block]
            assert count == held[block], (
                f"block {block}: ref count {count} but held by {held[block]} tables"
            )
            assert (count == 0) == (block in free_set), (
                f"block {block}: ref count {count} disagrees with free pool membership"
            )
        assert len(free) + sum(1 for c in self._ref_counts if c > 0) == self.num_blocks
        for h, block in self._cached.items():
            assert self._block_hash[block] == h, f"block {block} is cached under another hash"
        assert sum(1 for h in self._block_hash if h is not None) == len(self._cached), (
            "a block has a hash the cache does not map back to it"
        )
        assert self.enable_prefix_caching or not self._cached, "a cache while prefix caching is off"
        lo, hi = self.num_swap_blocks, self.num_swap_blocks + self.num_offload_blocks
        assert all(lo <= t < hi for t in self._host_lru), "a tier block out of range"
        assert len(self._host_lru) + len(self._host_free) == self.num_offload_blocks, "tier blocks leaked"
        assert not set(self._host_lru) & set(self._host_free), "a tier block both free and held"
        assert len(self._host_cached) == len(self._host_lru), "the tier's maps disagree"
        for h, tier in self._host_cached.items():
            assert self._host_lru[tier] == h, f"tier block {tier} is cached under another hash"
