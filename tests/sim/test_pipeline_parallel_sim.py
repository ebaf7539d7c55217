"""The simulator's pipeline parallelism: the stages' split and prices by hand, capacity per
device, the pipeline's timing on cost models whose answer is known (a compute-bound stage
keeps every stage busy, a fixed-cost one makes each token cross them all), and over random
workloads the invariants of batches in flight (hypothesis)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.config import ConfigError, EngineConfig
from conveyor.sampling_params import SamplingParams
from conveyor.sim.cost import RooflineCostModel, StepShape
from conveyor.sim.engine import PipelineSimEngine, build_sim_engine, describe_capacity
from conveyor.sim.hardware import get_hardware
from conveyor.sim.models import get_model
from tests.sim.test_sim import TOY, TOY_HW, TOY_PARAMS

DEEP = dataclasses.replace(TOY, name="deep", num_layers=10)


def test_stages_split_the_layers_and_the_step():
    """10 layers on 3 stages: 4, 3, 3 (the first stages one more, as vLLM splits them). Each
    stage prices its layers' share of every per-layer part; the first adds the step's fixed
    costs, the last the LM head; a batch's time is the stages' and two sends."""
    one = RooflineCostModel(TOY_HW, DEEP, TOY_PARAMS, 2)
    three = RooflineCostModel(TOY_HW, DEEP, TOY_PARAMS, 2, pipeline_parallel=3, pipeline_link_bandwidth=1e10)
    assert three.stage_layers == [4, 3, 3]
    shape = StepShape(num_seqs=4, num_tokens=20, num_sampled=4, prefill_pairs=100, prefill_context=16,
                      decode_seqs=3, decode_context=300)
    a = one.breakdown(shape)
    times, send = three.stage_times(shape)
    layered = a["linear"] + a["attn_prefill"] + a["attn_decode"]
    assert times[0] == pytest.approx(layered * 0.4 + a["overhead"] + a["host"])
    assert times[1] == pytest.approx(layered * 0.3)
    assert times[2] == pytest.approx(layered * 0.3 + a["lm_head"])
    assert send == pytest.approx(TOY_PARAMS.send_latency_s + 20 * DEEP.hidden_size * 2 / 1e10)
    assert three.step_time(shape) == pytest.approx(sum(times) + 2 * send)
    assert one.stage_times(shape) == ([pytest.approx(one.step_time(shape))], 0.0)


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 4096), decode=st.integers(0, 256), context=st.integers(0, 1 << 20),
       tp=st.sampled_from([1, 2, 8]), pp=st.sampled_from([2, 3, 4, 7]))
def test_stages_add_up_and_the_fullest_bounds_a_share(tokens, decode, context, tp, pp):
    """Over random steps of Llama-3.1-70B: the stages and sends add up to the batch's time, and
    no stage costs less than its layers' share of the per-layer work."""
    model, hw = get_model("llama-3.1-70b"), get_hardware("h100-sxm")
    decode = min(decode, tokens)
    shape = StepShape(num_seqs=max(decode, 1), num_tokens=tokens, num_sampled=max(decode, 1), decode_seqs=decode,
                      decode_context=context)
    cost = RooflineCostModel(hw, model, tensor_parallel=tp, pipeline_parallel=pp)
    times, send = cost.stage_times(shape)
    assert len(times) == pp
    assert sum(times) + (pp - 1) * send == pytest.approx(cost.step_time(shape), rel=1e-9)
    whole = RooflineCostModel(hw, model, tensor_parallel=tp).breakdown(shape)
    per_layer = sum(whole[p] for p in ("linear", "attn_prefill", "attn_decode"))
    for t, layers in zip(times, cost.stage_layers, strict=True):
        assert t >= per_layer * layers / model.num_layers - 1e-12


