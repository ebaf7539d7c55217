"""K/V handed from one engine to another: prefill/decode disaggregation (DistServe, Splitwise;
vLLM's and SGLang's "PD" serving).

A prefill engine runs a request's prompt and samples its first token
(`Engine.add_request(..., export_kv=True)`, with `max_tokens=1`); the request's final output
carries a `KVHandoff`, the K/V of the tokens it computed, token by token (not block by block:
the two engines may differ in block size and KV dtype). A decode engine takes the request with
that first token as already generated (`Resume`) and the handoff
(`add_request(..., resume=..., kv_handoff=...)`): the K/V land in its CPU swap space, and the
request waits there as a swapped-out sequence does, coming in through the scheduler's swap-in
once a seat and blocks are free; from then on it decodes. The handoff must hold a prefix of
the request's tokens and leave at least one to compute; one that cannot fit the receiving
engine's swap space at all is recomputed there instead (counted in `num_kv_recomputed`).

No torch here: `data` is what the runner reads, a CPU tensor `[layers, 2, tokens, kv_heads,
head_dim]`, or None in a simulation, where only `num_bytes` travels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class KVHandoff:
    token_ids: list[int]  # the tokens whose K/V `data` holds, from position 0
    data: Any  # [layers, 2, len(token_ids), kv_heads, head_dim] on the CPU; None when simulated
    num_bytes: int  # what crosses the link between the engines
    lora_key: tuple[str, int] | None = None  # the adapter the K/V were computed with (`LoRARequest.key`)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class Migration:
    """A running request taken out of one engine to go on in another (Llumnix's live migration,
    stop-and-copy): what `Engine.migrate_out` gives and `Engine.migrate_in` takes. `resume`
    holds its outputs so far (an `engine.Resume`), `handoff` the K/V of its computed tokens
    (None: it had none in the cache, and computes them again where it lands)."""

    request_id: str
    prompt_token_ids: list[int]
    prompt_text: str | None
    params: Any  # SamplingParams
    resume: Any  # engine.Resume
    handoff: KVHandoff | None
    lora_request: Any = None
    stream: bool = False

    @property
    def num_bytes(self) -> int:
        return 0 if self.handoff is None else self.handoff.num_bytes
