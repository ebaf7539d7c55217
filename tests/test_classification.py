"""Sequence classifiers and cross-encoders (vLLM's `LLM.classify` and a reranker's `LLM.score`)
against HF transformers' `*ForSequenceClassification` on the same weights.

The reference is HF's own logits in float64 (its head over the last token's hidden state)
through a softmax, or a sigmoid for a one-class model. Every way a prompt reaches the model in
pieces (chunks, recompute or swap after preemption, async steps, a prefix another request has
cached) must give the same probabilities; a cross-encoder's score must be HF's over the
tokenizer's pair template; a classifier refuses to generate, a causal LM to classify.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import LLM, InvalidRequestError, PoolingParams, SamplingParams
from conveyor.config import EngineConfig
from conveyor.engine import Engine
from tests.conftest import build_tiny_classifier

VOCAB = 384
TOL = 1e-5  # HF computes RoPE's angles in float32 even in a float64 model (1e-8 to 3e-6 apart here)
LABELS = {
    "llama": ["negative", "neutral", "positive"],
    "qwen2": ["no", "yes"],
    "qwen3": ["relevant"],  # a cross-encoder (reranker): one class
    "mistral": ["LABEL_0"],
    "gemma2": ["rejected", "chosen"],  # a reward model's shape (Skywork-Reward-Gemma-2)
    "gemma3": ["LABEL_0", "LABEL_1", "LABEL_2"],
}


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("classifiers")
    extra = {"qwen2": {"tie_word_embeddings": True}, "qwen3": {"head_dim": 32}, "mistral": {"sliding_window": None},
             "gemma2": {"head_dim": 16, "sliding_window": 6, "attn_logit_softcapping": 0.2},
             "gemma3": {"head_dim": 16, "sliding_window": 6, "sliding_window_pattern": 2}}
    return {family: str(build_tiny_classifier(root / family, family, labels, seed=i, **extra.get(family, {})))
            for i, (family, labels) in enumerate(LABELS.items())}


def hf_logits(model_dir: str, prompts: list[list[int]], pooling: str = "last") -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    # (eager: the attention that soft-caps Gemma 2's scores)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float64,
                                                               attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            if pooling == "last":
                out.append(model(torch.tensor([ids])).logits[0])
            else:  # the head over another pooling of the same hidden states
                hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
                out.append(model.score(hidden.mean(dim=0) if pooling == "mean" else hidden[0]))
    return out


def probs(logits: torch.Tensor) -> list[float]:
    return (torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=0)).tolist()


def random_prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(4, VOCAB) for _ in range(shared)]
    return [head + [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(n)]


@pytest.mark.parametrize("family", list(LABELS))
def test_classify_matches_hf(classifiers, family: str) -> None:
    prompts = random_prompts(6, seed=len(family))
    want = hf_logits(classifiers[family], prompts)
    llm = LLM(classifiers[family], dtype="float64", num_kv_blocks=64)
    outs = llm.classify(prompts, use_tqdm=False)
    labels = LABELS[family]
    for out, logits, ids in zip(outs, want, prompts, strict=True):
        assert out.outputs.probs == pytest.approx(probs(logits), rel=TOL, abs=TOL)
        assert out.outputs.num_classes == len(labels)
        assert out.label == labels[int(logits.argmax())]
        assert out.prompt_token_ids == ids
    raw = llm.classify(prompts[:2], PoolingParams(activation=False), use_tqdm=False)
    assert [o.outputs.probs for o in raw] == [pytest.approx(w.tolist(), rel=TOL, abs=TOL) for w in want[:2]]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_the_head_reads_other_poolings(classifiers, pooling: str) -> None:
    prompts = random_prompts(3, seed=7)
    want = hf_logits(classifiers["llama"], prompts, pooling)
    llm = LLM(classifiers["llama"], dtype="float64", num_kv_blocks=64, max_num_batched_tokens=8)
    outs = llm.classify(prompts, PoolingParams(pooling), use_tqdm=False)
    assert [o.outputs.probs for o in outs] == [pytest.approx(probs(w), rel=TOL, abs=TOL) for w in want]


SCHEDULES = [
    {"max_num_batched_tokens": 8, "block_size": 4},  # prompts in chunks of up to 8
    {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 8},  # preempted mid-prompt, recomputed
    {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 8, "preemption_mode": "swap",
     "num_swap_blocks": 64},
    {"async_scheduling": True, "max_num_batched_tokens": 8},
    {"enable_prefix_caching": True, "block_size": 4},
    {"prefill_mode": "prefill_first"},
    {"batching": "static", "max_num_seqs": 4},
]


@pytest.fixture(scope="module")
def llama(classifiers) -> Engine:
    return LLM(classifiers["llama"], dtype="float64", num_kv_blocks=64).engine


@pytest.mark.parametrize("options", SCHEDULES, ids=["chunked", "preempt", "swap", "async", "prefix-cache",
                                                     "prefill-first", "static"])
def test_every_schedule_gives_hfs_probabilities(classifiers, llama: Engine, options) -> None:
    prompts = random_prompts(8, seed=3) + random_prompts(4, seed=4, shared=12)  # some share a prefix
    want = [probs(w) for w in hf_logits(classifiers["llama"], prompts)]
    engine = Engine.from_model(EngineConfig.from_kwargs(**{"num_kv_blocks": 256, **options}),
                               llama.runner.model, llama.tokenizer)
    got = run(engine, prompts, [PoolingParams(task="classify")] * len(prompts))
    assert [got[str(i)] for i in range(len(prompts))] == [pytest.approx(w, rel=TOL, abs=TOL) for w in want]
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def run(engine: Engine, prompts: list[list[int]], poolings: list[PoolingParams]) -> dict[str, list[float]]:
    for i, (prompt, pooling) in enumerate(zip(prompts, poolings, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams.for_pooling(pooling))
    done: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
                done[out.request_id] = out.embedding or []
    return done


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    chunk=st.sampled_from([4, 8, 64]),
    blocks=st.sampled_from([10, 16, 64]),
    mode=st.sampled_from(["recompute", "swap"]),
    tasks=st.lists(st.sampled_from(["classify", "classify-raw", "embed"]), min_size=1, max_size=10),
)
def test_classifications_and_embeddings_side_by_side(classifiers, llama: Engine, seed, chunk, blocks, mode,
                                                      tasks) -> None:
    """Random prompts, each a classification (with or without its softmax) or an embedding of
    the same model, under random chunk sizes and cache pressure: each request gets its own
    answer, as if it ran alone, and every block comes back."""
    prompts = random_prompts(len(tasks), seed)
    poolings = [PoolingParams(task="embed") if t == "embed" else
                PoolingParams(task="classify", activation=t == "classify") for t in tasks]
    engine = Engine.from_model(
        EngineConfig.from_kwargs(num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=chunk,
                                 preemption_mode=mode, num_swap_blocks=64),
        llama.runner.model, llama.tokenizer,
    )
    got = run(engine, prompts, poolings)
    want = hf_logits(classifiers["llama"], prompts)
    for i, (t, w) in enumerate(zip(tasks, want, strict=True)):
        if t == "embed":
            assert len(got[str(i)]) == 64 and sum(x * x for x in got[str(i)]) == pytest.approx(1.0)
        else:
            assert got[str(i)] == pytest.approx(probs(w) if t == "classify" else w.tolist(), rel=TOL, abs=TOL)
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_cross_encoder_scores_pairs_as_one_input(classifiers) -> None:
    """A one-class model scores (query, document) read together through the tokenizer's pair
    template, `<s> query </s> document`, by HF's sigmoid; one query against many or pairwise."""
    from transformers import AutoTokenizer

    path = classifiers["qwen3"]
    tok = AutoTokenizer.from_pretrained(path)
    query, docs = "w10 w11 w12", ["w20 w21", "w30 w31 w32 w33", "w10 w11"]
    pairs = [tok(query, d)["input_ids"] for d in docs]
    assert pairs[0] == [1, 10, 11, 12, 2, 20, 21]
    want = [probs(w)[0] for w in hf_logits(path, pairs)]
    llm = LLM(path, dtype="float64", num_kv_blocks=64)
    assert llm.score(query, docs, use_tqdm=False) == pytest.approx(want, rel=TOL, abs=TOL)
    assert llm.score([query, query], docs[:2], use_tqdm=False) == pytest.approx(want[:2], rel=TOL, abs=TOL)
    with pytest.raises(InvalidRequestError, match="as many as text_2"):
        llm.score([query, query], docs)


