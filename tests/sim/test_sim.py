"""The simulator: the real scheduler on a cost model, hand-checked numbers, determinism."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cli import main
from conveyor.config import EngineConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from conveyor.engine import Engine
from conveyor.replay import TimedRequest, replay
from conveyor.sampling_params import SamplingParams
from conveyor.sim import calibrate
from conveyor.sim.cost import CostParams, RooflineCostModel, StepShape
from conveyor.sim.engine import SimEngine, build_sim_engine, describe_capacity
from conveyor.sim.hardware import GiB, Hardware, get_hardware
from conveyor.sim.models import ModelShape, get_model

# A toy model and toy hardware whose numbers are easy to follow by hand.
TOY = ModelShape("toy", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=1000, tie_word_embeddings=False, max_position_embeddings=512)
TOY_HW = Hardware("toy-gpu", "toy", peak_flops=1e12, mem_bandwidth=1e11, memory_bytes=4 * GiB, host_bandwidth=1e10)
TOY_PARAMS = CostParams(mfu=0.5, attn_mfu=0.25, mbu=0.8, kv_mbu=0.8, gemv_mbu=None,
                        step_overhead_s=1e-3, seq_overhead_s=1e-5, token_overhead_s=0.0)


def toy_engine(**kw) -> SimEngine:
    kw.setdefault("gpu_memory_utilization", 0.5)
    return build_sim_engine(EngineConfig.from_kwargs(**kw), TOY_HW, TOY, TOY_PARAMS)


def test_toy_sizes_by_hand():
    # per layer: q,k,v 64 x (64 + 2 x 32) = 8192, o 64 x 64 = 4096, MLP 3 x 64 x 128 = 24576
    assert TOY.layer_params == 2 * (8192 + 4096 + 24576) == 73_728
    assert TOY.num_params == 73_728 + 64_000 + 64_000  # + embedding + untied head
    assert TOY.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2 == 256


def test_kv_capacity_by_hand():
    engine = toy_engine()
    # 4 GiB x 0.5 - 1 GiB runtime reserve - 403,456 bytes of weights = 1,073,338,368 bytes;
    # a block is 16 tokens x 256 bytes = 4096 bytes: 262,045 whole blocks.
    assert engine.num_kv_blocks == 262_045
    cap = describe_capacity(engine)
    assert cap["kv_tokens"] == 262_045 * 16
    assert engine.max_model_len == 512  # the model's context, below the capacity
    assert toy_engine(num_kv_blocks=10).num_kv_blocks == 10


def _item(seq_id: int, n: int, start: int, sample: bool = True) -> ScheduledSequence:
    ids = [5] * (start + n)
    return ScheduledSequence(seq_id, ids[start:], start, [], sample, SamplingParams(), ids, start + n)


def test_step_times_by_hand():
    cost = RooflineCostModel(TOY_HW, TOY, TOY_PARAMS, dtype_bytes=2)
    # Two decodes at contexts 100 and 50.
    decode = StepShape.of(SchedulerOutput(0, [_item(0, 1, 99), _item(1, 1, 49)]))
    assert (decode.num_tokens, decode.decode_context, decode.num_sampled) == (2, 150, 2)
    linear = max(2 * 73_728 * 2 / 0.5e12, 73_728 * 2 / 0.8e11)  # memory-bound: 1.8432e-6
    head = max(2 * 64_000 * 2 / 0.5e12, 64_000 * 2 / 0.8e11)  # 1.6e-6
    attn = max(4 * 2 * 4 * 16 * 150 / 0.25e12, 256 * 150 / 0.8e11)  # 4.8e-7
    assert cost.step_time(decode) == pytest.approx(linear + head + attn + 1e-3 + 2e-5, rel=1e-12)
    assert cost.step_time(decode) == pytest.approx(1.0239232e-3, rel=1e-9)
    # One 100-token prompt: compute-bound linear layers, causal attention over 5050 pairs.
    prefill = StepShape.of(SchedulerOutput(0, [_item(0, 100, 0)]))
    assert prefill.prefill_pairs == 5050
    assert cost.step_time(prefill) == pytest.approx(2.94912e-5 + 1.6e-6 + 1.03424e-5 + 1.01e-3, rel=1e-9)
    parts = cost.breakdown(prefill)
    assert sum(parts.values()) == pytest.approx(cost.step_time(prefill))
    # A chunk that does not end its prompt samples nothing: no LM head.
    chunk = StepShape.of(SchedulerOutput(0, [_item(0, 100, 0, sample=False)]))
    assert cost.step_time(prefill) - cost.step_time(chunk) == pytest.approx(1.6e-6)


def test_gemv_efficiency_applies_to_one_token_steps_only():
    params = CostParams(mfu=0.5, attn_mfu=0.25, mbu=0.8, kv_mbu=0.8, gemv_mbu=0.4,
                        step_overhead_s=0.0, seq_overhead_s=0.0)
    cost = RooflineCostModel(TOY_HW, TOY, params, dtype_bytes=2)
    one = cost.breakdown(StepShape.of(SchedulerOutput(0, [_item(0, 1, 9)])))
    two = cost.breakdown(StepShape.of(SchedulerOutput(0, [_item(0, 1, 9), _item(1, 1, 9)])))
    assert one["linear"] == pytest.approx(73_728 * 2 / 0.4e11)
    assert two["linear"] == pytest.approx(73_728 * 2 / 0.8e11)


def test_skinny_rows_extend_the_matrix_vector_regime():
    params = CostParams(mfu=0.5, attn_mfu=0.25, mbu=0.8, kv_mbu=0.8, gemv_mbu=0.4, skinny_rows=8,
                        skinny_pass_rows=8, step_overhead_s=0.0, seq_overhead_s=0.0)
    cost = RooflineCostModel(TOY_HW, TOY, params, dtype_bytes=2)
    eight = cost.breakdown(StepShape.of(SchedulerOutput(0, [_item(i, 1, 9) for i in range(8)])))
    nine = cost.breakdown(StepShape.of(SchedulerOutput(0, [_item(i, 1, 9) for i in range(9)])))
    assert eight["linear"] == pytest.approx(73_728 * 2 / 0.4e11)
    assert nine["linear"] == pytest.approx(max(2 * 73_728 * 9 / 0.5e12, 73_728 * 2 / 0.8e11))
    assert CostParams.from_dict(params.to_dict()) == params
    # Two passes of 8 rows: twice the weight stream.
    two = CostParams(mfu=0.5, attn_mfu=0.25, mbu=0.8, kv_mbu=0.8, gemv_mbu=0.4, skinny_rows=16,
                     skinny_pass_rows=8, step_overhead_s=0.0, seq_overhead_s=0.0)
    cost2 = RooflineCostModel(TOY_HW, TOY, two, dtype_bytes=2)
    twelve = cost2.breakdown(StepShape.of(SchedulerOutput(0, [_item(i, 1, 9) for i in range(12)])))
    assert twelve["linear"] == pytest.approx(max(2 * 73_728 * 12 / 0.5e12, 2 * 73_728 * 2 / 0.4e11))


def test_unfused_overhead_applies_to_steps_the_fused_decode_does_not_take():
    params = CostParams(step_overhead_s=1e-3, seq_overhead_s=0.0, fused_rows=2, unfused_overhead_s=5e-3)
    cost = RooflineCostModel(TOY_HW, TOY, params, dtype_bytes=2)

    def overhead(items):
        return cost.breakdown(StepShape.of(SchedulerOutput(0, items)))["overhead"]

    assert overhead([_item(0, 1, 9), _item(1, 1, 19)]) == pytest.approx(1e-3)  # two decodes: fused
    assert overhead([_item(i, 1, 9) for i in range(3)]) == pytest.approx(6e-3)  # three: too many rows
    assert overhead([_item(0, 1, 9), _item(1, 4, 0)]) == pytest.approx(6e-3)  # a prompt in the step


def test_a_verification_step_is_priced_in_the_fused_decode_as_the_cpu_runner_runs_it():
    """The runner runs a speculative step's guessed rows as one-token decodes in the native call
    (`ModelRunner._chains`), and a draft model's catch-up spans of up to `chain_max_span` rows."""
    params = CostParams(step_overhead_s=1e-3, seq_overhead_s=0.0, fused_rows=4, unfused_overhead_s=5e-3)
    cost = RooflineCostModel(TOY_HW, TOY, params, dtype_bytes=2)
    guessing = _item(1, 3, 20)
    guessing.num_draft = 2

    def overhead(items, chain_span=0):
        return cost.breakdown(StepShape.of(SchedulerOutput(0, items), chain_span=chain_span))["overhead"]

    assert StepShape.of(SchedulerOutput(0, [_item(0, 1, 9), guessing])).chained_seqs == 1
    assert overhead([_item(0, 1, 9), guessing]) == pytest.approx(1e-3)  # 4 rows: fused
    assert overhead([_item(0, 1, 9), _item(2, 1, 9), guessing]) == pytest.approx(6e-3)  # 5 rows: too many
    assert overhead([_item(0, 1, 9), _item(1, 3, 20)]) == pytest.approx(6e-3)  # a prompt chunk of 3
    assert overhead([_item(0, 1, 9), _item(1, 3, 20)], chain_span=3) == pytest.approx(1e-3)  # a draft's catch-up


