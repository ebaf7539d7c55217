"""Custom logits processors: user code that edits a step's logits before the draw.

Two kinds, as vLLM has had them:

- **Per request** (`SamplingParams(logits_processors=[fn, ...])`, vLLM v0's and HF's form): a
  callable `fn(output_token_ids, logits)` or `fn(prompt_token_ids, output_token_ids, logits)`
  that returns the row's new logits (`[vocab]` float32; it may edit the row in place and
  return it). Called for each of the request's rows of each step, in list order.
- **Per engine** (`LLM(logits_processors=[MyProcessor])`, `conveyor serve --logits-processors
  module:Class`; vLLM v1's batch-level kind): a `LogitsProcessor` subclass, built once by the
  engine (`cls(config, device)`), whose `apply(logits, rows)` sees a step's whole
  `[rows, vocab]` logits and each row's request (its `SamplingParams`, whose `extra_args` carry
  the request's arguments: the server's `vllm_xargs`) and tokens. A processor leaves the rows
  it has no business with as they are.
- **vLLM v1's own classes, as they are** (`__init__(vllm_config, device, is_pin_memory)`,
  `update_state(batch_update)`, `apply(logits)`, `is_argmax_invariant()`, and the class method
  `validate_params(params)`): taken by the same options and driven as vLLM's persistent batch
  drives them (`PersistentBatch`): each step's changes as a `BatchUpdate` (removed, then added
  with the request's parameters, prompt ids and a live list of its output ids, then moves: a
  swap, or a one-way move into an empty slot) that leaves row i of the step's logits in slot i,
  or None when nothing changed. `vllm_config` is a view of this engine's configuration under
  vLLM's names (`scheduler_config.max_num_seqs`, `model_config`, `cache_config`). With vLLM
  installed its `BatchUpdate` and `MoveDirectionality` are the ones passed, so a processor
  written against vLLM compares against its own enum; without it, this module's. Not with
  speculative decoding (a request has several rows a step there), as in vLLM.

Both run on the model's raw logits, before penalties, logit_bias, masks (structured outputs,
bad words, allowed tokens, min_tokens), temperature and top-k / top-p / min-p, engine-wide
processors first; the logprobs a request asks for stay the raw distribution's (vLLM's default
`raw_logprobs`). A greedy row takes the argmax of the processed logits. A processor costs what
its code costs, on the step's critical path: a batch with one runs the sampler's general path
(not a CUDA graph's own argmax), and the runner builds each row's token lists.

Per-request callables live in the engine's process: an engine in a process of its own
(`AsyncLLM`'s, the server's) takes only what pickles (module-level functions and classes),
and the HTTP API takes none (a client sends `vllm_xargs` to an engine-wide processor instead).
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from conveyor.config import ConfigError

if TYPE_CHECKING:
    import torch

    from conveyor.config import EngineConfig
    from conveyor.sampling_params import SamplingParams


@dataclass(slots=True)
class LogitsRow:
    """One row of a step's logits: its request's parameters and the tokens before the one the
    row draws (a speculative step's rows each follow their own drafts)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seq_id: int = -1  # the sequence's (a vLLM-style processor's persistent batch is keyed by it)


class LogitsProcessor(ABC):
    """An engine-wide logits processor (vLLM v1's batch-level kind).

    Invariants: `apply` returns a `[rows, vocab]` float32 tensor on the logits' device (it may
    edit `logits` in place and return it); row i of `logits` is `rows[i]`'s. It is called once a
    step that samples, from the engine's step loop (one thread), never concurrently.
    """

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        """The step's logits after this processor."""

    def validate_params(self, params: SamplingParams) -> None:  # noqa: B027 (a hook: none by default)
        """Refuse a request this processor cannot serve (ValueError: the request fails alone,
        before it is queued); by default, none."""


# -- vLLM v1's processors ------------------------------------------------------------------------
class MoveDirectionality(Enum):
    """vLLM's: a one-way move (into an empty slot) or a swap of two slots."""

    UNIDIRECTIONAL = auto()
    SWAP = auto()


@dataclass(frozen=True)
class BatchUpdate:
    """vLLM's persistent batch's change in one step, applied in this order: `removed` (slots),
    `added` (slot, parameters, prompt ids, the request's output ids: a list that grows as it
    generates), `moved` (slot, slot, MoveDirectionality)."""

    batch_size: int
    removed: Sequence[int]
    added: Sequence[tuple[int, Any, list[int] | None, list[int]]]
    moved: Sequence[tuple[int, int, Any]]


def _vllm_types() -> tuple[Any, Any]:
    """vLLM's BatchUpdate and MoveDirectionality where vLLM is installed, else this module's."""
    try:
        from vllm.v1.sample.logits_processor import BatchUpdate as VBatchUpdate
        from vllm.v1.sample.logits_processor import MoveDirectionality as VMove
    except Exception:  # (not installed, or another layout)
        return BatchUpdate, MoveDirectionality
    return VBatchUpdate, VMove


def process_dict_updates(state: dict[int, Any], batch_update: Any,
                         new_state: Callable[[Any, list[int] | None, list[int]], Any]) -> bool:
    """A vLLM v1 processor's per-slot `state` brought through `batch_update` (vLLM's helper of
    this name): removed slots dropped, an added request's entry `new_state(params, prompt ids,
    output ids)` (None: no entry), then each move (a swap, or a one-way move that empties its
    source). Whether anything changed."""
    if batch_update is None:
        return False
    changed = False
    for i in batch_update.removed:
        changed |= state.pop(i, None) is not None
    for i, params, prompt, out in batch_update.added:
        entry = new_state(params, prompt, out)
        if entry is None:
            changed |= state.pop(i, None) is not None
        else:
            state[i] = entry
            changed = True
    for a, b, how in batch_update.moved:
        first, second = state.pop(a, None), state.pop(b, None)
        if first is not None:
            state[b] = first
        if getattr(how, "name", "") == "SWAP" and second is not None:
            state[a] = second
        changed |= first is not None or second is not None
    return changed


class AdapterLogitsProcessor(ABC):
    """vLLM v1's `AdapterLogitsProcessor`, for a processor of one request at a time: a subclass
    says, for each request as it joins the batch, which per-request callable edits its row
    (`new_req_logits_processor(params)`: a two- or three-argument callable as
    `SamplingParams.logits_processors` takes, or None), and this base keeps one a slot through
    the batch's updates (`process_dict_updates`) and applies them row by row. A vLLM v1
    processor (it is driven by `PersistentBatch`); a vLLM subclass ports by changing its import."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> Callable[..., torch.Tensor] | None:
        """The callable for a request's row (None: its row is left alone)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def _entry(self, params: SamplingParams, prompt: list[int] | None, out: list[int]
               ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        if _arity(fn) == 3:
            return lambda row: fn(prompt, out, row)
        return lambda row: fn(out, row)

    def update_state(self, batch_update: Any) -> None:
        process_dict_updates(self.req_info, batch_update, self._entry)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, fn in self.req_info.items():
            logits[i] = fn(logits[i])
        return logits


def is_vllm_processor(cls: Any) -> bool:
    return isinstance(cls, type) and all(callable(getattr(cls, m, None))
                                         for m in ("update_state", "apply", "is_argmax_invariant"))


class VllmConfigView:
    """This engine's configuration under the names a vLLM processor reads (`vllm_config`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.conveyor = config
        self.model_config = config.model
        self.scheduler_config = config.scheduler
        self.cache_config = config.cache


class PersistentBatch(LogitsProcessor):
    """A vLLM v1 processor (`inner`) driven as vLLM's persistent batch drives it: before each
    `apply`, the slots are made the step's rows (slot i, row i) by a `BatchUpdate` of removals,
    additions into free slots and moves (swaps, or one-way moves into an empty slot), handed to
    `update_state` (None when nothing changed); the output lists it was given are kept current."""

    def __init__(self, inner: Any, config: EngineConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.inner = inner
        self.update_type, self.move = _vllm_types()
        self.argmax_invariant = bool(inner.is_argmax_invariant())
        self._slots: list[int | None] = []  # the sequence in each slot
        self._outputs: dict[int, list[int]] = {}  # each one's output ids, as handed over

    def validate_params(self, params: SamplingParams) -> None:
        check = getattr(type(self.inner), "validate_params", None)
        if check is not None:
            check(params)

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        update = self.update(rows)
        for row in rows:  # (the lists handed over, grown to this step's tokens: outputs only grow)
            out, now = self._outputs[row.seq_id], row.output_token_ids
            if len(out) < len(now):
                out.extend(now[len(out):])
            elif len(out) > len(now):
                out[:] = now
        self.inner.update_state(update)
        if self.argmax_invariant and all(row.params.greedy for row in rows):
            return logits  # (vLLM's rule: it cannot change a greedy batch's tokens, so it is not run)
        return self.inner.apply(logits)

    def update(self, rows: Sequence[LogitsRow]) -> Any:
        """The BatchUpdate that makes slot i row i's sequence (None if it is already)."""
        keys = [r.seq_id for r in rows]
        if len(set(keys)) != len(keys):
            raise RuntimeError("a vLLM-style logits processor takes one row a request (no speculative decoding)")
        if keys == self._slots:
            return None
        wanted = set(keys)
        slots = list(self._slots) + [None] * max(0, len(keys) - len(self._slots))
        removed = [i for i, k in enumerate(self._slots) if k is not None and k not in wanted]
        for i in removed:
            self._outputs.pop(slots[i], None)  # type: ignore[arg-type]
            slots[i] = None
        free = (i for i, k in enumerate(slots) if k is None)
        added = []
        present = set(slots)
        for row in rows:
            if row.seq_id not in present:
                i = next(free)
                slots[i] = row.seq_id
                out = self._outputs[row.seq_id] = list(row.output_token_ids)
                added.append((i, row.params, list(row.prompt_token_ids), out))
        moved = []
        where = {k: i for i, k in enumerate(slots) if k is not None}
        for i, key in enumerate(keys):
            j = where[key]
            if j == i:
                continue
            if slots[i] is None:  # into an empty slot: one way
                moved.append((j, i, self.move.UNIDIRECTIONAL))
            else:
                moved.append((i, j, self.move.SWAP))
                where[slots[i]] = j  # type: ignore[index]
            slots[i], slots[j] = key, slots[i]
            where[key] = i
        self._slots = slots[: len(keys)]
        assert all(k is None for k in slots[len(keys):])
        return self.update_type(batch_size=len(keys), removed=removed, added=added, moved=moved)


def load_processors(specs: Sequence[Any], config: EngineConfig, device: torch.device) -> list[LogitsProcessor]:
    """Each spec (a `LogitsProcessor` subclass or a vLLM v1 processor class, or its name as
    `module:Class` or `module.Class`) built for this engine; a name that does not import, or a
    class of another kind, is a ConfigError naming it."""
    out: list[LogitsProcessor] = []
    for spec in specs:
        cls: Any = resolve(spec)
        if issubclass(cls, LogitsProcessor):
            out.append(cls(config, device))
            continue
        if config.scheduler.speculative_method:
            raise ConfigError(f"logits_processors: {spec!r} is a vLLM v1 processor, which takes one row a request: "
                              "not with speculative decoding (as in vLLM)")
        out.append(PersistentBatch(cls(VllmConfigView(config), device, False), config, device))
    return out


def resolve(spec: Any) -> type:
    cls = spec
    if isinstance(spec, str):
        module, sep, name = spec.partition(":")
        if not sep:
            module, _, name = spec.rpartition(".")
        if not module or not name:
            raise ConfigError(f"logits_processors: {spec!r} is not `module:Class` or `module.Class`")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"logits_processors: {spec!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and (issubclass(cls, LogitsProcessor) or is_vllm_processor(cls))):
        raise ConfigError(f"logits_processors: {spec!r} is not a subclass of conveyor.LogitsProcessor, nor a vLLM "
                          "v1 processor (update_state, apply, is_argmax_invariant)")
    return cls


def check_request_processor(fn: Any) -> None:
    """A per-request processor must be a callable of 2 or 3 positional arguments (those
    without a default)."""
    if not callable(fn):
        raise ValueError(f"{fn!r} is not callable")
    if _arity(fn) not in (2, 3):
        raise ValueError(f"{fn!r} takes (output_token_ids, logits) or (prompt_token_ids, output_token_ids, logits)")


def _arity(fn: Callable[..., Any]) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # (a builtin without a signature: taken as the two-argument form)
    if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
        return 3
    # (the parameters without a default: `lambda out, row, s=strength: ...` takes two)
    return sum(1 for p in sig.parameters.values()
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


def apply_processors(
    logits: torch.Tensor, rows: Sequence[LogitsRow], processors: Sequence[LogitsProcessor]
) -> torch.Tensor:
    """The engine's processors over the whole batch, then each row's own, in order."""
    for proc in processors:
        logits = proc.apply(logits, rows)
    for i, row in enumerate(rows):
        for fn in row.params.logits_processors:
            if _arity(fn) == 3:
                logits[i] = fn(row.prompt_token_ids, row.output_token_ids, logits[i])
            else:
                logits[i] = fn(row.output_token_ids, logits[i])
    return logits
