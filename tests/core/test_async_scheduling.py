"""Async scheduling over random request streams: step t+1 is scheduled (and launched) before
step t's tokens come back, and every request still generates exactly what it does alone.

The driver below does what `Engine` does with `async_scheduling`: schedule, launch, then
complete the previous step. The fake runner computes a step when it is launched, reading a
pending token's value from the step before, as `ModelRunner` reads it on the device.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings, target

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.scheduler import Scheduler, SchedulerOutput
from conveyor.sampling_params import SamplingParams
from conveyor.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus
from tests.core.helpers import EOS, FakeRunner, make_prompt
from tests.core.test_scheduler import MAX_STEPS, RunResult, Scenario, check_outputs, scenarios


class LaunchingRunner:
    """`FakeRunner` behind a launch: a decode of a pending token reads it from the previous
    launched step's samples. Counts the decodes that did (the overlap actually happened)."""

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner
        self.last: dict[int, int] = {}
        self.pending_inputs = 0

    def launch(self, out: SchedulerOutput) -> dict[int, int]:
        items = []
        for item in out.scheduled:
            history = list(item.all_token_ids[: item.context_len])
            tokens = list(item.token_ids)
            if tokens[-1] == PLACEHOLDER:
                assert tokens == [PLACEHOLDER], "a pending token is only ever a decode's input"
                tokens = [self.last[item.seq_id]]
                history[-1] = tokens[0]
                self.pending_inputs += 1
            assert PLACEHOLDER not in history, "the runner would read a token two steps old"
            items.append(dataclasses.replace(item, token_ids=tokens, all_token_ids=history))
        sampled = self.runner(dataclasses.replace(out, scheduled=items))
        if sampled:
            self.last = sampled
        return sampled


def run_async_scenario(sc: Scenario) -> tuple[RunResult, int]:
    config = dataclasses.replace(sc.config, async_scheduling=True)
    bm = BlockManager(sc.num_blocks, sc.block_size, enable_prefix_caching=sc.prefix_caching)
    sched = Scheduler(config, bm, sc.max_model_len, frozenset({EOS}))
    runner = LaunchingRunner(FakeRunner(sc.num_blocks, sc.block_size, shared_prefixes=sc.prefix_caching))
    specs = {i: s for i, s in enumerate(sc.requests) if sc.admissible(s)}
    seqs: dict[int, Sequence] = {}
    reported: Counter[int] = Counter()
    last_arrival = max((s.arrival_step for s in specs.values()), default=0)
    in_flight: tuple[SchedulerOutput, dict[int, int]] | None = None

    def abort_due(step: int, mid: bool) -> None:
        for i, spec in specs.items():
            if spec.abort_step == step and spec.abort_mid_step == mid and i in seqs:
                sched.abort(i, float(step))
                assert seqs[i].is_finished and seqs[i].block_table == []

    for step in range(MAX_STEPS):
        now = float(step)
        for i, spec in specs.items():
            if spec.arrival_step == step:
                seqs[i] = Sequence(i, f"r{i}", spec.prompt(i), spec.params(), now)
                sched.add(seqs[i])
        abort_due(step, mid=False)
        if step > last_arrival and not sched.has_unfinished() and in_flight is None:
            break
        out = sched.schedule(now)
        sched.check_integrity()
        assert len(out.scheduled) <= config.max_num_seqs
        assert out.num_tokens <= config.max_num_batched_tokens
        reported.update(out.finished_seq_ids)
        for item in out.scheduled:
            seq = sched.get(item.seq_id)
            assert seq is not None and seq.status is SequenceStatus.RUNNING
            assert seq.num_pending <= 2
            # Never launched past the last token its length allows.
            assert seq.num_scheduled_outputs <= seq.sampling_params.max_tokens
            assert seq.num_tokens <= sc.max_model_len
        if in_flight is None and sched.has_unfinished():
            assert out.scheduled or out.preempted_seq_ids, "nothing in flight and nothing scheduled"
        sampled = runner.launch(out) if not out.is_empty else {}
        abort_due(step, mid=True)  # while the step "runs"
        if in_flight is not None:
            sched.update(in_flight[0], in_flight[1], now)
            sched.check_integrity()
        in_flight = None if out.is_empty else (out, sampled)
        for seq in seqs.values():
            if seq.is_finished:
                assert seq.block_table == [] and sched.get(seq.seq_id) is None
    else:
        pytest.fail(f"not finished after {MAX_STEPS} steps: starvation or livelock")
    assert bm.num_free_blocks == sc.num_blocks, "blocks leaked at the end"
    last = sched.schedule(float(step))
    assert last.is_empty
    reported.update(last.finished_seq_ids)
    assert reported == Counter(seqs.keys())
    return RunResult(seqs, specs, step, sched.num_preemptions, bm.num_hit_tokens), runner.pending_inputs


ASYNC_STREAMS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_async_stream(sc: Scenario) -> None:
    result, overlapped = run_async_scenario(sc)
    check_outputs(result, sc.max_model_len)
    target(float(result.num_preemptions), label="preemptions")
    event("preempted" if result.num_preemptions else "no preemption")
    event("overlapped" if overlapped else "never overlapped")
    if sc.prefix_caching:
        event("prefix hits" if result.num_hit_tokens else "prefix caching, no hit")


@ASYNC_STREAMS
@given(scenarios(chunked=True))
def test_async_random_streams_with_chunked_prefill(sc: Scenario) -> None:
    check_async_stream(sc)


@ASYNC_STREAMS
@given(scenarios(chunked=False))
def test_async_random_streams_without_chunked_prefill(sc: Scenario) -> None:
    check_async_stream(sc)


def test_async_decodes_read_the_pending_token_and_stop_at_max_tokens() -> None:
    sc = Scenario(SchedulerConfig(max_num_seqs=4), 4, 64, [])
    config = dataclasses.replace(sc.config, async_scheduling=True)
    sched = Scheduler(config, BlockManager(64, 4), 256, frozenset({EOS}))
    runner = LaunchingRunner(FakeRunner(64, 4))
    seq = Sequence(0, "r0", make_prompt(0, 5), SamplingParams(max_tokens=4, ignore_eos=True), 0.0)
    sched.add(seq)
    steps, in_flight = 0, None
    while sched.has_unfinished() or in_flight is not None:
        out = sched.schedule(float(steps))
        sampled = runner.launch(out) if out.scheduled else {}
        if in_flight is not None:
            sched.update(*in_flight, float(steps))
        in_flight = (out, sampled) if out.scheduled else None
        steps += 1
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == 4
    # The prompt, then three decodes whose input was still pending when launched; the fourth
    # token ended the request by length, so nothing was launched on it.
    assert runner.pending_inputs == 3
    assert seq.num_pending == 0 and PLACEHOLDER not in seq.token_ids
