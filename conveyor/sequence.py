"""One request's state, token-centric: `num_computed_tokens` catches up with `num_tokens`.

A prefill, a chunk of a prefill, a decode and a resume after preemption are the same rule: the
scheduler grants a sequence `n` tokens to compute, and when computed reaches the total the
runner samples one more token. No torch here.

The scheduler counts a granted token as computed when it schedules it, and a token to be
sampled as known: it appends `PLACEHOLDER` to `token_ids` at once and `Scheduler.update` puts
the sampled id in its place. With async scheduling the next step is scheduled before the last
one's tokens are back, so a sequence may hold a placeholder (two at most) while it is scheduled
again: the runner reads that decode's input from the previous step's sampled tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.lora import LoRARequest
from conveyor.multimodal import ImageSpan
from conveyor.sampling_params import SamplingParams

PLACEHOLDER = -1  # a sampled token not back from the runner yet (see the module docstring)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock (or virtual-clock) timestamps in seconds; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


class Sequence:
    """Mutable state of one generation stream. Owned by the scheduler."""

    __slots__ = (
        "block_hashes",
        "block_table",
        "cross_table",
        "finish_reason",
        "images",
        "images_charged",
        "lora_request",
        "metrics",
        "num_computed_tokens",
        "num_pending",
        "num_preemptions",
        "prompt_len",
        "request_id",
        "sampling_params",
        "seq_id",
        "status",
        "stop_reason",
        "token_ids",
        "window_start",
        "window_tables",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        lora_request: LoRARequest | None = None,
        images: tuple[ImageSpan, ...] = (),
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.num_computed_tokens = 0
        self.num_pending = 0  # trailing PLACEHOLDERs in token_ids: tokens the runner still owes
        # Grows in place by appends only; any other change assigns a new list (HostBlockTables).
        self.block_table: list[int] = []
        # A hybrid KV cache's (`HybridLayout`): the sliding layer groups' tables, each as long
        # as `block_table`, whose first `window_start` entries are the null block (their tokens
        # out of every query's window). Replaced, never changed in place, but by appends.
        self.window_tables: list[list[int]] = []
        self.window_start = 0
        # An encoder-decoder's (Whisper's): the blocks holding its clip's cross-attention keys
        # and values in every decoder layer's cache (`BlockManager.cross_pages`), taken with its
        # first blocks and released with them. Replaced, never changed in place.
        self.cross_table: list[int] = []
        # Chained hashes of the leading full blocks of token_ids, as far as the block manager
        # has needed them (prefix caching); tokens never change once known, so they stay valid.
        self.block_hashes: list[bytes] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)
        self.images = images  # where its prompt's image tokens are (conveyor/multimodal.py)
        # How many of `images` the scheduler has charged to a step's encoder budget (or seen
        # passed without encoding, as prefix-cache hits): they are encoded in order.
        self.images_charged = 0

    @property
    def num_tokens(self) -> int:
        """Tokens to compute: the prompt, the outputs and any pending placeholders."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs the runner has returned (pending placeholders not counted)."""
        return len(self.token_ids) - self.prompt_len - self.num_pending

    @property
    def num_scheduled_outputs(self) -> int:
        """Outputs returned or owed: what the scheduler has already committed to."""
        return len(self.token_ids) - self.prompt_len

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        """The outputs returned so far (never a placeholder)."""
        return self.token_ids[self.prompt_len : len(self.token_ids) - self.num_pending]

    def resolve(self, token: int) -> None:
        """The runner returned the oldest pending token: it replaces that placeholder."""
        assert self.num_pending > 0, self
        self.token_ids[len(self.token_ids) - self.num_pending] = token
        self.num_pending -= 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while the sequence still has more than one token to compute (prompt or resume)."""
        return self.num_uncomputed_tokens > 1

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, pending={self.num_pending}, blocks={len(self.block_table)})"
        )