def test_a_step_after_idle_costs_the_idle_factor_more():
    params = CostParams(idle_factor=0.25, idle_threshold_s=0.05)
    cost = RooflineCostModel(TOY_HW, TOY, params, dtype_bytes=2)
    warm = StepShape.of(SchedulerOutput(0, [_item(0, 100, 0)]))
    cold = StepShape.of(SchedulerOutput(0, [_item(0, 100, 0)]))
    cold.idle_before_s = 0.05
    assert cost.step_time(cold) == pytest.approx(1.25 * cost.step_time(warm))
    cold.idle_before_s = 0.049  # a pause shorter than the threshold: the server's own host work
    assert cost.step_time(cold) == pytest.approx(cost.step_time(warm))


def test_a_step_after_idle_costs_the_fixed_idle_cost_more():
    cost = RooflineCostModel(TOY_HW, TOY, CostParams(idle_cost_s=3e-3, idle_threshold_s=0.05), dtype_bytes=2)
    for n in (1, 100, 1000):  # the same few ms whatever the step's size
        warm = StepShape.of(SchedulerOutput(0, [_item(0, n, 0)]))
        cold = StepShape.of(SchedulerOutput(0, [_item(0, n, 0)]))
        cold.idle_before_s = 0.2
        assert cost.step_time(cold) == pytest.approx(cost.step_time(warm) + 3e-3)
        assert cost.breakdown(cold)["after_idle"] == pytest.approx(3e-3)
    assert cost.step_time(StepShape(idle_before_s=1.0)) == 0.0  # an empty step computes nothing


