"""The simulator's latent attention (DeepSeek-V2/V3): the catalog's sizes against the model
cards, the shape read from a loaded model, the K/V bytes and attention FLOPs by hand (a run
from the command line: tests/sim/test_moe_sim.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conveyor.sim.cost import RooflineCostModel, StepShape
from conveyor.sim.models import ModelShape, get_model
from tests.sim.test_sim import TOY, TOY_HW, TOY_PARAMS

# TOY's attention as MLA: a latent of 32, rotary keys of 8, per-head keys of 16 + 8, values of 16.
TOY_MLA = dataclasses.replace(TOY, name="toy-mla", num_kv_heads=4, head_dim=8, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def test_catalog_sizes_match_the_model_cards():
    """DeepSeek-V3: 671B weights (its card's 685B has the 14B multi-token-prediction layer),
    37B active; DeepSeek-V2-Lite: 15.7B; GLM-4.5-Air: 106B, 12B active."""
    air = get_model("glm-4.5-air")  # DeepSeek's mixture under GQA: 106 B, 12 B active without the embeddings
    assert air.num_params / 1e9 == pytest.approx(106, abs=1)
    assert (air.active_params - air.head_params - air.vocab_size * air.hidden_size) / 1e9 == pytest.approx(12, abs=0.5)
    v3, lite = get_model("deepseek-v3"), get_model("deepseek-v2-lite")
    assert v3.num_params / 1e9 == pytest.approx(671, abs=0.5)
    assert v3.active_params / 1e9 == pytest.approx(37, abs=1)
    assert lite.num_params / 1e9 == pytest.approx(15.7, abs=0.05)
    # a token a layer caches 512 + 64 values where 128 heads of K and V would cache 2 x 128 x 192
    assert v3.kv_bytes_per_token(2) == 61 * 576 * 2
    assert v3.kv_share(8) == 1.0  # every tensor-parallel device holds the whole latent
    v3.check_tensor_parallel(8)


def test_shape_of_a_loaded_model_matches_its_config(tmp_path):
    from conveyor.models.loader import read_hf_arch
    from tests.conftest import build_tiny_model
    from tests.models.test_deepseek import GLM, MLA

    for family in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        shape = GLM if family == "glm4_moe" else {"q_lora_rank": 24 if family == "deepseek_v3" else None, **MLA}
        folder = build_tiny_model(tmp_path / family, family, **shape)
        arch = read_hf_arch(folder)
        from_arch = ModelShape.from_arch(arch, family)
        from_config = ModelShape.from_hf_config(json.loads((folder / "config.json").read_text()), family)
        assert dataclasses.replace(from_arch, eos_token_ids=()) == dataclasses.replace(from_config, eos_token_ids=())
        assert from_arch.kv_bytes_per_token(2) == arch.kv_bytes_per_token(2)
        # ModelShape leaves out norms (and V3's router bias)
        assert 0 < arch.num_params - from_arch.num_params < 0.02 * arch.num_params, family


def test_attention_cost_by_hand():
    cost = RooflineCostModel(TOY_HW, TOY_MLA, TOY_PARAMS, dtype_bytes=2)
    # attention weights a layer: q 64 x 4 x 24, latent 64 x 40, up 32 x 4 x 32, out 4 x 16 x 64
    assert TOY_MLA.attention_params == 6144 + 2560 + 4096 + 4096
    # a decode over 100 context tokens: 4 FLOPs x 2 layers x 4 heads x (2 x 32 + 8) / 2 a pair
    # against 2 layers x 40 values x 2 bytes a token read; compute-bound here
    one = StepShape(num_seqs=1, num_tokens=1, num_sampled=1, decode_seqs=1, decode_context=100)
    flops, bytes_ = 4 * 2 * 4 * 36 * 100, 2 * 40 * 2 * 100
    assert cost.breakdown(one)["attn_decode"] == pytest.approx(max(flops / 2.5e11, bytes_ / 8e10))
    # a prompt's pairs at (16 + 8 + 16) / 2
    prompt = StepShape(num_seqs=1, num_tokens=64, num_sampled=1, prefill_pairs=2080, prefill_context=64)
    assert cost.breakdown(prompt)["attn_prefill"] == pytest.approx(4 * 2 * 4 * 20 * 2080 / 2.5e11)


def test_mtp_is_priced_as_a_one_layer_draft():
    """`speculative_method="mtp"`: the drafter's steps priced on one sparse layer of the model with
    its embeddings and head (FP8 with the model), its weights and one layer's latents in the
    memory plan; every guess taken at an acceptance of 1."""
    from conveyor.config import EngineConfig
    from conveyor.replay import TimedRequest, replay
    from conveyor.sampling_params import SamplingParams
    from conveyor.sim.engine import build_sim_engine, describe_capacity
    from conveyor.sim.hardware import get_hardware

    model, hw = get_model("deepseek-v3"), get_hardware("h200")
    kw = dict(tensor_parallel_size=8, quantization="fp8")
    base = build_sim_engine(EngineConfig.from_kwargs(**kw), hw, model)
    engine = build_sim_engine(EngineConfig.from_kwargs(**kw, speculative_method="mtp", num_speculative_tokens=2),
                              hw, model, acceptance_rate=1.0)
    draft = engine.drafter.runner.cost_model.model
    assert (draft.num_layers, draft.num_sparse_layers, draft.kv_lora_rank) == (1, 1, 512)
    assert engine.drafter.runner.cost_model.fp8
    layer = (model.layer_params) // model.num_layers  # roughly one layer more: its share of the weights
    assert describe_capacity(engine)["weight_gib"] > describe_capacity(base)["weight_gib"] + layer / 8 / 2**30 / 2
    assert describe_capacity(engine)["kv_bytes_per_token"] == model.kv_bytes_per_token(2) * 62 // 61
    requests = [TimedRequest(0.0, [5] * 32, SamplingParams(max_tokens=16, ignore_eos=True)) for _ in range(4)]
    replay(engine, requests)
    scheduler = engine.scheduler
    assert scheduler.num_draft_tokens > 0 and scheduler.num_accepted_tokens == scheduler.num_draft_tokens
