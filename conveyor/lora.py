"""`LoRARequest`: which low-rank adapter a request runs with (vLLM's multi-LoRA serving).

A request names an adapter; the engine loads it once (a PEFT folder: `adapter_config.json`
and `adapter_model.safetensors`), keeps up to `max_cpu_loras` loaded, and runs requests of
up to `max_loras` adapters in one step beside requests of the base model, each row adding
only its own adapter's `B A x` (conveyor/models/lora.py). No torch here: the scheduler and
the server's processes pass requests around.
"""

from __future__ import annotations

from dataclasses import dataclass

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