def test_simulator_marks_the_steps_that_follow_an_idle_period():
    """Requests 10 s apart on a fast toy: each one's prompt step follows an idle period, and
    every later step of it follows a busy one."""

    class Recording:
        def __init__(self) -> None:
            self.shapes: list[StepShape] = []

        def step_time(self, shape: StepShape) -> float:
            self.shapes.append(shape)
            return 1e-3

    cost = Recording()
    engine = build_sim_engine(EngineConfig.from_kwargs(gpu_memory_utilization=0.5), TOY_HW, TOY, cost_model=cost)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    replay(engine, [TimedRequest(10.0 * i + 1.0, [5] * 20, sp) for i in range(3)])
    idles = [s.idle_before_s for s in cost.shapes]
    assert len(idles) == 3 * 4  # one prompt step, three decodes, per request
    assert [round(x, 6) for x in idles[::4]] == [1.0, 10 - 4e-3, 10 - 4e-3]
    assert all(x == 0.0 for i, x in enumerate(idles) if i % 4)


def test_simulator_uses_the_real_scheduler():
    engine = toy_engine()
    assert isinstance(engine, Engine)
    assert type(engine.scheduler) is Scheduler
    assert type(engine.scheduler.block_manager) is BlockManager


def test_single_request_timeline_by_hand():
    engine = toy_engine()
    engine.add_request("a", [7] * 100, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = outs
    cost = engine.cost_model
    prefill = cost.step_time(StepShape.of(SchedulerOutput(0, [_item(0, 100, 0)])))
    d1 = cost.step_time(StepShape.of(SchedulerOutput(0, [_item(0, 1, 100)])))
    d2 = cost.step_time(StepShape.of(SchedulerOutput(0, [_item(0, 1, 101)])))
    m = out.metrics
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    assert m.first_token_time - m.arrival_time == pytest.approx(prefill)
    assert m.finished_time - m.arrival_time == pytest.approx(prefill + d1 + d2)


def _workload(n: int, seed: int) -> list[TimedRequest]:
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(200.0)
        reqs.append(TimedRequest(t, [rng.randrange(10, 900) for _ in range(rng.randint(4, 150))],
                                 SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True, temperature=0.0)))
    return reqs


def _timeline(engine: SimEngine, reqs: list[TimedRequest]) -> list[tuple]:
    outs = replay(engine, reqs)
    return [(o.metrics.first_token_time, o.metrics.finished_time, len(o.outputs[0].token_ids)) for o in outs]


def test_deterministic():
    reqs = _workload(60, 1)
    a = _timeline(toy_engine(num_kv_blocks=40, max_num_seqs=8), reqs)
    b = _timeline(toy_engine(num_kv_blocks=40, max_num_seqs=8), reqs)
    assert a == b
    assert [n for *_, n in a] == [r.params.max_tokens for r in reqs]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batching=st.sampled_from(["continuous", "static", "dynamic"]),
    prefill_mode=st.sampled_from(["chunked", "mixed", "prefill_first"]),
    policy=st.sampled_from(["fcfs", "priority", "sjf", "mlfq", "lpm", "slo", "vtc"]),
    preemption=st.sampled_from(["recompute", "swap"]),
    blocks=st.integers(14, 60),
)
def test_every_request_gets_its_length_under_any_schedule(seed, batching, prefill_mode, policy, preemption, blocks):
    kw = dict(batching=batching, prefill_mode=prefill_mode, policy=policy, preemption_mode=preemption,
              num_kv_blocks=blocks, max_num_seqs=6, max_num_batched_tokens=256, num_swap_blocks=64)
    if batching != "continuous":
        kw["max_batch_size"] = 4
    engine = toy_engine(**kw)
    reqs = _workload(25, seed)
    timeline = _timeline(engine, reqs)
    assert [n for *_, n in timeline] == [r.params.max_tokens for r in reqs]
    assert engine.scheduler.block_manager.num_used_blocks == 0
    engine.scheduler.check_integrity()
    busy = sum(s.duration_s for s in engine.step_trace)
    assert busy == pytest.approx(engine.runner_busy_s)
    assert engine.clock.now >= busy  # the clock also waits for arrivals


