"""Scheduler properties over random request streams, driven by a fake runner (no torch).

The fake runner (tests/core/helpers.py) stands in for the model and its KV cache, so a step
that computes the wrong tokens, or reads KV it should not, changes a request's outputs; every
request's outputs must equal what it generates alone.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from conveyor.config import (
    EVICTION_POLICIES,
    OFFLOADING_POLICIES,
    PREEMPTION_MODES,
    SchedulerConfig,
)
from conveyor.core.block_manager import BlockManager
from conveyor.core.disk_tier import DiskTier
from conveyor.core.scheduler import Scheduler, SchedulerOutput, SequenceUpdate
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus
from tests.core.helpers import (
    EOS,
    STOP_TOKEN,
    FakeRunner,
    blocks_for,
    make_prompt,
    reference,
)

MAX_STEPS = 20_000


# -- scenarios -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_len: int
    max_tokens: int
    arrival_step: int
    abort_step: int | None = None  # absolute step; None: never aborted
    abort_mid_step: bool = False  # abort between the runner and update(), not before schedule
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_on_token: bool = False
    family: int | None = None  # requests of one family share their prompts' leading tokens

    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, self.max_tokens),
            stop_token_ids=(STOP_TOKEN,) if self.stop_on_token else (),
        )

    def prompt(self, index: int) -> list[int]:
        return make_prompt(index if self.family is None else 1000 + self.family, self.prompt_len)


@dataclass(frozen=True, slots=True)
class Scenario:
    config: SchedulerConfig
    block_size: int
    num_blocks: int
    requests: list[RequestSpec]
    prefix_caching: bool = False
    cross_tokens: int = 0  # an encoder-decoder's: the encoder positions each sequence holds blocks for
    num_swap_blocks: int = 0
    num_offload_blocks: int = 0  # KV offloading's tier (with prefix caching)
    offloading_policy: str = "write_back"
    num_disk_blocks: int = 0  # a disk tier under it (files in a temporary directory)
    eviction_policy: str = "lru"  # which free cached block the prefix cache gives up first

    @property
    def max_model_len(self) -> int:
        # As the engine does: a sequence never outgrows the whole cache (less its cross blocks).
        return (self.num_blocks - blocks_for(self.cross_tokens, self.block_size)) * self.block_size

    def admissible(self, spec: RequestSpec) -> bool:
        """What the engine should accept. It rejects a prompt that leaves no room for a token.
        With chunked prefill off it should also reject a prompt longer than the step budget:
        such a prompt can never be scheduled whole, and the scheduler, which runs prompts
        whole in that mode, would keep it (and the FCFS queue behind it) waiting forever.
        (`Engine.validate` does not check this second rule yet.)"""
        if spec.prompt_len >= self.max_model_len:
            return False
        if self.config.prefill_mode != "chunked":
            return spec.prompt_len <= self.config.max_num_batched_tokens
        return True


@dataclass(slots=True)
class RunResult:
    seqs: dict[int, Sequence]
    specs: dict[int, RequestSpec]
    steps: int
    num_preemptions: int
    num_hit_tokens: int = 0
    num_offload_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0


def fcfs_key(seq: Sequence) -> tuple[float, int]:
    return (seq.metrics.arrival_time, seq.seq_id)


def check_fcfs_admission(
    sched: Scheduler, out: SchedulerOutput, waiting_before: list[Sequence]
) -> None:
    """FCFS never admits a request past an older one left waiting: that is what rules out
    starvation (a stream of small late requests cannot keep a large early one out)."""
    scheduled = {item.seq_id for item in out.scheduled}
    admitted = [fcfs_key(s) for s in waiting_before if s.seq_id in scheduled]
    left = [fcfs_key(s) for s in waiting_before if s in sched.waiting]
    if admitted and left:
        assert max(admitted) < min(left), f"admitted {admitted} past waiting {left}"


def check_after_schedule(
    sched: Scheduler, sc: Scenario, out: SchedulerOutput, had_work: bool
) -> None:
    cfg, bs = sc.config, sc.block_size
    sched.check_integrity()
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert out.num_tokens <= cfg.max_num_batched_tokens
    ids = [item.seq_id for item in out.scheduled]
    assert len(ids) == len(set(ids)), f"a sequence scheduled twice: {ids}"
    if had_work:
        # Liveness: with unfinished requests something always fits (the oldest alone fits
        # the empty cache and the full budget), so an empty step is a stall.
        assert out.scheduled, f"empty step with {sched.num_unfinished} unfinished"
    spare = spare_blocks(cfg, bs)
    for item in out.scheduled:
        seq = sched.get(item.seq_id)
        assert seq is not None and seq.status is SequenceStatus.RUNNING
        end = item.start_pos + len(item.token_ids)
        assert len(item.token_ids) >= 1
        assert item.block_table is seq.block_table
        assert item.cross_table is seq.cross_table and len(item.cross_table) == sched.block_manager.cross_pages
        # Covers every token it will hold after the step, and no block more (with drafts,
        # at most the blocks a rejected draft left over from an earlier step).
        assert blocks_for(end, bs) <= len(item.block_table) <= blocks_for(end, bs) + spare
        assert item.sample == (seq.num_pending == 1)
        assert PLACEHOLDER not in item.token_ids
        if item.num_draft:  # a decode with drafts: only its last token counts as computed
            assert cfg.speculative_method is not None and item.sample
            assert 1 <= item.num_draft <= cfg.num_speculative_tokens
            assert item.start_pos + 1 == seq.num_computed_tokens == seq.num_tokens - 1
            assert item.token_ids[0] == seq.token_ids[item.start_pos]
            # The step's tokens never overrun max_tokens or the model's length.
            assert seq.num_scheduled_outputs + item.num_draft <= seq.sampling_params.max_tokens
            assert seq.num_tokens + item.num_draft <= sc.max_model_len
            continue
        # Scheduled tokens count as computed at once; a token to sample is a placeholder.
        assert end == seq.num_computed_tokens
        assert item.token_ids == seq.token_ids[item.start_pos : end]
        assert end == seq.num_tokens - seq.num_pending if item.sample else end < seq.num_tokens
        if cfg.prefill_mode != "chunked" and item.start_pos % bs == 0 and seq.num_output_tokens == 0:
            assert item.sample, "chunked prefill is off but a prompt was split"
    scheduled = set(ids)
    for seq in sched.running:
        if seq.seq_id not in scheduled:
            need = blocks_for(seq.num_computed_tokens, bs)
            assert need <= len(seq.block_table) <= need + spare
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    for seq_id in out.preempted_seq_ids:
        seq = sched.get(seq_id)
        assert seq is not None and (seq in sched.waiting or seq in sched.swapped) and seq_id not in scheduled
    if not sc.prefix_caching:  # only a prefix-cache hit shares a block
        held = [b for s in sched.all_sequences() if s.status is not SequenceStatus.SWAPPED
                for b in (*s.block_table, *s.cross_table)]
        assert len(held) == len(set(held))


def spare_blocks(cfg: SchedulerConfig, block_size: int) -> int:
    """Blocks a running sequence may hold beyond its computed tokens: those allocated for
    drafts the model rejected (speculative decoding), at most a step's drafts."""
    return blocks_for(cfg.num_speculative_tokens, block_size) if cfg.speculative_method else 0


