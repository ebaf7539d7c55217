"""The scheduling switchboard: every axis does what it says, and the invariants hold under
every combination of axes.

Three parts:
- configuration: `SchedulerConfig` accepts exactly the documented combinations; presets build
  valid configs that explicit options override;
- a property test over random full switchboard configs and random request streams (arrivals,
  priorities, length hints, aborts) on a fake clock, checking after every step what each axis
  promises, and at the end that everything finished and every request generated what it
  generates alone;
- deterministic tests of each axis's behaviour, judged from what the scheduler did step by step.

The fake runner (tests/core/helpers.py) honours swaps (swap-outs before swap-ins, both before
computing) and tags every KV slot, so a lost, stale or misplaced block changes the outputs.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from conveyor.config import (
    ADMISSION_TRIGGERS,
    BATCHING_MODES,
    EVICTION_POLICIES,
    KV_RESERVATIONS,
    OFFLOADING_POLICIES,
    PREEMPTION_MODES,
    PREFILL_MODES,
    PRESETS,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
)
from conveyor.core.batching import QueueState, make_batching
from conveyor.core.block_manager import BlockManager, HybridLayout
from conveyor.core.disk_tier import DiskTier
from conveyor.core.policies import OnlineMeanPredictor, ShortestPredictedFirstPolicy
from conveyor.core.scheduler import Scheduler, SchedulerOutput
from conveyor.sampling_params import InvalidRequestError, SamplingParams
from conveyor.sequence import FinishReason, Sequence, SequenceStatus
from tests.core.helpers import (
    EOS,
    STOP_TOKEN,
    Driver,
    FakeRunner,
    blocks_for,
    ids,
    make_prompt,
    reference,
)

POLICIES = ("fcfs", "priority", "sjf", "spf", "mlfq", "lpm", "slo", "vtc")
PREEMPTIVE = ("priority", "mlfq")
DEFAULTS = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}


# == configuration ==========================================================================
def config_problem(kw: dict[str, Any]) -> str | None:
    """The documented rules, written out independently of `SchedulerConfig`: the name of the
    first rule `kw` breaks, or None if the combination is valid."""

    def get(name: str) -> Any:
        return kw.get(name, DEFAULTS[name])

    def differs(name: str) -> bool:
        return bool(get(name) != DEFAULTS[name])

    choices = {
        "batching": BATCHING_MODES,
        "prefill_mode": PREFILL_MODES,
        "admission": ADMISSION_TRIGGERS,
        "preemption_mode": PREEMPTION_MODES,
        "kv_reservation": KV_RESERVATIONS,
    }
    for name, allowed in choices.items():
        if get(name) not in allowed:
            return name
    for name in ("schedule_interval", "max_waiting_tokens", "mlfq_levels", "mlfq_quantum",
                 "mlfq_prompt_quantum", "max_preemptions", "max_num_seqs"):
        if get(name) < 1:
            return name
    if get("long_prefill_token_threshold") < 0 or get("auto_swap_min_tokens") < 0:
        return "negative"
    if get("waiting_served_ratio") <= 0:
        return "waiting_served_ratio"
    if get("slo_ttft_ms") <= 0 or get("slo_tpot_ms") <= 0:
        return "slo targets"
    batched = get("batching") != "continuous"
    if get("max_batch_size") is not None and (
        not batched or not 1 <= get("max_batch_size") <= get("max_num_seqs")
    ):
        return "max_batch_size"
    if get("batch_timeout_ms") is not None and (
        get("batching") != "dynamic" or get("batch_timeout_ms") < 0
    ):
        return "batch_timeout_ms"
    if batched and get("admission") != "every_step":
        return "admission with static/dynamic batching"
    if get("admission") != "interval" and differs("schedule_interval"):
        return "schedule_interval"
    if get("admission") == "interval" and get("schedule_interval") < 2:
        return "interval of 1"
    if get("admission") != "ratio" and (differs("waiting_served_ratio") or differs("max_waiting_tokens")):
        return "ratio knobs"
    if get("long_prefill_token_threshold") and get("prefill_mode") != "chunked":
        return "threshold without chunking"
    if not 1 <= get("max_long_partial_prefills") <= get("max_num_partial_prefills"):
        return "partial prefill counts"
    if get("max_num_partial_prefills") > 1 and get("prefill_mode") != "chunked":
        return "partial prefills without chunking"
    if get("aging_bound_s") is not None and (get("policy") == "fcfs" or get("aging_bound_s") <= 0):
        return "aging_bound_s"
    if get("policy") != "mlfq" and any(
        differs(k) for k in ("mlfq_levels", "mlfq_quantum", "mlfq_prompt_quantum")
    ):
        return "mlfq knobs"
    if get("policy") != "slo" and (differs("slo_ttft_ms") or differs("slo_tpot_ms")):
        return "slo knobs"
    if get("kv_reservation") == "reserve" and get("preemption_mode") != "recompute":
        return "reserve with swap"
    if get("preemption_mode") != "auto" and differs("auto_swap_min_tokens"):
        return "auto_swap_min_tokens"
    ratio_knobs = ("init_new_token_ratio", "min_new_token_ratio", "new_token_ratio_decay_steps",
                   "schedule_conservativeness")
    if get("kv_reservation") != "estimate" and any(differs(k) for k in ratio_knobs):
        return "new-token ratio knobs"
    if not 0 < get("min_new_token_ratio") <= get("init_new_token_ratio") <= 1:
        return "new-token ratios"
    if get("schedule_conservativeness") < 0:
        return "schedule_conservativeness"
    if get("new_token_ratio_decay_steps") < 1:
        return "new_token_ratio_decay_steps"
    return None


@st.composite
def any_scheduler_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    """Every axis and knob, each left out or set to a (mostly meaningful) value."""
    space: dict[str, st.SearchStrategy[Any]] = {
        "max_num_seqs": st.sampled_from([1, 4, 8]),
        "batching": st.sampled_from(BATCHING_MODES),
        "max_batch_size": st.sampled_from([None, 0, 1, 4, 9]),
        "batch_timeout_ms": st.sampled_from([None, -1.0, 0.0, 20.0]),
        "prefill_mode": st.sampled_from(PREFILL_MODES),
        "long_prefill_token_threshold": st.sampled_from([0, 8, -1]),
        "admission": st.sampled_from(ADMISSION_TRIGGERS),
        "schedule_interval": st.sampled_from([0, 1, 2, 5]),
        "waiting_served_ratio": st.sampled_from([1.2, 0.5, 0.0]),
        "max_waiting_tokens": st.sampled_from([20, 4, 0]),
        "policy": st.sampled_from(POLICIES),
        "aging_bound_s": st.sampled_from([None, 1.0, 0.0]),
        "mlfq_levels": st.sampled_from([4, 2, 0]),
        "mlfq_quantum": st.sampled_from([32, 8]),
        "mlfq_prompt_quantum": st.sampled_from([256, 16]),
        "slo_ttft_ms": st.sampled_from([1000.0, 20.0, 0.0]),
        "slo_tpot_ms": st.sampled_from([100.0, 5.0, -1.0]),
        "preemption_mode": st.sampled_from(PREEMPTION_MODES),
        "auto_swap_min_tokens": st.sampled_from([256, 16, -1]),
        "max_preemptions": st.sampled_from([3, 1, 0]),
        "kv_reservation": st.sampled_from(KV_RESERVATIONS),
        "init_new_token_ratio": st.sampled_from([0.7, 0.3, 1.0, 1.5, 0.05]),
        "min_new_token_ratio": st.sampled_from([0.098, 0.3, 0.0]),
        "new_token_ratio_decay_steps": st.sampled_from([600, 10, 0]),
        "schedule_conservativeness": st.sampled_from([1.0, 0.3, 2.0, 0.0, -1.0]),
        "max_num_partial_prefills": st.sampled_from([1, 3, 0]),
        "max_long_partial_prefills": st.sampled_from([1, 2, 0]),
    }
    names = draw(st.sets(st.sampled_from(sorted(space)), max_size=6))
    return {name: draw(space[name]) for name in sorted(names)}


@settings(max_examples=400, deadline=None)
@given(any_scheduler_kwargs())
def test_config_accepts_exactly_the_documented_combinations(kw: dict[str, Any]) -> None:
    problem = config_problem(kw)
    event("refused" if problem else "accepted")
    if problem is None:
        cfg = SchedulerConfig(**kw)
        for name, value in kw.items():
            assert getattr(cfg, name) == value
    else:
        with pytest.raises(ConfigError):
            SchedulerConfig(**kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(batching="round_robin"), "batching"),
        (dict(prefill_mode="split"), "prefill_mode"),
        (dict(admission="sometimes"), "admission"),
        (dict(preemption_mode="kill"), "preemption_mode"),
        (dict(kv_reservation="half"), "kv_reservation"),
        (dict(max_batch_size=4), "static/dynamic"),
        (dict(batching="static", max_num_seqs=4, max_batch_size=5), "max_batch_size"),
        (dict(batching="static", batch_timeout_ms=10.0), "dynamic"),
        (dict(batching="static", admission="interval", schedule_interval=2), "never lets anyone join"),
        (dict(batching="dynamic", admission="ratio"), "never lets anyone join"),
        (dict(schedule_interval=4), "interval"),
        (dict(admission="interval"), "schedule_interval >= 2"),
        (dict(waiting_served_ratio=2.0), "ratio"),
        (dict(admission="interval", schedule_interval=2, max_waiting_tokens=5), "ratio"),
        (dict(prefill_mode="mixed", long_prefill_token_threshold=64), "chunked"),
        (dict(prefill_mode="prefill_first", long_prefill_token_threshold=64), "chunked"),
        (dict(aging_bound_s=5.0), "fcfs"),
        (dict(policy="sjf", aging_bound_s=0.0), "aging_bound_s"),
        (dict(policy="priority", mlfq_quantum=8), "mlfq"),
        (dict(kv_reservation="reserve", preemption_mode="swap"), "never preempts"),
        (dict(kv_reservation="reserve", preemption_mode="auto"), "never preempts"),
        (dict(preemption_mode="swap", auto_swap_min_tokens=64), "auto"),
        (dict(max_preemptions=0), "max_preemptions"),
    ],
)
def test_invalid_combinations_raise_config_error(kw: dict[str, Any], match: str) -> None:
    assert config_problem(kw) is not None
    with pytest.raises(ConfigError, match=match):
        SchedulerConfig(**kw)


def test_unknown_policy_is_refused_when_the_scheduler_is_built() -> None:
    with pytest.raises(ConfigError, match="policy"):
        Scheduler(SchedulerConfig(policy="lottery"), BlockManager(4, 4), 16)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_valid_configs(name: str) -> None:
    cfg = EngineConfig.from_kwargs(preset=name)
    for key, value in PRESETS[name].items():
        assert getattr(cfg.scheduler, key) == value
    assert config_problem(PRESETS[name]) is None


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_explicit_options_override_a_preset(name: str) -> None:
    cfg = EngineConfig.from_kwargs(preset=name, max_num_seqs=3, max_num_batched_tokens=100, block_size=8)
    assert cfg.scheduler.max_num_seqs == 3
    assert cfg.scheduler.max_num_batched_tokens == 100
    assert cfg.cache.block_size == 8
    # What was not overridden still comes from the preset.
    assert cfg.scheduler.policy == PRESETS[name]["policy"]
    assert cfg.scheduler.prefill_mode == PRESETS[name]["prefill_mode"]
    # None means "not given" and keeps the preset's value.
    assert EngineConfig.from_kwargs(preset=name, policy=None).scheduler.policy == PRESETS[name]["policy"]


@pytest.mark.parametrize(
    ("name", "override"),
    [
        # An override of an axis drops the preset's knobs of the old choice on that axis.
        ("ttft", dict(policy="fcfs")),
        ("latency", dict(prefill_mode="mixed")),
        ("latency", dict(prefill_mode="prefill_first")),
        ("ttft", dict(policy="mlfq", mlfq_quantum=8)),
        ("throughput", dict(batching="static", max_batch_size=8)),
        ("latency", dict(admission="interval", schedule_interval=4)),
    ],
)
def test_overriding_a_preset_axis_gives_a_valid_config(name: str, override: dict[str, Any]) -> None:
    cfg = EngineConfig.from_kwargs(preset=name, **override)
    for key, value in override.items():
        assert getattr(cfg.scheduler, key) == value
    assert config_problem({k: getattr(cfg.scheduler, k) for k in DEFAULTS}) is None


def test_preset_still_refuses_an_explicit_contradiction() -> None:
    with pytest.raises(ConfigError, match="fcfs"):
        EngineConfig.from_kwargs(preset="ttft", policy="fcfs", aging_bound_s=3.0)
    with pytest.raises(ConfigError, match="preset"):
        EngineConfig.from_kwargs(preset="fastest")


# == random switchboards ====================================================================
DT = 0.01  # seconds of fake clock per step
MAX_STEPS = 20_000


@dataclass(frozen=True, slots=True)
class Req:
    prompt_len: int
    max_tokens: int
    arrival: float
    priority: int = 0
    expected: int | None = None
    abort_at: float | None = None
    abort_mid_step: bool = False
    ignore_eos: bool = True
    min_tokens: int = 0
    stop_on_token: bool = False
    family: int | None = None  # requests of one family share their prompts' leading tokens

    def prompt(self, index: int) -> list[int]:
        return make_prompt(index if self.family is None else 1000 + self.family, self.prompt_len)

    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, self.max_tokens),
            stop_token_ids=(STOP_TOKEN,) if self.stop_on_token else (),
            priority=self.priority,
            expected_output_tokens=self.expected,
            tenant=f"tenant{self.priority}",  # (vtc) a tenant per priority level
        )


@dataclass(frozen=True, slots=True)
class Board:
    config: SchedulerConfig
    block_size: int
    num_blocks: int
    num_swap_blocks: int
    requests: tuple[Req, ...]
    prefix_caching: bool = False
    layout: HybridLayout | None = None
    cross_tokens: int = 0  # an encoder-decoder's (Whisper's): each sequence's cross-attention blocks' positions
    num_offload_blocks: int = 0  # KV offloading's tier of the prefix cache
    offloading_policy: str = "write_back"
    num_disk_blocks: int = 0  # a disk tier under it (files in a temporary directory)
    eviction_policy: str = "lru"  # which free cached block the prefix cache gives up first

    @property
    def max_model_len(self) -> int:
        if self.layout is not None:  # what one sequence's tables hold alone (as `plan_cache`)
            return self.layout.capacity(self.num_blocks, self.block_size, self.config.kv_chunk)
        return (self.num_blocks - blocks_for(self.cross_tokens, self.block_size)) * self.block_size

    @property
    def plenty_of_swap(self) -> bool:
        """Every seat can hold a whole cache's worth of swapped blocks."""
        return self.num_swap_blocks >= self.num_blocks * self.config.max_num_seqs


