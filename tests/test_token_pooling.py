"""Per-token outputs (vLLM's `LLM.encode`, `pooling_type="all"`): every prompt token's hidden
state, and token classifiers (`*ForTokenClassification`: decoders and BERT / XLM-RoBERTa),
against HF transformers in float64.

A prompt that reaches the model in pieces (chunks, preemption by recompute or by swap, async
steps) must give the same rows as one forward pass over it; a token classifier's rows are HF's
logits through a softmax, token by token.
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, InvalidRequestError, PoolingParams
from tests.conftest import build_tiny_classifier, build_tiny_encoder

VOCAB = 384
TOL = 1e-5  # (HF's RoPE angles are float32 even in a float64 model: up to about 3e-6 apart)


@pytest.fixture(scope="module")
def taggers(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("taggers")
    tags = ["O", "B-PER", "I-PER", "B-LOC"]
    return {
        "llama": str(build_tiny_classifier(root / "llama", "llama", tags, seed=21, tokens=True)),
        "qwen2": str(build_tiny_classifier(root / "qwen2", "qwen2", tags, seed=22, tokens=True)),
        "bert": str(build_tiny_encoder(root / "bert", "bert", tags, seed=23, tokens=True)),
        "xlmr": str(build_tiny_encoder(root / "xlmr", "xlmr", tags, seed=24, tokens=True)),
        "gemma2": str(build_tiny_classifier(root / "gemma2", "gemma2", tags, seed=26, tokens=True, head_dim=16,
                                            sliding_window=6, attn_logit_softcapping=0.2)),
    }


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def hf_rows(path: str, batch: list[list[int]]) -> list[torch.Tensor]:
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForTokenClassification,
    )

    arch = AutoConfig.from_pretrained(path).architectures[0]
    with torch.no_grad():
        if arch.endswith("ForTokenClassification"):
            model = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float64,
                                                                    attn_implementation="eager").eval()
            return [model(torch.tensor([ids])).logits[0] for ids in batch]
        if arch.endswith("ForCausalLM"):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
            return [model.model(torch.tensor([ids])).last_hidden_state[0] for ids in batch]
        model = AutoModel.from_pretrained(path, dtype=torch.float64).eval()
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in batch]


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 8, "block_size": 4},  # prompts in chunks
    {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 8},  # preempted mid-prompt, recomputed
    {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 8, "preemption_mode": "swap",
     "num_swap_blocks": 64},
    {"async_scheduling": True, "max_num_batched_tokens": 8},
], ids=["whole", "chunked", "recompute", "swap", "async"])
def test_every_tokens_hidden_state(tiny_models, options) -> None:
    path = str(tiny_models["llama"])
    batch = prompts(8, seed=1)
    want = hf_rows(path, batch)
    llm = LLM(path, dtype="float64", **{"num_kv_blocks": 128, **options})
    got = llm.encode(batch, PoolingParams("all", normalize=False), use_tqdm=False)
    for o, w, ids in zip(got, want, batch, strict=True):
        assert len(o.outputs.data) == len(ids)
        assert o.outputs.data == [pytest.approx(r, rel=TOL, abs=TOL) for r in w.tolist()]
    cut = llm.encode(batch[:2], PoolingParams("all", dimensions=5), use_tqdm=False)
    for o, w in zip(cut, want[:2], strict=True):
        rows = torch.nn.functional.normalize(w[:, :5], dim=-1)
        assert o.outputs.data == [pytest.approx(r, rel=TOL, abs=TOL) for r in rows.tolist()]
    one = llm.encode(batch[:1], PoolingParams("last"), use_tqdm=False)[0].outputs.data  # a vector, as embed gives
    assert one == pytest.approx(llm.embed(batch[:1], use_tqdm=False)[0].outputs.embedding, abs=1e-12)


@pytest.mark.parametrize("name", ["llama", "qwen2", "bert", "xlmr", "gemma2"])
def test_token_classifiers_match_hf(taggers, name: str) -> None:
    path = taggers[name]
    batch = [[2, *p, 3] for p in prompts(5, seed=2)] if name in ("bert", "xlmr") else prompts(5, seed=2)
    want = hf_rows(path, batch)
    llm = LLM(path, dtype="float64", max_num_batched_tokens=16 if name in ("llama", "qwen2", "gemma2") else 512)
    got = llm.encode(batch, use_tqdm=False)  # a token classifier's default: each token's probabilities
    for o, w in zip(got, want, strict=True):
        assert o.outputs.data == [pytest.approx(r, rel=TOL, abs=TOL) for r in w.softmax(-1).tolist()]
    raw = llm.encode(batch[:1], PoolingParams("all", task="classify", activation=False), use_tqdm=False)[0]
    assert raw.outputs.data == [pytest.approx(r, rel=TOL, abs=TOL) for r in want[0].tolist()]
    with pytest.raises(InvalidRequestError, match="classifies each token"):
        llm.classify(batch[:1])
    with pytest.raises(InvalidRequestError, match="its head reads pooling_type 'all'"):
        llm.encode(batch[:1], PoolingParams("last", task="classify"))
    assert len(llm.embed(batch[:1], use_tqdm=False)[0].outputs.embedding) == 64  # its hidden states embed


def test_async_encode_takes_a_token_classifiers_default_as_llm_encode(taggers) -> None:
    """`AsyncLLM.encode` without `PoolingParams` on a token classifier: each token's
    probabilities, as `LLM.encode` gives them (not its hidden states)."""
    import asyncio

    from conveyor import AsyncLLM

    batch = prompts(2, seed=5)
    want = [o.outputs.data for o in LLM(taggers["llama"], dtype="float64").encode(batch, use_tqdm=False)]

    async def main() -> list:
        async with AsyncLLM(taggers["llama"], dtype="float64") as llm:
            got = []
            for p in batch:
                outs = [o.outputs.data async for o in llm.encode(p)]
                assert len(outs) == 1  # (one output, once the prompt is computed)
                got.append(outs[0])
            return got

    got = asyncio.run(main())
    assert got == want and len(got[0][0]) == 4  # (four tags a token)


def test_a_sequence_classifiers_head_over_every_token(tmp_path) -> None:
    """`pooling_type="all"` with a sequence classifier: its score head at every position (what
    a reward model's per-token scores are), HF's `score` over its last hidden states."""
    from transformers import AutoModelForSequenceClassification

    path = str(build_tiny_classifier(tmp_path / "clf", "llama", ["a", "b"], seed=25))
    batch = prompts(3, seed=3)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        want = [model.score(model.model(torch.tensor([ids])).last_hidden_state[0]) for ids in batch]
    got = LLM(path, dtype="float64").encode(batch, PoolingParams("all", task="classify", activation=False),
                                            use_tqdm=False)
    for o, w in zip(got, want, strict=True):
        assert o.outputs.data == [pytest.approx(r, rel=TOL, abs=TOL) for r in w.tolist()]


@pytest.mark.parametrize("chunk", [8, 512])
def test_step_pooling_reads_the_step_tags(tmp_path, chunk) -> None:
    """`pooling_type="step"` (vLLM's, a process reward model's): the head's output at each
    prompt token equal to `step_tag_id` only, in order, across a prompt's chunks; none where the
    prompt has no tag."""
    from transformers import AutoModelForSequenceClassification

    path = str(build_tiny_classifier(tmp_path / "prm", "llama", ["bad", "good"], seed=26))
    tag = 9
    batch = [[5, 6, tag, 7, 8, 10, tag, 11, tag], [12, 13, 14], [tag] * 3 + list(range(20, 40)) + [tag]]
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        want = [model.score(model.model(torch.tensor([ids])).last_hidden_state[0])[torch.tensor(ids) == tag].softmax(-1)
                for ids in batch]
    llm = LLM(path, dtype="float64", max_num_batched_tokens=chunk, num_kv_blocks=64, block_size=4)
    got = llm.encode(batch, PoolingParams("step", task="classify", step_tag_id=tag), use_tqdm=False)
    assert [len(o.outputs.data) for o in got] == [3, 0, 4]
    for o, w in zip(got, want, strict=True):
        assert o.outputs.data == [pytest.approx(r, rel=TOL, abs=TOL) for r in w.tolist()]
    with pytest.raises(InvalidRequestError, match="pooling_type 'step' needs a token id"):
        PoolingParams("step")
    with pytest.raises(InvalidRequestError, match="only it takes one"):
        PoolingParams("all", step_tag_id=3)
