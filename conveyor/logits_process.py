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


def load_processors(specs: Sequence[Any], config: EngineConfig, device: torch.device) -> list[LogitsProcessor]:
    """Each spec (a `LogitsProcessor` subclass, or its name as `module:Class` or
    `module.Class`) built for this engine; a name that does not import, or a class of another
    kind, is a ConfigError naming it."""
    out = []
    for spec in specs:
        cls = resolve(spec)
        out.append(cls(config, device))
    return out


def resolve(spec: Any) -> type[LogitsProcessor]:
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
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ConfigError(f"logits_processors: {spec!r} is not a subclass of conveyor.LogitsProcessor")
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