def test_offloading_prices_its_copies_and_saves_the_prefills():
    """Four 64-token prefixes in turn through a device cache that holds about one: the tier's
    hits are loads over the host link (priced per block, as swaps) in place of prefills."""
    rng = random.Random(2)
    prefixes = [[rng.randrange(10, 900) for _ in range(64)] for _ in range(4)]
    reqs = [TimedRequest(float(i), prefixes[i % 4] + [rng.randrange(10, 900) for _ in range(8)],
                         SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)) for i in range(16)]
    base = toy_engine(num_kv_blocks=8, max_num_seqs=1)
    tier = toy_engine(num_kv_blocks=8, max_num_seqs=1, num_offload_blocks=32)
    replay(base, reqs)
    replay(tier, reqs)
    bm = tier.scheduler.block_manager
    assert base.scheduler.block_manager.num_hit_tokens == 0
    assert bm.num_offload_hit_tokens == bm.num_hit_tokens == 12 * 64  # every turn after the first four
    loads = [s for s in tier.step_trace if s.blocks_loaded]
    assert sum(s.blocks_loaded for s in loads) == 12 * 4
    swap_s = tier.cost_model._swap_s
    for s in loads:  # each load step: the prompt's last 8 tokens and 4 blocks copied in
        assert s.num_prefill_tokens == 8 and s.blocks_loaded == 4
        assert s.duration_s > 4 * swap_s
    assert sum(s.num_prefill_tokens for s in tier.step_trace) == 16 * 72 - 12 * 64
    assert tier.runner_busy_s < base.runner_busy_s
    assert describe_capacity(tier)["offload_tokens"] == 32 * 16 and not describe_capacity(base)["offload_tokens"]


def test_write_through_prices_its_stores_when_the_blocks_are_computed():
    """write_through stores every computed block the step after (a decode step here, priced over
    the host link), and an eviction copies nothing: the same hits and stores as write_back
    (every prefix is evicted in turn), none of them in the steps that admit and load."""
    rng = random.Random(2)
    prefixes = [[rng.randrange(10, 900) for _ in range(64)] for _ in range(4)]
    reqs = [TimedRequest(float(i), prefixes[i % 4] + [rng.randrange(10, 900) for _ in range(8)],
                         SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)) for i in range(16)]
    back = toy_engine(num_kv_blocks=8, max_num_seqs=1, num_offload_blocks=64)
    through = toy_engine(num_kv_blocks=8, max_num_seqs=1, num_offload_blocks=64, kv_offloading_policy="write_through")
    replay(back, reqs)
    replay(through, reqs)
    a, b = back.scheduler.block_manager, through.scheduler.block_manager
    assert a.num_offload_hit_tokens == b.num_offload_hit_tokens == 12 * 64
    assert b.num_offload_stores == a.num_offload_stores == 16
    assert sum(s.blocks_stored for s in back.step_trace if s.num_prefill_tokens) > 0
    assert sum(s.blocks_stored for s in through.step_trace if s.num_prefill_tokens) == 0
    assert sum(s.blocks_stored for s in through.step_trace) == b.num_offload_stores


