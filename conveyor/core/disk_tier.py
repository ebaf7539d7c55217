"""KV offloading's disk tier: a directory of K/V blocks, one file a block, named by its prefix hash.

The third tier of the prefix cache (LMCache's local disk, SGLang's hierarchical cache over a file
storage backend), under the host tier (`BlockManager`'s `num_offload_blocks`): every block stored
into the host tier is written here too, and a lookup whose chain leaves the host tier goes on
here; a block found is read into a host tier block, then loaded to the device as a host hit is.
The hashes are SHA-256 over the token prefix (`chain_hashes`), the same in every process, so the
files outlive the engine: a restarted engine, or another engine of the same model pointed at the
same directory, finds them. The directory holds a subdirectory a cache layout (`fingerprint`):
model, dtypes, block size and shapes, so no engine reads another layout's bytes.

A file is written under a temporary name and renamed, so no reader sees half of one. A lookup
opens the file it finds and keeps it open until the runner reads it: another engine may delete
it in between (each engine evicts, least recently used first, what it knows of beyond its
`num_blocks`), and an open file stays readable after that. A shared directory may hold up to
each engine's `num_blocks`. No torch here: the runner turns the bytes into K/V.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
# Files a schedule's lookups hold open at most (a chain found on disk stops there): bounds the
# descriptors, and what one step reads from disk.
MAX_OPEN = 256
STALE_TMP_S = 600.0  # a temporary file this old at start is a dead engine's unfinished write


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # another engine deleted it first
        os.unlink(path)


def fingerprint(*parts: object) -> str:
    """A layout's subdirectory name: the hex digest of what makes a block's bytes."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


class DiskTier:
    def __init__(self, root: str, layout: str, num_blocks: int, block_bytes: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a disk tier of {num_blocks} blocks holds nothing")
        self.dir = os.path.join(root, layout)
        os.makedirs(self.dir, exist_ok=True)
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # hashes whose files this engine knows, least recent first
        self._open: dict[bytes, int] = {}  # files a lookup of this schedule opened: hash -> descriptor
        self._reading: dict[bytes, int] = {}  # the step's reads, handed to the runner
        self._pinned: set[bytes] = set()  # hashes this step's reads or writes use: not evicted in it
        self.num_reads = 0
        self.num_writes = 0
        self.num_write_errors = 0
        # What an earlier engine left: known from the oldest file to the newest, the oldest
        # beyond num_blocks deleted.
        found = []
        now = time.time()
        for entry in os.scandir(self.dir):
            try:
                if entry.name.endswith(".tmp") and entry.stat().st_mtime < now - STALE_TMP_S:
                    _unlink(entry.path)  # a write an engine did not finish (it died): never renamed
                elif entry.name.endswith(SUFFIX) and entry.is_file():
                    found.append((entry.stat().st_mtime, bytes.fromhex(entry.name[: -len(SUFFIX)])))
            except (OSError, ValueError):  # gone meanwhile (another engine's), or not a name of ours
                continue
        for _, h in sorted(found):
            self._lru[h] = None
        self._evict()
        if self._lru:
            logger.info("KV disk tier %s: %d blocks from earlier runs", self.dir, len(self._lru))

    def __len__(self) -> int:
        return len(self._lru)

    def path(self, h: bytes) -> str:
        return os.path.join(self.dir, h.hex() + SUFFIX)

    def find(self, h: bytes) -> bool:
        """Whether the block `h` is on disk; if so its file stays open for a read this step."""
        if h in self._open:
            return True
        if len(self._open) >= MAX_OPEN:
            return False
        try:
            fd = os.open(self.path(h), os.O_RDONLY)
        except OSError:  # not there, or another engine deleted it
            self._lru.pop(h, None)
            return False
        if os.fstat(fd).st_size != self.block_bytes:  # another size: not this layout's (or cut short)
            os.close(fd)
            return False
        self._open[h] = fd
        self._lru[h] = None
        self._lru.move_to_end(h)
        return True

    def read_scheduled(self, h: bytes) -> None:
        """A lookup's hit is read this step (the runner takes its file by `take_read`)."""
        self._reading[h] = self._open.pop(h)
        self._pinned.add(h)
        self.num_reads += 1

    def write_scheduled(self, h: bytes) -> bool:
        """Whether the block `h`, stored into the host tier this step, is to be written (False
        if a file holds it already); it becomes the most recently used either way."""
        known = h in self._lru or self._exists(h)
        self._lru[h] = None
        self._lru.move_to_end(h)
        self._pinned.add(h)
        if not known:
            self.num_writes += 1
            self._evict()
        return not known

    def end_step(self) -> None:
        """A schedule ends: the files its lookups opened and did not read are closed."""
        for fd in self._open.values():
            self._close(fd)
        self._open.clear()
        self._pinned.clear()

    def _evict(self) -> None:
        lru = self._lru
        while len(lru) > self.num_blocks:
            h = next((k for k in lru if k not in self._pinned), None)
            if h is None:
                return
            del lru[h]
            self._delete(h)

    # -- the files (`MemoryDiskTier` has none) ----------------------------------------------
    def _exists(self, h: bytes) -> bool:
        return os.path.exists(self.path(h))

    def _delete(self, h: bytes) -> None:
        _unlink(self.path(h))

    def _close(self, fd: int) -> None:
        os.close(fd)

    # -- the runner's side -------------------------------------------------------------------
    def take_read(self, h: bytes, out: memoryview) -> None:
        """Read the block `h` into `out` (block_bytes long) and close its file."""
        fd = self._reading.pop(h)
        try:
            n = os.preadv(fd, [out], 0)
        finally:
            os.close(fd)
        if n != self.block_bytes:
            raise OSError(f"KV disk tier: {self.path(h)} gave {n} of {self.block_bytes} bytes")

    def write(self, h: bytes, data: memoryview) -> None:
        """Write the block `h` (a temporary file renamed into place: a reader sees all or none).
        A write that fails (a full disk, a directory gone) loses only that block's copy: it is
        forgotten, logged, and the engine goes on."""
        final = self.path(h)
        tmp = f"{final}.{os.getpid()}-{id(self)}.tmp"  # (engines of one process write apart too)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as e:
            self._lru.pop(h, None)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.num_write_errors += 1
            if self.num_write_errors == 1 or self.num_write_errors % 1000 == 0:
                logger.warning("KV disk tier %s: a block's write failed (%s); %d so far, each block only lost",
                               self.dir, e, self.num_write_errors)

    def clear(self) -> int:
        """Forget and delete every block this engine knows of; returns how many."""
        self.end_step()
        n = len(self._lru)
        for h in self._lru:
            self._delete(h)
        self._lru.clear()
        return n


class MemoryDiskTier(DiskTier):
    """The disk tier's bookkeeping without files (the simulator's): the index is the disk."""

    def __init__(self, num_blocks: int, block_bytes: int) -> None:  # (no directory: not DiskTier's)
        if num_blocks < 1:
            raise ValueError(f"a disk tier of {num_blocks} blocks holds nothing")
        self.dir = ""
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self._lru = OrderedDict()
        self._open, self._reading, self._pinned = {}, {}, set()
        self.num_reads = self.num_writes = self.num_write_errors = 0

    def find(self, h: bytes) -> bool:
        if h not in self._lru:
            return False
        self._lru.move_to_end(h)
        self._open[h] = -1  # (no file: a placeholder for `read_scheduled`)
        return True

    def _exists(self, h: bytes) -> bool:
        return False  # (the index is all there is)

    def _delete(self, h: bytes) -> None:
        pass

    def _close(self, fd: int) -> None:
        pass
