"""The simulator's tensor parallelism: a step's parts by hand, capacity per device, the split's
rules, and over random step shapes the bounds the model must keep."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import ConfigError, EngineConfig
from conveyor.sim.cost import RooflineCostModel, StepShape
from conveyor.sim.engine import build_sim_engine, describe_capacity
from conveyor.sim.hardware import get_hardware
from conveyor.sim.models import get_model
from tests.sim.test_sim import TOY, TOY_HW, TOY_PARAMS

NVLINK_HW = dataclasses.replace(TOY_HW, link_bandwidth=5e10)


def test_a_step_by_hand():
    """Two devices: half the weights' and heads' time, and 2 all-reduces a layer plus the gather."""
    one = RooflineCostModel(NVLINK_HW, TOY, TOY_PARAMS, 2)
    two = RooflineCostModel(NVLINK_HW, TOY, TOY_PARAMS, 2, tensor_parallel=2)
    shape = StepShape(num_seqs=4, num_tokens=4, num_sampled=4, decode_seqs=4, decode_context=400)
    a, b = one.breakdown(shape), two.breakdown(shape)
    for part in ("linear", "lm_head", "attn_decode"):
        assert b[part] == pytest.approx(a[part] / 2)
    assert a["allreduce"] == 0.0
    link = 5e10 * TOY_PARAMS.link_efficiency
    layers, hidden, lat = TOY.num_layers, TOY.hidden_size, TOY_PARAMS.allreduce_latency_s
    want = 2 * layers * (lat + 2 * 0.5 * 4 * hidden * 2 / link) + lat + 0.5 * 4 * TOY.vocab_size * 4 / link
    assert b["allreduce"] == pytest.approx(want)
    assert b["overhead"] == a["overhead"]  # the host drives the devices once a step


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 4096), decode=st.integers(0, 256), context=st.integers(0, 1 << 20),
       n=st.sampled_from([2, 4, 8]))
def test_more_devices_never_cost_more_than_one_nor_less_than_a_share(tokens, decode, context, n):
    """A step on n devices costs at most what it costs on one plus its all-reduces, and at least
    1/n of the compute; the all-reduces grow with its tokens."""
    model = get_model("llama-3.1-70b")
    hw = get_hardware("h100-sxm")
    decode = min(decode, tokens)
    shape = StepShape(num_seqs=max(decode, 1), num_tokens=tokens, num_sampled=max(decode, 1), decode_seqs=decode,
                      decode_context=context)
    one = RooflineCostModel(hw, model).breakdown(shape)
    many = RooflineCostModel(hw, model, tensor_parallel=n).breakdown(shape)
    compute = ("linear", "lm_head", "attn_decode", "attn_prefill")
    assert sum(many[p] for p in compute) <= sum(one[p] for p in compute) + 1e-12
    assert sum(many[p] for p in compute) >= sum(one[p] for p in compute) / n - 1e-12
    more = dataclasses.replace(shape, num_tokens=tokens + 1)
    assert RooflineCostModel(hw, model, tensor_parallel=n).breakdown(more)["allreduce"] > many["allreduce"]


def test_capacity_is_per_device():
    """Llama-3.1-70B in bf16 (141 GB) fits no single H100; on 4, each holds a quarter of the
    weights and of each token's K/V."""
    hw, model = get_hardware("h100-sxm"), get_model("llama-3.1-70b")
    with pytest.raises(ConfigError, match="tensor_parallel_size or pipeline_parallel_size splits"):
        build_sim_engine(EngineConfig.from_kwargs(), hw, model)
    engine = build_sim_engine(EngineConfig.from_kwargs(tensor_parallel_size=4), hw, model)
    cap = describe_capacity(engine)
    assert cap["weight_gib"] == pytest.approx(model.weight_bytes(2) / 4 / 2**30, rel=1e-6)
    assert cap["kv_bytes_per_token"] == model.kv_bytes_per_token(2) // 4
    free = hw.memory_bytes * 0.9 - model.weight_bytes(2) / 4 - (1 << 30)
    assert cap["kv_tokens"] == pytest.approx(free / (model.kv_bytes_per_token(2) / 4), rel=0.01)


def test_kv_heads_fewer_than_devices_are_copied():
    """Llama-3.1-70B has 8 KV heads: on 16 devices each holds one (vLLM's rule), not half."""
    model = get_model("llama-3.1-70b")
    assert model.kv_share(16) == model.kv_share(8) == 1 / 8
    with pytest.raises(ValueError, match="num_kv_heads=8"):
        dataclasses.replace(model, num_kv_heads=8).check_tensor_parallel(3)


def test_a_split_that_does_not_divide_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        build_sim_engine(EngineConfig.from_kwargs(tensor_parallel_size=3), TOY_HW, TOY, TOY_PARAMS)


def test_simulated_runs_from_the_command_line(tmp_path, capsys):
    from conveyor.cli import main

    rc = main(["simulate", "--hardware", "h100-sxm", "--model", "llama-3.1-70b", "--num-requests", "16",
               "--concurrency", "4", "--no-plots", "--no-progress", "--out", str(tmp_path),
               "tp4:tensor_parallel_size=4", "tp8:tensor_parallel_size=8"])
    assert rc == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "on each of 4 devices (4 tensor parallel); 4 devices in all" in summary
    assert "on each of 8 devices" in summary


def test_all_reduce_assumptions_are_flags(tmp_path):
    """A slower all-reduce (50 us, not 10) makes two devices slower than one at one request."""
    import json

    from conveyor.cli import main

    def itl(latency_us: float, system: str) -> float:
        out = tmp_path / f"{latency_us}"
        main(["simulate", "--hardware", "h100-sxm", "--model", "llama-3.1-8b", "--num-requests", "4",
              "--concurrency", "1", "--no-plots", "--no-progress", "--out", str(out),
              "--allreduce-latency-us", str(latency_us), "--link-efficiency", "0.5",
              "one:tensor_parallel_size=1", "two:tensor_parallel_size=2"])
        result = json.loads((out / "result.json").read_text())
        assert result["simulation"]["cost_params"]["allreduce_latency_s"] == pytest.approx(latency_us / 1e6)
        assert result["simulation"]["cost_params"]["link_efficiency"] == 0.5
        point = next(s for s in result["systems"] if s["name"] == system)["points"][0]
        return point["summary"]["itl_s"]["p50"]

    assert itl(10, "two") < itl(10, "one")
    assert itl(50, "two") > itl(50, "one")