def test_capacity_is_per_stage():
    """Llama-3.1-70B on 4 stages: each device holds a quarter of the layers' weights and of a
    token's K/V; with 3 stages the fullest holds 27 of the 80 layers."""
    hw, model = get_hardware("h100-sxm"), get_model("llama-3.1-70b")
    cap = describe_capacity(build_sim_engine(EngineConfig.from_kwargs(pipeline_parallel_size=4), hw, model))
    assert cap["weight_gib"] == pytest.approx(model.weight_bytes(2) / 4 / 2**30, rel=1e-6)
    assert cap["kv_bytes_per_token"] == model.kv_bytes_per_token(2) // 4
    three = describe_capacity(build_sim_engine(EngineConfig.from_kwargs(pipeline_parallel_size=3), hw, model))
    assert three["weight_gib"] == pytest.approx(model.weight_bytes(2) * 27 / 80 / 2**30, rel=1e-6)
    both = describe_capacity(build_sim_engine(
        EngineConfig.from_kwargs(pipeline_parallel_size=2, tensor_parallel_size=2), hw, model))
    assert both["weight_gib"] == pytest.approx(cap["weight_gib"], rel=1e-6)
    assert both["pipeline_parallel_size"] == 2


class StageCost:
    """Each stage costs `per_token * tokens + fixed` seconds a batch; sends are free."""

    def __init__(self, stages: int, per_token: float, fixed: float = 0.0) -> None:
        self.stage_layers = [1] * stages
        self.per_token, self.fixed = per_token, fixed

    def stage_times(self, shape: StepShape) -> tuple[list[float], float]:
        return [self.per_token * shape.num_tokens + self.fixed] * len(self.stage_layers), 0.0

    def step_time(self, shape: StepShape) -> float:
        return sum(self.stage_times(shape)[0])


def decode_gaps(engine, n: int, tokens: int) -> list[float]:
    """Run n one-token prompts for `tokens` tokens each; the gaps between a request's tokens
    once every request is running (its first three tokens left out)."""
    for i in range(n):
        engine.add_request(str(i), [5], SamplingParams(max_tokens=tokens, ignore_eos=True))
    gaps: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                t = out.metrics.token_times
                gaps += [b - a for a, b in itertools.pairwise(t[3:])]
    return gaps


def pipeline_engine(stages: int, cost, **options) -> PipelineSimEngine:
    config = EngineConfig.from_kwargs(pipeline_parallel_size=stages, num_kv_blocks=512, **options)
    engine = build_sim_engine(config, TOY_HW, DEEP, TOY_PARAMS, cost_model=cost)
    assert isinstance(engine, PipelineSimEngine)
    return engine


def test_compute_bound_stages_stay_busy():
    """Stages whose time grows with their tokens: 4 balanced batches of 16 of 64 decoding
    sequences keep all 4 stages busy, so a sequence waits one stage's work on all 64 tokens
    between its tokens (64 us), what one device doing every layer at once would take: the
    pipeline costs nothing. One batch of all 64 would wait four times as long."""
    gaps = decode_gaps(pipeline_engine(4, StageCost(4, 1e-6)), 64, 12)
    assert gaps and max(gaps) == pytest.approx(64e-6) and min(gaps) == pytest.approx(64e-6)


