"""New weights from a trainer (SGLang's weight-update API; the pattern of verl, OpenRLHF and TRL
with vLLM): tensors handed over in the same process, sent over HTTP as a safetensors file, or
broadcast over a process group the trainer and the engines join.

The engine side is `Engine.update_weights_from_tensor`, `init_weights_update_group`,
`update_weights_from_distributed` and `destroy_weights_update_group` (conveyor/engine.py); this
module holds what both sides share:

- `WeightUpdateGroup`: a process group of its own (gloo on CPU, NCCL on CUDA), made from a TCP
  store the trainer (rank 0) hosts, apart from any default group either side has;
- `WeightBroadcaster`: the trainer's side, rank 0, which sends each tensor in the order of the
  names it gave the engines (`weight_metadata`);
- `serialize_named_tensors` / `deserialize_named_tensors`: a safetensors file in base64, what
  `POST /update_weights_from_tensor` takes (SGLang sends pickles there; a server here unpickles
  nothing a client sends);
- `overlaid`: a checkpoint's tensors with the ones sent in their place.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from conveyor.sampling_params import InvalidRequestError

DEFAULT_GROUP = "weight_update_group"
BACKENDS = ("gloo", "nccl")

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_items(named_tensors: NamedTensors, param: str = "named_tensors") -> list[tuple[str, torch.Tensor]]:
    """`(name, tensor)` pairs from a mapping or pairs; InvalidRequestError for anything else."""
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    if not items:
        raise InvalidRequestError(f"{param}: no tensors", param=param)
    for item in items:
        if (not isinstance(item, tuple | list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], torch.Tensor)):
            raise InvalidRequestError(f"{param}: (name, tensor) pairs are needed, not {type(item).__name__}",
                                      param=param)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"{param}: a name is given twice", param=param)
    return [(n, t) for n, t in items]


def canonical_name(name: str) -> str:
    """The name a checkpoint's tensor and a trainer's parameter share (HF's `model.` prefix off)."""
    return name.removeprefix("model.")


def overlaid(base: Iterator[tuple[str, torch.Tensor]], overlay: Mapping[str, torch.Tensor]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """`base`'s tensors but those `overlay` names, then `overlay`'s."""
    sent = {canonical_name(n) for n in overlay}
    for name, tensor in base:
        if canonical_name(name) not in sent:
            yield name, tensor
    yield from overlay.items()


def parse_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` or `"torch.bfloat16"` as a torch dtype; InvalidRequestError otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"dtypes: {name!r} is not a torch dtype", param="dtypes")
    return dtype


def weight_metadata(named_tensors: NamedTensors) -> tuple[list[str], list[str], list[list[int]]]:
    """What `update_weights_from_distributed` takes for these tensors: names, dtypes, shapes."""
    items = named_items(named_tensors)
    return ([n for n, _ in items], [str(t.dtype).removeprefix("torch.") for _, t in items],
            [list(t.shape) for _, t in items])


# -- over HTTP ------------------------------------------------------------------------------------
def serialize_named_tensors(named_tensors: NamedTensors) -> str:
    """The tensors as one safetensors file in base64 (the body field `safetensors` of
    `POST /update_weights_from_tensor`)."""
    return base64.b64encode(save_named_tensors(named_tensors)).decode("ascii")


def deserialize_named_tensors(data: str) -> dict[str, torch.Tensor]:
    """`serialize_named_tensors`'s text back as tensors; InvalidRequestError if it is not one."""
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:  # (binascii.Error)
        raise InvalidRequestError(f"safetensors: not base64 ({e})", param="safetensors") from None
    return load_named_tensors(raw)


def save_named_tensors(named_tensors: NamedTensors) -> bytes:
    """The tensors as one safetensors file's bytes (the body of `POST /update_weights_from_tensor`
    sent as `application/octet-stream`: no base64 or JSON to write and read, about 4x faster)."""
    from safetensors.torch import save

    return bytes(save({n: t.detach().to("cpu").contiguous() for n, t in named_items(named_tensors)}))


def load_named_tensors(raw: bytes) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; InvalidRequestError if the bytes are not one, or hold none."""
    from safetensors.torch import load

    try:
        tensors = load(raw)
    except Exception as e:  # (safetensors' own errors)
        raise InvalidRequestError(f"safetensors: not a safetensors file ({e})", param="safetensors") from None
    if not tensors:
        raise InvalidRequestError("safetensors: the file holds no tensors", param="safetensors")
    return tensors


# -- over a process group -------------------------------------------------------------------------
class WeightUpdateGroup:
    """One side of a weight-update group: `world_size` ranks, rank 0 the trainer (it hosts the
    TCP store at `master_address:master_port`), the engines the others. Made apart from
    `torch.distributed`'s default group (neither side's own is touched); joining blocks until
    every rank has joined or `timeout_s` passes."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = DEFAULT_GROUP, backend: str = "gloo", timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise InvalidRequestError(f"backend={backend!r}: one of {', '.join(BACKENDS)}", param="backend")
        if not isinstance(world_size, int) or world_size < 2 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidRequestError(f"rank {rank!r} of world_size {world_size!r}: the trainer is rank 0 of 2 or "
                                      "more", param="world_size")
        if backend == "nccl" and not torch.cuda.is_available():
            raise InvalidRequestError("backend='nccl' needs CUDA: use 'gloo'", param="backend")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.name, self.rank, self.world_size, self.backend = group_name, rank, world_size, backend
        try:
            store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout)
        except Exception as e:  # (a refused or timed-out connection, a port in use)
            raise InvalidRequestError(f"the weight-update group's store at {master_address}:{master_port}: {e}",
                                      param="master_address") from None
        self._store = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            self.group: Any = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
        self.device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (in place; the ranks but 0 pass one to fill)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                bucket_bytes: int = 0) -> dict[str, torch.Tensor]:
        """An engine's side of one update: a tensor of each name, dtype and shape, in order; with
        `bucket_bytes`, in the flat buckets `bucket_plan` makes (the trainer's `send` the same)."""
        kinds = [parse_dtype(d) for d in dtypes]
        out: dict[str, torch.Tensor] = {}
        for bucket in bucket_plan(kinds, shapes, bucket_bytes):
            sizes = [_numel(shapes[i]) for i in bucket]
            flat = self.broadcast(torch.empty(sum(sizes), dtype=kinds[bucket[0]], device=self.device))
            for i, part in zip(bucket, flat.split(sizes), strict=True):
                out[names[i]] = part.view(tuple(shapes[i]))
        return out

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            with contextlib.suppress(Exception):  # (a backend without it, or a peer gone)
                shutdown()
        self.group = None


class WeightBroadcaster(WeightUpdateGroup):
    """The trainer's side (rank 0): join the group while the engines join it
    (`init_weights_update_group` with the same address, port, world size and name), then for each
    update ask the engines to receive (`update_weights_from_distributed` with
    `weight_metadata(tensors)`) while `send(tensors)` runs."""

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str = DEFAULT_GROUP,
                 backend: str = "gloo", timeout_s: float = 600.0) -> None:
        super().__init__(master_address, master_port, 0, world_size, group_name, backend, timeout_s)

    def send(self, named_tensors: NamedTensors, bucket_bytes: int = 0) -> None:
        """Broadcast the tensors in order: one broadcast each, or (`bucket_bytes` > 0, the
        engines told the same) runs of one dtype packed flat into buckets of about that size,
        one broadcast a bucket (fewer calls: a mixture of experts has thousands of tensors)."""
        items = named_items(named_tensors)
        for bucket in bucket_plan([t.dtype for _, t in items], [list(t.shape) for _, t in items], bucket_bytes):
            parts = [items[i][1].detach().to(self.device).reshape(-1) for i in bucket]
            self.broadcast(parts[0].contiguous() if len(parts) == 1 else torch.cat(parts))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def bucket_plan(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]], bucket_bytes: int
                ) -> list[list[int]]:
    """The tensors' indices in broadcast order, grouped: each alone (`bucket_bytes` <= 0), or
    consecutive tensors of one dtype until a bucket holds `bucket_bytes` or more (a tensor larger
    than that goes alone). Both sides compute it from the same metadata."""
    if bucket_bytes <= 0:
        return [[i] for i in range(len(dtypes))]
    out: list[list[int]] = []
    size = 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        if out and dtypes[out[-1][0]] == dtype and size < bucket_bytes:
            out[-1].append(i)
        else:
            out.append([i])
            size = 0
        size += _numel(shape) * dtype.itemsize
    return out


def check_update_metadata(names: Any, dtypes: Any, shapes: Any) -> None:
    """InvalidRequestError unless names, dtypes and shapes are lists of one length, of strings,
    dtype names and lists of sizes."""
    if not (isinstance(names, list | tuple) and isinstance(dtypes, list | tuple) and isinstance(shapes, list | tuple)):
        raise InvalidRequestError("names, dtypes and shapes: lists are needed", param="names")
    if not len(names) == len(dtypes) == len(shapes) or not names:
        raise InvalidRequestError(f"names, dtypes and shapes: {len(names)}, {len(dtypes)} and {len(shapes)} items; "
                                  "one each per tensor, one or more", param="names")
    if not all(isinstance(n, str) for n in names):
        raise InvalidRequestError("names: strings are needed", param="names")
    for d in dtypes:
        parse_dtype(d)
    for s in shapes:
        if not isinstance(s, list | tuple) or not all(isinstance(x, int) and x >= 0 for x in s):
            raise InvalidRequestError(f"shapes: {s!r} is not a list of sizes", param="shapes")