def check_after_update(sched: Scheduler, sc: Scenario, seqs: dict[int, Sequence]) -> None:
    sched.check_integrity()
    spare = spare_blocks(sc.config, sc.block_size)
    for seq in sched.running:
        # Computed KV is what the table covers (and drafts' leftovers); something is always
        # left to compute.
        need = blocks_for(seq.num_computed_tokens, sc.block_size)
        assert need <= len(seq.block_table) <= need + spare
        assert seq.num_uncomputed_tokens >= 1
        assert seq.num_tokens < sc.max_model_len
    for seq in seqs.values():
        if seq.is_finished:
            assert seq.block_table == [] and sched.get(seq.seq_id) is None
            assert seq.finish_reason is not None


def check_updates(
    out: SchedulerOutput,
    sampled: dict[int, int],
    updates: list[SequenceUpdate],
    gone: set[int],
    accepted: dict[int, list[tuple[int, None]]] | None = None,
) -> None:
    """One update per scheduled sequence still alive, carrying exactly the sampled token; with
    drafts, one per token it kept, in order, up to the first that ended it."""
    live = [item for item in out.scheduled if item.seq_id not in gone]
    queue = list(updates)
    for item in live:
        if not item.sample:
            update = queue.pop(0)
            assert update.seq.seq_id == item.seq_id and update.new_token_id is None and update.last
            continue
        kept = [sampled[item.seq_id], *(t for t, _ in (accepted or {}).get(item.seq_id, []))]
        for i, token in enumerate(kept):
            update = queue.pop(0)
            seq = update.seq
            assert seq.seq_id == item.seq_id and update.new_token_id == token
            assert seq.token_ids[update.index] == token
            if update.last:
                assert i == len(kept) - 1 or seq.is_finished
                assert update.index == len(seq.token_ids) - seq.num_pending - 1
                break
    assert not queue, f"updates left over: {queue}"


