"""Tensor parallelism's ranks (`tensor_parallel_size`): one engine, `size` processes.

Rank 0 is the engine's own `ModelRunner`: it schedules, samples and holds the LM head, as
without tensor parallelism. Ranks 1.. are worker processes started here (`python -m
conveyor.runner.tensor_parallel`), each with its shard of the weights
(conveyor/models/tensor_parallel.py) and a KV cache of the same blocks over its own heads.
Each step rank 0 sends every worker what it needs to run the same forward pass over its
shard: the step's token ids, each sequence's block table, start position and token count,
and the blocks to swap. The ranks then meet in the all-reduces after each layer's attention
and MLP; a worker's hidden states are dropped (rank 0's are the same).

Steps go down each worker's stdin, length-prefixed pickles: a worker whose engine is gone
reads the end of its input and exits. The all-reduces run in a gloo process group of their
own (not torch.distributed's global one), so one process may hold several engines. A
worker's `ready` or its load error comes back on its stdout before the engine starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import mmap
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from conveyor.runner.model_runner import ModelRunner

# How long a rank waits for the others in one collective (also to meet at start-up): ranks
# run the same work, so a wait this long means a rank is gone.
TIMEOUT = datetime.timedelta(seconds=600)
_HEADER = struct.Struct("<Q")


@dataclass(frozen=True)
class Recipe:
    """What a worker needs to build its shard and KV cache as rank 0 built its own."""

    model_path: str
    dtype: str  # torch dtype names ("float32")
    kv_dtype: str
    max_len: int
    num_blocks: int
    block_size: int
    num_swap_blocks: int
    num_threads: int
    quantization: str | None = None
    calibration_ids: list[int] | None = None
    shm_path: str | None = None  # the shared all-reduce mapping (None: gloo); set by the group
    lora: tuple[int, int] | None = None  # enable_lora: (max_lora_rank, adapters kept loaded)
    layout: Any = None  # hybrid_kv_cache: the HybridLayout (conveyor/core/block_manager.py)


@dataclass(frozen=True)
class Step:
    """One step's work on a worker: swaps first, then the forward pass (none if no tokens)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    tables: list[Any] = field(default_factory=list)  # each sequence's block table
    window_tables: list[list[Any]] | None = None  # a hybrid cache's: each sliding group's tables
    starts: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    # The LM head over the last forward pass's rows `head_rows` (None: all), split by vocabulary
    # (`split_logits`); a message of its own, after the forward pass, when rank 0 samples.
    head: bool = False
    head_rows: list[int] | None = None
    lora: list[Any] | None = None  # each sequence's LoRARequest (None: a step without adapters)
    lora_pinned: frozenset[tuple[str, int]] = frozenset()  # rank 0's pinned adapters (with `lora`)
    # Image tokens' rows and embeddings, which rank 0's vision side computed (`AttentionMetadata.embeds`),
    # and each prefill's ranges that see each other both ways (`open_ranges`).
    embeds: tuple[list[int], torch.Tensor] | None = None
    ranges: list[tuple[tuple[int, int], ...]] | None = None
    mrope: torch.Tensor | None = None  # M-RoPE's positions `[T, 3]` (`AttentionMetadata.mrope`)
    # New weights by their HF names, whole (`Engine.update_weights_from_tensor`): each rank copies
    # its slice into its model (no forward pass).
    weights: dict[str, torch.Tensor] | None = None
    kv: str | None = None  # sleep mode: "release" or "restore" the rank's KV cache (no forward pass)