@st.composite
def switchboard_configs(draw: st.DrawFn, memory: str, prefill_mode: str) -> SchedulerConfig:
    """A random valid combination of every axis and its knobs. `memory` is a preemption mode,
    or "reserve" for kv_reservation='reserve' (which never preempts)."""
    max_num_seqs = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 10]))
    kw: dict[str, Any] = dict(
        max_num_seqs=max_num_seqs,
        # Mostly budgets a sequence can outgrow (prompts are at most 48 tokens).
        max_num_batched_tokens=draw(
            st.one_of(st.integers(1, 16), st.integers(17, 64), st.integers(65, 256), st.just(48))
        ),
        batching=draw(st.sampled_from(BATCHING_MODES)),
        prefill_mode=prefill_mode,
        policy=draw(st.sampled_from(POLICIES)),
        kv_reservation="reserve" if memory == "reserve" else draw(st.sampled_from(["on_demand", "estimate"])),
        max_preemptions=draw(st.integers(1, 4)),
    )
    if kw["kv_reservation"] == "estimate" and draw(st.booleans()):  # SGLang's defaults, or a short decay
        low = draw(st.sampled_from([0.01, 0.1, 0.5]))
        kw.update(min_new_token_ratio=low, init_new_token_ratio=draw(st.sampled_from([low, 0.7, 1.0])),
                  new_token_ratio_decay_steps=draw(st.integers(1, 20)),
                  schedule_conservativeness=draw(st.sampled_from([1.0, 0.0, 0.5, 3.0])))
    if kw["batching"] == "continuous":
        kw["admission"] = draw(st.sampled_from(ADMISSION_TRIGGERS))
    else:
        if draw(st.booleans()):
            kw["max_batch_size"] = draw(st.integers(1, max_num_seqs))
        if kw["batching"] == "dynamic" and draw(st.booleans()):
            kw["batch_timeout_ms"] = draw(st.sampled_from([0.0, 5.0, 30.0, 70.0, 250.0]))
    if kw.get("admission") == "interval":
        kw["schedule_interval"] = draw(st.integers(2, 6))
    if kw.get("admission") == "ratio":
        kw["waiting_served_ratio"] = draw(st.sampled_from([0.3, 1.2, 3.0]))
        kw["max_waiting_tokens"] = draw(st.integers(1, 30))
    if kw["prefill_mode"] == "chunked" and draw(st.booleans()):
        kw["long_prefill_token_threshold"] = draw(st.integers(1, 32))
    if kw["prefill_mode"] == "chunked" and draw(st.booleans()):  # vLLM's partial prefills
        kw["max_num_partial_prefills"] = draw(st.integers(2, 4))
        kw["max_long_partial_prefills"] = draw(st.integers(1, kw["max_num_partial_prefills"]))
    if kw["policy"] != "fcfs" and draw(st.booleans()):
        kw["aging_bound_s"] = draw(st.sampled_from([0.02, 0.1, 0.5, 30.0]))
    if kw["policy"] == "mlfq":
        kw["mlfq_levels"] = draw(st.integers(1, 4))
        kw["mlfq_quantum"] = draw(st.integers(1, 8))
        kw["mlfq_prompt_quantum"] = draw(st.integers(1, 32))
    if kw["policy"] == "slo":  # the fake clock advances DT (10 ms) a step: deadlines of a few steps
        kw["slo_ttft_ms"] = draw(st.sampled_from([20.0, 50.0, 200.0, 1e6]))
        kw["slo_tpot_ms"] = draw(st.sampled_from([10.0, 30.0, 100.0]))
    if memory != "reserve":
        kw["preemption_mode"] = memory
    if kw.get("preemption_mode") == "auto":
        kw["auto_swap_min_tokens"] = draw(st.sampled_from([0, 1, 4, 8, 16, 32]))
    assert config_problem(kw) is None, kw
    return SchedulerConfig(**kw)


