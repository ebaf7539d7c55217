"""Queue-order policies: which waiting request is admitted first, which running one is preempted.

A policy gives every sequence a sort key (lower = served first). The scheduler admits waiting
sequences in key order and, when memory runs out, preempts the running sequence with the
largest key. A *preemptive* policy also lets a waiting sequence displace a running one with a
larger key when seats or blocks are full (priority, MLFQ). Policies that learn (predicted
output lengths, MLFQ levels) observe steps and finished requests through the hooks.

Starvation guard: a policy that can starve a request (everything but FCFS) takes an
`aging_bound_s`; a request that has waited longer than that goes ahead of the policy's own
order (oldest first) and, once admitted, is never displaced by a preemptive policy. So no
request waits much longer than the bound plus the time for a seat to free.

Adding a policy is one class and `@register_policy("name")`; see README "Add a policy".
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

from conveyor.config import ConfigError, SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.registry import Registry
from conveyor.sequence import Sequence

SortKey = tuple[Any, ...]

_POLICIES: Registry[QueuePolicy] = Registry("queue policy")

DEFAULT_AGING_BOUND_S = 30.0


def register_policy(name: str) -> Callable[[type[QueuePolicy]], type[QueuePolicy]]:
    return _POLICIES.register(name)


def available_policies() -> list[str]:
    return _POLICIES.names()


def make_policy(config: SchedulerConfig | str) -> QueuePolicy:
    if isinstance(config, str):
        config = SchedulerConfig(policy=config)
    if config.policy not in _POLICIES:
        raise ConfigError(f"policy={config.policy!r} is not one of {available_policies()}")
    return _POLICIES[config.policy](config)


class QueuePolicy(ABC):
    """Orders sequences. Invariant: `sort_key` depends only on the sequence, `now` and the
    policy's own state, so the same inputs give the same schedule (tests rely on it)."""

    name: ClassVar[str] = ""
    preemptive: ClassVar[bool] = False  # may a waiting sequence displace a running one?
    can_starve: ClassVar[bool] = True

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        bound = config.aging_bound_s
        self.aging_bound_s = bound if bound is not None else (DEFAULT_AGING_BOUND_S if self.can_starve else None)
        self._aged: set[int] = set()

    @abstractmethod
    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        """The policy's own order; lower keys are admitted first and preempted last."""

    def key(self, seq: Sequence, now: float) -> SortKey:
        """`sort_key` behind the aging guard: aged requests come first, oldest first."""
        if self.aging_bound_s is not None and self.is_aged(seq, now):  # is_aged's first test, sparing the call per sort key
            return (0, seq.metrics.arrival_time, seq.seq_id)
        return (1, *self.sort_key(seq, now))

    def is_aged(self, seq: Sequence, now: float) -> bool:
        """A request that waited past the bound stays aged until it finishes: it keeps its
        place at the front and is never displaced by a preemptive policy, so it cannot be
        starved again by the very requests it waited behind."""
        if self.aging_bound_s is None:
            return False
        if seq.seq_id in self._aged:
            return True
        if self.waited(seq, now) > self.aging_bound_s:
            self._aged.add(seq.seq_id)
            return True
        return False

    @staticmethod
    def waited(seq: Sequence, now: float) -> float:
        """Time since the request last made progress (arrival, or its latest token)."""
        last = seq.metrics.last_token_time
        return now - (last if last is not None else seq.metrics.arrival_time)

    def prepare(self, waiting: list[Sequence], block_manager: BlockManager) -> None:  # noqa: B027 - optional hook
        """Called at the start of each schedule, before the queues are sorted (a policy that
        orders by what the KV cache holds looks it up here)."""

    def on_admitted(self, seq: Sequence) -> None:  # noqa: B027 - optional hook
        """Called when a waiting sequence is admitted (fresh, or again after a preemption)."""

    def on_step(self, seqs: Iterable[Sequence]) -> None:  # noqa: B027 - optional hook
        """Called after each step with the sequences that got a new token."""

    def on_finished(self, seq: Sequence) -> None:
        """Called once when a sequence finishes (learning policies observe outcomes here).
        Subclasses that override it must call `super().on_finished(seq)`."""
        self._aged.discard(seq.seq_id)


