"""`LoRARequest`: which low-rank adapter a request runs with (vLLM's multi-LoRA serving).

A request names an adapter; the engine loads it once (a PEFT folder: `adapter_config.json`
and `adapter_model.safetensors`), keeps up to `max_cpu_loras` loaded, and runs requests of
up to `max_loras` adapters in one step beside requests of the base model, each row adding
only its own adapter's `B A x` (conveyor/models/lora.py). No torch here: the scheduler and
the server's processes pass requests around.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from pathlib import Path

from conveyor.sampling_params import InvalidRequestError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter: its name (the model name a server's requests send), its id (vLLM's
    `lora_int_id`) and where its files are. Name and id together are the adapter's identity
    (`key`), what the scheduler counts, the engine keeps loaded and the prefix cache keys on:
    a server that unloads an adapter and loads another under the same name gives it a new id,
    so nothing of the old one (weights, cached K/V) can serve the new one."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise InvalidRequestError("a LoRA adapter needs a name", param="lora_request")
        if self.lora_int_id < 1:
            raise InvalidRequestError(
                f"lora_int_id={self.lora_int_id} must be at least 1 (0 is the base model)", param="lora_request"
            )

    @property
    def key(self) -> tuple[str, int]:
        return (self.lora_name, self.lora_int_id)

    @property
    def hash_salt(self) -> bytes:
        """What the prefix cache chains a request's first block onto: the same tokens under
        another adapter are other K/V, so they never share a cached block."""
        return b"lora:%d:" % self.lora_int_id + self.lora_name.encode()


class LoRAResolver(abc.ABC):
    """Finds an adapter a server was not told of, by the model name a request sends (vLLM's
    `LoRAResolver`): a server with resolvers asks them in turn when a request names an
    unknown model, loads the first adapter found (checked against the model as a load route's
    is) and serves it under that name from then on.

    Register one with `register_lora_resolver(name, resolver)`, or as a package's entry point
    in the group `conveyor.lora_resolvers` (an instance, or a class or function making one);
    `conveyor serve --lora-resolver NAME` uses it."""

    @abc.abstractmethod
    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """The adapter named `lora_name` for the model `base_model_name` (the server's --model
        as given), or None if this resolver has none. Its `lora_int_id` is not kept: the
        server gives each adapter it takes an id of its own."""


class FilesystemResolver(LoRAResolver):
    """Adapters as folders under `root` (vLLM's `lora_filesystem_resolver` plugin and its
    VLLM_LORA_RESOLVER_CACHE_DIR): the model name `sql` is the PEFT folder `root/sql`, if it
    holds an `adapter_config.json` of a LoRA. A name is one folder's name, never a path; the
    adapter is not matched with the model by its `base_model_name_or_path` (a path on another
    machine, often) but checked against the model's shapes when it is loaded."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        if lora_name in ("", ".", "..") or "/" in lora_name or "\\" in lora_name or "\0" in lora_name:
            return None
        folder = self.root / lora_name
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
            return None
        return LoRARequest(lora_name, 1, str(folder))


_RESOLVERS: dict[str, LoRAResolver] = {}


def register_lora_resolver(name: str, resolver: LoRAResolver) -> None:
    """Make `resolver` the one `--lora-resolver name` (`ServerConfig(lora_resolver=(name,))`) uses."""
    if not isinstance(resolver, LoRAResolver):
        raise TypeError(f"lora resolver {name!r}: {resolver!r} is not a LoRAResolver")
    _RESOLVERS[name] = resolver


def lora_resolver(name: str) -> LoRAResolver:
    """The resolver registered as `name`, or a package's entry point of that name in the group
    `conveyor.lora_resolvers`; KeyError naming the ones there are if none is."""
    if name in _RESOLVERS:
        return _RESOLVERS[name]
    from importlib.metadata import entry_points

    for point in entry_points(group="conveyor.lora_resolvers"):
        if point.name == name:
            made = point.load()
            resolver = made() if callable(made) and not isinstance(made, LoRAResolver) else made
            register_lora_resolver(name, resolver)
            return resolver
    known = sorted({*_RESOLVERS, *(p.name for p in entry_points(group="conveyor.lora_resolvers"))})
    raise KeyError(f"no LoRA resolver {name!r} is registered" + (f" (there are {', '.join(known)})" if known else ""))