def test_a_disk_tier_extends_the_host_tier_and_prices_its_copies_at_the_disks_bandwidth():
    """Eight 64-token prefixes in turn through a device cache of about one and a host tier of
    about two: without a disk the host tier forgets each before its turn; with one (bookkeeping
    only, no files) every later turn reads its prefix from disk into the tier, priced per block
    at `disk_bandwidth`, in place of computing it."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(10, 900) for _ in range(64)] for _ in range(8)]
    reqs = [TimedRequest(float(i), prefixes[i % 8] + [rng.randrange(10, 900) for _ in range(8)],
                         SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)) for i in range(32)]
    host = toy_engine(num_kv_blocks=8, max_num_seqs=1, num_offload_blocks=8)
    disk = toy_engine(num_kv_blocks=8, max_num_seqs=1, num_offload_blocks=8, kv_disk_path="unused",
                      kv_disk_size=64 * 16 * TOY.kv_bytes_per_token(2))
    replay(host, reqs)
    replay(disk, reqs)
    assert host.scheduler.block_manager.num_offload_hit_tokens == 0
    bm = disk.scheduler.block_manager
    assert bm.num_disk_hit_tokens == bm.num_hit_tokens == 24 * 64  # every turn after the first eight
    reads = [s for s in disk.step_trace if s.disk_blocks_read]
    assert sum(s.disk_blocks_read for s in reads) == 24 * 4
    cost = disk.cost_model
    for s in reads:  # each: the prompt's last 8 tokens, 4 blocks read from disk (and loaded)
        assert s.num_prefill_tokens == 8 and s.duration_s > 4 * (cost._disk_s + cost._swap_s)
    assert cost._disk_s == pytest.approx(cost._swap_s * TOY_HW.host_bandwidth / TOY_HW.disk_bandwidth)
    assert disk.runner_busy_s < host.runner_busy_s
    assert describe_capacity(disk)["disk_tokens"] == 64 * 16 and not describe_capacity(host)["disk_tokens"]


def test_a_max_tokens_factor_asks_for_more_and_stops_at_the_answers_length():
    """`--max-tokens-factor`: max_tokens is F times the output length and the simulated model
    stops each request at its length; `reserve` then holds F times the blocks, `on_demand` the
    same as without, and `estimate` in between: the most requests each runs at once."""
    from conveyor.bench.offline import bench_params
    from conveyor.bench.workload import BenchRequest

    rng = random.Random(3)
    bench = [BenchRequest(i, tuple(rng.randrange(10, 900) for _ in range(20)), 20, rng.randint(8, 40)) for i in range(24)]
    most = {}
    for mode in ("on_demand", "estimate", "reserve"):
        engine = toy_engine(num_kv_blocks=64, max_num_seqs=24, kv_reservation=mode)
        outs = replay(engine, [TimedRequest(0.0, list(r.prompt), bench_params(r, 4.0)) for r in bench])
        assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in bench]
        assert {o.outputs[0].finish_reason for o in outs} == {"stop"}
        most[mode] = max(st.num_running for st in engine.step_trace)
    assert most["on_demand"] > most["estimate"] > most["reserve"] > 0, most
    plain = bench_params(bench[0])
    assert plain.max_tokens == bench[0].output_len and plain.ignore_eos


def test_continuous_beats_static_under_varied_lengths():
    rng = random.Random(0)
    reqs = [TimedRequest(0.0, [5] * 64, SamplingParams(max_tokens=rng.choice([4, 200]), ignore_eos=True, temperature=0.0))
            for _ in range(64)]
    done = {}
    for batching in ("static", "continuous"):
        kw = {"max_batch_size": 16} if batching == "static" else {}
        engine = build_sim_engine(EngineConfig.from_kwargs(batching=batching, max_num_seqs=16, **kw),
                                  get_hardware("a100-40gb"), get_model("llama-2-7b"))
        replay(engine, reqs)
        done[batching] = engine.clock.now
    assert done["continuous"] < 0.8 * done["static"]


def test_catalog_parameter_counts():
    published = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9, "llama-2-7b": 6.74e9, "llama-2-13b": 13.0e9, "opt-13b": 12.85e9,
                 "mistral-7b": 7.24e9, "qwen3-0.6b": 0.596e9, "smollm2-135m": 134.5e6}
    for name, n in published.items():
        assert get_model(name).num_params == pytest.approx(n, rel=0.01), name


def test_model_from_config_json(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))
    assert (m.head_dim, m.num_kv_heads, m.tie_word_embeddings) == (64, 2, True)
    assert m.num_params == pytest.approx(494e6, rel=0.01)  # Qwen2-0.5B
    with pytest.raises(ValueError, match="unknown model"):
        get_model("no-such-model")
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu")


def test_weights_that_do_not_fit_are_refused():
    from conveyor.config import ConfigError

    with pytest.raises(ConfigError, match="weighs"):
        build_sim_engine(EngineConfig(), get_hardware("rtx-4070-laptop"), get_model("llama-2-13b"))


def test_speculative_decoding_needs_an_acceptance_rate():
    from conveyor.config import ConfigError

    config = EngineConfig.from_kwargs(speculative_method="ngram")
    with pytest.raises(ConfigError, match="spec-acceptance-rate"):
        build_sim_engine(config, get_hardware("h100-sxm"), get_model("llama-2-7b"))
    with pytest.raises(ConfigError, match="must be in"):
        build_sim_engine(config, get_hardware("h100-sxm"), get_model("llama-2-7b"), acceptance_rate=1.5)


def test_simulated_speculative_decoding_follows_its_acceptance_rate(tmp_path):
    """The real scheduler drafts; the runner accepts each draft with the given probability. At
    batch 1 on an H100 (a decode step reads all the weights for one token), drafts accepted
    80% of the time cut the time of a request by more than half; none accepted, they cost;
    every request gets exactly its length either way."""
    import json

    from conveyor.cli import main

    def run(name, *flags):
        out = tmp_path / name
        assert main(["simulate", "--hardware", "h100-sxm", "--model", "llama-3.1-8b", "--num-requests", "4",
                     "--concurrency", "1", "--input-len", "256", "--output-len", "256", "--no-plots",
                     "--no-progress", "--out", str(out), *flags]) == 0
        point = json.loads((out / "result.json").read_text())["systems"][0]["points"][0]
        assert point["summary"]["completed"] == 4
        return point["summary"]["duration_s"]

    base = run("base")
    fast = run("fast", "--speculative-method", "ngram", "--spec-acceptance-rate", "0.8")
    none = run("none", "--speculative-method", "ngram", "--spec-acceptance-rate", "0")
    assert fast < 0.5 * base
    assert none > base
    assert main(["simulate", "--hardware", "h100-sxm", "--request-rate", "inf", "--no-plots",
                 "--spec-acceptance-rate", "0.5", "--out", str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("fused_rows", [0, 16])
def test_fit_recovers_a_known_cost_model(fused_rows):
    truth = CostParams(mfu=0.6, attn_mfu=0.3, mbu=0.2, kv_mbu=0.05, gemv_mbu=0.35, gemv_mfu=0.3, skinny_rows=16, skinny_pass_rows=8,
                       step_overhead_s=2e-3, seq_overhead_s=3e-4, token_overhead_s=1e-5, fused_rows=fused_rows,
                       unfused_overhead_s=4e-3 if fused_rows else 0.0, idle_cost_s=2.5e-3, gemm_overhead_s=6e-3)
    hw = Hardware("cpu", "toy cpu", 1e11, 5e10, 8 * GiB, 2.5e10, dtype_bytes=4, is_gpu=False)
    model = get_model("smollm2-135m")
    cost = RooflineCostModel(hw, model, truth, 4)
    samples = []
    for label, shape in calibrate.default_grid():
        items = [_item(i, n, start) for i, (n, start) in enumerate(shape)]
        s = StepShape.of(SchedulerOutput(0, items))
        samples.append((label, s, cost.step_time(s)))
        if all(n > 1 for n, _ in shape):  # the prompt shapes, timed again after an idle
            cold = StepShape.of(SchedulerOutput(0, items))
            cold.idle_before_s = calibrate.IDLE_S
            samples.append((f"{label} {calibrate.AFTER_IDLE}", cold, cost.step_time(cold)))
    fit = calibrate.fit(hw, model, samples, skinny=(16, 8), fused_rows=fused_rows)
    assert fit.max_abs_rel_error < 0.03
    assert fit.params.idle_cost_s == pytest.approx(2.5e-3, rel=0.05)
    assert fit.params.idle_factor == 0.0
    if fused_rows:  # the fused steps' saving is found, not spread over the other overheads
        assert fit.params.unfused_overhead_s == pytest.approx(4e-3, rel=0.2)
    assert fit.params.gemm_overhead_s == pytest.approx(6e-3, rel=0.2)  # the matrix path's fixed cost too
    path = calibrate.save(__import__("pathlib").Path("/tmp") / f"cal-{random.random()}.json", hw, model, None, fit, samples, 16)
    loaded = calibrate.load(path)
    assert loaded.params == fit.params and loaded.hardware == hw and loaded.model == model
    path.unlink()


def test_loading_a_calibration_of_another_hand_over_point_warns(tmp_path, caplog, monkeypatch):
    """A calibration fitted when the runner's skinny kernel stopped at 64 rows prices steps of
    65-128 rows on MKL's path: loading it under a runner that hands over elsewhere says so."""
    hw = Hardware("cpu", "toy cpu", 1e11, 5e10, 8 * GiB, 2.5e10, dtype_bytes=4, is_gpu=False)
    model = get_model("smollm2-135m")
    fit = calibrate.Fit(CostParams(skinny_rows=64, skinny_pass_rows=64), [0.0])
    sample = ("decode 1", StepShape.of(SchedulerOutput(0, [_item(0, 1, 10)])), 0.02)
    path = calibrate.save(tmp_path / "cal.json", hw, model, None, fit, [sample], 16)
    monkeypatch.setattr(calibrate, "runner_skinny_rows", lambda: (128, 64))
    with caplog.at_level("WARNING", logger="conveyor"):
        calibrate.load(path)
    assert "up to 64 rows" in caplog.text and "calibrate" in caplog.text
    caplog.clear()
    monkeypatch.setattr(calibrate, "runner_skinny_rows", lambda: (64, 64))
    with caplog.at_level("WARNING", logger="conveyor"):
        calibrate.load(path)
    assert caplog.text == ""


