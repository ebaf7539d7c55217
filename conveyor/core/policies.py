"""Queue-order policies: which waiting request is admitted first, which running one is preempted.

A policy is a small class with one job: give every sequence a sort key (lower = served first).
The scheduler admits waiting sequences in key order and, when memory runs out, preempts the
running sequence with the largest key. Policies that learn (predicted output lengths, MLFQ
levels) override the hooks. Adding a policy is one class plus `@register_policy("name")`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from conveyor.config import ConfigError
from conveyor.sequence import Sequence

SortKey = tuple[Any, ...]

_POLICIES: dict[str, type[QueuePolicy]] = {}


def register_policy(name: str) -> Callable[[type[QueuePolicy]], type[QueuePolicy]]:
    def wrap(cls: type[QueuePolicy]) -> type[QueuePolicy]:
        if name in _POLICIES and _POLICIES[name] is not cls:
            raise ValueError(f"a queue policy named {name!r} is already registered")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return wrap


def available_policies() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str, **params: Any) -> QueuePolicy:
    if name not in _POLICIES:
        raise ConfigError(f"policy={name!r} is not one of {available_policies()}")
    return _POLICIES[name](**params)


class QueuePolicy(ABC):
    """Orders sequences. Invariant: `sort_key` is a pure function of the sequence, `now` and
    the policy's own state, so the same inputs give the same schedule (tests rely on it)."""

    name: ClassVar[str] = ""

    @abstractmethod
    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        """Lower keys are admitted first and preempted last."""

    def on_finished(self, seq: Sequence) -> None:  # noqa: B027 - optional hook
        """Called once when a sequence finishes (learning policies observe outcomes here)."""


@register_policy("fcfs")
class FCFSPolicy(QueuePolicy):
    """First come, first served: arrival order; the latest arrival is preempted first."""

    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        return (seq.metrics.arrival_time, seq.seq_id)
