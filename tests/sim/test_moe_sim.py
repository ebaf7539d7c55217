"""The simulator's mixtures of experts: the catalog's sizes against the model cards, the shape
read from a loaded model, and the cost of a step's experts by hand and over random shapes."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cli import main
from conveyor.sim.cost import RooflineCostModel, StepShape
from conveyor.sim.models import ModelShape, get_model
from tests.sim.test_sim import TOY, TOY_HW, TOY_PARAMS

# TOY with its MLP replaced by 4 experts of 32, 2 a token, in both layers.
TOY_MOE = dataclasses.replace(TOY, name="toy-moe", num_experts=4, experts_per_token=2, expert_intermediate_size=32,
                              num_sparse_layers=2)


def test_catalog_sizes_match_the_model_cards():
    """Mixtral-8x7B: 46.7B weights, 12.9B active; Qwen3-30B-A3B: 30.5B, 3.3B (their cards)."""
    mixtral, qwen = get_model("mixtral-8x7b"), get_model("qwen3-30b-a3b")
    assert mixtral.num_params / 1e9 == pytest.approx(46.7, abs=0.05)
    assert mixtral.active_params / 1e9 == pytest.approx(12.9, abs=0.05)
    assert qwen.num_params / 1e9 == pytest.approx(30.5, abs=0.05)
    assert qwen.active_params / 1e9 == pytest.approx(3.3, abs=0.1)
    llama = get_model("llama-3.1-8b")
    assert llama.active_params == llama.num_params and llama.dense_params == llama.layer_params


def test_toy_moe_sizes_by_hand():
    # per layer: attention 8192 + 4096, router 64 x 4 = 256, experts 4 x 3 x 64 x 32 = 24576
    assert TOY_MOE.expert_params == 6144
    assert TOY_MOE.dense_params == 2 * (8192 + 4096 + 256)
    assert TOY_MOE.layer_params == TOY_MOE.dense_params + 2 * 4 * 6144
    assert TOY_MOE.active_params == TOY_MOE.num_params - 2 * 2 * 6144


def test_shape_of_a_loaded_model_matches_its_config(tiny_moe_models):
    from conveyor.models.loader import read_hf_arch

    for family, folder in tiny_moe_models.items():
        arch = read_hf_arch(folder)
        from_arch = ModelShape.from_arch(arch, family)
        from_config = ModelShape.from_hf_config(json.loads((folder / "config.json").read_text()), family)
        assert dataclasses.replace(from_arch, eos_token_ids=()) == dataclasses.replace(from_config, eos_token_ids=())
        # ModelShape leaves out norms and biases (and the shared expert's one-row gate is in)
        assert 0 < arch.num_params - from_arch.num_params < 0.02 * arch.num_params, family
    assert from_arch.num_sparse_layers == arch.num_sparse_layers


def test_expert_cost_by_hand():
    cost = RooflineCostModel(TOY_HW, TOY_MOE, TOY_PARAMS, dtype_bytes=2)
    # one token: 2 of 4 experts, each streamed whole: 6144 x 2 bytes / (1e11 x 0.8) a layer
    one = StepShape(num_seqs=1, num_tokens=1, num_sampled=1, decode_seqs=1, decode_context=9)
    assert cost.experts_touched(1) == pytest.approx(2)
    assert cost.breakdown(one)["experts"] == pytest.approx(2 * 2 * 6144 * 2 / 8e10)
    # many tokens: every expert, each over T x 2 / 4 rows, compute-bound
    many = StepShape(num_seqs=1, num_tokens=4096, num_sampled=1, prefill_pairs=1, prefill_context=4096)
    assert cost.experts_touched(4096) == pytest.approx(4)
    assert cost.breakdown(many)["experts"] == pytest.approx(2 * 4 * 2 * 6144 * (4096 * 2 / 4) / 5e11)
    dense = RooflineCostModel(TOY_HW, TOY, TOY_PARAMS, dtype_bytes=2)
    assert dense.breakdown(one)["experts"] == 0.0
    assert not cost.fused(one) and dense.params.fused_rows == 0


@settings(max_examples=200, deadline=None)
@given(experts=st.integers(1, 256), data=st.data(), tokens=st.integers(1, 10_000))
def test_experts_read_grow_with_the_batch_and_stay_in_bounds(experts, data, tokens):
    k = data.draw(st.integers(1, experts))
    shape = dataclasses.replace(TOY_MOE, num_experts=experts, experts_per_token=k)
    cost = RooflineCostModel(TOY_HW, shape, TOY_PARAMS, dtype_bytes=2)
    touched = cost.experts_touched(tokens)
    assert k - 1e-9 <= touched <= min(experts, tokens * k) + 1e-9
    assert cost.experts_touched(tokens + 1) >= touched - 1e-9

    def step(n: int) -> float:
        return cost.breakdown(StepShape(num_seqs=n, num_tokens=n, num_sampled=n, decode_seqs=n,
                                        decode_context=n))["experts"]

    assert step(tokens + 1) >= step(tokens) * (1 - 1e-9)  # more tokens never cost less
    # never more than reading every expert and computing every assignment
    e = shape.expert_params
    bound = shape.num_sparse_layers * (experts * e * 2 / 8e10 + 2 * e * tokens * k / 5e11)
    assert step(tokens) <= bound * (1 + 1e-9)


@pytest.mark.parametrize("model, field, value", [("qwen3-30b-a3b", "num_experts", 128),
                                                 ("deepseek-v2-lite", "kv_lora_rank", 512)])
def test_simulate_a_mixture_end_to_end(tmp_path, capsys, model, field, value):
    out = tmp_path / "sim"
    rc = main(["simulate", "--hardware", "h100-sxm", "--model", model, "--num-requests", "40",
               "--request-rate", "inf", "--input-len", "256", "--output-len", "64", "--out", str(out)])
    assert rc == 0
    assert "40/40 done" in capsys.readouterr().out
    result = json.loads((out / "result.json").read_text())
    assert result["simulation"]["model"][field] == value
