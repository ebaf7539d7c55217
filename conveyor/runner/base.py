"""The runner interface: one `SchedulerOutput` in, one `RunnerOutput` out.

`ModelRunner` runs the real model; a simulator's runner returns a step time from a cost model.
Neither sees queues or policies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from conveyor.core.scheduler import SchedulerOutput

TopLogprobs = list[tuple[int, float]]
PromptLogprob = tuple[float, int, TopLogprobs | None]  # a prompt token's logprob, rank, top k


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[int, int]  # seq_id -> token id, for every scheduled sequence with sample=True
    logprobs: dict[int, tuple[float, TopLogprobs | None]] = field(default_factory=dict)
    # Speculative decoding: a sequence's tokens after its first (in `sampled`), each with its
    # logprobs if asked: the drafts the model accepted, then one of its own.
    accepted: dict[int, list[tuple[int, tuple[float, TopLogprobs | None] | None]]] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: seq_id -> (the index of the first prompt token they are
    # of, then one entry per token): those the step's prompt rows predict.
    prompt_logprobs: dict[int, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    # SamplingParams.pooling: seq_id -> the pooled hidden states (on the runner's device,
    # float32 at least) of an embedding request whose prompt the step completed.
    pooled: dict[int, Any] = field(default_factory=dict)
    duration_s: float = 0.0  # measured (ModelRunner) or simulated (SimRunner) step time
    # A draft model's runner (`keep_logits`): each sampled sequence's logits row, for the
    # drafter to draw its guess from.
    logits: dict[int, Any] | None = None


class Runner(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step. Must sample exactly the sequences marked `sample`."""
        ...

    # Prefill/decode disaggregation (conveyor/kv_transfer.py): the K/V of a sequence's first
    # `num_tokens` tokens out of its device blocks, and handed-over K/V into swap blocks.
    # A hybrid KV cache's sliding groups read and write through tables of their own: theirs
    # follow, and in swap space they start at block `window_start` (`BlockManager.receive`).
    def read_kv(self, block_table: list[int], num_tokens: int, window_tables: Sequence[list[int]] = ()) -> Any: ...

    def receive_kv(self, swap_table: list[int], data: Any, window_tables: Sequence[list[int]] = (),
                   window_start: int = 0) -> None: ...

    def kv_bytes(self, num_tokens: int) -> int: ...

    def kv_mismatch(self, data: Any) -> str | None:
        """Why handed-over K/V cannot serve this model (None: they can)."""
        ...
