"""The simulator's data-parallel attention with expert-parallel experts (`enable_dp_attention`):
a step's parts by hand, each device's weights and the group's K/V capacity, the refusals, over
random step shapes the bounds the model must keep, and a run from the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM
from conveyor.cli import main
from conveyor.config import ConfigError, EngineConfig
from conveyor.sim.cost import RooflineCostModel, StepShape
from conveyor.sim.engine import build_sim_engine, describe_capacity
from conveyor.sim.hardware import get_hardware
from conveyor.sim.models import get_model
from tests.sim.test_moe_sim import TOY_MOE
from tests.sim.test_sim import TOY_HW, TOY_PARAMS

NVLINK_HW = dataclasses.replace(TOY_HW, link_bandwidth=5e10)


def test_a_step_by_hand():
    """Two devices, 8 decodes: each prices 4 over whole weights and heads; the experts are the
    ones all 8 tokens chose, half of them a device, each over its full width; two all-to-alls
    a sparse layer carry a device's 4 tokens x 2 copies, half of them to the other device."""
    one = RooflineCostModel(NVLINK_HW, TOY_MOE, TOY_PARAMS, 2)
    dp = RooflineCostModel(NVLINK_HW, TOY_MOE, TOY_PARAMS, 2, tensor_parallel=2, dp_attention=True)
    shape = StepShape(num_seqs=8, num_tokens=8, num_sampled=8, decode_seqs=8, decode_context=800)
    local = dp.local_shape(shape)
    assert (local.num_seqs, local.num_tokens, local.decode_context) == (4, 4, 400)
    a, b, half = one.breakdown(shape), dp.breakdown(shape), one.breakdown(local)
    for part in ("linear", "lm_head", "attn_decode", "overhead"):
        assert b[part] == pytest.approx(half[part])
    assert b["experts"] == pytest.approx(a["experts"] / 2)  # the touched experts of 8 tokens, half each
    assert b["allreduce"] == 0.0 and a["all_to_all"] == 0.0
    link = 5e10 * TOY_PARAMS.link_efficiency
    sparse, lat = TOY_MOE.num_sparse_layers, TOY_PARAMS.allreduce_latency_s
    assert b["all_to_all"] == pytest.approx(2 * sparse * (lat + 4 * 2 * 0.5 * TOY_MOE.hidden_size * 2 / link))
    # an odd count goes to the busiest device rounded up
    assert dp.local_shape(dataclasses.replace(shape, num_seqs=7, num_tokens=7)).num_tokens == 4


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 4096), decode=st.integers(0, 256), context=st.integers(0, 1 << 20),
       n=st.sampled_from([2, 4, 8]))
def test_a_device_never_costs_more_than_the_whole_step_nor_less_than_its_share(tokens, decode, context, n):
    """A device's compute on its share of the step is at most one device's on all of it, and at
    least 1/n of it; its all-to-alls grow with the step's tokens."""
    model, hw = get_model("deepseek-v2-lite"), get_hardware("h100-sxm")
    decode = min(decode, tokens)
    shape = StepShape(num_seqs=max(decode, 1), num_tokens=tokens, num_sampled=max(decode, 1), decode_seqs=decode,
                      decode_context=context)
    one = RooflineCostModel(hw, model).breakdown(shape)
    dp = RooflineCostModel(hw, model, tensor_parallel=n, dp_attention=True)
    many = dp.breakdown(shape)
    compute = ("linear", "experts", "lm_head", "attn_decode", "attn_prefill")
    assert sum(many[p] for p in compute) <= sum(one[p] for p in compute) * (1 + 1e-9)
    assert sum(many[p] for p in compute) >= sum(one[p] for p in compute) / n * (1 - 1e-9)
    more = dataclasses.replace(shape, num_tokens=tokens + n)
    assert dp.breakdown(more)["all_to_all"] > many["all_to_all"]


def test_each_device_holds_its_experts_and_its_own_sequences_kv():
    """DeepSeek-V2-Lite on 4 H100s: under tensor parallelism every device caches each token's
    whole latent; under DP attention each caches only its own sequences', so the group holds
    4x the tokens (less what the copied attention weights take)."""
    model, hw = get_model("deepseek-v2-lite"), get_hardware("h100-sxm")
    tp = build_sim_engine(EngineConfig.from_kwargs(tensor_parallel_size=4), hw, model)
    dp = build_sim_engine(EngineConfig.from_kwargs(tensor_parallel_size=4, enable_dp_attention=True), hw, model)
    a, b = describe_capacity(tp), describe_capacity(dp)
    experts = model.num_sparse_layers * model.num_experts * model.expert_params * 2
    assert b["weight_gib"] * 2**30 == pytest.approx(model.weight_bytes(2) - experts * 3 / 4, abs=1)
    assert a["kv_bytes_per_token"] == b["kv_bytes_per_token"] == model.kv_bytes_per_token(2)
    assert dp.num_kv_blocks == 4 * b["kv_blocks"]  # the group's, as one engine
    assert dp.num_kv_blocks / tp.num_kv_blocks == pytest.approx(4 * b["kv_gib"] / a["kv_gib"])
    assert dp.scheduler.config.max_num_seqs == 4 * 256


def test_what_is_not_modelled_is_refused():
    hw = get_hardware("h100-sxm")
    with pytest.raises(ConfigError, match="tensor_parallel_size >= 2"):
        build_sim_engine(EngineConfig.from_kwargs(enable_dp_attention=True), hw, get_model("deepseek-v2-lite"))
    with pytest.raises(ConfigError, match="divide"):  # 64 experts over 3 devices
        build_sim_engine(EngineConfig.from_kwargs(tensor_parallel_size=3, enable_dp_attention=True), hw,
                         get_model("deepseek-v2-lite"))
    with pytest.raises(ConfigError, match="does not build data-parallel attention"):
        LLM(enable_dp_attention=True)


def test_simulated_runs_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--hardware", "h100-sxm", "--model", "deepseek-v2-lite", "--tensor-parallel-size", "2",
               "--enable-dp-attention", "--num-requests", "40", "--request-rate", "inf", "--input-len", "256",
               "--output-len", "32", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "40/40 done" in text and "2 data-parallel attention, expert parallel" in text
    system = next(iter(json.loads((out / "result.json").read_text())["simulation"]["systems"].values()))
    assert system["enable_dp_attention"] is True