def run_scenario(sc: Scenario) -> RunResult:
    with tempfile.TemporaryDirectory() as root:
        disk = DiskTier(root, "layout", sc.num_disk_blocks, 8) if sc.num_disk_blocks else None
        return _run_scenario(sc, disk)


def _run_scenario(sc: Scenario, disk: DiskTier | None) -> RunResult:
    bm = BlockManager(sc.num_blocks, sc.block_size, sc.num_swap_blocks, enable_prefix_caching=sc.prefix_caching,
                      cross_tokens=sc.cross_tokens, num_offload_blocks=sc.num_offload_blocks,
                      offloading_policy=sc.offloading_policy, disk=disk, eviction_policy=sc.eviction_policy)
    sched = Scheduler(sc.config, bm, sc.max_model_len, frozenset({EOS}))
    runner = FakeRunner(sc.num_blocks, sc.block_size, sc.num_swap_blocks, shared_prefixes=sc.prefix_caching,
                        cross_tokens=sc.cross_tokens, num_offload_blocks=sc.num_offload_blocks, disk=disk)
    specs = {i: s for i, s in enumerate(sc.requests) if sc.admissible(s)}
    seqs: dict[int, Sequence] = {}
    reported_finished: Counter[int] = Counter()
    last_arrival = max((s.arrival_step for s in specs.values()), default=0)

    def abort_due(step: int, mid: bool) -> None:
        for i, spec in specs.items():
            if spec.abort_step == step and spec.abort_mid_step == mid and i in seqs:
                seq = seqs[i]
                was_live = not seq.is_finished
                assert (sched.abort(i, float(step)) is not None) == was_live
                assert seq.is_finished and seq.block_table == []
                if was_live:
                    assert seq.finish_reason is FinishReason.ABORT

    for step in range(MAX_STEPS):
        now = float(step)
        for i, spec in specs.items():
            if spec.arrival_step == step:
                seqs[i] = Sequence(i, f"r{i}", spec.prompt(i), spec.params(), now)
                sched.add(seqs[i])
        abort_due(step, mid=False)
        if step > last_arrival and not sched.has_unfinished():
            break
        had_work = sched.has_unfinished()
        waiting_before = list(sched.waiting)
        out = sched.schedule(now)
        check_after_schedule(sched, sc, out, had_work)
        check_fcfs_admission(sched, out, waiting_before)
        reported_finished.update(out.finished_seq_ids)
        sampled = runner(out)
        abort_due(step, mid=True)
        gone = {item.seq_id for item in out.scheduled if seqs[item.seq_id].is_finished}
        updates = sched.update(out, sampled, now, accepted=runner.accepted)
        check_updates(out, sampled, updates, gone, runner.accepted)
        check_after_update(sched, sc, seqs)
    else:
        pytest.fail(f"not finished after {MAX_STEPS} steps: starvation or livelock")
    assert bm.num_free_blocks == sc.num_blocks, "blocks leaked at the end"
    # The runner learns of every finished sequence once (to drop per-sequence state).
    last = sched.schedule(float(step))
    for _ in range(MAX_STEPS):  # the last steps' write-through (a few blocks a schedule, as the tier allows)
        if not (last.blocks_to_store and sc.offloading_policy != "write_back"):
            break
        reported_finished.update(last.finished_seq_ids)
        runner(last)
        last = sched.schedule(float(step))
    assert not bm.has_pending_copies
    assert last.is_empty
    reported_finished.update(last.finished_seq_ids)
    assert reported_finished == Counter(seqs.keys())
    assert sched.num_preemptions == sum(seq.num_preemptions for seq in seqs.values())
    return RunResult(seqs, specs, step, sched.num_preemptions, bm.num_hit_tokens, bm.num_offload_hit_tokens,
                     bm.num_disk_hit_tokens)


