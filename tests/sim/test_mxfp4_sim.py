"""The simulator's MXFP4 experts (`quantization="mxfp4"`, as gpt-oss ships): a routed expert's
weight at 4.25 bits multiplied at the 16-bit rate by hand, everything else as in bf16, the
memory plan (gpt-oss-120b on one H100), and the refusals."""

from __future__ import annotations

import math

import pytest

from conveyor import LLM
from conveyor.config import ConfigError, EngineConfig
from conveyor.sim.cost import RooflineCostModel, StepShape
from conveyor.sim.engine import MXFP4_BYTES, build_sim_engine, describe_capacity
from conveyor.sim.hardware import get_hardware
from conveyor.sim.models import get_model
from tests.sim.test_fp8_sim import FP8_HW
from tests.sim.test_moe_sim import TOY_MOE
from tests.sim.test_sim import TOY, TOY_HW, TOY_PARAMS


def test_a_step_by_hand():
    """The experts' bytes at 4.25 / 16 of bf16's where memory decides, their FLOPs at the 16-bit
    rate (FP8 tensor cores or not) where compute decides; the rest unchanged."""
    bf16 = RooflineCostModel(FP8_HW, TOY_MOE, TOY_PARAMS, 2)
    mx = RooflineCostModel(FP8_HW, TOY_MOE, TOY_PARAMS, 2, expert_bytes=MXFP4_BYTES)
    decode = StepShape(num_seqs=1, num_tokens=1, num_sampled=1, decode_seqs=1, decode_context=100)
    a, b = bf16.breakdown(decode), mx.breakdown(decode)
    assert b["experts"] == pytest.approx(a["experts"] * MXFP4_BYTES / 2)
    for part in ("linear", "lm_head", "attn_decode", "overhead"):
        assert b[part] == a[part]
    prompt = StepShape(num_seqs=1, num_tokens=4096, num_sampled=1, prefill_pairs=4096 * 4097 // 2,
                       prefill_context=4096)
    assert mx.breakdown(prompt)["experts"] == pytest.approx(bf16.breakdown(prompt)["experts"])


def test_gpt_oss_120b_fits_one_h100():
    """116.8 B weights: 217 GiB in bf16 (more than an H100), 60.7 GiB with the experts in MXFP4
    and the rest (attention, routers, embeddings, head: 2.1 B) in bf16."""
    model, hw = get_model("gpt-oss-120b"), get_hardware("h100-sxm")
    routed = model.num_sparse_layers * model.num_experts * model.expert_params
    assert model.weight_bytes(2, None, MXFP4_BYTES) == math.ceil(routed * MXFP4_BYTES + (model.num_params - routed) * 2)
    with pytest.raises(ConfigError, match="more than"):
        build_sim_engine(EngineConfig.from_kwargs(), hw, model)
    cap = describe_capacity(build_sim_engine(EngineConfig.from_kwargs(quantization="mxfp4"), hw, model))
    assert cap["weight_gib"] == pytest.approx(60.7, abs=0.1)
    assert cap["kv_bytes_per_token"] == model.kv_bytes_per_token(2)  # the cache stays bf16


def test_what_is_refused():
    with pytest.raises(ConfigError, match="routed experts"):
        build_sim_engine(EngineConfig.from_kwargs(quantization="mxfp4"), TOY_HW, TOY, TOY_PARAMS)
    with pytest.raises(ConfigError, match="priced by the simulator"):
        LLM(quantization="mxfp4")
    with pytest.raises(ConfigError, match="'mxfp4'"):
        EngineConfig.from_kwargs(quantization="fp4")