def test_the_matrix_path_pays_its_fixed_cost_and_kinds_are_banded():
    params = CostParams(skinny_rows=64, skinny_pass_rows=64, gemm_overhead_s=0.03)
    hw = Hardware("cpu", "toy cpu", 1e11, 5e10, 8 * GiB, 2.5e10, dtype_bytes=4, is_gpu=False)
    cost = RooflineCostModel(hw, get_model("smollm2-135m"), params, 4)
    skinny = StepShape(num_seqs=1, num_tokens=64, num_sampled=1, prefill_pairs=64 * 65 // 2, prefill_context=64)
    matrix = StepShape(num_seqs=1, num_tokens=65, num_sampled=1, prefill_pairs=65 * 66 // 2, prefill_context=65)
    without = RooflineCostModel(cost.hardware, cost.model, CostParams(skinny_rows=64, skinny_pass_rows=64), 4)
    assert cost.step_time(skinny) == without.step_time(skinny)
    assert cost.step_time(matrix) == pytest.approx(without.step_time(matrix) + 0.03)
    kinds = [calibrate.fit_kind(s) for s in (skinny, matrix, StepShape(num_seqs=6, num_tokens=6, decode_seqs=6))]
    assert kinds == ["prompt 64+", "prompt 64+", "decode x5-8"]
    assert calibrate.fit_kind(StepShape(num_seqs=2, num_tokens=130, decode_seqs=1)) == "mixed 128+"


def test_a_peak_read_low_binds_the_fit_and_the_best_reading_frees_it():
    """Samples from a runner whose skinny kernel streams at 0.9 of the true bandwidth: fitted
    against a bandwidth read 40% low (a busy moment), the efficiency it needs (1.5) is past the
    ceiling and the error lands elsewhere; against the best of the readings the fit holds."""
    truth = CostParams(mfu=0.6, attn_mfu=0.3, mbu=0.2, kv_mbu=0.3, gemv_mbu=0.9, gemv_mfu=0.5, skinny_rows=16,
                       skinny_pass_rows=8, step_overhead_s=2e-3, seq_overhead_s=3e-4, token_overhead_s=1e-5)
    model = get_model("smollm2-135m")
    true_hw = Hardware("cpu", "toy cpu", 1e11, 5e10, 8 * GiB, 2.5e10, dtype_bytes=4, is_gpu=False)
    cost = RooflineCostModel(true_hw, model, truth, 4)
    samples = []
    for label, shape in calibrate.default_grid():
        s = StepShape.of(SchedulerOutput(0, [_item(i, n, start) for i, (n, start) in enumerate(shape)]))
        samples.append((label, s, cost.step_time(s)))
    readings = [(1e11, 3e10), (0.8e11, 5e10)]  # before and after: each low in one of the two
    assert calibrate.best_peaks(readings) == (1e11, 5e10)
    low = Hardware("cpu", "toy cpu", 1e11, 3e10, 8 * GiB, 1.5e10, dtype_bytes=4, is_gpu=False)
    bound = calibrate.fit(low, model, samples, skinny=(16, 8))
    assert bound.params.gemv_mbu == pytest.approx(1.0) and bound.max_abs_rel_error > 0.1
    best = calibrate.fit(true_hw, model, samples, skinny=(16, 8))
    assert best.max_abs_rel_error < 0.03


def test_grid_blocks_is_the_largest_shapes_need():
    """The calibration grid's largest shape is 64 decodes at context 512: 64 x 32 blocks of 16
    tokens; a shape's need counts each sequence's blocks apart (17 tokens take two)."""
    assert calibrate.grid_blocks(16) == 64 * 32
    assert calibrate.grid_blocks(32) == 64 * 16
    assert calibrate.grid_blocks(16, [("two", [(1, 16), (17, 0)]), ("one", [(16, 0)])]) == 4


def test_simulate_cli(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["simulate", "--hardware", "a100-80gb", "--model", "llama-2-7b", "--num-requests", "50",
               "--request-rate", "4,inf", "--no-plots", "--no-progress", "--out", str(out), "static", "continuous"])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    assert result["mode"] == "simulate"
    assert [s["name"] for s in result["systems"]] == ["static", "continuous"]
    assert all(p["summary"]["completed"] == 50 for s in result["systems"] for p in s["points"])
    assert "simulated: llama-2-7b on NVIDIA A100" in (out / "summary.md").read_text()
    assert main(["simulate", "--hardware", "a100-80gb", "--num-requests", "2", "--request-rate", "inf",
                 "--no-plots", "--out", str(tmp_path / "x"), "hf_static"]) == 2
    assert main(["simulate", "--hardware", "tpu", "--request-rate", "inf", "--no-plots"]) == 2


def test_cpu_needs_a_calibration(tmp_path, capsys):
    rc = main(["simulate", "--hardware", "cpu", "--calibration", str(tmp_path / "none.json"),
               "--request-rate", "inf", "--no-plots"])
    assert rc == 2
    assert "conveyor calibrate" in capsys.readouterr().err


def test_report_merges_a_simulated_run_beside_another(tmp_path):
    common = ["--num-requests", "20", "--request-rate", "2,inf", "--no-plots", "--no-progress", "--seed", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["simulate", "--hardware", "a100-80gb", "--model", "llama-2-7b", *common, "--out", str(a)]) == 0
    assert main(["simulate", "--hardware", "h100-sxm", "--model", "llama-2-7b", *common, "--out", str(b)]) == 0
    both = tmp_path / "both"
    assert main(["bench", "report", str(a / "result.json"), str(b / "result.json"), "--out", str(both), "--no-plots"]) == 0
    merged = json.loads((both / "result.json").read_text())
    assert [s["name"] for s in merged["systems"]] == ["a100-80gb (simulated)", "h100-sxm (simulated)"]
    h100 = merged["systems"][1]["points"][1]["summary"]["output_throughput"]
    a100 = merged["systems"][0]["points"][1]["summary"]["output_throughput"]
    assert h100 > a100  # more FLOP/s and bandwidth: more tokens at full load
    # Different load points cannot share one report.
    c = tmp_path / "c"
    assert main(["simulate", "--hardware", "l4", "--model", "llama-2-7b", "--num-requests", "20",
                 "--request-rate", "1", "--no-plots", "--no-progress", "--out", str(c)]) == 0
    assert main(["bench", "report", str(a / "result.json"), str(c / "result.json"), "--out", str(tmp_path / "x"),
                 "--no-plots"]) == 2
    assert main(["bench", "report", str(a / "result.json"), str(b / "result.json"), "--no-plots"]) == 2


def test_fit_measures_the_host_time_between_served_steps():
    """`host_s` is the mean gap before the closed-loop served steps (under the idle threshold);
    the open-loop part's gaps (waits for arrivals) and the grid's pauses do not count."""
    hw = Hardware("cpu", "toy cpu", 1e11, 5e10, 8 * GiB, 2.5e10, dtype_bytes=4, is_gpu=False)
    model = get_model("smollm2-135m")
    truth = CostParams(step_overhead_s=2e-3, seq_overhead_s=3e-4)
    cost = RooflineCostModel(hw, model, truth, 4)
    samples = []
    for i, (label, shape) in enumerate(calibrate.default_grid()):
        s = StepShape.of(SchedulerOutput(0, [_item(j, n, start) for j, (n, start) in enumerate(shape)]))
        s.idle_before_s = 1e-3  # the grid's pause
        samples.append((label, s, cost.step_time(s)))
        served = dataclasses.replace(s, idle_before_s=(0.4e-3, 0.8e-3)[i % 2])
        samples.append((f"{calibrate.SERVED_CLOSED}4", served, cost.step_time(served)))
        waiting = dataclasses.replace(s, idle_before_s=0.03)  # open loop: waited for an arrival
        samples.append(("served open 0.5/s", waiting, cost.step_time(waiting)))
    fit = calibrate.fit(hw, model, samples, skinny=(16, 8))
    assert fit.params.host_s == pytest.approx(0.6e-3, rel=0.05)
    assert fit.max_abs_rel_error < 0.05  # errors compare the runner's part of the price
    priced = RooflineCostModel(hw, model, fit.params, 4)
    s = samples[0][1]
    assert priced.breakdown(s)["host"] == fit.params.host_s
    assert priced.runner_time(s) == pytest.approx(priced.step_time(s) - fit.params.host_s)
    assert priced.breakdown(StepShape())["host"] == 0.0  # a step that computes nothing


def test_measure_served_leaves_the_between_hook_out_of_the_gaps(tiny_models):
    from conveyor import LLM

    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_kv_blocks=256)
    samples = calibrate.measure_served(llm.engine, concurrencies=(2,), rounds=1, open_requests=0,
                                       between=lambda: time.sleep(0.02))
    gaps = [s.idle_before_s for _, s, _ in samples[1:]]
    assert gaps and max(gaps) < 0.015  # the 20 ms hook before every step is not the engine's


def test_measure_served_times_real_steps(tiny_models):
    from conveyor import LLM

    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_kv_blocks=256)
    samples = calibrate.measure_served(llm.engine, concurrencies=(1, 3), open_requests=2)
    assert len(samples) > 20
    assert all(t > 0 and s.num_tokens > 0 for _, s, t in samples)
    assert any(s.decode_seqs > 1 for _, s, _ in samples) and any(s.prefill_pairs for _, s, _ in samples)
    assert not llm.engine.has_unfinished_requests()
    assert "execute" not in vars(llm.engine.runner)  # the timing wrapper is gone