@register_policy("fcfs")
class FCFSPolicy(QueuePolicy):
    """First come, first served: arrival order; the latest arrival is preempted first."""

    can_starve = False

    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        return (seq.metrics.arrival_time, seq.seq_id)


@register_policy("priority")
class PriorityPolicy(QueuePolicy):
    """`SamplingParams.priority`, lower first, then arrival. Preemptive: a higher-priority
    arrival displaces lower-priority running work when seats or blocks are full."""

    preemptive = True

    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        return (seq.sampling_params.priority, seq.metrics.arrival_time, seq.seq_id)


@register_policy("sjf")
class ShortestJobFirstPolicy(QueuePolicy):
    """Shortest prompt first (the job size known at arrival). Not preemptive."""

    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        return (seq.prompt_len, seq.metrics.arrival_time, seq.seq_id)


@register_policy("lpm")
class LongestPrefixMatchPolicy(QueuePolicy):
    """SGLang's cache-aware order: the waiting request with the longest prefix-cache hit first,
    then arrival. Requests that share what the cache holds now run while it holds it, instead
    of being admitted in arrival order among requests whose prefixes evict theirs (SGLang,
    arXiv 2312.07104, section 3). Running and swapped sequences keep arrival order (the latest
    arrival is preempted first). Not preemptive; it can starve a request whose prefix is never
    cached, hence the aging guard.

    The hits are looked up for every waiting request at every step, so past `max_waiting`
    waiting requests the order falls back to arrival (SGLang does the same past 128).
    """

    max_waiting: ClassVar[int] = 128

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._hit_blocks: dict[int, int] = {}

    def prepare(self, waiting: list[Sequence], block_manager: BlockManager) -> None:
        self._hit_blocks = (
            {s.seq_id: len(block_manager.match_prefix(s, disk=False)) for s in waiting}
            if len(waiting) <= self.max_waiting and block_manager.enable_prefix_caching
            else {}
        )

    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        return (-self._hit_blocks.get(seq.seq_id, 0), seq.metrics.arrival_time, seq.seq_id)