def check_outputs(result: RunResult, max_model_len: int) -> None:
    """Token-centric contract: a request's outputs never depend on how it was scheduled."""
    assert set(result.seqs) == set(result.specs), "an admissible request never arrived"
    for i, seq in result.seqs.items():
        assert seq.is_finished, f"request {i} never finished"
        assert seq.prompt_token_ids == result.specs[i].prompt(i)
        want, reason = reference(seq.prompt_token_ids, seq.sampling_params, max_model_len)
        got = seq.output_token_ids
        if seq.finish_reason is FinishReason.ABORT:
            assert result.specs[i].abort_step is not None
            assert len(got) < len(want) and got == want[: len(got)]
        else:
            assert got == want, f"request {i}: got {got}, alone it generates {want}"
            assert seq.finish_reason is reason
        # A token is timed once, when it is sampled, never again when recomputed.
        m = seq.metrics
        assert len(m.token_times) == len(got)
        if got:
            assert m.first_scheduled_time is not None and m.first_token_time is not None
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
            assert m.token_times == sorted(m.token_times)
        assert m.finished_time is not None and m.finished_time >= m.arrival_time


# -- hypothesis strategies -----------------------------------------------------------------
@st.composite
def scenarios(draw: st.DrawFn, chunked: bool) -> Scenario:
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 16)),
        # Mostly budgets a sequence can outgrow (prompts are at most 48 tokens).
        max_num_batched_tokens=draw(
            st.one_of(st.integers(1, 16), st.integers(17, 64), st.integers(65, 256))
        ),
        prefill_mode="chunked" if chunked else "mixed",
    )
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    # Mostly caches of a few dozen tokens, so that requests compete and get preempted;
    # sometimes >= 100 blocks, where the admission watermark is at least one block.
    num_blocks = draw(
        st.one_of(
            st.integers(1, max(1, 64 // block_size)),
            st.integers(1, 40),
            st.integers(100, 130),
        )
    )
    max_model_len = num_blocks * block_size
    longest = max(1, min(max_model_len - 1, 48))
    if not chunked:
        # Most prompts the engine would reject here would only be drawn to be dropped.
        longest = min(longest, config.max_num_batched_tokens)
    near_budget = min(config.max_num_batched_tokens, longest)
    requests = draw(st.lists(request_specs(longest, near_budget), min_size=1, max_size=16))
    caching = draw(st.booleans())
    return Scenario(config, block_size, num_blocks, requests, caching,
                    eviction_policy=draw(st.sampled_from(EVICTION_POLICIES)) if caching else "lru")


def preempting_config(draw: st.DrawFn) -> SchedulerConfig:
    """Chunked or whole prompts, small batches and budgets, any preemption mode."""
    mode = draw(st.sampled_from(PREEMPTION_MODES))
    return SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.one_of(st.integers(1, 16), st.integers(17, 64))),
        prefill_mode="chunked" if draw(st.booleans()) else "mixed",
        preemption_mode=mode,
        **({"auto_swap_min_tokens": draw(st.integers(1, 16))} if mode == "auto" else {}),
    )


def requests_within(draw: st.DrawFn, config: SchedulerConfig, max_model_len: int, cap: int,
                    max_size: int) -> list[RequestSpec]:
    """Requests whose prompts fit the model (at most `cap` tokens) and, unchunked, the budget."""
    longest = max(1, min(max_model_len - 1, cap))
    if config.prefill_mode != "chunked":
        longest = min(longest, config.max_num_batched_tokens)
    near_budget = min(config.max_num_batched_tokens, longest)
    return draw(st.lists(request_specs(longest, near_budget), min_size=1, max_size=max_size))