def test_fixed_cost_stages_make_each_token_cross_them_all():
    """Stages that cost the same whatever their batch (a memory-bound decode reading its
    weights): each token crosses the 4 stages one after the other, 4 ms a token, however the
    sequences are split."""
    gaps = decode_gaps(pipeline_engine(4, StageCost(4, 0.0, fixed=1e-3)), 64, 10)
    assert gaps and max(gaps) == pytest.approx(4e-3) and min(gaps) == pytest.approx(4e-3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stages=st.integers(2, 5),
    lens=st.lists(st.tuples(st.integers(1, 80), st.integers(1, 30), st.floats(0, 0.05)), min_size=1, max_size=24),
    blocks=st.sampled_from([24, 64, 512]),
    budget=st.sampled_from([16, 64, 2048]),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_random_workloads_keep_the_pipeline_sound(stages, lens, blocks, budget, mode):
    """Random prompts, outputs and arrivals under random caches, budgets and preemption: every
    request gets exactly its tokens (as many as fit the context), never more than `stages` batches are in flight, a
    sequence waiting for its sampled token is in no later batch, batches land in order, and
    every block comes back."""
    engine = build_sim_engine(
        EngineConfig.from_kwargs(pipeline_parallel_size=stages, num_kv_blocks=blocks, block_size=4,
                                 max_num_batched_tokens=budget, preemption_mode=mode, num_swap_blocks=256,
                                 max_num_seqs=8),
        TOY_HW, DEEP, TOY_PARAMS,
    )
    assert isinstance(engine, PipelineSimEngine)
    launch, land = engine._launch, engine._land
    landed: list[float] = []

    def checked_launch(sched_out, start):
        waiting_for_token = {s.seq_id for b in engine._pipe for s in b.scheduled.scheduled if s.sample}
        assert not waiting_for_token & {s.seq_id for s in sched_out.scheduled}
        launch(sched_out, start)
        assert len(engine._pipe) <= stages

    def checked_land():
        landed.append(engine._pipe[0].done)
        return land()

    engine._launch, engine._land = checked_launch, checked_land  # type: ignore[method-assign]
    arrivals = sorted((a, i) for i, (_, _, a) in enumerate(lens))
    done: dict[str, int] = {}
    k = 0
    while k < len(arrivals) or engine.has_unfinished_requests():
        while k < len(arrivals) and arrivals[k][0] <= engine.clock():
            i = arrivals[k][1]
            prompt, out, _ = lens[i]
            engine.add_request(str(i), [7] * prompt, SamplingParams(max_tokens=out, ignore_eos=True),
                               arrival_time=arrivals[k][0])
            k += 1
        if engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = len(o.outputs[0].token_ids)
        else:
            engine.wait_until(arrivals[k][0])
    room = engine.max_model_len  # (a sequence never outgrows the cache: a long prompt's output is cut)
    assert done == {str(i): min(out, room - prompt) for i, (prompt, out, _) in enumerate(lens)}
    assert landed == sorted(landed)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_refusals():
    hw, model = get_hardware("h100-sxm"), get_model("llama-3.1-8b")
    with pytest.raises(ConfigError, match="has 2 layers to split"):
        build_sim_engine(EngineConfig.from_kwargs(pipeline_parallel_size=3), TOY_HW, TOY, TOY_PARAMS)
    with pytest.raises(ConfigError, match="speculative decoding is not modelled"):
        build_sim_engine(EngineConfig.from_kwargs(pipeline_parallel_size=2, speculative_method="ngram"), hw, model,
                         acceptance_rate=0.5)
    with pytest.raises(ConfigError, match="must be at least 1"):
        EngineConfig.from_kwargs(pipeline_parallel_size=0)


def test_the_engine_refuses_pipeline_parallelism(tiny_models):
    from conveyor import LLM

    with pytest.raises(ConfigError, match="the engine does not build pipeline parallelism"):
        LLM(str(tiny_models["llama"]), pipeline_parallel_size=2)


def test_from_the_command_line(tmp_path):
    """Llama-3.1-405B on two machines of 8 H100s: 8-way tensor parallel within each, 2 stages
    across them over a 50 GB/s NIC."""
    from conveyor.cli import main

    rc = main(["simulate", "--hardware", "h100-sxm", "--model", "llama-3.1-405b", "--num-requests", "16",
               "--concurrency", "8", "--no-plots", "--no-progress", "--out", str(tmp_path),
               "--pipeline-link-gbps", "50", "tp8pp2:tensor_parallel_size=8,pipeline_parallel_size=2"])
    assert rc == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "on each of 16 devices (8 tensor parallel x 2 pipeline stages); 16 devices in all" in summary
    assert "| tp8pp2 | c=8 | 16/16 |" in summary
