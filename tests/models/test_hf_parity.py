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