@st.composite
def boards(draw: st.DrawFn, memory: str, prefill_mode: str) -> Board:
    config = draw(switchboard_configs(memory, prefill_mode))
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    # Mostly caches of a few dozen tokens, so that requests compete and get preempted;
    # sometimes >= 100 blocks, where the admission watermark is at least one block.
    cache_tokens = draw(st.sampled_from([8, 16, 24, 32, 48, 64, 96, 1600]))
    num_blocks = max(1, cache_tokens // block_size)
    max_model_len = num_blocks * block_size
    plenty = num_blocks * config.max_num_seqs
    # With no swap space, swap and auto must fall back to recompute.
    num_swap_blocks = draw(st.sampled_from([0, 1, 2, 4, 8, plenty, plenty]))
    longest = max(1, min(max_model_len - 1, 48))
    if config.prefill_mode != "chunked":
        # The engine refuses prompts longer than the step budget when prompts run whole.
        longest = min(longest, config.max_num_batched_tokens)
    near_budget = min(config.max_num_batched_tokens, longest)
    requests = draw(st.lists(reqs(longest, near_budget), min_size=2, max_size=14))
    return Board(config, block_size, num_blocks, num_swap_blocks, tuple(requests), draw(st.booleans()),
                 eviction_policy=draw(st.sampled_from(EVICTION_POLICIES)))


@st.composite
def reqs(draw: st.DrawFn, longest_prompt: int, near_budget: int) -> Req:
    max_tokens = draw(st.one_of(st.integers(1, 24), st.integers(12, 24)))
    # Many requests at time 0 compete at once; later ones join a running batch; some land
    # between two steps of the fake clock.
    arrival = draw(
        st.one_of(
            st.just(0.0),
            st.integers(0, 40).map(lambda k: k * DT),
            st.floats(0.0, 0.5, allow_nan=False).map(lambda t: round(t, 4)),
        )
    )
    abort_at = draw(st.one_of(st.none(), st.none(), st.integers(0, 60).map(lambda k: arrival + k * DT)))
    return Req(
        prompt_len=draw(
            st.one_of(
                st.integers(1, longest_prompt),
                st.integers(max(1, near_budget - 2), near_budget),
            )
        ),
        max_tokens=max_tokens,
        arrival=arrival,
        priority=draw(st.integers(0, 3)),
        expected=draw(st.one_of(st.none(), st.integers(0, 30))),
        abort_at=abort_at,
        abort_mid_step=draw(st.booleans()),
        ignore_eos=draw(st.booleans()),
        min_tokens=draw(st.one_of(st.just(0), st.integers(0, max_tokens))),
        stop_on_token=draw(st.booleans()),
        family=draw(st.one_of(st.none(), st.integers(0, 2))),
    )


@dataclass(slots=True)
class Before:
    """What the scheduler held just before `schedule()`."""

    now: float
    waiting: list[Sequence]
    running: list[Sequence]
    swapped: list[Sequence]
    computed: dict[int, int]
    uncomputed: dict[int, int]
    tables: dict[int, list[int]]
    first_scheduled: set[int]
    free_swap_blocks: int
    members: set[int]
    batches_formed: int
    keys: dict[int, Any]
    wakeup: float | None

    @classmethod
    def of(cls, sched: Scheduler, now: float) -> Before:
        everyone = list(sched.all_sequences())
        batching = sched.batching
        sched.policy.prepare(sched.waiting, sched.block_manager)  # as `schedule` will, first (lpm)
        return cls(
            now=now,
            waiting=list(sched.waiting),
            running=list(sched.running),
            swapped=list(sched.swapped),
            computed={s.seq_id: s.num_computed_tokens for s in everyone},
            uncomputed={s.seq_id: s.num_uncomputed_tokens for s in everyone},
            # Every block a sequence holds (a hybrid cache's sliding tables' too).
            tables={s.seq_id: [b for t in sched.block_manager.tables_of(s) for b in t] for s in everyone},
            first_scheduled={s.seq_id for s in everyone if s.metrics.first_scheduled_time is not None},
            free_swap_blocks=sched.block_manager.num_free_swap_blocks,
            members=set(getattr(batching, "members", set())),
            batches_formed=getattr(batching, "batches_formed", 0),
            keys={s.seq_id: sched.policy.key(s, now) for s in everyone},
            wakeup=sched.next_wakeup(),
        )

    @property
    def seats_held(self) -> int:
        return len(self.running) + len(self.swapped)


class Checker:
    """Everything each axis promises about one step, judged from outside the scheduler."""

    def __init__(self, board: Board, sched: Scheduler) -> None:
        self.board = board
        self.cfg = board.config
        self.sched = sched
        self.decode_steps_since_admission = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def is_prefill_work(before: Before, item: Any) -> bool:
        """A prompt, a prompt chunk, a recompute: the sequence had more than one token to
        compute, or starts from nothing (a fresh one-token prompt). Else it is a decode."""
        return before.uncomputed[item.seq_id] > 1 or item.start_pos == 0

    def trigger_open(self, before: Before) -> bool:
        cfg = self.cfg
        if before.seats_held == 0 or cfg.admission == "every_step":
            return True
        if cfg.admission == "interval":
            return self.decode_steps_since_admission >= cfg.schedule_interval
        fresh = sum(1 for s in before.waiting if s.num_output_tokens == 0)
        return (
            fresh >= cfg.waiting_served_ratio * before.seats_held
            or self.decode_steps_since_admission >= cfg.max_waiting_tokens
        )

    def dynamic_ready(self, before: Before) -> bool:
        if len(before.waiting) >= self.cfg.batch_size:
            return True
        return before.wakeup is not None and before.now >= before.wakeup

    # -- the step --------------------------------------------------------------------------
    def after_schedule(self, before: Before, out: SchedulerOutput) -> None:
        cfg, sched, bs = self.cfg, self.sched, self.board.block_size
        sched.check_integrity()
        scheduled = ids(out)
        assert len(scheduled) == len(set(scheduled)), f"a sequence scheduled twice: {scheduled}"
        # Seats and budget.
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) + len(sched.swapped) <= cfg.max_num_seqs
        if cfg.batching != "continuous":
            assert len(sched.running) + len(sched.swapped) <= cfg.batch_size
        # Every item is the next run of its sequence's tokens, on blocks that cover it.
        by_id = {s.seq_id: s for s in sched.all_sequences()}
        for item in out.scheduled:
            seq = by_id[item.seq_id]
            end = item.start_pos + len(item.token_ids)
            assert seq.status is SequenceStatus.RUNNING
            assert len(item.token_ids) >= 1
            assert end == seq.num_computed_tokens  # counted as computed at once
            assert item.token_ids == seq.token_ids[item.start_pos : end]
            assert item.block_table is seq.block_table
            assert item.sample == (seq.num_pending == 1)  # the token to sample is a placeholder
            assert end == seq.num_tokens - seq.num_pending if item.sample else end < seq.num_tokens
            if cfg.kv_reservation != "reserve":  # (estimate allocates on demand too)
                assert len(item.block_table) == blocks_for(end, bs)
            if before.computed[item.seq_id] == 0 and item.start_pos > 0:  # a prefix-cache hit
                assert self.board.prefix_caching and item.start_pos % bs == 0, item
                assert item.start_pos < seq.num_tokens - seq.num_pending, "a hit left nothing to compute"
            layout = self.board.layout
            if layout is not None:
                # A hybrid cache's sliding tables: as long as the global one, every block before
                # the first query's window released at once, every one after it held.
                assert item.window_tables is seq.window_tables
                assert len(seq.window_tables) == layout.num_window_groups
                dead = max(0, item.start_pos - layout.window + 1) // bs
                assert seq.window_start == dead, (seq, dead)
                sliding = [*seq.window_tables, *([item.block_table] if layout.all_sliding else [])]
                for t in sliding:
                    assert len(t) == len(item.block_table)
                    assert all(b == board_null(self.board) for b in t[:dead])
                    assert board_null(self.board) not in t[dead:]
                if not layout.all_sliding:
                    assert board_null(self.board) not in item.block_table
        for seq in sched.running:
            if cfg.kv_reservation == "reserve":
                reserved = min(seq.prompt_len + seq.sampling_params.max_tokens, self.board.max_model_len)
                assert len(seq.block_table) == blocks_for(reserved, bs), seq
            elif seq.seq_id not in scheduled:
                assert len(seq.block_table) == blocks_for(seq.num_computed_tokens, bs)
        for seq in sched.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        self._check_preemptions(before, out, scheduled)
        self._check_prefill_mode(before, out, by_id)
        self._check_admission(before, out, by_id)
        self._check_batching(before, out)
        self._check_liveness(before, out)

    def _check_preemptions(self, before: Before, out: SchedulerOutput, scheduled: list[int]) -> None:
        cfg, sched = self.cfg, self.sched
        if cfg.kv_reservation == "reserve":
            assert not out.preempted_seq_ids, "kv_reservation='reserve' preempted"
        swapped_now = {s.seq_id for s in sched.swapped}
        pool = before.free_swap_blocks
        swaps = 0
        for seq_id in out.preempted_seq_ids:
            assert seq_id not in scheduled, "a sequence preempted and scheduled in one step"
            assert seq_id in {s.seq_id for s in before.running}, "preempted a sequence not running"
            seq = next(s for s in before.running if s.seq_id == seq_id)
            table = before.tables[seq_id]
            computed = before.computed[seq_id]
            wants_swap = cfg.preemption_mode == "swap" or (
                cfg.preemption_mode == "auto" and computed >= cfg.auto_swap_min_tokens
            )
            fits = 0 < len(table) <= pool
            if seq_id in swapped_now:
                # A swapped sequence keeps its computed tokens, on as many swap blocks (fewer
                # in a hybrid cache, when its allocation this step released sliding ones).
                held = sched.block_manager.num_held(seq)
                assert wants_swap and 0 < held <= pool, f"seq {seq_id} swapped under {cfg.preemption_mode}"
                assert seq.num_computed_tokens == computed
                assert held == len(table) or (self.board.layout is not None and held < len(table))
                pool -= held
                swaps += 1
            else:
                assert seq in sched.waiting
                assert seq.num_computed_tokens == 0 and seq.block_table == []
                if wants_swap and fits and cfg.policy not in PREEMPTIVE:
                    # Without displacement every preemption is for memory: swap when it can.
                    raise AssertionError(f"seq {seq_id} recomputed though it could be swapped")
        assert len(out.blocks_to_swap_out) == sum(
            sched.block_manager.num_held(s) for s in sched.swapped if s.seq_id in out.preempted_seq_ids
        )
        assert sched.num_swaps_out - self.num_swapped_out == swaps
        self.num_swapped_out = sched.num_swaps_out
        swapped_in = [s for s in before.swapped if s.seq_id in scheduled]
        assert sched.num_swaps_in - self.num_swapped_in == len(swapped_in)
        self.num_swapped_in = sched.num_swaps_in
        assert len(out.blocks_to_swap_in) == sum(len(before.tables[s.seq_id]) for s in swapped_in)
        new_tokens = {item.seq_id: len(item.token_ids) for item in out.scheduled}
        for s in swapped_in:  # resumes where it left off (and this step's tokens count)
            assert s.num_computed_tokens == before.computed[s.seq_id] + new_tokens[s.seq_id]
        if cfg.preemption_mode == "recompute" or self.board.num_swap_blocks == 0:
            assert not (out.blocks_to_swap_out or out.blocks_to_swap_in or sched.swapped)

    def _check_prefill_mode(self, before: Before, out: SchedulerOutput, by_id: dict[int, Sequence]) -> None:
        cfg = self.cfg
        if cfg.prefill_mode == "chunked":
            cap = cfg.long_prefill_token_threshold
            if cap:
                assert all(len(item.token_ids) <= max(cap, 1) for item in out.scheduled)
            if cfg.max_num_partial_prefills > 1:  # vLLM's partial prefills: so many prompts a step at most
                prefills = [item for item in out.scheduled if self.is_prefill_work(before, item)]
                assert len(prefills) <= cfg.max_num_partial_prefills, out.scheduled
            return
        for item in out.scheduled:
            if not self.is_prefill_work(before, item):
                continue
            seq = by_id[item.seq_id]
            end = item.start_pos + len(item.token_ids)
            hit = before.computed[item.seq_id] == 0 and item.start_pos > 0  # prefix cache
            if hit:
                assert self.board.prefix_caching and item.start_pos % self.board.block_size == 0, item
            if seq.num_output_tokens == 0:
                # A fresh prompt runs whole (after its cached prefix).
                assert (item.start_pos == 0 or hit) and end == seq.prompt_len, item
            else:
                # A resume runs to the end, unless it outgrew the step budget (then in chunks).
                known = seq.num_tokens - seq.num_pending
                outgrown = known - item.start_pos > cfg.max_num_batched_tokens
                assert end == known or outgrown, item
        if cfg.prefill_mode == "prefill_first":
            kinds = {self.is_prefill_work(before, item) for item in out.scheduled}
            assert len(kinds) <= 1, f"prefill_first step mixes prefills and decodes: {out.scheduled}"

    def _check_admission(self, before: Before, out: SchedulerOutput, by_id: dict[int, Sequence]) -> None:
        cfg = self.cfg
        scheduled = set(ids(out))
        waiting_ids = {s.seq_id for s in before.waiting}
        admitted = [by_id[i] for i in ids(out) if i in waiting_ids]
        fresh = [s for s in admitted if s.num_output_tokens == 0]
        if fresh:
            assert self.trigger_open(before), f"admission={cfg.admission} admitted while closed"
        # Admission follows the policy's order among the eligible (head of line).
        if cfg.batching != "continuous":
            members = set(getattr(self.sched.batching, "members", set()))
            eligible_ids = {s.seq_id for s in before.waiting if s.seq_id in members}
        elif self.trigger_open(before):
            eligible_ids = waiting_ids
        else:
            eligible_ids = {s.seq_id for s in before.waiting if s.num_output_tokens > 0}
        order = sorted((s for s in before.waiting if s.seq_id in eligible_ids), key=lambda s: before.keys[s.seq_id])
        if cfg.max_num_partial_prefills > 1:
            # vLLM's partial prefills: a long prompt left waiting while max_long_partial_prefills
            # long ones prefill (running before, or admitted now) is passed by shorter ones.
            long = self.sched.long_prompt_tokens
            longs = sum(1 for s in (*before.running, *before.swapped) if before.uncomputed[s.seq_id] > long)
            longs += sum(1 for s in admitted if before.uncomputed[s.seq_id] > long)
            if longs >= cfg.max_long_partial_prefills:
                order = [s for s in order if s.seq_id in scheduled or before.uncomputed[s.seq_id] <= long]
        taken = [s.seq_id in scheduled for s in order]
        assert taken == sorted(taken, reverse=True), (
            f"admitted past a better waiting request: {[(s.seq_id, before.keys[s.seq_id]) for s in order]}, {taken}"
        )
        if fresh:
            self.decode_steps_since_admission = 0
        elif out.num_decode_tokens:
            self.decode_steps_since_admission += 1

    def _check_batching(self, before: Before, out: SchedulerOutput) -> None:
        cfg, sched = self.cfg, self.sched
        if cfg.batching == "continuous":
            return
        batching: Any = sched.batching
        formed = batching.batches_formed - before.batches_formed
        assert formed in (0, 1)
        if formed:
            # A new batch forms only when the last one is done, from the best waiting requests.
            assert not before.members and before.seats_held == 0
            order = sorted(before.waiting, key=lambda s: before.keys[s.seq_id])
            want = {s.seq_id for s in order[: cfg.batch_size]}
            assert batching.members == want
            if cfg.batching == "dynamic":
                assert self.dynamic_ready(before), "a dynamic batch started before its window closed"
        else:
            assert batching.members == before.members, "a batch changed while it ran"
            if not before.members and before.seats_held == 0 and before.waiting:
                assert cfg.batching == "dynamic" and not self.dynamic_ready(before), (
                    "an idle batcher left a ready batch waiting"
                )
        # Nobody outside the current batch runs.
        members = batching.members
        assert set(ids(out)) <= members
        assert {s.seq_id for s in (*sched.running, *sched.swapped)} <= members
        assert len(members) <= cfg.batch_size

    def _check_liveness(self, before: Before, out: SchedulerOutput) -> None:
        if not (before.waiting or before.running or before.swapped) or not out.is_empty:
            return
        if out.preempted_seq_ids:
            return  # a step that only made room (displacement)
        assert self.cfg.batching == "dynamic" and before.seats_held == 0 and not self.dynamic_ready(before), (
            f"empty step with {self.sched.num_unfinished} unfinished"
        )