def test_refusals(classifiers, tiny_models) -> None:
    llm = LLM(classifiers["llama"], dtype="float64", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match=r"is a classifier \(3 classes\): it generates no text") as e:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert e.value.param == "model"
    with pytest.raises(InvalidRequestError, match="has 3 classes; a cross-encoder's score is a one-class"):
        llm.score("w5", "w6")
    vec = llm.embed([[5, 6, 7]], use_tqdm=False)[0].outputs.embedding  # its hidden states still embed
    assert len(vec) == 64
    with pytest.raises(InvalidRequestError, match="dimensions cuts an embedding") as e:
        PoolingParams(task="classify", dimensions=3)
    with pytest.raises(InvalidRequestError, match="task='rank'"):
        PoolingParams(task="rank")
    causal = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="no classification head") as e:
        causal.classify([[5, 6, 7]])
    assert e.value.param == "task"


def test_arch_reads_labels() -> None:
    from conveyor.models.arch import ArchConfig, UnsupportedModelError

    base = {"architectures": ["Qwen3ForSequenceClassification"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    arch = ArchConfig.from_hf({**base, "id2label": {"1": "b", "0": "a"}})
    assert arch.labels == ("a", "b") and arch.family == "qwen3"
    assert ArchConfig.from_hf({**base, "num_labels": 3}).labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    assert ArchConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "id2label": {"0": "a"}}).labels == ()
    with pytest.raises(UnsupportedModelError, match=r"id2label's keys must be 0\.\.1"):
        ArchConfig.from_hf({**base, "id2label": {"0": "a", "2": "b"}})
    with pytest.raises(UnsupportedModelError, match="num_labels=3 but id2label names 2"):
        ArchConfig.from_hf({**base, "num_labels": 3, "id2label": {"0": "a", "1": "b"}})
    # the head's weights count; a classifier has no LM head
    with_head = ArchConfig.from_hf({**base, "id2label": {"0": "a"}})
    causal = ArchConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True})
    assert with_head.num_params - causal.num_params == 8


def test_two_tensor_parallel_ranks_classify_as_one(classifiers) -> None:
    """The head reads rank 0's whole hidden states (its weights whole on every rank)."""
    threads = torch.get_num_threads()
    try:
        two = LLM(classifiers["llama"], dtype="float64", tensor_parallel_size=2, num_threads=1, num_kv_blocks=64)
        prompts = random_prompts(5, seed=9)
        want = [probs(w) for w in hf_logits(classifiers["llama"], prompts)]
        got = two.classify(prompts, use_tqdm=False)
        assert [o.outputs.probs for o in got] == [pytest.approx(w, rel=TOL, abs=TOL) for w in want]
    finally:
        torch.set_num_threads(threads)
