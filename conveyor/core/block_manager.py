"""Fixed-size KV blocks: a free pool, reference counts and per-sequence block tables.

Invariants (checked by `check_integrity`, which tests call after every step):
- every block is either free (ref count 0, in the free pool exactly once) or used (ref count
  equal to the number of block tables that hold it);
- free + used == total;
- a sequence's block table covers at least its computed tokens and never more than it needs
  plus what the current step grants.
No torch: this module plans memory, the runner owns the tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from conveyor.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        # CPU swap space: a second, plain pool (swapped blocks are never shared).
        self.num_swap_blocks = num_swap_blocks
        self._swap_free: deque[int] = deque(range(num_swap_blocks))

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

    def num_new_blocks_needed(self, seq: Sequence, num_total_tokens: int) -> int:
        """Blocks to add so that `seq`'s table covers `num_total_tokens` token slots."""
        return max(0, self.blocks_for_tokens(num_total_tokens) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # -- mutations -------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_total_tokens: int) -> bool:
        """Grow `seq`'s table to cover `num_total_tokens` slots. All or nothing. The one change
        made to a table in place, by appends: free and swap assign a new list (the runner
        keeps a row per list object, `HostBlockTables`)."""
        need = -(-num_total_tokens // self.block_size) - len(seq.block_table)  # num_new_blocks_needed, inline
        if need <= 0:
            return True  # the common case: a decode within its last block
        if need > len(self._free):
            return False
        for _ in range(need):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block `seq` holds; a block returns to the pool at ref count zero."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    # -- swap ------------------------------------------------------------------------------
    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._swap_free)

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self._swap_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq`'s blocks to CPU swap space; its table then names swap blocks.

        Returns the (device block, swap block) copies the runner must make before the device
        blocks are reused (the runner does every swap-out of a step before anything else).
        """
        if not self.can_swap_out(seq):
            raise RuntimeError(f"not enough swap space for {len(seq.block_table)} blocks")
        mapping = []
        for block in seq.block_table:
            cpu = self._swap_free.popleft()
            mapping.append((block, cpu))
            self._release(block)
        seq.block_table = [cpu for _, cpu in mapping]
        return mapping

    def can_swap_in(self, seq: Sequence, extra_blocks: int = 0) -> bool:
        return len(seq.block_table) + extra_blocks <= len(self._free)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence's blocks back; returns (swap block, device block) copies."""
        if not self.can_swap_in(seq):
            raise RuntimeError("not enough free device blocks to swap in")
        mapping = []
        for cpu in seq.block_table:
            block = self._free.popleft()
            self._ref_counts[block] = 1
            mapping.append((cpu, block))
            self._swap_free.append(cpu)
        seq.block_table = [block for _, block in mapping]
        return mapping

    def free_swapped(self, seq: Sequence) -> None:
        """Release a swapped sequence's swap blocks (it finished or was aborted while out)."""
        self._swap_free.extend(seq.block_table)
        seq.block_table = []

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
            self._free.append(block)

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
        assert len(set(free)) == len(free), "a block is in the free pool twice"
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
