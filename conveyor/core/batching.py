"""When waiting requests may enter the running batch: the batching mode and the admission trigger.

The batching mode decides *which* waiting sequences are eligible at all:
- continuous: every waiting sequence, every step (subject to the admission trigger);
- static: a batch of up to `max_batch_size` is formed when nothing runs, and nobody else joins
  until every member has finished;
- dynamic: like static, but a batch forms only once `max_batch_size` requests wait or the
  oldest has waited `batch_timeout_ms` (the classic dynamic-batching window).

The admission trigger decides *when* a continuous batch opens its doors (TGI's knobs):
every step; every N decode steps; or when waiting/running reaches a ratio, with a bound of
`max_waiting_tokens` decode steps after which waiting requests join anyway.
No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.config import SchedulerConfig
from conveyor.sequence import Sequence


@dataclass(slots=True)
class QueueState:
    """What admission decisions look at."""

    now: float
    waiting: list[Sequence]  # in policy order
    num_running: int  # running + swapped: sequences that hold a seat
    decode_steps_since_admission: int


class Batching:
    """Continuous batching: everyone waiting is eligible, gated by the admission trigger."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.trigger = _make_trigger(config)

    def eligible(self, state: QueueState) -> list[Sequence]:
        """Waiting sequences that may be admitted this step, in policy order."""
        if state.num_running and not self.trigger(state):
            return [s for s in state.waiting if s.num_output_tokens > 0]  # resumes may return
        return state.waiting

    def seat_limit(self) -> int:
        return self.config.max_num_seqs

    def on_admitted(self, seq: Sequence) -> None:
        pass

    def on_finished(self, seq: Sequence) -> None:
        pass


class StaticBatching(Batching):
    """A fixed batch runs to completion; its members alone may (re-)enter until it is done."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.members: set[int] = set()  # the current batch's sequences still unfinished
        self.batches_formed = 0

    def ready_to_form(self, state: QueueState) -> bool:
        return bool(state.waiting)

    def eligible(self, state: QueueState) -> list[Sequence]:
        if not self.members:
            if state.num_running or not self.ready_to_form(state):
                return []
            self.members = {s.seq_id for s in state.waiting[: self.config.batch_size]}
            self.batches_formed += 1
        return [s for s in state.waiting if s.seq_id in self.members]

    def seat_limit(self) -> int:
        return self.config.batch_size

    def on_finished(self, seq: Sequence) -> None:
        self.members.discard(seq.seq_id)


class DynamicBatching(StaticBatching):
    """Static batches that start when full or when the oldest request has waited long enough."""

    def ready_to_form(self, state: QueueState) -> bool:
        if len(state.waiting) >= self.config.batch_size:
            return True
        # The same sum as `next_deadline`: `now - oldest >= timeout` can round below the
        # timeout at now == the deadline, and an idle loop woken then would find nothing to do.
        deadline = self.next_deadline(state.waiting)
        return deadline is not None and state.now >= deadline

    def next_deadline(self, waiting: list[Sequence]) -> float | None:
        """When a partial batch will be allowed to start (so an idle loop knows when to wake)."""
        oldest = min((s.metrics.arrival_time for s in waiting), default=None)
        return None if oldest is None else oldest + self.config.batch_timeout_s


def make_batching(config: SchedulerConfig) -> Batching:
    kinds: dict[str, type[Batching]] = {
        "continuous": Batching,
        "static": StaticBatching,
        "dynamic": DynamicBatching,
    }
    return kinds[config.batching](config)


def _make_trigger(config: SchedulerConfig) -> Callable[[QueueState], bool]:
    if config.admission == "interval":
        interval = config.schedule_interval
        return lambda st: st.decode_steps_since_admission >= interval
    if config.admission == "ratio":
        ratio, patience = config.waiting_served_ratio, config.max_waiting_tokens

        def ratio_trigger(st: QueueState) -> bool:
            fresh = sum(1 for s in st.waiting if s.num_output_tokens == 0)
            return (
                fresh >= ratio * st.num_running
                or st.decode_steps_since_admission >= patience
            )

        return ratio_trigger
    return lambda st: True