@dataclass(slots=True)
class BoardRun:
    seqs: dict[int, Sequence]
    reqs: dict[int, Req]
    steps: int
    sched: Scheduler


def admissible(board: Board, req: Req) -> bool:
    """What the engine accepts (`Engine.validate`)."""
    if req.prompt_len >= board.max_model_len:
        return False
    return board.config.prefill_mode == "chunked" or req.prompt_len <= board.config.max_num_batched_tokens


def board_null(board: Board) -> int:
    return board.num_blocks  # (the block manager's null block)


def run_board(board: Board) -> BoardRun:
    with tempfile.TemporaryDirectory() as root:
        disk = DiskTier(root, "layout", board.num_disk_blocks, 8) if board.num_disk_blocks else None
        return _run_board(board, disk)


def _run_board(board: Board, disk: DiskTier | None) -> BoardRun:
    bm = BlockManager(board.num_blocks, board.block_size, board.num_swap_blocks, board.prefix_caching, board.layout,
                      cross_tokens=board.cross_tokens, num_offload_blocks=board.num_offload_blocks,
                      offloading_policy=board.offloading_policy, disk=disk, eviction_policy=board.eviction_policy)
    sched = Scheduler(board.config, bm, board.max_model_len, frozenset({EOS}))
    runner = FakeRunner(board.num_blocks, board.block_size, board.num_swap_blocks, board.prefix_caching,
                        board.layout.window if board.layout else 0, board.layout is not None and board.layout.all_sliding,
                        cross_tokens=board.cross_tokens, num_offload_blocks=board.num_offload_blocks, disk=disk)
    checker = Checker(board, sched)
    specs = {i: r for i, r in enumerate(board.requests) if admissible(board, r)}
    pending = sorted(specs, key=lambda i: (specs[i].arrival, i))
    seqs: dict[int, Sequence] = {}
    aborted: set[int] = set()
    reported_finished: Counter[int] = Counter()
    now = 0.0

    def abort_due(mid: bool) -> None:
        for i, seq in seqs.items():
            at = specs[i].abort_at
            if at is None or i in aborted or specs[i].abort_mid_step != mid or at > now:
                continue
            aborted.add(i)
            was_live = not seq.is_finished
            assert (sched.abort(i, now) is not None) == was_live
            assert seq.is_finished and seq.block_table == []

    for step in range(MAX_STEPS):  # noqa: B007 - `step` is reported
        while pending and specs[pending[0]].arrival <= now:
            i = pending.pop(0)
            spec = specs[i]
            seqs[i] = Sequence(i, f"r{i}", spec.prompt(i), spec.params(), spec.arrival)
            sched.add(seqs[i])
        abort_due(mid=False)
        if not pending and not sched.has_unfinished():
            break
        before = Before.of(sched, now)
        out = sched.schedule(now)
        checker.after_schedule(before, out)
        reported_finished.update(out.finished_seq_ids)
        sampled = runner(out)
        # The runner saw exactly the swaps the scheduler made.
        assert runner.swapped_out == [i for i in out.preempted_seq_ids if seqs[i].status is SequenceStatus.SWAPPED]
        abort_due(mid=True)
        gone = {i for i in ids(out) if seqs[i].is_finished}
        updates = sched.update(out, sampled, now)
        assert [u.seq.seq_id for u in updates] == [i for i in ids(out) if i not in gone]
        sched.check_integrity()
        for seq in sched.running:
            assert seq.num_uncomputed_tokens >= 1 and seq.num_tokens < board.max_model_len
        if out.is_empty and sched.has_unfinished():
            # Idle: let the clock run to the next event (a dynamic window, an arrival).
            wake = sched.next_wakeup()
            nxt = wake if wake is not None and wake > now else now + DT
            if pending:
                nxt = min(nxt, max(specs[pending[0]].arrival, now + 1e-6))
            now = nxt
        else:
            now += DT
    else:
        pytest.fail(f"not finished after {MAX_STEPS} steps: starvation or livelock")
    bm_free = sched.block_manager
    assert bm_free.num_free_blocks == board.num_blocks, "device blocks leaked"
    assert bm_free.num_free_swap_blocks == board.num_swap_blocks, "swap blocks leaked"
    last = sched.schedule(now)
    for _ in range(MAX_STEPS):  # the last steps' write-through (a few blocks a schedule, as the tier allows)
        if not (last.blocks_to_store and board.offloading_policy != "write_back"):
            break
        reported_finished.update(last.finished_seq_ids)
        runner(last)
        last = sched.schedule(now)
    assert not sched.block_manager.has_pending_copies
    assert last.is_empty
    reported_finished.update(last.finished_seq_ids)
    assert reported_finished == Counter(seqs.keys()), "the runner must hear of every finish once"
    assert sched.num_preemptions == sum(s.num_preemptions for s in seqs.values())
    assert sched.num_swaps_in <= sched.num_swaps_out
    return BoardRun(seqs, specs, step, sched)


def check_board_outputs(run: BoardRun, board: Board) -> None:
    """Token-centric invariance: outputs never depend on how the request was scheduled."""
    assert set(run.seqs) == set(run.reqs), "an admissible request never arrived"
    for i, seq in run.seqs.items():
        assert seq.is_finished, f"request {i} never finished"
        want, reason = reference(seq.prompt_token_ids, seq.sampling_params, board.max_model_len)
        got = seq.output_token_ids
        if seq.finish_reason is FinishReason.ABORT:
            assert run.reqs[i].abort_at is not None
            assert len(got) < len(want) and got == want[: len(got)]
        else:
            assert got == want, f"request {i}: got {got}, alone it generates {want}"
            assert seq.finish_reason is reason
        m = seq.metrics
        assert len(m.token_times) == len(got), "a token is timed once, when it is sampled"
        assert m.finished_time is not None and m.finished_time >= m.arrival_time


MEMORY = ("recompute", "swap", "auto", "reserve")