def _write(stream: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    """The next message, or None at the end of the stream."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


class AllReduce:
    """The ranks' sum of a tensor, in place; every rank gets the same bits.

    float32/float64 tensors go through a mapping every rank shares (`shm_all_reduce` in
    conveyor/kernels/cpu_kernels.cpp): a decode step's row in microseconds, where gloo's
    TCP round trips take hundreds (BENCHMARKS.md). Other dtypes, machines without the native
    kernels, and `CONVEYOR_TP_ALL_REDUCE=gloo` use the gloo group."""

    SLOT_BYTES = 4 << 20  # a rank's share of one round; larger tensors go in several

    def __init__(self, group: Any, rank: int, size: int, shm_path: str | None, create: bool = False) -> None:
        from conveyor.kernels import shm_all_reduce

        self.group, self.rank, self.size = group, rank, size
        self._kernel = shm_all_reduce() if shm_path is not None else None
        self._map: mmap.mmap | None = None
        if self._kernel is None or shm_path is None:
            return
        header = (size + 1) * 64  # one line per rank's generation, then the abort word
        total = header + 2 * size * self.SLOT_BYTES
        fd = os.open(shm_path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._abort = ctypes.c_int64.from_buffer(self._map, size * 64)
        self._gen = ctypes.c_int64(0)

    @staticmethod
    def wanted() -> bool:
        from conveyor.kernels import shm_all_reduce

        return os.environ.get("CONVEYOR_TP_ALL_REDUCE", "shm") != "gloo" and shm_all_reduce() is not None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self._kernel is None or t.dtype not in (torch.float32, torch.float64) or not t.is_contiguous():
            self.group.allreduce([t]).wait()
            return t
        rc = self._kernel(self._base, self.rank, self.size, self.SLOT_BYTES, t.data_ptr(), t.numel(),
                          t.element_size(), ctypes.byref(self._gen), TIMEOUT.total_seconds())
        if rc:
            why = "a rank is gone" if rc == -2 else f"a rank did not arrive within {TIMEOUT.total_seconds():.0f} s"
            raise RuntimeError(f"tensor-parallel all-reduce failed: {why}")
        return t

    def abort(self) -> None:
        """Make every rank's waiting all-reduce give up (a watchdog saw a rank die)."""
        if self._map is not None:
            self._abort.value = 1


def _watch(alive: Callable[[], bool], all_reduce: AllReduce, stop: threading.Event) -> None:
    """Abort the all-reduces once `alive()` fails (checked twice a second) or `stop` is set."""

    def run() -> None:
        while not stop.wait(0.5):
            if not alive():
                all_reduce.abort()
                return

    threading.Thread(target=run, name="conveyor-tp-watchdog", daemon=True).start()


class TensorParallelGroup:
    """Rank 0's side: starts the workers, meets them in a gloo group, sends them each step."""

    def __init__(self, size: int, recipe: Recipe, arch: Any = None) -> None:
        """`arch`: the whole model's `ArchConfig` (rank 0's adapters are checked against it)."""
        from torch.distributed import ProcessGroupGloo, TCPStore

        self.size = size
        self.arch = arch
        store = TCPStore("127.0.0.1", 0, size, True, timeout=TIMEOUT, wait_for_workers=False)
        shm_path = None
        if AllReduce.wanted():
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            shm_path = os.path.join(folder, f"conveyor-tp-{os.getpid()}-{store.port}")
            recipe = dataclasses.replace(recipe, shm_path=shm_path)
        # The mapping exists before any worker looks for it; the gloo group is set once met.
        self.all_reduce = AllReduce(None, 0, size, shm_path, create=True)
        self._shm_path = shm_path
        env = {**os.environ, "OMP_NUM_THREADS": str(recipe.num_threads)}
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "conveyor.runner.tensor_parallel", str(store.port), str(rank), str(size)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            )
            for rank in range(1, size)
        ]
        # The workers go when the engine does (or the interpreter ends): their input closes.
        self._stop_watch = threading.Event()
        self._finalizer = weakref.finalize(self, _stop, self.procs, shm_path, self._stop_watch)
        procs = self.procs  # (not `self`: the watchdog must not keep the group alive)
        _watch(lambda: all(proc.poll() is None for proc in procs), self.all_reduce, self._stop_watch)
        for proc in self.procs:
            assert proc.stdin is not None
            _write(proc.stdin, recipe)
        self.group = self._meet(lambda: ProcessGroupGloo(store, 0, size, TIMEOUT))
        self.all_reduce.group = self.group
        self._store = store  # (the group's rendezvous; kept while the group lives)

    def _meet(self, make: Callable[[], Any]) -> Any:
        """`make()` (the group, which waits for every rank to join), failing at once, not after
        TIMEOUT, if a worker exits before it joins."""
        made: list[Any] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                made.append(make())
            except BaseException as e:  # (handed to the caller)
                errors.append(e)

        thread = threading.Thread(target=run, name="conveyor-tp-meet", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            gone = [(rank, proc.poll()) for rank, proc in enumerate(self.procs, start=1) if proc.poll() is not None]
            if gone and thread.is_alive():
                self.close()
                raise RuntimeError(f"tensor-parallel rank {gone[0][0]} exited with code {gone[0][1]} before it joined")
        if errors:
            self.close()
            raise errors[0]
        return made[0]

    def wait_ready(self) -> None:
        """Wait until every worker has built its shard; a worker's load error is raised here."""
        for rank, proc in enumerate(self.procs, start=1):
            assert proc.stdout is not None
            answer = _read(proc.stdout)
            if answer != "ready":
                self.close()
                why = answer if isinstance(answer, str) else f"exited with code {proc.wait()}"
                raise RuntimeError(f"tensor-parallel rank {rank} could not start: {why}")
        if self._shm_path is not None:  # every rank has it mapped: the name can go
            with contextlib.suppress(OSError):
                os.unlink(self._shm_path)

    def update_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every worker copies its slice of these whole tensors into its model (rank 0 checked
        its own slice first: theirs have its shapes)."""
        self.send(Step(weights=tensors))

    def send(self, step: Step) -> None:
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _HEADER.pack(len(data)) + data
        for rank, proc in enumerate(self.procs, start=1):
            assert proc.stdin is not None
            try:
                proc.stdin.write(frame)
                proc.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone (exit code {proc.poll()})") from e

    def close(self) -> None:
        self._finalizer()


def _stop(procs: list[subprocess.Popen[bytes]], shm_path: str | None, watch: threading.Event | None) -> None:
    if watch is not None:
        watch.set()
    if shm_path is not None:
        with contextlib.suppress(OSError):
            os.unlink(shm_path)
    for proc in procs:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def splits_head(model: Any) -> bool:
    """Whether the ranks share the LM head's work (not the int8 head, which rank 0 keeps)."""
    return getattr(model, "_head_int8", None) is None


def split_logits(model: Any, hidden: torch.Tensor, rank: int, size: int, all_reduce: Any) -> torch.Tensor:
    """The logits of `hidden` `[rows, hidden]` with each rank computing the vocabulary's `rank`-th
    slice (the head's weight is whole on every rank: a slice of its rows is contiguous), put
    together by an all-reduce of the zero-padded slices (every rank gets them all)."""
    from conveyor.kernels import SKINNY_MAX_ROWS

    vocab = model.arch.vocab_size
    per = -(-vocab // size)
    lo, hi = min(rank * per, vocab), min((rank + 1) * per, vocab)
    weight = model.head_weight[lo:hi]
    kernel = getattr(model, "_head_kernel", None)
    head_t = getattr(model, "_head_t", None)
    if kernel is not None and hidden.shape[0] <= SKINNY_MAX_ROWS:
        part = kernel(hidden.contiguous(), weight)
    elif head_t is not None:
        part = hidden @ head_t[:, lo:hi]
    else:
        part = torch.nn.functional.linear(hidden, weight)
    out = torch.zeros((hidden.shape[0], vocab), dtype=part.dtype, device=part.device)
    out[:, lo:hi] = part
    return model.cap_logits(all_reduce(out))


class Worker:
    """A worker rank: its runner (shard and KV cache), its place, its all-reduce, and its last
    forward pass's hidden states (what a head step reads)."""

    def __init__(self, runner: ModelRunner, rank: int, size: int, all_reduce: Any) -> None:
        self.runner, self.rank, self.size, self.all_reduce = runner, rank, size, all_reduce
        self.hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def run(self, step: Step) -> None:
        """A worker's share of one step: the same swaps and forward pass as rank 0's, or its
        slice of the LM head over the last pass's rows."""
        from conveyor.models.attention import build_metadata, open_ranges

        runner = self.runner
        if step.kv is not None:
            runner.release_kv() if step.kv == "release" else runner.restore_kv()
            return
        if step.weights is not None:
            from conveyor.models.loader import update_weights_in_place
            from conveyor.models.tensor_parallel import shard_tensors

            arch = getattr(runner, "full_arch", None)
            mine = dict(shard_tensors(iter(step.weights.items()), self.rank, self.size, arch))
            assert update_weights_in_place(runner.model, mine), "rank 0 copies new weights only where they fit"
            return
        if step.head:
            hidden = self.hidden
            assert hidden is not None, "the head follows a forward pass"
            rows = hidden if step.head_rows is None else hidden[torch.tensor(step.head_rows, dtype=torch.long)]
            split_logits(runner.model, rows, self.rank, self.size, self.all_reduce)
            return
        if step.swap_out:
            runner._copy_blocks(runner.kv_pages, runner.swap_pages, step.swap_out)
        if step.swap_in:
            runner._copy_blocks(runner.swap_pages, runner.kv_pages, step.swap_in)
        if not step.token_ids:
            return
        meta = build_metadata(step.tables, step.starts, step.num_new, runner.block_size, runner.device,
                              runner.sliding_window, runner.dtype)
        if step.window_tables is not None:
            runner.hybrid_metadata(meta, step.window_tables, step.starts, step.num_new)
        if step.embeds is not None:
            meta.embeds = (torch.tensor(step.embeds[0], dtype=torch.long), step.embeds[1])
        if step.ranges is not None:
            open_ranges(meta, step.ranges)
        if step.mrope is not None:
            meta.mrope = step.mrope.to(meta.positions.device)
        input_ids = torch.tensor(step.token_ids, dtype=torch.long, device=runner.device)
        if step.lora is None:
            self.hidden = runner.model(input_ids, meta.positions, runner.kv_caches, meta)
            return
        assert runner.lora is not None, "rank 0 sends adapters only to an engine with enable_lora"
        runner.lora.set_pinned(set(step.lora_pinned))
        with runner.lora.context.use(runner.lora.step(step.lora, step.num_new)):
            self.hidden = runner.model(input_ids, meta.positions, runner.kv_caches, meta)


def _build_rank(recipe: Recipe, rank: int, size: int, all_reduce: Any) -> ModelRunner:
    from conveyor.models.attention import TorchPagedAttention
    from conveyor.models.loader import build_model, open_model
    from conveyor.models.tensor_parallel import shard_arch, shard_tensors
    from conveyor.runner.model_runner import ModelRunner

    device = torch.device("cpu")
    dtype = getattr(torch, recipe.dtype)
    arch, tensors, _ = open_model(Path(recipe.model_path))
    model = build_model(
        shard_arch(arch, size), shard_tensors(tensors, rank, size, arch), TorchPagedAttention(), recipe.max_len, dtype,
        device, recipe.quantization, recipe.calibration_ids, all_reduce=all_reduce,
    )
    runner = ModelRunner(model, recipe.num_blocks, recipe.block_size, dtype, device,
                         num_swap_blocks=recipe.num_swap_blocks, kv_dtype=getattr(torch, recipe.kv_dtype),
                         max_model_len=recipe.max_len, layout=recipe.layout)
    runner.full_arch = arch  # type: ignore[attr-defined]  # (new weights arrive whole: sliced by it)
    if recipe.lora is not None:
        from conveyor.models.lora import LoRAManager

        runner.lora = LoRAManager(model, *recipe.lora, arch=arch, shard=(rank, size))
    return runner


def main(argv: list[str]) -> int:
    from torch.distributed import ProcessGroupGloo, TCPStore

    port, rank, size = (int(a) for a in argv)
    stdin, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed goes to the log, not into the answers
    recipe = _read(stdin)
    if not isinstance(recipe, Recipe):
        return 2
    torch.set_num_threads(recipe.num_threads)
    store = TCPStore("127.0.0.1", port, size, False, timeout=TIMEOUT)
    group = ProcessGroupGloo(store, rank, size, TIMEOUT)
    try:
        all_reduce = AllReduce(group, rank, size, recipe.shm_path)
        parent = os.getppid()
        _watch(lambda: os.getppid() == parent, all_reduce, threading.Event())  # rank 0 gone: stop waiting
        worker = Worker(_build_rank(recipe, rank, size, all_reduce), rank, size, all_reduce)
    except Exception as e:  # the engine raises it: the worker's only report
        _write(answers, f"{type(e).__name__}: {e}")
        return 1
    _write(answers, "ready")
    while (step := _read(stdin)) is not None:
        worker.run(step)
    return 0


if __name__ == "__main__":
    # The module's own `main`, not this copy's: the recipe rank 0 pickles is the module's `Recipe`.
    from conveyor.runner.tensor_parallel import main as _main

    sys.exit(_main(sys.argv[1:]))
