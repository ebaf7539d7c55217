"""The simulator's FP8 weights (`quantization="fp8"`): a layer weight's byte and the FP8 rate by
hand, the LM head and K/V left in 16-bit, the memory plan, and the engine's refusal."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor import LLM
from conveyor.config import ConfigError, EngineConfig
from conveyor.sim.cost import RooflineCostModel, StepShape
from conveyor.sim.engine import build_sim_engine, describe_capacity
from conveyor.sim.hardware import get_hardware
from conveyor.sim.models import get_model
from tests.sim.test_moe_sim import TOY_MOE
from tests.sim.test_sim import TOY_HW, TOY_PARAMS

FP8_HW = dataclasses.replace(TOY_HW, fp8_flops=2 * TOY_HW.peak_flops)


@pytest.mark.parametrize("hw, rate", [(FP8_HW, 2.0), (TOY_HW, 1.0)], ids=["fp8-cores", "weight-only"])
def test_a_step_by_hand(hw, rate):
    """Layer weights read at one byte (half a bf16 step's bytes) and multiplied at the FP8 rate
    where the hardware has one; the LM head and attention as in bf16."""
    bf16 = RooflineCostModel(hw, TOY_MOE, TOY_PARAMS, 2)
    fp8 = RooflineCostModel(hw, TOY_MOE, TOY_PARAMS, 2, fp8=True)
    decode = StepShape(num_seqs=1, num_tokens=1, num_sampled=1, decode_seqs=1, decode_context=100)
    a, b = bf16.breakdown(decode), fp8.breakdown(decode)
    assert b["linear"] == pytest.approx(a["linear"] / 2)  # memory-bound: the bytes halve
    assert b["experts"] == pytest.approx(a["experts"] / 2)
    for part in ("lm_head", "attn_decode", "overhead"):
        assert b[part] == a[part]
    prompt = StepShape(num_seqs=1, num_tokens=4096, num_sampled=1, prefill_pairs=4096 * 4097 // 2,
                       prefill_context=4096)
    a, b = bf16.breakdown(prompt), fp8.breakdown(prompt)
    assert b["linear"] == pytest.approx(a["linear"] / rate)  # compute-bound: the rate decides
    assert b["attn_prefill"] == a["attn_prefill"]


def test_weights_and_capacity():
    """DeepSeek-V3 in FP8 on 8 H200s: 671 B layer and embedding weights take 1 byte each for the
    layers, 2 for the embeddings and the head; the freed memory goes to the cache."""
    model, hw = get_model("deepseek-v3"), get_hardware("h200")
    assert model.weight_bytes(2, 1) == model.layer_params + 2 * (model.num_params - model.layer_params)
    with pytest.raises(ConfigError, match="more than"):  # 1.34 TB in bf16 does not fit 8 x 141 GB
        build_sim_engine(EngineConfig.from_kwargs(tensor_parallel_size=8), hw, model)
    engine = build_sim_engine(EngineConfig.from_kwargs(tensor_parallel_size=8, quantization="fp8"), hw, model)
    cap = describe_capacity(engine)
    assert cap["weight_gib"] * 2**30 == pytest.approx(model.weight_bytes(2, 1) / 8, rel=1e-6)
    assert cap["kv_bytes_per_token"] == model.kv_bytes_per_token(2)  # the cache stays bf16


def test_the_engine_and_config_say_what_they_take():
    with pytest.raises(ConfigError, match="priced by the simulator"):
        LLM(quantization="fp8")
    with pytest.raises(ConfigError, match="use 'int8', 'fp8'"):
        EngineConfig.from_kwargs(quantization="fp4")