@st.composite
def cross_scenarios(draw: st.DrawFn) -> Scenario:
    """An encoder-decoder's (Whisper's): every sequence holds blocks for the encoder's positions
    beside its own, preempted by recompute (its cross blocks written again), swap or both."""
    config = preempting_config(draw)
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    cross_tokens = draw(st.integers(1, 24))
    # Room for one to three sequences beside their cross blocks: they compete and get preempted.
    num_blocks = blocks_for(cross_tokens, block_size) + draw(st.integers(1, 40))
    num_swap_blocks = draw(st.integers(0, 80)) if config.preemption_mode != "recompute" else 0
    max_model_len = (num_blocks - blocks_for(cross_tokens, block_size)) * block_size
    requests = requests_within(draw, config, max_model_len, 32, 10)
    return Scenario(config, block_size, num_blocks, requests, False, cross_tokens, num_swap_blocks)


@st.composite
def offload_scenarios(draw: st.DrawFn) -> Scenario:
    """KV offloading: a device cache of a few blocks under prompts of a few shared families, so
    that cached blocks are evicted to a tier of a few blocks and found there again, beside
    every preemption mode (a swap pool of its own beside the tier), under each write policy, and
    with or without a disk tier under it."""
    config = preempting_config(draw)
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(2, max(2, 80 // block_size)))
    num_swap_blocks = draw(st.integers(0, 40)) if config.preemption_mode != "recompute" else 0
    requests = requests_within(draw, config, num_blocks * block_size, 40, 14)
    return Scenario(config, block_size, num_blocks, requests, True, 0, num_swap_blocks,
                    draw(st.integers(1, 24)), draw(st.sampled_from(OFFLOADING_POLICIES)),
                    draw(st.sampled_from([0, 0, 1, 4, 64])), draw(st.sampled_from(EVICTION_POLICIES)))


@st.composite
def request_specs(draw: st.DrawFn, longest_prompt: int, near_budget: int) -> RequestSpec:
    max_tokens = draw(st.integers(1, 24))
    # Many requests at step 0 compete at once; later ones join a running batch.
    arrival = draw(st.one_of(st.just(0), st.integers(0, 30)))
    abort_step = draw(st.one_of(st.none(), st.integers(0, 60).map(lambda d: arrival + d)))
    return RequestSpec(
        # Prompts just under the step budget: the edge of chunking, and of fitting whole.
        prompt_len=draw(
            st.one_of(
                st.integers(1, longest_prompt),
                st.integers(max(1, near_budget - 2), near_budget),
            )
        ),
        max_tokens=max_tokens,
        arrival_step=arrival,
        abort_step=abort_step,
        abort_mid_step=draw(st.booleans()),
        ignore_eos=draw(st.booleans()),
        min_tokens=draw(st.one_of(st.just(0), st.integers(0, max_tokens))),
        family=draw(st.one_of(st.none(), st.integers(0, 2))),
        stop_on_token=draw(st.booleans()),
    )


def check_random_stream(sc: Scenario) -> None:
    result = run_scenario(sc)
    check_outputs(result, sc.max_model_len)
    # Steer the search toward memory pressure, where the interesting bugs live.
    target(float(result.num_preemptions), label="preemptions")
    event("preempted" if result.num_preemptions else "no preemption")
    aborts = any(s.abort_step is not None for s in result.specs.values())
    event("abort requested" if aborts else "no abort")
    if sc.prefix_caching:
        event("prefix hits" if result.num_hit_tokens else "prefix caching, no hit")


# One test per prefill mode, so that the search effort (and the targeting) covers both.
RANDOM_STREAMS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@RANDOM_STREAMS
@given(scenarios(chunked=True))
def test_random_streams_with_chunked_prefill(sc: Scenario) -> None:
    check_random_stream(sc)


@RANDOM_STREAMS
@given(scenarios(chunked=False))
def test_random_streams_without_chunked_prefill(sc: Scenario) -> None:
    check_random_stream(sc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(offload_scenarios())
def test_random_streams_with_kv_offloading(sc: Scenario) -> None:
    """KV offloading's tier under random arrivals, aborts, preemption and eviction: every block
    a load brings back holds the K/V of its prefix (the fake runner checks each read slot's
    tag), nothing leaks (`check_integrity` after every schedule and update), and every request
    generates what it generates alone."""
    result = run_scenario(sc)
    check_outputs(result, sc.max_model_len)
    target(float(result.num_offload_hit_tokens), label="tier hits")
    event("tier hits" if result.num_offload_hit_tokens else "no tier hit")
    event(f"preemption_mode={sc.config.preemption_mode}")
    event(f"offloading_policy={sc.offloading_policy}")
    if sc.num_disk_blocks:
        target(float(result.num_disk_hit_tokens), label="disk hits")
        event("disk hits" if result.num_disk_hit_tokens else "a disk tier, no disk hit")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cross_scenarios())
def test_random_streams_with_cross_attention_blocks(sc: Scenario) -> None:
    """Whisper's cross-attention blocks: a sequence holds them from admission to its end (never
    while it waits), they come back through swap intact or are written again after recompute
    (the fake runner reads every one back at each step), and none leaks."""
    check_random_stream(sc)
    event(f"preemption_mode={sc.config.preemption_mode}")


# -- deterministic tests -------------------------------------------------------------------
def plain(prompt_len: int, max_tokens: int, arrival: int = 0) -> RequestSpec:
    # ignore_eos: these tests count steps and tokens, an early EOS would change them.
    return RequestSpec(prompt_len, max_tokens, arrival, ignore_eos=True)


def scheduler_with(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int = 16,
    budget: int = 256,
    chunked: bool = True,
    max_model_len: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, budget, prefill_mode="chunked" if chunked else "mixed")
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(config, bm, max_model_len or num_blocks * block_size, frozenset({EOS}))


def add(sched: Scheduler, seq_id: int, prompt_len: int, max_tokens: int, t: float) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(seq_id, f"r{seq_id}", make_prompt(seq_id, prompt_len), params, t)
    sched.add(seq)
    return seq


def step(sched: Scheduler, runner: FakeRunner, now: float) -> SchedulerOutput:
    out = sched.schedule(now)
    sched.check_integrity()
    sched.update(out, runner(out), now)
    sched.check_integrity()
    return out


def test_scheduler_imports_no_torch() -> None:
    code = (
        "import sys, conveyor.core.scheduler, conveyor.core.block_manager; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_preemption_keeps_outputs_of_a_huge_cache(chunked: bool, block_size: int) -> None:
    requests = [plain(6, 12, arrival=a) for a in (0, 0, 1, 1, 2, 3, 5, 8)]
    tiny = Scenario(SchedulerConfig(8, 32, prefill_mode="chunked" if chunked else "mixed"), block_size, 24 // block_size, requests)
    huge = Scenario(SchedulerConfig(8, 32, prefill_mode="chunked" if chunked else "mixed"), block_size, 4096 // block_size, requests)
    small_run = run_scenario(tiny)
    big_run = run_scenario(huge)
    assert small_run.num_preemptions > 0
    assert big_run.num_preemptions == 0
    check_outputs(small_run, tiny.max_model_len)
    for i, seq in small_run.seqs.items():
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == big_run.seqs[i].output_token_ids
        assert len(seq.output_token_ids) == 12


def test_without_chunked_prefill_a_preempted_sequence_that_outgrew_the_budget_resumes() -> None:
    # Regression: seq 1 (12-token prompt) fits the 13-token budget whole, grows to 14 tokens,
    # is preempted by seq 0 and, before the fix, waited forever: 14 > 13 never fits whole.
    sched = scheduler_with(num_blocks=17, block_size=1, max_num_seqs=2, budget=13, chunked=False)
    runner = FakeRunner(17, 1)
    a = add(sched, 0, 2, 6, t=0.0)
    b = add(sched, 1, 12, 3, t=1.0)
    for now in range(40):
        step(sched, runner, float(now))
        if not sched.has_unfinished():
            break
    assert b.num_preemptions >= 1
    assert not sched.has_unfinished()
    for seq in (a, b):
        assert seq.output_token_ids == reference(seq.prompt_token_ids, seq.sampling_params, 17)[0]


def test_fcfs_admits_in_arrival_order_not_add_order() -> None:
    sched = scheduler_with(num_blocks=64, block_size=4, max_num_seqs=1)
    runner = FakeRunner(64, 4)
    # Added out of order: arrival time, not the order of add(), decides.
    add(sched, 0, 3, 2, t=2.0)
    add(sched, 1, 3, 2, t=0.0)
    add(sched, 2, 3, 2, t=1.0)
    order = []
    for now in range(10):
        out = step(sched, runner, float(now))
        order += [s.seq_id for s in out.scheduled if s.seq_id not in order]
    assert order == [1, 2, 0]
    assert not sched.has_unfinished()


def test_fcfs_batches_in_arrival_order_when_everything_fits() -> None:
    sched = scheduler_with(num_blocks=64, block_size=4)
    for seq_id, t in [(3, 0.5), (1, 0.1), (2, 0.3), (0, 0.3)]:
        add(sched, seq_id, 2, 1, t)
    out = sched.schedule(1.0)
    # Ties in arrival time fall back to the sequence id.
    assert [s.seq_id for s in out.scheduled] == [1, 0, 2, 3]


def test_latest_arrival_is_preempted_and_recomputes_on_resume() -> None:
    # 3 blocks of 2 tokens. Three 2-token prompts fill the cache; the first decode needs a
    # 4th block, so the latest arrival (seq 2) must give its blocks up.
    sched = scheduler_with(num_blocks=3, block_size=2, max_model_len=6)
    runner = FakeRunner(3, 2)
    a = add(sched, 0, 2, 3, t=0.0)
    b = add(sched, 1, 2, 3, t=1.0)
    c = add(sched, 2, 2, 3, t=2.0)
    out = step(sched, runner, 0.0)
    assert [s.seq_id for s in out.scheduled] == [0, 1, 2]
    assert all(s.num_output_tokens == 1 for s in (a, b, c))
    c_tokens = list(c.token_ids)

    out = sched.schedule(1.0)
    # c, the latest arrival, goes first; then b has no one behind it to take a block from.
    assert out.preempted_seq_ids == [2, 1]
    assert [s.seq_id for s in out.scheduled] == [0]
    assert c.status is SequenceStatus.WAITING and c in sched.waiting and c not in sched.running
    assert c.block_table == [] and c.num_computed_tokens == 0
    assert c.token_ids == c_tokens, "preemption must keep the tokens, prompt and output"
    assert c.num_preemptions == 1 and sched.num_preemptions >= 1
    sched.check_integrity()
    sched.update(out, runner(out), 1.0)

    # Run until c is scheduled again: it recomputes prompt + its output, then samples.
    resumed = None
    for now in range(2, 50):
        out = sched.schedule(float(now))
        sched.check_integrity()
        mine = [s for s in out.scheduled if s.seq_id == 2]
        if mine and resumed is None:
            resumed = mine[0]
        sched.update(out, runner(out), float(now))
        if not sched.has_unfinished():
            break
    assert resumed is not None
    assert resumed.start_pos == 0
    assert resumed.token_ids == c_tokens and resumed.sample
    assert not sched.has_unfinished()
    for seq in (a, b, c):
        want, _ = reference(seq.prompt_token_ids, seq.sampling_params, 6)
        assert seq.output_token_ids == want
        assert seq.block_table == []


def test_preemption_picks_the_least_valuable_running_sequence() -> None:
    # Four 1-token prompts with a 1-token block each fill a 4-block cache; each decode needs
    # a new block, so running sequences are evicted from the latest arrival backwards.
    sched = scheduler_with(num_blocks=4, block_size=1, max_model_len=4)
    runner = FakeRunner(4, 1)
    for seq_id, t in [(0, 3.0), (1, 0.0), (2, 2.0), (3, 1.0)]:
        add(sched, seq_id, 1, 3, t)
    step(sched, runner, 0.0)
    out = sched.schedule(1.0)
    # Oldest (1) takes the block of the newest (0); then 3 takes 2's block.
    assert out.preempted_seq_ids == [0, 2]
    assert [s.seq_id for s in out.scheduled] == [1, 3]


def test_chunked_prefill_splits_a_long_prompt_and_samples_on_the_last_chunk() -> None:
    sched = scheduler_with(num_blocks=16, block_size=4, budget=4)
    runner = FakeRunner(16, 4)
    seq = add(sched, 0, 10, 2, t=0.0)
    chunks = []
    for now in range(3):
        out = step(sched, runner, float(now))
        (item,) = out.scheduled
        chunks.append((item.start_pos, len(item.token_ids), item.sample))
        assert len(item.block_table) == blocks_for(item.context_len, 4)
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert seq.num_output_tokens == 1 and seq.num_computed_tokens == 10
    out = step(sched, runner, 3.0)
    assert [(s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled] == [(10, 1, True)]
    assert seq.is_finished
    assert seq.output_token_ids == reference(seq.prompt_token_ids, seq.sampling_params, 64)[0]


def test_chunked_prefill_fills_the_budget_beside_decodes() -> None:
    sched = scheduler_with(num_blocks=32, block_size=4, budget=8)
    runner = FakeRunner(32, 4)
    add(sched, 0, 3, 8, t=0.0)
    step(sched, runner, 0.0)
    add(sched, 1, 20, 2, t=1.0)
    out = step(sched, runner, 1.0)
    # One decode token for seq 0, the other 7 of the budget go to seq 1's first chunk.
    assert [(s.seq_id, len(s.token_ids), s.sample) for s in out.scheduled] == [
        (0, 1, True),
        (1, 7, False),
    ]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    sched = scheduler_with(num_blocks=32, block_size=4, budget=8, chunked=False)
    runner = FakeRunner(32, 4)
    a = add(sched, 0, 3, 4, t=0.0)
    step(sched, runner, 0.0)
    b = add(sched, 1, 8, 2, t=1.0)
    while not a.is_finished:
        out = step(sched, runner, 1.0)
        # a's decode takes 1 of the 8 tokens, so b's 8-token prompt must not start.
        assert [s.seq_id for s in out.scheduled] == [0]
        assert b.status is SequenceStatus.WAITING and b.block_table == []
    out = step(sched, runner, 2.0)
    assert [(s.seq_id, s.start_pos, len(s.token_ids), s.sample) for s in out.scheduled] == [
        (1, 0, 8, True)
    ]


def test_watermark_holds_blocks_back_from_admission_while_others_run() -> None:
    # 100 blocks: a watermark of 1 block is kept free for running decodes.
    sched = scheduler_with(num_blocks=100, block_size=1)
    runner = FakeRunner(100, 1)
    assert sched.watermark_blocks == 1
    add(sched, 0, 10, 20, t=0.0)
    step(sched, runner, 0.0)
    # Seq 0's decode takes an 11th block this step, leaving 89: exactly what `late` needs,
    # so only the watermark keeps it out.
    late = add(sched, 1, 89, 1, t=1.0)
    out = step(sched, runner, 1.0)
    assert [s.seq_id for s in out.scheduled] == [0]
    assert late.status is SequenceStatus.WAITING


def test_watermark_never_keeps_a_lone_request_out_of_an_empty_cache() -> None:
    # The prompt needs all 100 blocks; with nothing running the watermark must not apply,
    # or the request would wait forever.
    sched = scheduler_with(num_blocks=100, block_size=2)
    runner = FakeRunner(100, 2)
    seq = add(sched, 0, 199, 3, t=0.0)
    out = step(sched, runner, 0.0)
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [(0, 199)]
    step(sched, runner, 1.0)
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_tokens == 200


def test_abort_frees_a_running_and_a_waiting_sequence() -> None:
    sched = scheduler_with(num_blocks=8, block_size=2, max_num_seqs=1)
    runner = FakeRunner(8, 2)
    a = add(sched, 0, 3, 5, t=0.0)
    b = add(sched, 1, 3, 5, t=1.0)
    out = step(sched, runner, 0.0)
    assert a.block_table and not b.block_table
    assert sched.abort(1, 1.0) is b and b.finish_reason is FinishReason.ABORT
    assert sched.abort(0, 1.0) is a and a.block_table == []
    assert sched.abort(0, 1.0) is None  # already gone
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 8
    out = sched.schedule(2.0)
    assert out.is_empty and sorted(out.finished_seq_ids) == [0, 1]


def test_abort_while_the_step_runs_drops_its_result() -> None:
    sched = scheduler_with(num_blocks=8, block_size=2)
    runner = FakeRunner(8, 2)
    seq = add(sched, 0, 3, 5, t=0.0)
    out = sched.schedule(0.0)
    sampled = runner(out)
    sched.abort(0, 0.5)
    updates = sched.update(out, sampled, 1.0)
    assert updates == [] and seq.output_token_ids == [] and seq.block_table == []
    sched.check_integrity()


def test_stops_at_max_model_len() -> None:
    sched = scheduler_with(num_blocks=2, block_size=4)  # max_model_len 8
    runner = FakeRunner(2, 4)
    seq = add(sched, 0, 5, 100, t=0.0)
    for now in range(10):
        step(sched, runner, float(now))
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_tokens == 8