@register_policy("slo")
class SLOAwarePolicy(QueuePolicy):
    """Earliest deadline first, and a request that can no longer meet its deadline goes last.

    A request's deadline is when its next token is due: `slo_ttft_ms` (the request's own
    `SamplingParams.slo_ttft_ms`, else the engine's) after arrival for its first token; once
    it has one, `slo_tpot_ms` per token after its first, which is when the next must come for
    its mean time per output token to stay within the objective. Under
    overload FCFS serves the oldest requests first, which are late already, and so makes the
    next ones late too; this order serves those that can still meet the objectives and leaves
    the late ones for when there is room (or until the aging guard serves them), which is what
    goodput counts (DistServe, OSDI '24). When memory runs out, the victim is a late running
    sequence if there is one, else the one whose next token is due last (the most slack).
    Not preemptive.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.ttft_s = config.slo_ttft_ms / 1e3
        self.tpot_s = config.slo_tpot_ms / 1e3

    def deadline(self, seq: Sequence) -> float:
        """When `seq`'s next token is due (its own objectives if it has any, else the engine's)."""
        params = seq.sampling_params
        first = seq.metrics.first_token_time
        if first is None:
            ttft = self.ttft_s if params.slo_ttft_ms is None else params.slo_ttft_ms / 1e3
            return seq.metrics.arrival_time + ttft
        tpot = self.tpot_s if params.slo_tpot_ms is None else params.slo_tpot_ms / 1e3
        return first + tpot * seq.num_output_tokens

    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        due = self.deadline(seq)
        return (due < now, due, seq.seq_id)


@register_policy("vtc")
class VirtualTokenCounterPolicy(QueuePolicy):
    """Per-tenant fair share by virtual token counters (VTC: Sheng et al., "Fairness in Serving
    Large Language Models", OSDI '24). Each tenant (`SamplingParams.tenant`, the server's
    `user`) has a counter of the service it got: `input_weight` per prompt token when one of
    its requests is first admitted, `output_weight` per output token. The waiting request of
    the tenant with the smallest counter goes first, each tenant's own in arrival order; so a
    tenant that sends ten times as much gets no more than its share while others wait. A
    tenant that starts waiting again is lifted to the smallest counter of those already
    waiting, so an idle spell earns no credit to crowd the others out later. The victim of a
    preemption is the latest request of the tenant with the largest counter. Not preemptive.
    """

    input_weight: ClassVar[float] = 1.0  # the paper's w_p and w_q: an output token costs two
    output_weight: ClassVar[float] = 2.0
    max_tenants: ClassVar[int] = 4096  # past this many counters, forget those that cannot matter

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.counters: dict[str | None, float] = {}
        self._waiting_tenants: set[str | None] = set()
        self._floor = 0.0  # the smallest counter of the tenants that last waited
        self._charged: set[int] = set()  # sequences whose prompt is counted
        self._keys: dict[int, float] = {}

    def prepare(self, waiting: list[Sequence], block_manager: BlockManager) -> None:
        counters = self.counters
        tenants = {s.sampling_params.tenant for s in waiting}
        stayed = [counters.get(t, 0.0) for t in tenants & self._waiting_tenants]
        floor = min(stayed) if stayed else self._floor
        for t in tenants - self._waiting_tenants:
            counters[t] = max(counters.get(t, 0.0), floor)
        self._waiting_tenants = tenants
        if tenants:
            self._floor = min(counters[t] for t in tenants)
        if len(counters) > self.max_tenants:
            # A tenant not waiting, at or below the floor, would be lifted to it on its return
            # anyway: its counter can go (a server sees many users that come once).
            for t in [t for t, c in counters.items() if c <= self._floor and t not in tenants]:
                del counters[t]
        # A tenant's k-th waiting request comes up once its k-1 before it are charged: as if
        # the requests were picked one at a time, with the counters updated in between.
        ahead: dict[str | None, float] = {}
        keys = self._keys = {}
        for s in sorted(waiting, key=lambda s: (s.metrics.arrival_time, s.seq_id)):
            t = s.sampling_params.tenant
            before = ahead.get(t, 0.0)
            keys[s.seq_id] = counters[t] + before
            if s.seq_id not in self._charged:
                ahead[t] = before + self.input_weight * s.prompt_len

    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        key = self._keys.get(seq.seq_id)
        if key is None:  # running or swapped: the most served tenant's latest is the victim
            key = self.counters.get(seq.sampling_params.tenant, 0.0)
        return (key, seq.metrics.arrival_time, seq.seq_id)

    def on_admitted(self, seq: Sequence) -> None:
        if seq.seq_id not in self._charged:
            self._charged.add(seq.seq_id)
            t = seq.sampling_params.tenant
            self.counters[t] = self.counters.get(t, 0.0) + self.input_weight * seq.prompt_len

    def on_step(self, seqs: Iterable[Sequence]) -> None:
        counters, w = self.counters, self.output_weight
        for s in seqs:
            t = s.sampling_params.tenant
            counters[t] = counters.get(t, 0.0) + w

    def on_finished(self, seq: Sequence) -> None:
        super().on_finished(seq)
        self._charged.discard(seq.seq_id)
        if seq.finish_reason is not None and seq.finish_reason.value != "abort":
            t = seq.sampling_params.tenant  # its last token: `on_step` counts only those going on
            self.counters[t] = self.counters.get(t, 0.0) + self.output_weight


class OutputLengthPredictor(Protocol):
    def predict(self, seq: Sequence) -> float: ...

    def observe(self, seq: Sequence) -> None: ...


class OnlineMeanPredictor:
    """Mean output length of finished requests, per prompt-length bucket (powers of two),
    falling back to the global mean, then to `prior` before anything has finished."""

    def __init__(self, prior: float = 128.0) -> None:
        self.prior = prior
        self._sums: dict[int, tuple[float, int]] = {}
        self._total = (0.0, 0)

    @staticmethod
    def _bucket(prompt_len: int) -> int:
        return max(0, math.ceil(math.log2(max(prompt_len, 1))))

    def predict(self, seq: Sequence) -> float:
        s, n = self._sums.get(self._bucket(seq.prompt_len), (0.0, 0))
        if n:
            return s / n
        total, count = self._total
        return total / count if count else self.prior

    def observe(self, seq: Sequence) -> None:
        if seq.finish_reason is not None and seq.finish_reason.value == "abort":
            return  # an aborted request says nothing about how long answers are
        b = self._bucket(seq.prompt_len)
        s, n = self._sums.get(b, (0.0, 0))
        self._sums[b] = (s + seq.num_output_tokens, n + 1)
        total, count = self._total
        self._total = (total + seq.num_output_tokens, count + 1)


@register_policy("spf")
class ShortestPredictedFirstPolicy(QueuePolicy):
    """Shortest predicted remaining output first. The request's `expected_output_tokens`
    hint wins; otherwise an online predictor learned from finished requests."""

    def __init__(self, config: SchedulerConfig, predictor: OutputLengthPredictor | None = None) -> None:
        super().__init__(config)
        self.predictor: OutputLengthPredictor = predictor or OnlineMeanPredictor()

    def predicted_total(self, seq: Sequence) -> float:
        hint = seq.sampling_params.expected_output_tokens
        total = float(hint) if hint is not None else self.predictor.predict(seq)
        return min(total, float(seq.sampling_params.max_tokens))

    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        remaining = max(0.0, self.predicted_total(seq) - seq.num_output_tokens)
        return (remaining, seq.metrics.arrival_time, seq.seq_id)

    def on_finished(self, seq: Sequence) -> None:
        super().on_finished(seq)
        self.predictor.observe(seq)


@register_policy("mlfq")
class MLFQPolicy(QueuePolicy):
    """FastServe's skip-join multi-level feedback queue.

    Level `i` has quantum `mlfq_quantum * 2**i` tokens. A request joins the first level whose
    prompt allowance (`mlfq_prompt_quantum * 2**i` tokens) holds its prompt, so long prompts
    skip the top queues; each token served counts against the level's quantum, and a request
    that uses it up drops one level. Preemptive: at a quantum's end a demoted request yields
    to waiting requests of higher levels.
    """

    preemptive = True

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.levels = config.mlfq_levels
        self._state: dict[int, list[int]] = {}  # seq_id -> [level, tokens served at that level]

    def join_level(self, prompt_len: int) -> int:
        level = 0
        while level < self.levels - 1 and prompt_len > self.config.mlfq_prompt_quantum * 2**level:
            level += 1
        return level

    def level(self, seq: Sequence) -> int:
        state = self._state.get(seq.seq_id)
        if state is None:
            state = self._state[seq.seq_id] = [self.join_level(seq.prompt_len), 0]
        return state[0]

    def quantum(self, level: int) -> int:
        return self.config.mlfq_quantum * 2**level

    def sort_key(self, seq: Sequence, now: float) -> SortKey:
        return (self.level(seq), seq.metrics.arrival_time, seq.seq_id)

    def on_step(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.level(seq)
            state = self._state[seq.seq_id]
            state[1] += 1
            if state[1] >= self.quantum(state[0]) and state[0] < self.levels - 1:
                state[0] += 1
                state[1] = 0

    def on_finished(self, seq: Sequence) -> None:
        super().on_finished(seq)
        self._state.pop(seq.seq_id, None)
