"""Greedy tokens equal HF transformers' on the same weights (float64, exact)."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams

PROMPTS = [
    [5, 17, 99, 3, 250],
    [7] * 40,
    list(range(10, 90)),
    [300, 12],
    [42],
]


def hf_greedy(model_dir, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers(tiny_models, family):
    model_dir = tiny_models[family]
    expected = hf_greedy(model_dir, PROMPTS, max_new_tokens=24)
    llm = LLM(str(model_dir), dtype="float64", num_kv_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected


def test_yarn_rope_matches_transformers(tmp_path):
    """YaRN-scaled RoPE as Qwen's long-context configs write it (no mscale: the cos/sin tables
    scaled by 0.1 ln(factor) + 1): HF's greedy tokens and hidden states, and the scaled table."""
    from tests.conftest import build_tiny_model

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    model_dir = build_tiny_model(tmp_path / "qwen3_yarn", "qwen3", seed=21, rope_parameters=yarn, head_dim=32)
    expected = hf_greedy(model_dir, PROMPTS, max_new_tokens=12)
    llm = LLM(str(model_dir), dtype="float64", num_kv_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ids = PROMPTS[2]
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    got = llm.engine.runner.model.forward_sequence(ids)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)  # (HF's RMSNorm computes in float32, even in float64)
    assert llm.engine.runner.model.rotary.cos[1, 0] == pytest.approx(
        (0.1 * torch.log(torch.tensor(4.0)).item() + 1) * torch.cos(torch.tensor(1.0)).item(), rel=1e-6)