# One test per preemption setup and prefill mode, so that the search covers each; the other
# axes (batching, admission, policy and their knobs) are drawn.
def over_every_board(max_examples: int) -> Callable[[Callable[..., None]], Any]:
    """A test of `(memory, prefill_mode, data)` run for each memory and prefill mode, on
    `max_examples` random boards each."""

    def wrap(test: Callable[..., None]) -> Any:
        test = given(data=st.data())(test)
        test = settings(max_examples=max_examples, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(test)
        return pytest.mark.parametrize("prefill_mode", PREFILL_MODES)(pytest.mark.parametrize("memory", MEMORY)(test))

    return wrap


@over_every_board(100)
def test_every_switchboard_keeps_the_invariants(memory: str, prefill_mode: str, data: st.DataObject) -> None:
    board = data.draw(boards(memory, prefill_mode))
    run = run_board(board)
    check_board_outputs(run, board)
    cfg = board.config
    if cfg.kv_reservation == "reserve":
        assert run.sched.num_preemptions == 0
    event(f"batching={cfg.batching}")
    event(f"kv_reservation={cfg.kv_reservation}")
    event(f"policy={cfg.policy}")
    event(f"admission={cfg.admission}")
    event("swapped" if run.sched.num_swaps_out else "no swap")
    event("preempted" if run.sched.num_preemptions else "no preemption")
    if board.prefix_caching:
        event("prefix hits" if run.sched.block_manager.num_hit_tokens else "prefix caching, no hit")


@over_every_board(30)
def test_every_switchboard_keeps_the_invariants_with_kv_offloading(
    memory: str, prefill_mode: str, data: st.DataObject
) -> None:
    """The same invariants with a tier of the prefix cache in host memory: evicted cached
    blocks are stored there and loaded back for hits (the fake runner checks every slot a
    step reads holds its prefix's K/V), under every axis and policy, each write policy, with
    or without a disk tier under it."""
    board = data.draw(boards(memory, prefill_mode))
    board = dataclasses.replace(board, prefix_caching=True, num_offload_blocks=data.draw(st.integers(1, 32)),
                                offloading_policy=data.draw(st.sampled_from(OFFLOADING_POLICIES)),
                                num_disk_blocks=data.draw(st.sampled_from([0, 0, 2, 64])))
    run = run_board(board)
    check_board_outputs(run, board)
    bm = run.sched.block_manager
    target(float(bm.num_offload_hit_tokens), label="tier hits")
    event("tier hits" if bm.num_offload_hit_tokens else "no tier hit")
    event(f"offloading_policy={board.offloading_policy}")
    if board.num_disk_blocks:
        target(float(bm.num_disk_hit_tokens), label="disk hits")
        event("disk hits" if bm.num_disk_hit_tokens else "a disk tier, no disk hit")
    event("preempted" if run.sched.num_preemptions else "no preemption")


@st.composite
def hybrid_boards(draw: st.DrawFn, memory: str, prefill_mode: str) -> Board:
    """A board over a hybrid cache: sliding groups (1 to 3) beside the global one, or one table
    that slides itself (every layer sliding), with windows from one token to more than the
    longest sequence; the pool grown about as many times as a sequence has tables."""
    board = draw(boards(memory, prefill_mode))
    window = draw(st.one_of(st.integers(1, 6), st.integers(7, 80)))
    groups = draw(st.integers(0, 3))  # 0: every layer slides, and so does the block table
    layout = HybridLayout(window=window, page_layers=1, num_window_groups=groups, all_sliding=not groups)
    return dataclasses.replace(board, num_blocks=board.num_blocks * max(1, groups), layout=layout)


@over_every_board(40)
def test_every_switchboard_keeps_the_invariants_over_a_hybrid_cache(
    memory: str, prefill_mode: str, data: st.DataObject
) -> None:
    """The same invariants with sliding tables that release their blocks as the window moves
    on: the fake runner reads each group's window through its own table, so a block released
    while a query still reads it (and handed to another sequence), a swap that forgets a
    sliding block, or a prefix hit without its window's blocks gives a wrong token."""
    board = data.draw(hybrid_boards(memory, prefill_mode))
    run = run_board(board)
    check_board_outputs(run, board)
    assert board.layout is not None
    event("every layer slides" if board.layout.all_sliding else "global and sliding groups")
    event("window outgrown" if any(s.num_tokens > board.layout.window + board.block_size
                                   for s in run.seqs.values()) else "window never outgrown")
    event("swapped" if run.sched.num_swaps_out else "no swap")
    event("preempted" if run.sched.num_preemptions else "no preemption")
    if board.prefix_caching:
        event("prefix hits" if run.sched.block_manager.num_hit_tokens else "prefix caching, no hit")


@over_every_board(30)
def test_every_switchboard_keeps_the_invariants_with_cross_attention_blocks(
    memory: str, prefill_mode: str, data: st.DataObject
) -> None:
    """The same invariants where every sequence also holds cross-attention blocks (Whisper's:
    the encoder's positions' keys and values, `BlockManager.cross_pages`), the pool grown by one
    sequence's worth of them: admission, displacement and preemption count them, a swap brings
    them back and a recompute writes them again (the fake runner reads every one at each step),
    and none leaks. No prefix cache (the engine runs Whisper without one)."""
    board = data.draw(boards(memory, prefill_mode))
    cross = data.draw(st.integers(1, 24))
    board = dataclasses.replace(board, num_blocks=board.num_blocks + blocks_for(cross, board.block_size),
                                prefix_caching=False, cross_tokens=cross)
    run = run_board(board)
    check_board_outputs(run, board)
    event(f"policy={board.config.policy}")
    event("swapped" if run.sched.num_swaps_out else "no swap")
    event("preempted" if run.sched.num_preemptions else "no preemption")


# == deterministic behaviour of each axis ===================================================
def fresh_admissions(d: Driver) -> dict[int, int]:
    """seq id -> index of the step that first computed it."""
    first: dict[int, int] = {}
    for i, out in enumerate(d.log):
        for seq_id in ids(out):
            first.setdefault(seq_id, i)
    return first


def finish_step(d: Driver, seq_id: int) -> int:
    """Index of the step whose update finished `seq_id`."""
    t = d.seqs[seq_id].metrics.finished_time
    assert t is not None
    return d.times.index(t)


# -- batching ------------------------------------------------------------------------------
def test_static_batching_admits_nobody_until_its_batch_is_done() -> None:
    d = Driver(64, 4, batching="static", max_num_seqs=8, max_batch_size=2)
    d.add(0, 3, 3)
    d.add(1, 3, 6)
    d.add(2, 3, 2)  # a seat frees when 0 finishes, but 2 is not in the batch
    for _ in range(2):
        d.step()
    d.add(3, 2, 2)  # arrives while the first batch runs
    d.run()
    first = fresh_admissions(d)
    end_of_batch = max(finish_step(d, 0), finish_step(d, 1))
    assert finish_step(d, 0) < finish_step(d, 1) == end_of_batch
    for out in d.log[: end_of_batch + 1]:
        assert set(ids(out)) <= {0, 1}
    # The next batch is everyone who waited meanwhile, and it starts right after.
    assert first[2] == first[3] == end_of_batch + 1
    assert d.sched.batching.batches_formed == 2  # type: ignore[attr-defined]
    d.check_outputs()


def test_dynamic_batching_starts_a_partial_batch_at_its_deadline() -> None:
    d = Driver(64, 4, dt=0.01, batching="dynamic", max_num_seqs=8, max_batch_size=4, batch_timeout_ms=50)
    d.add(0, 3, 2, at=0.0)
    d.add(1, 3, 2, at=0.02)
    assert d.sched.next_wakeup() == pytest.approx(0.05)  # the oldest request's window
    while d.now < 0.045:
        assert d.step().is_empty  # a partial batch waits for the window...
    d.now = d.sched.next_wakeup()  # type: ignore[assignment]
    out = d.step()  # ...and starts exactly when it closes
    assert ids(out) == [0, 1]
    assert d.sched.next_wakeup() is None  # nothing to wait for while a batch runs
    d.run()
    d.check_outputs()


def test_dynamic_batching_starts_a_full_batch_at_once() -> None:
    d = Driver(64, 4, dt=0.01, batching="dynamic", max_num_seqs=8, max_batch_size=3, batch_timeout_ms=1000)
    for i in range(4):
        d.add(i, 3, 3)
    out = d.step()
    assert ids(out) == [0, 1, 2]  # full: no waiting for the window; 3 is in the next batch
    d.run()
    # 3 alone is a partial batch: it starts when its window (1 s) closes, and not before.
    assert 1.0 - 1e-9 <= d.times[d.first_step_of(3)] <= 1.0 + d.dt + 1e-9
    d.check_outputs()


def test_dynamic_batching_never_waits_past_its_window_after_a_batch() -> None:
    d = Driver(64, 4, dt=0.01, batching="dynamic", max_num_seqs=8, max_batch_size=4, batch_timeout_ms=20)
    d.add(0, 3, 8)
    while not d.step().scheduled:
        pass
    assert d.times[d.first_step_of(0)] == pytest.approx(0.02)
    d.add(1, 2, 2)  # waits for batch {0}; its own window closes long before 0 finishes
    d.run()
    assert d.first_step_of(1) == finish_step(d, 0) + 1
    d.check_outputs()


# -- admission triggers --------------------------------------------------------------------
def admission_steps(d: Driver) -> list[int]:
    return sorted(set(fresh_admissions(d).values()))


def test_interval_trigger_admits_exactly_every_n_decode_steps() -> None:
    n = 3
    d = Driver(256, 4, admission="interval", schedule_interval=n, max_num_seqs=32)
    d.add(0, 4, 40)
    for k in range(16):
        if k:
            d.add(k, 2, 40)  # one arrival before every step
        d.step()
    first = fresh_admissions(d)
    assert admission_steps(d) == [0, 4, 8, 12]
    # Each admission takes everyone who arrived since the last one.
    assert [first[k] for k in range(1, 13)] == [4] * 4 + [8] * 4 + [12] * 4
    for a, b in [(0, 4), (4, 8), (8, 12)]:
        decode_steps = [i for i in range(a + 1, b) if d.log[i].num_decode_tokens]
        assert len(decode_steps) == n


@pytest.mark.parametrize(("steps", "open_"), [(0, False), (3, False), (4, True), (9, True)])
def test_interval_trigger_gates_fresh_requests_only(steps: int, open_: bool) -> None:
    batching = make_batching(SchedulerConfig(admission="interval", schedule_interval=4))
    fresh = Sequence(0, "f", [1, 2], SamplingParams(), 0.0)
    resumed = Sequence(1, "r", [1, 2], SamplingParams(), 0.0)
    resumed.token_ids.append(3)  # has output: preempted, waiting to resume
    eligible = batching.eligible(QueueState(1.0, [fresh, resumed], 1, steps))
    # A closed door keeps fresh requests out; a preempted one may always come back.
    assert eligible == ([fresh, resumed] if open_ else [resumed])
    assert batching.eligible(QueueState(1.0, [fresh, resumed], 0, 0)) == [fresh, resumed]


def test_ratio_trigger_admits_when_enough_wait_or_after_max_waiting_tokens() -> None:
    d = Driver(256, 4, admission="ratio", waiting_served_ratio=2.0, max_waiting_tokens=5, max_num_seqs=32)
    d.add(0, 3, 40)
    d.add(1, 3, 40)
    d.step()  # step 0: nothing ran, so the door was open
    d.add(2, 3, 40)  # 1 fresh waiting < 2.0 * 2 running
    d.step()  # step 1
    d.add(3, 3, 40)
    d.add(4, 3, 40)
    d.add(5, 3, 40)  # 4 fresh waiting >= 2.0 * 2 running: admitted at once
    d.step()  # step 2
    d.add(6, 3, 40)  # 1 waiting vs 6 running: must wait 5 decode steps
    for _ in range(8):
        d.step()
    first = fresh_admissions(d)
    assert first[0] == first[1] == 0
    assert first[2] == first[3] == first[4] == first[5] == 2
    assert first[6] == 8  # decode steps 3..7 without admission, then the patience runs out
    assert all(d.log[i].num_decode_tokens for i in range(3, 8))


@pytest.mark.parametrize(
    ("fresh", "resumed", "running", "steps", "open_"),
    [
        (3, 0, 2, 0, False),  # 3 < 2.0 * 2
        (4, 0, 2, 0, True),  # 4 >= 2.0 * 2
        (3, 5, 2, 0, False),  # preempted requests waiting to resume do not count
        (1, 0, 6, 4, False),
        (1, 0, 6, 5, True),  # max_waiting_tokens decode steps without admission
        (1, 0, 0, 0, True),  # nothing runs: always open
    ],
)
def test_ratio_trigger_counts_fresh_requests_only(
    fresh: int, resumed: int, running: int, steps: int, open_: bool
) -> None:
    cfg = SchedulerConfig(admission="ratio", waiting_served_ratio=2.0, max_waiting_tokens=5)
    batching = make_batching(cfg)
    waiting = []
    for i in range(fresh + resumed):
        seq = Sequence(i, f"r{i}", [1, 2], SamplingParams(), 0.0)
        if i >= fresh:
            seq.token_ids.append(3)  # has output: a preempted request waiting to resume
        waiting.append(seq)
    eligible = batching.eligible(QueueState(1.0, waiting, running, steps))
    # Resumes may always come back; fresh requests only when the trigger is open.
    assert eligible == (waiting if open_ else waiting[fresh:])


# -- prefill modes -------------------------------------------------------------------------
def kinds(out: SchedulerOutput) -> set[str]:
    """'prefill' for a prompt (or chunk, or recompute) item, 'decode' for a one-token step."""
    return {
        "prefill" if len(item.token_ids) > 1 or item.start_pos == 0 else "decode"
        for item in out.scheduled
    }


def test_prefill_first_steps_hold_no_decodes() -> None:
    d = Driver(64, 4, prefill_mode="prefill_first", max_num_batched_tokens=10)
    d.add(0, 4, 12)
    d.step()
    d.step()
    d.add(1, 8, 3)
    d.add(2, 6, 3)  # 8 + 6 > 10: two prefill steps in a row, decodes pause for both
    out1, out2, out3 = d.step(), d.step(), d.step()
    assert [(i.seq_id, len(i.token_ids)) for i in out1.scheduled] == [(1, 8)]
    assert [(i.seq_id, len(i.token_ids)) for i in out2.scheduled] == [(2, 6)]
    assert ids(out3) == [0, 1, 2] and kinds(out3) == {"decode"}
    d.run()
    for out in d.log:
        assert len(kinds(out)) == 1
    d.check_outputs()


def test_prefill_first_swaps_back_in_a_decode_step() -> None:
    # Regression: a swapped-out decode came back in the same step as a new prompt's prefill.
    d = Driver(10, 1, num_swap_blocks=20, prefill_mode="prefill_first", preemption_mode="swap",
               max_num_seqs=4, max_num_batched_tokens=16, max_model_len=10)
    d.add(0, 4, 6)
    d.add(1, 4, 5)
    while not d.sched.swapped:
        d.step()
    assert d.sched.swapped == [d.seqs[1]]
    d.add(2, 3, 2)  # waits: swapped sequences come back first
    d.run()
    swap_ins = [i for i, out in enumerate(d.log) if out.blocks_to_swap_in]
    assert swap_ins and all(kinds(d.log[i]) == {"decode"} for i in swap_ins)
    assert d.first_step_of(2) > swap_ins[0]
    for out in d.log:
        assert len(kinds(out)) == 1
    assert d.sched.num_swaps_out == d.sched.num_swaps_in >= 1
    d.check_outputs()


def test_mixed_steps_hold_whole_prompts_beside_decodes() -> None:
    d = Driver(64, 4, prefill_mode="mixed", max_num_batched_tokens=10)
    d.add(0, 3, 8)
    d.step()
    d.add(1, 9, 4)  # 1 decode + 9 = 10: fits whole beside the decode
    out = d.step()
    assert [(i.seq_id, i.start_pos, len(i.token_ids)) for i in out.scheduled] == [(0, 3, 1), (1, 0, 9)]
    d.add(2, 9, 2)  # 2 decodes + 9 > 10: it waits; it is never split
    d.run()
    for out in d.log:
        for item in out.scheduled:
            if len(item.token_ids) > 1 or item.start_pos == 0:
                assert item.start_pos == 0 and len(item.token_ids) == item.prompt_len
    # 2 starts once a step has room for all 9 of its tokens: when 1 has finished.
    assert d.first_step_of(2) == finish_step(d, 1) + 1
    d.check_outputs()


def test_chunked_steps_fill_the_budget_beside_decodes_and_never_exceed_it() -> None:
    d = Driver(64, 4, max_num_batched_tokens=8)
    d.add(0, 3, 10)
    d.step()
    d.add(1, 20, 2)
    outs = [d.step() for _ in range(3)]
    assert [[(i.seq_id, len(i.token_ids)) for i in out.scheduled] for out in outs] == [
        [(0, 1), (1, 7)],
        [(0, 1), (1, 7)],
        [(0, 1), (1, 6)],  # the rest of the prompt; it samples its first token
    ]
    assert [out.num_tokens for out in outs] == [8, 8, 7]
    d.run()
    assert all(out.num_tokens <= 8 for out in d.log)
    d.check_outputs()


def test_long_prefill_token_threshold_caps_each_prompt_chunk() -> None:
    d = Driver(64, 4, max_num_batched_tokens=16, long_prefill_token_threshold=5)
    d.add(0, 12, 2)
    d.add(1, 12, 2)
    out = d.step()
    # Two prompts share the budget: each gets at most the cap.
    assert [(i.seq_id, len(i.token_ids)) for i in out.scheduled] == [(0, 5), (1, 5)]
    d.run()
    assert all(len(i.token_ids) <= 5 for out in d.log for i in out.scheduled)
    d.check_outputs()


def test_partial_prefills_let_short_prompts_past_a_long_one() -> None:
    """vLLM's partial prefills: at most 4 prompts a step, of which 1 long (over 40 tokens), each
    chunk at most the budget over the prompts expected to prefill. The second long prompt waits
    in its place while the short ones behind it start at once, and goes once what is left of the
    first is no longer long."""
    d = Driver(256, 4, max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=40,
               max_num_partial_prefills=4, max_long_partial_prefills=1)
    d.add(0, 200, 2)  # long
    d.add(1, 200, 2)  # long, after it
    for i in (2, 3, 4):
        d.add(i, 12, 2)  # short ones
    out = d.step()
    # The long one and three short ones: 64 // 4 = 16 tokens a chunk at most (and the cap of 40).
    assert [(i.seq_id, len(i.token_ids)) for i in out.scheduled] == [(0, 16), (2, 12), (3, 12), (4, 12)]
    while d.sched.get(0).num_uncomputed_tokens > 40:  # (what is left of it counts: 40 or less is short)
        assert 1 not in {i.seq_id for i in d.step().scheduled}
    assert 1 in {i.seq_id for i in d.step().scheduled}
    d.run()
    d.check_outputs()
    without = Driver(256, 4, max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=40)
    for i, n in enumerate((200, 200, 12, 12, 12)):
        without.add(i, n, 2)
    first = without.step()  # FCFS with the budget alone: the two long prompts take it all
    assert [(i.seq_id, len(i.token_ids)) for i in first.scheduled] == [(0, 40), (1, 24)]
    without.run()
    assert min(without.first_step_of(i) for i in (2, 3, 4)) >= 5  # after both long prompts' chunks


# -- queue policies ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_late_urgent_request_displaces_when_seats_are_full(mode: str) -> None:
    d = Driver(64, 4, num_swap_blocks=64, policy="priority", preemption_mode=mode, max_num_seqs=2)
    d.add(0, 3, 20, priority=5)
    d.add(1, 3, 20, priority=5)
    for _ in range(3):
        d.step()
    d.add(2, 3, 3, priority=0)
    d.run()
    assert d.seqs[1].num_preemptions == 1 and d.seqs[0].num_preemptions == 0
    assert d.finish_order[0] == 2
    assert finish_step(d, 2) <= d.first_step_of(2) + 3  # it ran without further delay
    d.check_outputs()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_late_urgent_request_displaces_when_blocks_are_full(mode: str) -> None:
    # 8 blocks of 2: two running requests hold all of them by the time the urgent one comes.
    d = Driver(8, 2, num_swap_blocks=64, policy="priority", preemption_mode=mode, max_num_seqs=8,
               max_model_len=16)
    d.add(0, 4, 12, priority=3)
    d.add(1, 4, 12, priority=3)
    for _ in range(4):
        d.step()
    assert d.bm.num_free_blocks < 3  # the urgent prompt needs 3 blocks
    d.add(2, 6, 2, priority=0)
    d.run()
    assert d.finish_order[0] == 2
    assert d.seqs[2].num_preemptions == 0 and d.sched.num_preemptions >= 1
    d.check_outputs()


def test_priority_urgent_request_displaces_under_the_estimated_reservation() -> None:
    """kv_reservation='estimate': the room displacement makes counts as admission counts it, the
    urgent request's expected blocks and the running ones' beside its prompt's: it displaces
    as many as that takes (one of the two here), and is admitted in the same step."""
    d = Driver(16, 2, policy="priority", max_num_seqs=8, kv_reservation="estimate", init_new_token_ratio=1.0,
               min_new_token_ratio=1.0, max_model_len=32)
    d.add(0, 4, 8, priority=3)  # 12 tokens expected: 6 blocks each
    d.add(1, 4, 8, priority=3)
    d.step()
    assert len(d.sched.running) == 2
    d.add(2, 6, 10, priority=0)  # 16 tokens expected: 8 blocks; 4 are free, 6 + 6 expected for the others
    out = d.step()
    assert out.preempted_seq_ids == [1] and 2 in {i.seq_id for i in out.scheduled}
    d.run()
    assert d.finish_order == [0, 2, 1] and d.seqs[2].num_preemptions == 0 and d.seqs[0].num_preemptions == 0
    d.check_outputs()


def test_priority_urgent_request_displaces_for_its_cross_attention_blocks_too() -> None:
    # Whisper's requests hold 2 cross blocks each (8 encoder positions, blocks of 4) beside their
    # own: the running request holds 3 of 5, and the urgent prompt's one block fits the 2 free
    # ones, but not with its cross blocks. It displaces the running one at once, rather than
    # waiting behind a lower priority for want of blocks it did not count.
    d = Driver(5, 4, policy="priority", max_num_seqs=8, cross_tokens=8)
    d.add(0, 4, 8, priority=3)
    d.step()
    assert d.bm.num_free_blocks == 2
    d.add(1, 4, 2, priority=0)
    out = d.step()
    assert [it.seq_id for it in out.scheduled] == [1] and out.preempted_seq_ids == [0]
    d.run()
    assert d.finish_order == [1, 0]
    d.check_outputs()


def test_priority_order_under_load() -> None:
    d = Driver(64, 4, policy="priority", max_num_seqs=1)
    d.add(0, 3, 3, priority=3)
    d.step()
    for i, prio in [(1, 1), (2, 2), (3, 0)]:
        d.add(i, 3, 3, priority=prio)
    d.run()
    assert d.finish_order == [3, 1, 2, 0]  # 0 ran first and was displaced; then by priority
    assert d.seqs[0].num_preemptions == 1
    d.check_outputs()


def test_sjf_runs_short_prompts_first_and_is_not_preemptive() -> None:
    d = Driver(64, 4, policy="sjf", max_num_seqs=1)
    d.add(0, 10, 3)
    d.add(1, 2, 3)
    d.add(2, 5, 3)
    d.add(3, 7, 3)
    d.step()
    d.add(4, 1, 3)  # shortest of all, but sjf does not displace the running one
    d.run()
    assert d.finish_order == [1, 4, 2, 3, 0]
    assert d.sched.num_preemptions == 0
    d.check_outputs()


def test_mlfq_short_jobs_finish_first_and_long_ones_are_demoted() -> None:
    d = Driver(64, 4, policy="mlfq", max_num_seqs=1, mlfq_quantum=2, mlfq_levels=3)
    policy: Any = d.sched.policy
    d.add(0, 2, 16, at=0.0)  # long
    d.add(1, 2, 2, at=0.1)  # short
    d.add(2, 2, 4, at=0.2)  # medium
    d.step()
    d.step()
    assert policy.level(d.seqs[0]) == 1  # quantum 2 used up at level 0
    d.run()
    assert d.finish_order == [1, 2, 0]
    assert d.seqs[0].num_preemptions >= 1
    d.check_outputs()


def test_mlfq_demoted_job_yields_to_a_newly_arrived_short_job() -> None:
    d = Driver(64, 4, policy="mlfq", max_num_seqs=1, mlfq_quantum=3, mlfq_levels=4)
    policy: Any = d.sched.policy
    d.add(0, 2, 30)
    for _ in range(5):
        d.step()
    assert policy.level(d.seqs[0]) == 1
    d.add(1, 2, 2)
    out = d.step()
    assert out.preempted_seq_ids == [0]
    d.run()
    assert d.finish_order == [1, 0]
    d.check_outputs()


def test_mlfq_skip_join_puts_a_long_prompt_on_a_lower_level() -> None:
    d = Driver(256, 4, policy="mlfq", max_num_seqs=1, mlfq_quantum=64, mlfq_levels=3, mlfq_prompt_quantum=8)
    policy: Any = d.sched.policy
    assert [policy.join_level(n) for n in (1, 8, 9, 16, 17, 200)] == [0, 0, 1, 1, 2, 2]
    d.add(0, 40, 3, at=0.0)  # arrives first, but joins level 2
    d.add(1, 4, 3, at=0.1)  # level 0
    d.run()
    assert d.finish_order == [1, 0]
    d.check_outputs()


def test_spf_uses_the_expected_output_tokens_hint() -> None:
    d = Driver(64, 4, policy="spf", max_num_seqs=1)
    d.add(0, 3, 30, expected=20, at=0.0)
    d.add(1, 3, 30, expected=2, at=0.1)
    d.add(2, 3, 30, expected=8, at=0.2)
    d.add(3, 3, 30, expected=500, at=0.3)  # capped by max_tokens=30: still last
    d.run()
    assert d.finish_order == [1, 2, 0, 3]
    d.check_outputs()


def test_spf_learns_output_lengths_from_finished_requests() -> None:
    d = Driver(256, 4, policy="spf", max_num_seqs=1)
    # Teach it: short prompts (bucket of 3) give long answers, long prompts short ones.
    d.add(0, 3, 20)
    d.add(1, 30, 2)
    d.run()
    policy: Any = d.sched.policy
    x = d.add(2, 3, 20, at=d.now)
    y = d.add(3, 30, 20, at=d.now + 0.1)
    assert policy.predicted_total(x) == 20 and policy.predicted_total(y) == 2
    d.run()
    # y asked for as much as x, but its prompt bucket predicts a short answer: it goes first.
    assert d.finish_order[-2:] == [3, 2]
    d.check_outputs()


def lpm_prompt(family: int, own: int) -> list[int]:
    """8 tokens of a family's shared prefix (two blocks of 4), then one of the request's own."""
    return [*make_prompt(1000 + family, 8), 300 + own]


def test_lpm_admits_the_requests_whose_prefix_is_cached_first() -> None:
    d = Driver(64, 4, policy="lpm", max_num_seqs=1, prefix_caching=True)
    d.add(0, 0, 2, prompt=lpm_prompt(0, 0))
    d.step()  # family 0's prefix is now cached
    d.add(1, 0, 2, prompt=lpm_prompt(1, 1))  # waits first, but nothing of it is cached
    d.add(2, 0, 2, prompt=lpm_prompt(0, 2))
    d.add(3, 0, 2, prompt=lpm_prompt(1, 3))
    d.add(4, 0, 2, prompt=lpm_prompt(0, 4))
    d.run()
    # 2 and 4 hit family 0; once 1 has run, 3 hits family 1's prefix.
    assert d.finish_order == [0, 2, 4, 1, 3]
    assert [d.seqs[i].metrics.num_cached_tokens for i in range(5)] == [0, 0, 8, 8, 8]
    assert d.sched.num_preemptions == 0
    d.check_outputs()


def test_lpm_is_fcfs_for_running_sequences_and_past_its_queue_limit(monkeypatch) -> None:
    from conveyor.core.policies import LongestPrefixMatchPolicy

    monkeypatch.setattr(LongestPrefixMatchPolicy, "max_waiting", 2)
    d = Driver(64, 4, policy="lpm", max_num_seqs=1, prefix_caching=True)
    d.add(0, 0, 2, prompt=lpm_prompt(0, 0))
    d.step()
    for i, family in enumerate([1, 0, 1], start=1):  # three waiting: more than the limit
        d.add(i, 0, 2, prompt=lpm_prompt(family, i))
    d.run()
    assert d.finish_order == [0, 1, 2, 3]  # arrival order: the hits are not looked up
    d.check_outputs()


def test_lpm_needs_prefix_caching() -> None:
    with pytest.raises(ConfigError, match="lpm"):
        EngineConfig.from_kwargs(policy="lpm", enable_prefix_caching=False)
    assert EngineConfig.from_kwargs(policy="lpm").scheduler.policy == "lpm"


def test_lpm_aging_ends_starvation_of_a_request_that_never_hits() -> None:
    """A stream of requests with a cached prefix goes ahead of one without, until it ages."""
    bound, dt = 0.1, 0.01
    d = Driver(512, 4, policy="lpm", aging_bound_s=bound, max_num_seqs=1, dt=dt, prefix_caching=True)
    d.add(0, 0, 2, prompt=lpm_prompt(0, 0))
    d.step()
    d.add(1, 0, 2, prompt=lpm_prompt(1, 1))  # the victim
    for k in range(60):
        d.add(100 + k, 0, 2, prompt=lpm_prompt(0, 100 + k))
        d.step()
    first = fresh_admissions(d)
    assert 1 in first, "the request without a hit starved"
    assert d.times[first[1]] > bound  # every request with a hit goes first until then
    assert d.times[first[1]] <= bound + 3 * dt + 1e-9
    d.run()
    d.check_outputs()


def test_slo_serves_requests_that_can_still_meet_their_ttft_before_late_ones() -> None:
    def run(policy: str) -> Driver:
        kw: dict[str, Any] = dict(slo_ttft_ms=2500.0) if policy == "slo" else {}
        d = Driver(64, 4, policy=policy, max_num_seqs=1, dt=1.0, **kw)
        for i in range(3):
            d.add(i, 4, 3)  # each holds the seat 3 steps; 1 and 2 are late (due at 2.5) at 3.0
        for _ in range(3):
            d.step()
        d.add(3, 4, 3)  # arrives at 3.0, due at 5.5: it can still make it
        d.run()
        d.check_outputs()
        return d

    def met(d: Driver) -> list[int]:
        return [i for i, s in d.seqs.items() if s.metrics.first_token_time - s.metrics.arrival_time <= 2.5]

    fcfs, slo = run("fcfs"), run("slo")
    assert fcfs.finish_order == [0, 1, 2, 3] and met(fcfs) == [0]
    assert slo.finish_order == [0, 3, 1, 2] and met(slo) == [0, 3]


def test_slo_deadlines_and_victims() -> None:
    from conveyor.core.policies import SLOAwarePolicy

    policy = SLOAwarePolicy(SchedulerConfig(policy="slo", slo_ttft_ms=500.0, slo_tpot_ms=100.0))

    def seq(seq_id: int, arrival: float, first: float | None = None, outputs: int = 0) -> Sequence:
        s = Sequence(seq_id, "r", [1, 2, 3], SamplingParams(max_tokens=50), arrival)
        s.metrics.first_token_time = first
        s.token_ids += [4] * outputs
        return s

    fresh = seq(0, arrival=10.0)
    assert policy.deadline(fresh) == 10.5
    assert policy.deadline(seq(1, 9.0, first=9.2, outputs=5)) == 9.2 + 0.5  # the 6th token's
    now = 10.0
    behind = seq(2, 8.0, first=8.1, outputs=3)  # due at 8.4: late
    ahead = seq(3, 9.8, first=9.9, outputs=10)  # due at 10.9: the most slack of the punctual
    close = seq(4, 9.5, first=9.6, outputs=5)  # due at 10.1
    order = sorted([behind, ahead, close, fresh], key=lambda s: policy.key(s, now))
    assert [s.seq_id for s in order] == [4, 0, 3, 2]  # victims come off the end: late first


def test_slo_per_request_objectives_put_a_tight_request_ahead_of_loose_ones() -> None:
    """Interactive and batch requests in one queue: the batch ones ask for a TTFT of a minute,
    the interactive one for 3 s; it arrives last and is served first (earliest deadline)."""
    d = Driver(64, 4, policy="slo", max_num_seqs=1, dt=1.0)
    d.add(0, 4, 3)  # the engine's objective (1 s): late from its second step on
    for i in (1, 2):
        d.add(i, 4, 3, slo_ttft_ms=60_000.0)
    urgent = d.add(3, 4, 3, slo_ttft_ms=3_000.0)
    d.run()
    d.check_outputs()
    assert d.finish_order == [0, 3, 1, 2]
    policy = d.sched.policy
    assert policy.deadline(urgent) == urgent.metrics.first_token_time + 0.1 * 3  # engine's TPOT


def test_slo_per_request_objectives_are_validated() -> None:
    with pytest.raises(InvalidRequestError, match="slo_ttft_ms"):
        SamplingParams(slo_ttft_ms=0)
    with pytest.raises(InvalidRequestError, match="slo_tpot_ms"):
        SamplingParams(slo_tpot_ms=-5.0)
    assert SamplingParams(slo_ttft_ms=250, slo_tpot_ms=20.5).slo_tpot_ms == 20.5


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(slo_ttft_ms=200.0), "apply only to policy='slo'"),
        (dict(policy="slo", slo_tpot_ms=0.0), "slo_tpot_ms"),
        (dict(policy="slo", slo_ttft_ms=-1.0), "slo_ttft_ms"),
    ],
)
def test_slo_knobs_are_checked(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SchedulerConfig(**kw)


def add_for(d: Driver, seq_id: int, tenant: str) -> Sequence:
    return d.add(seq_id, 4, 3, tenant=tenant)


def test_vtc_shares_the_engine_between_tenants_not_requests() -> None:
    """Tenant a sends 8 requests before tenant b's 2: FCFS serves all of a's first; VTC
    serves the tenant with the least counted service, so b's come second and fourth."""
    orders = {}
    for policy in ("fcfs", "vtc"):
        d = Driver(64, 4, policy=policy, max_num_seqs=1)
        for i in range(8):
            add_for(d, i, "a")
        for i in (8, 9):
            add_for(d, i, "b")
        d.run()
        d.check_outputs()
        orders[policy] = d.finish_order
    assert orders["fcfs"] == list(range(10))
    assert orders["vtc"] == [0, 8, 1, 9, 2, 3, 4, 5, 6, 7]


def test_vtc_counts_tokens_and_lifts_a_tenant_that_was_idle() -> None:
    """b arrives after a has been served three times: it is lifted to a's counter, so the two
    alternate instead of b's requests running back to back on credit saved while idle."""
    from conveyor.core.policies import VirtualTokenCounterPolicy

    d = Driver(64, 4, policy="vtc", max_num_seqs=1)
    policy = d.sched.policy
    assert isinstance(policy, VirtualTokenCounterPolicy)
    for i in range(6):
        add_for(d, i, "a")
    while len(d.finish_order) < 3:
        d.step()
    # Three requests of 4 prompt tokens (weight 1) and 3 output tokens (weight 2): 30.
    assert policy.counters["a"] == 30.0
    for i in (10, 11, 12):
        add_for(d, i, "b")
    d.run()
    d.check_outputs()
    assert d.finish_order == [0, 1, 2, 3, 10, 4, 11, 5, 12]
    assert policy.counters == {"a": 60.0, "b": 60.0}


def test_vtc_forgets_counters_that_cannot_matter(monkeypatch) -> None:
    """Many one-off tenants: past `max_tenants` the counters at or below the floor of those
    waiting go, and the order is what it would have been."""
    from conveyor.core.policies import VirtualTokenCounterPolicy

    orders, sizes = [], []
    for limit in (4096, 3):
        monkeypatch.setattr(VirtualTokenCounterPolicy, "max_tenants", limit)
        d = Driver(64, 4, policy="vtc", max_num_seqs=1)
        for i in range(12):
            add_for(d, i, f"user{i % 6}" if i < 6 else "regular")
        d.run()
        d.check_outputs()
        orders.append(d.finish_order)
        sizes.append(len(d.sched.policy.counters))
    assert orders[0] == orders[1]
    assert sizes[0] == 7 and sizes[1] <= 4


def test_the_servers_user_is_the_tenant_and_slo_fields_reach_the_request() -> None:
    from types import SimpleNamespace

    from conveyor.server.protocol import CompletionRequest
    from conveyor.server.serving import CompletionHandler

    state = SimpleNamespace(engine=SimpleNamespace(tokenizer=None), model_name="m", loras={})
    body = CompletionRequest(prompt="hi", user="alice")
    params = CompletionHandler(state, body).sampling_params(4, 0)  # type: ignore[arg-type]
    assert params.tenant == "alice"
    body = CompletionRequest(prompt="hi", slo_ttft_ms=300, slo_tpot_ms=40)
    params = CompletionHandler(state, body).sampling_params(4, 0)  # type: ignore[arg-type]
    assert (params.slo_ttft_ms, params.slo_tpot_ms) == (300, 40)
    assert CompletionHandler(state, CompletionRequest(prompt="hi")).sampling_params(4, 0).tenant is None  # type: ignore[arg-type]


def test_online_mean_predictor() -> None:
    p = OnlineMeanPredictor(prior=50.0)

    def seq(prompt_len: int, outputs: int, reason: FinishReason = FinishReason.LENGTH) -> Sequence:
        s = Sequence(0, "r", [1] * prompt_len, SamplingParams(max_tokens=100), 0.0)
        s.token_ids += [2] * outputs
        s.finish_reason = reason
        return s

    assert p.predict(seq(5, 0)) == 50.0  # nothing learned: the prior
    p.observe(seq(5, 10))
    p.observe(seq(6, 20))  # same bucket (4, 8]
    assert p.predict(seq(7, 0)) == 15.0
    assert p.predict(seq(100, 0)) == 15.0  # unseen bucket: the global mean
    p.observe(seq(100, 3))
    assert p.predict(seq(120, 0)) == 3.0
    p.observe(seq(100, 90, FinishReason.ABORT))  # an abort says nothing about lengths
    assert p.predict(seq(120, 0)) == 3.0
    policy = ShortestPredictedFirstPolicy(SchedulerConfig(policy="spf"), predictor=p)
    hinted = Sequence(1, "h", [1] * 7, SamplingParams(max_tokens=4, expected_output_tokens=9), 0.0)
    assert policy.predicted_total(hinted) == 4  # a hint never exceeds max_tokens
    assert policy.predicted_total(seq(7, 0)) == 15.0


@pytest.mark.parametrize("policy", ["sjf", "spf", "priority", "mlfq"])
def test_aging_ends_starvation_within_its_bound(policy: str) -> None:
    bound, dt = 0.1, 0.01
    kw: dict[str, Any] = dict(policy=policy, aging_bound_s=bound, max_num_seqs=1, dt=dt)
    if policy == "mlfq":
        kw.update(mlfq_prompt_quantum=4)
    d = Driver(512, 4, **kw)
    # The victim: long prompt, no hint, low priority: last in every policy's own order.
    d.add(0, 40, 2, priority=9, expected=50)
    short_len = 2  # each short job holds the seat for 2 steps
    for k in range(60):
        d.add(100 + k, 2, short_len, priority=0, expected=1)
        d.step()
    first = fresh_admissions(d)
    assert 0 in first, "the long request starved"
    assert d.seqs[0].is_finished
    started = d.times[first[0]]
    assert started > bound  # not before it aged: every short job goes first until then
    # Aged, it takes the next seat (aging never displaces, under any policy): at most one short
    # job's run after the bound; and once running it is never displaced, so it finishes.
    assert started <= bound + short_len * dt + dt + 1e-9


@pytest.mark.parametrize("policy", PREEMPTIVE)
def test_aging_does_not_make_equal_requests_displace_each_other(policy: str) -> None:
    d = Driver(512, 4, policy=policy, aging_bound_s=0.1, max_num_seqs=2, dt=0.01)
    for k in range(60):  # one arrival per step, each holds a seat for 6 steps: overload
        d.add(k, 8, 6)
        d.step()
    d.run()
    d.check_outputs()
    # Same priority, same level, same size: only arrival order tells them apart, and a
    # request admitted earlier is never worse than one that arrived later.
    assert d.sched.num_preemptions == 0


def test_without_aging_a_long_job_starves_under_sjf() -> None:
    d = Driver(512, 4, policy="sjf", max_num_seqs=1, dt=0.01)  # default bound: 30 s
    d.add(0, 40, 2)
    for k in range(60):
        d.add(100 + k, 2, 2)
        d.step()
    assert d.seqs[0].metrics.first_scheduled_time is None


# -- preemption modes ----------------------------------------------------------------------
def pressure(d: Driver) -> None:
    """Eight requests competing for a cache that holds about two of them."""
    for i in range(8):
        d.add(i, 6, 12, at=i * 0.1)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_swap_really_swaps_and_keeps_outputs(block_size: int) -> None:
    n = 24 // block_size
    d = Driver(n, block_size, num_swap_blocks=8 * n, preemption_mode="swap", max_num_seqs=8)
    pressure(d)
    swapped_items = 0
    while d.sched.has_unfinished():
        computed = {s.seq_id: s.num_computed_tokens for s in d.sched.swapped}
        out = d.step()
        for item in out.scheduled:
            if item.seq_id in computed:
                # Back from swap: it goes on where it stopped, nothing is recomputed.
                assert item.start_pos == computed[item.seq_id] > 0
                swapped_items += 1
    assert d.sched.num_swaps_out > 0 and swapped_items == d.sched.num_swaps_in == d.sched.num_swaps_out
    assert d.sched.num_preemptions == d.sched.num_swaps_out  # every preemption was a swap
    assert d.runner.blocks_copied > 0
    d.check_outputs()
    # Recompute computes more tokens for the same outputs.
    r = Driver(n, block_size, preemption_mode="recompute", max_num_seqs=8)
    pressure(r)
    r.run()
    r.check_outputs()
    assert r.sched.num_preemptions > 0
    assert sum(o.num_tokens for o in r.log) > sum(o.num_tokens for o in d.log)
    for i in range(8):
        assert d.seqs[i].output_token_ids == r.seqs[i].output_token_ids


def test_swap_without_swap_space_falls_back_to_recompute() -> None:
    d = Driver(24, 1, num_swap_blocks=0, preemption_mode="swap", max_num_seqs=8)
    pressure(d)
    d.run()
    assert d.sched.num_preemptions > 0 and d.sched.num_swaps_out == 0
    assert not any(out.blocks_to_swap_out or out.blocks_to_swap_in for out in d.log)
    d.check_outputs()


def test_swap_recomputes_a_sequence_too_big_for_the_swap_space_left() -> None:
    d = Driver(24, 1, num_swap_blocks=9, preemption_mode="swap", max_num_seqs=8)
    pressure(d)
    kinds_seen = set()
    while d.sched.has_unfinished():
        tables = {s.seq_id: len(s.block_table) for s in d.sched.running}
        free_swap = d.bm.num_free_swap_blocks
        out = d.step()
        for seq_id in out.preempted_seq_ids:
            swapped = seq_id in d.runner.swapped_out
            kinds_seen.add(swapped)
            if swapped:
                free_swap -= tables[seq_id]
            else:
                assert tables[seq_id] > free_swap  # recomputed only for want of swap space
    assert kinds_seen == {True, False}
    d.check_outputs()


def test_auto_swaps_long_sequences_and_recomputes_short_ones() -> None:
    d = Driver(40, 1, num_swap_blocks=400, preemption_mode="auto", auto_swap_min_tokens=16, max_num_seqs=8)
    for i in range(8):
        d.add(i, 2 + 3 * i, 12, at=i * 0.1)  # prompts from 2 to 23 tokens
    seen: Counter[bool] = Counter()
    while d.sched.has_unfinished():
        computed = {s.seq_id: s.num_computed_tokens for s in d.sched.running}
        out = d.step()
        for seq_id in out.preempted_seq_ids:
            swapped = d.seqs[seq_id].status is SequenceStatus.SWAPPED
            assert swapped == (computed[seq_id] >= 16), (seq_id, computed[seq_id])
            seen[swapped] += 1
    assert seen[True] and seen[False]
    d.check_outputs()


def test_thrash_guard_spares_a_sequence_preempted_max_preemptions_times() -> None:
    def run(max_preemptions: int) -> Driver:
        d = Driver(13, 1, max_preemptions=max_preemptions, max_num_seqs=8)
        for i, (prompt_len, max_tokens) in enumerate([(3, 3), (1, 5), (1, 9), (3, 5)]):
            d.add(i, prompt_len, max_tokens, at=i * 0.1)
        d.run()
        d.check_outputs()
        return d

    # Unguarded, the latest arrival (3) is the victim every time memory runs short.
    unguarded = run(max_preemptions=100)
    assert [unguarded.seqs[i].num_preemptions for i in range(4)] == [0, 0, 0, 3]
    # Guarded, 3 is spared once preempted, and the next victim in line (2) goes instead.
    guarded = run(max_preemptions=1)
    assert guarded.seqs[3].num_preemptions == 1
    spared = [i for i, out in enumerate(guarded.log) if out.preempted_seq_ids and 3 in ids(out)]
    assert spared and all(guarded.log[i].preempted_seq_ids == [2] for i in spared)


def run_pressured(**config: Any) -> tuple[Driver, int]:
    """`pressure` on 24 blocks of 2 under `config`, run to the end: the driver, and the most
    sequences that ran at once (every running table checked by `check_running`, if given)."""
    check = config.pop("check_running", None)
    d = Driver(24, 2, max_num_seqs=8, **config)
    pressure(d)
    most = 0
    while d.sched.has_unfinished():
        d.step()
        most = max(most, len(d.sched.running))
        for seq in d.sched.running if check else ():
            check(d, seq)
    d.check_outputs()
    return d, most


def test_reserve_never_preempts_and_holds_its_blocks_from_admission() -> None:
    on_demand, _ = run_pressured()
    assert on_demand.sched.num_preemptions > 0

    def whole(d: Driver, seq: Sequence) -> None:
        assert len(seq.block_table) == blocks_for(min(6 + 12, d.max_model_len), 2)

    d, most_running = run_pressured(kv_reservation="reserve", check_running=whole)
    assert d.sched.num_preemptions == 0
    assert most_running == 48 // 18  # as many as their whole lengths fit, no more


# -- kv_reservation='estimate' (SGLang's new-token ratio) --------------------------------------
def test_estimate_admits_what_the_ratio_expects_to_fit_and_preempts_less() -> None:
    """Eight requests of 6 prompt and 12 output tokens against 24 blocks of 2 (48 tokens): on
    demand admits four at once (their prompts fit) and preempts as they grow; the estimate
    counts 70% of each running request's 12 outputs too, so admits fewer and preempts less."""
    on_demand, _ = run_pressured()
    d, most_running = run_pressured(kv_reservation="estimate")
    assert d.sched.num_preemptions < on_demand.sched.num_preemptions
    # 6 + ceil(0.7 x 12) = 15 tokens, 8 blocks each: three fit in 24 (the first admitted alone).
    assert most_running == 3


def test_estimate_ratio_decays_per_decode_step_and_resets_when_idle() -> None:
    d = Driver(200, 4, max_num_seqs=2, kv_reservation="estimate", init_new_token_ratio=0.5,
               min_new_token_ratio=0.1, new_token_ratio_decay_steps=4)
    d.add(0, 8, 10)
    ratios = []
    while d.sched.has_unfinished():
        d.step()
        ratios.append(round(d.sched.new_token_ratio, 6))
    # The prompt's step decodes nothing; each of the 9 decodes lowers it by 0.1, to 0.1; once
    # nothing runs, the next schedule starts it again at 0.5.
    assert ratios[:6] == [0.5, 0.4, 0.3, 0.2, 0.1, 0.1]
    d.step()
    assert d.sched.new_token_ratio == 0.5


def test_schedule_conservativeness_scales_both_ratios_as_sglang() -> None:
    """SGLang's knob: the first ratio times it, at most 1; the least keeps its part of the first
    (0.098 / 0.7 = 0.14): 2.0 starts at 1.0 and decays to 0.14, 0.5 starts at 0.35."""
    for c, first, least in [(1.0, 0.7, 0.098), (2.0, 1.0, 0.14), (0.5, 0.35, 0.049)]:
        d = Driver(200, 4, max_num_seqs=2, kv_reservation="estimate", schedule_conservativeness=c,
                   new_token_ratio_decay_steps=2)
        assert d.sched.new_token_ratio == pytest.approx(first)
        d.add(0, 8, 10)
        d.run()
        assert d.sched._least_ratio == pytest.approx(least)
    with pytest.raises(ConfigError, match="apply only to kv_reservation='estimate'"):
        SchedulerConfig(schedule_conservativeness=2.0)


def test_estimate_ratio_rises_after_a_preemption_for_memory() -> None:
    """With the least ratio the estimate admits as on demand does, runs short and preempts;
    the ratio then becomes the running requests' decoded share of their max_tokens (plus 20
    steps each), SGLang's retraction rule."""
    d = Driver(24, 2, max_num_seqs=8, kv_reservation="estimate", init_new_token_ratio=0.01,
               min_new_token_ratio=0.01)
    pressure(d)
    while d.sched.num_preemptions == 0:
        d.step()
    running = d.sched.running
    want = min(1.0, (sum(s.num_output_tokens for s in running) + 20 * len(running)) / (12 * len(running) + 1))
    assert d.sched.new_token_ratio == pytest.approx(want) and want > 0.01
    d.run()
    d.check_outputs()


def test_estimate_never_keeps_a_lone_request_out() -> None:
    """A request whose expected length outgrows the cache is admitted when nothing runs (it may
    then be cut by the model's length, never kept waiting forever)."""
    d = Driver(8, 2, max_num_seqs=4, kv_reservation="estimate", init_new_token_ratio=1.0)
    d.add(0, 4, 40)  # 4 + 40 tokens expected, 16 fit
    d.run()
    d.check_outputs()
    assert d.seqs[0].is_finished
