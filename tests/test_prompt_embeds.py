"""Prompts given as embeddings (vLLM's `{"prompt_embeds": tensor}`, `enable_prompt_embeds`).

The reference is HF transformers' greedy `generate(inputs_embeds=...)` on the same weights
(float64), with embeddings that are the embedding table's rows for random ids plus noise (no
token has them): the tokens must be equal under every scheduling that changes how a prompt's
rows reach the model (chunked prompts, preemption, async scheduling, speculative steps), beside
prompts of token ids, for a Llama and for Gemma 2 (which scales its embeddings: so are these,
as vLLM takes them, the table's rows before the scale). Equal embeddings share the prefix cache, others do not; bad
tensors and options that read the prompt's tokens are refused.
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, InvalidRequestError, SamplingParams
from tests.conftest import build_tiny_model
from tests.schedulings import SCHEDULINGS

VOCAB = 384


def embeds_and_reference(model_dir: str, seed: int, n: int) -> list[tuple[torch.Tensor, int, list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    table = model.get_input_embeddings().weight.detach()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 24))]
        embeds = table[ids] + 0.02 * torch.randn(len(ids), table.shape[1], generator=gen, dtype=torch.float64)
        max_tokens = rng.randint(4, 12)
        # (vLLM's convention: the table's rows, before the model's scale; transformers 5's Gemma
        # scales inside its embedding module, so its `inputs_embeds` are the scaled rows)
        scale = getattr(model.get_input_embeddings(), "embed_scale", 1.0)
        got = model.generate(inputs_embeds=embeds[None] * scale, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        out.append((embeds, max_tokens, got[0, -max_tokens:].tolist()))
    return out


@pytest.fixture(scope="module")
def llama_cases(tiny_models):
    return embeds_and_reference(str(tiny_models["llama"]), 1, 6)


@SCHEDULINGS
def test_embeddings_give_hfs_tokens_beside_token_prompts(tiny_models, llama_cases, options):
    llm = LLM(str(tiny_models["llama"]), dtype="float64", enable_prompt_embeds=True, **{"num_kv_blocks": 128, **options})
    plain = [5, 6, 7, 8, 9]
    want_plain = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=64).generate(
        [plain], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    prompts = [{"prompt_embeds": e} for e, _, _ in llama_cases] + [plain]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m, _ in llama_cases]
    outs = llm.generate(prompts, [*params, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for *_, want in llama_cases] + [want_plain]
    assert [len(o.prompt_token_ids) for o in outs[:-1]] == [len(e) for e, _, _ in llama_cases]
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0


def test_gemma_scales_the_embeddings_as_hf_does(tmp_path):
    path = build_tiny_model(tmp_path / "g2", "gemma2", seed=3)
    cases = embeds_and_reference(str(path), 2, 3)
    llm = LLM(str(path), dtype="float64", enable_prompt_embeds=True, num_kv_blocks=64)
    outs = llm.generate([{"prompt_embeds": e} for e, _, _ in cases],
                        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m, _ in cases],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for *_, want in cases]


def test_equal_embeddings_share_the_prefix_cache_and_bad_ones_are_refused(tiny_models, llama_cases):
    llm = LLM(str(tiny_models["llama"]), enable_prompt_embeds=True, num_kv_blocks=64, block_size=4)
    embeds = max((e for e, _, _ in llama_cases), key=len).float()
    assert len(embeds) >= 8
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = llm.generate({"prompt_embeds": embeds}, greedy, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": embeds.clone()}, greedy, use_tqdm=False)[0]
    other = embeds.clone()
    other[0] += 0.5  # (its first block differs: nothing of it is cached)
    moved = llm.generate({"prompt_embeds": other}, greedy, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 4 and moved.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    hidden = embeds.shape[1]
    for bad, match in ((torch.zeros(3, hidden + 1), "float tensor"), (torch.zeros(0, hidden), "float tensor"),
                       (torch.zeros(3, hidden, dtype=torch.long), "float tensor"), ([[0.0] * hidden], "float tensor"),
                       (torch.full((2, hidden), float("nan")), "not finite")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate({"prompt_embeds": bad}, greedy, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        llm.generate({"prompt_embeds": embeds}, SamplingParams(max_tokens=2, repetition_penalty=1.2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="enable_prompt_embeds"):
        LLM(str(tiny_models["llama"]), num_kv_blocks=16).generate({"prompt_embeds": embeds}, greedy, use_tqdm=False)
