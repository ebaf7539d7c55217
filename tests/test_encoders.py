"""Bidirectional encoders (BERT, XLM-RoBERTa) as embedding models, classifiers and
cross-encoders, against HF transformers on the same random weights, in float64.

The reference is HF's own forward over one prompt at a time, given the tokenizer's
`token_type_ids` (BERT's pair segments): conveyor reads the segments from the tokens, so the two
must agree. Every prompt of a step attends only to its own tokens, whole: one-token prompts, a
prompt that fills the positions, many prompts side by side under random budgets (hypothesis);
the engine turns chunked prefill and the prefix cache off for an encoder; generation and the
options not built for encoders are refused with the reason.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import LLM, InvalidRequestError, PoolingParams, SamplingParams
from conveyor.config import ConfigError, EngineConfig
from conveyor.engine import Engine
from conveyor.models.loader import ModelLoadError
from tests.conftest import build_tiny_encoder, build_tiny_modernbert

VOCAB = 384
TOL = 1e-10  # no rotary angles in float32 here: HF's float64 arithmetic, to rounding


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoders")
    return {
        "bert": str(build_tiny_encoder(root / "bert", "bert", seed=1)),
        "bert-mean": str(build_tiny_encoder(root / "bert-mean", "bert", seed=1, pooling="mean")),
        "bert-max": str(build_tiny_encoder(root / "bert-max", "bert", seed=1, pooling="max")),
        "bert-reranker": str(build_tiny_encoder(root / "bert-reranker", "bert", ["relevant"], seed=2)),
        "xlmr": str(build_tiny_encoder(root / "xlmr", "xlmr", seed=3)),
        "xlmr-classifier": str(build_tiny_encoder(root / "xlmr-classifier", "xlmr", ["a", "b", "c"], seed=4)),
    }


def hf_model(path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    classifier = AutoConfig.from_pretrained(path).architectures[0].endswith("ForSequenceClassification")
    auto = AutoModelForSequenceClassification if classifier else AutoModel
    return auto.from_pretrained(path, dtype=torch.float64).eval()


def hf_outputs(path: str, prompts: list[list[int]], types: list[list[int]] | None = None) -> list[torch.Tensor]:
    """HF's last hidden states (an embedding model) or logits (a classifier), one prompt at a time."""
    model = hf_model(path)
    out = []
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            kwargs = {"token_type_ids": torch.tensor([types[i]])} if types is not None else {}
            got = model(torch.tensor([ids]), **kwargs)
            out.append(got.logits[0] if hasattr(got, "logits") else got.last_hidden_state[0])
    return out


def random_prompts(n: int, seed: int, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[2] + [rng.randrange(4, VOCAB) for _ in range(rng.randint(0, longest))] + [3] for _ in range(n)]


def pooled(hidden: torch.Tensor, kind: str) -> list[float]:
    v = {"cls": hidden[0], "mean": hidden.mean(dim=0), "max": hidden.amax(dim=0), "last": hidden[-1]}[kind]
    return (v / v.norm()).tolist()


@pytest.mark.parametrize("name", ["bert", "xlmr"])
@pytest.mark.parametrize("kind", ["cls", "mean", "max", "last"])
def test_embeddings_match_hf(encoders, name: str, kind: str) -> None:
    prompts = [*random_prompts(6, seed=1), [2], [2, 3]]  # one-token and two-token prompts too
    want = [pooled(h, kind) for h in hf_outputs(encoders[name], prompts)]
    llm = LLM(encoders[name], dtype="float64")
    got = llm.embed(prompts, PoolingParams(kind), use_tqdm=False)
    assert [o.outputs.embedding for o in got] == [pytest.approx(w, abs=TOL) for w in want]


def test_default_pooling_is_the_models(encoders) -> None:
    """CLS for an encoder (vLLM's default), unless a sentence-transformers folder declares
    another (mean and max here)."""
    prompts = random_prompts(3, seed=2)
    hidden = hf_outputs(encoders["bert"], prompts)
    for name, kind in (("bert", "cls"), ("bert-mean", "mean"), ("bert-max", "max")):
        llm = LLM(encoders[name], dtype="float64")
        assert llm.engine.default_pooling == kind
        got = llm.embed(prompts, use_tqdm=False)
        assert [o.outputs.embedding for o in got] == [pytest.approx(pooled(h, kind), abs=TOL) for h in hidden]


def test_pairs_take_berts_segments(encoders) -> None:
    """A pair's second text is segment 1, as the tokenizer's `token_type_ids` say: the
    embeddings of `[CLS] A [SEP] B [SEP]` equal HF's given those ids (and differ from all-zero
    segments, so the segments are read)."""
    from transformers import AutoTokenizer

    path = encoders["bert"]
    tok = AutoTokenizer.from_pretrained(path)
    pairs = [tok("w10 w11 w12", "w20 w21"), tok("w5", "w6 w7 w8 w9"), tok("w30 w31", None)]
    ids = [p["input_ids"] for p in pairs]
    assert pairs[0]["token_type_ids"] == [0, 0, 0, 0, 0, 1, 1, 1]
    want = hf_outputs(path, ids, [p["token_type_ids"] for p in pairs])
    flat = hf_outputs(path, ids)  # all segment 0
    got = LLM(path, dtype="float64").embed(ids, PoolingParams("mean", normalize=False), use_tqdm=False)
    for o, w in zip(got, want, strict=True):
        assert o.outputs.embedding == pytest.approx(w.mean(dim=0).tolist(), abs=TOL)
    assert (want[0] - flat[0]).abs().max() > 1e-3


def test_cross_encoder_and_classifier_match_hf(encoders) -> None:
    from transformers import AutoTokenizer

    path = encoders["bert-reranker"]
    tok = AutoTokenizer.from_pretrained(path)
    query, docs = "w10 w11 w12", ["w20 w21", "w10 w11", "w40 w41 w42 w43 w44", "w7"]
    encoded = [tok(query, d) for d in docs]
    logits = hf_outputs(path, [e["input_ids"] for e in encoded], [e["token_type_ids"] for e in encoded])
    llm = LLM(path, dtype="float64")
    assert llm.score(query, docs, use_tqdm=False) == pytest.approx([torch.sigmoid(x).item() for x in logits], abs=TOL)
    assert llm.classify([e["input_ids"] for e in encoded[:1]], use_tqdm=False)[0].label == "relevant"

    path = encoders["xlmr-classifier"]
    prompts = random_prompts(5, seed=5)
    want = hf_outputs(path, prompts)
    llm = LLM(path, dtype="float64")
    got = llm.classify(prompts, use_tqdm=False)
    assert [o.outputs.probs for o in got] == [pytest.approx(w.softmax(0).tolist(), abs=TOL) for w in want]
    assert [o.label for o in got] == [["a", "b", "c"][int(w.argmax())] for w in want]
    with pytest.raises(InvalidRequestError, match="has 3 classes"):
        llm.score("w5", "w6")


def test_a_cross_encoders_activation_is_its_configs(encoders, tmp_path) -> None:
    """sentence-transformers' CrossEncoder `activation_fn` (or the older
    `sbert_ce_default_activation_function`): the score is the logit through it (Identity: the
    raw logit, as ms-marco rerankers are scored), from `LLM.score` and `AsyncLLM.score` alike;
    `classify` still gives the sigmoid; one conveyor does not compute is refused at load."""
    import asyncio
    import json
    import math
    import shutil

    from transformers import AutoTokenizer

    from conveyor import AsyncLLM
    from conveyor.models.arch import UnsupportedModelError

    source = encoders["bert-reranker"]
    tok = AutoTokenizer.from_pretrained(source)
    query, docs = "w10 w11 w12", ["w20 w21", "w10 w11", "w7"]
    encoded = [tok(query, d) for d in docs]
    logits = [x.item() for x in hf_outputs(source, [e["input_ids"] for e in encoded],
                                           [e["token_type_ids"] for e in encoded])]

    def variant(name: str, **keys: object) -> str:
        folder = tmp_path / name
        shutil.copytree(source, folder)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **keys}))
        return str(folder)

    identity = variant("identity", sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity",
                                                          "version": "5.0.0"})
    tanh = variant("tanh", sbert_ce_default_activation_function="torch.nn.modules.activation.Tanh")
    llm = LLM(identity, dtype="float64")
    assert llm.score(query, docs, use_tqdm=False) == pytest.approx(logits, abs=TOL)
    assert llm.classify([encoded[0]["input_ids"]], use_tqdm=False)[0].outputs.probs == pytest.approx(
        [1 / (1 + math.exp(-logits[0]))], abs=TOL)
    assert LLM(tanh, dtype="float64").score(query, docs, use_tqdm=False) == pytest.approx(
        [math.tanh(x) for x in logits], abs=TOL)

    async def served() -> list[float]:
        async with AsyncLLM(identity, dtype="float64") as a:
            return await a.score(query, docs)

    assert asyncio.run(served()) == pytest.approx(logits, abs=TOL)
    with pytest.raises(UnsupportedModelError, match=r"activation_fn 'torch\.nn\.modules\.activation\.Softmax' is not supported"):
        LLM(variant("softmax", sbert_ce_default_activation_function="torch.nn.modules.activation.Softmax"))


def test_a_prompt_may_fill_the_positions(encoders) -> None:
    """BERT's 130 positions; XLM-RoBERTa's start after its padding id, so it has 129."""
    for name, room in (("bert", 130), ("xlmr", 129)):
        llm = LLM(encoders[name], dtype="float64")
        assert llm.engine.max_model_len == room
        prompt = random_prompts(1, seed=6, longest=0)[0][:1] + [5] * (room - 2) + [3]
        want = pooled(hf_outputs(encoders[name], [prompt])[0], "cls")
        assert llm.embed([prompt], use_tqdm=False)[0].outputs.embedding == pytest.approx(want, abs=TOL)
        with pytest.raises(InvalidRequestError, match=f"embeds at most {room}"):
            llm.embed([[*prompt, 5]])


@pytest.fixture(scope="module")
def bert_engine(encoders) -> Engine:
    return LLM(encoders["bert"], dtype="float64").engine


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 12),
    budget=st.sampled_from([1, 16, 64, 512]),
    seats=st.sampled_from([1, 3, 8]),
    blocks=st.sampled_from([None, 24]),
    mode=st.sampled_from(["chunked", "mixed", "prefill_first"]),
    overlap=st.booleans(),
)
def test_any_budget_computes_each_prompt_whole(encoders, bert_engine: Engine, seed, n, budget, seats, blocks,
                                               mode, overlap) -> None:
    """Random prompts (one token to 60) under random token budgets, seats, caches, prefill
    modes and async scheduling: each prompt is computed whole in one step, beside others
    (chunked prefill is turned off, the budget raised to the longest prompt), and gets HF's
    vector as if alone."""
    prompts = random_prompts(n, seed, longest=58)
    rng = random.Random(seed)
    prompts = [p[: rng.choice([1, len(p)])] for p in prompts]  # some one-token prompts
    options = {"max_num_batched_tokens": budget, "max_num_seqs": seats, "prefill_mode": mode,
               "num_kv_blocks": blocks, "block_size": 4, "async_scheduling": overlap}
    engine = Engine.from_model(EngineConfig.from_kwargs(**options), bert_engine.runner.model, bert_engine.tokenizer)
    assert engine.config.scheduler.prefill_mode != "chunked" and not engine.config.cache.enable_prefix_caching
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams.for_pooling(PoolingParams("mean")))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.embedding
    want = hf_outputs(encoders["bert"], prompts)
    assert [done[str(i)] for i in range(n)] == [pytest.approx(pooled(w, "mean"), abs=TOL) for w in want]
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_refusals(encoders) -> None:
    llm = LLM(encoders["bert"], dtype="float64")
    with pytest.raises(InvalidRequestError, match="is an encoder: it generates no text") as e:
        llm.generate([[2, 5, 3]], SamplingParams(max_tokens=2))
    assert e.value.param == "model"
    with pytest.raises(InvalidRequestError, match="no classification head"):
        llm.classify([[2, 5, 3]])
    assert llm.engine.runner.kv_caches == []  # an encoder keeps no K/V
    with pytest.raises(ConfigError, match="exceeds the 130 positions this model was built for"):
        LLM(encoders["bert"], max_model_len=200)
    for options, name in (({"tensor_parallel_size": 2}, "tensor_parallel_size"), ({"enable_lora": True}, "enable_lora"),
                          ({"quantization": "int8", "dtype": "float32"}, "quantization")):
        with pytest.raises(ConfigError, match=f"runs without {name}"):
            LLM(encoders["bert"], **options)


def test_sentence_transformers_dense_modules(tmp_path) -> None:
    """A folder whose modules are Transformer, Pooling (CLS), Dense (to 32 values, tanh) and
    Normalize, as LaBSE's: the embedding is the Dense layer over the pooled state, what
    sentence-transformers computes; `dimensions` is checked against the Dense output."""
    from safetensors.torch import load_file

    path = build_tiny_encoder(tmp_path / "labse", "bert", seed=5, pooling="cls", dense=32)
    prompts = random_prompts(4, seed=8)
    dense = load_file(str(path / "2_Dense" / "model.safetensors"))
    want = []
    for hidden in hf_outputs(str(path), prompts):
        v = torch.tanh(hidden[0] @ dense["linear.weight"].double().t() + dense["linear.bias"].double())
        want.append((v / v.norm()).tolist())
    llm = LLM(str(path), dtype="float64")
    got = llm.embed(prompts, use_tqdm=False)
    assert [o.outputs.embedding for o in got] == [pytest.approx(w, abs=TOL) for w in want]
    with pytest.raises(InvalidRequestError, match="embeddings have 32 values"):
        llm.embed(prompts[:1], PoolingParams(dimensions=33))
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 4, "name": "4", "path": "4_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match=r"module 'sentence_transformers\.models\.LayerNorm' is not applied here"):
        LLM(str(path))


@pytest.mark.parametrize("head,pooling", [(None, None), ("sequence", "cls"), ("sequence", "mean"), ("token", None)],
                         ids=["embeddings", "classifier-cls", "classifier-mean", "tagger"])
@pytest.mark.parametrize("budget", [64, 2048])
def test_modernbert_matches_hf(tmp_path, head, pooling, budget) -> None:
    """ModernBERT: rotary positions at two thetas, local layers within 8 tokens either side of
    each (prompts up to 60 tokens cross the window), GeGLU; its classifier's head over the CLS
    state or the mean (`classifier_pooling`), or over every token. HF's forward in float64
    (its rotary products in float32: 1e-7 apart here), one prompt at a time."""
    from transformers import (
        AutoModel,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    extra = {"classifier_pooling": pooling} if pooling else {}
    path = str(build_tiny_modernbert(tmp_path / "mb", head, 3, seed=9, **extra))
    auto = {None: AutoModel, "sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification}
    model = auto[head].from_pretrained(path, dtype=torch.float64).eval()
    batch = random_prompts(6, seed=11, longest=58)
    llm = LLM(path, dtype="float64", max_num_batched_tokens=budget)
    if head == "sequence":
        got = [o.outputs.probs for o in llm.classify(batch, PoolingParams(activation=False), use_tqdm=False)]
    elif head == "token":
        got = [o.outputs.data for o in llm.encode(batch, use_tqdm=False)]
    else:
        got = [o.outputs.data for o in llm.encode(batch, PoolingParams("all", normalize=False), use_tqdm=False)]
    with torch.no_grad():
        for g, ids in zip(got, batch, strict=True):
            out = model(torch.tensor([ids]))
            want = out.last_hidden_state[0] if head is None else out.logits[0]
            if head == "token":
                want = want.softmax(-1)
            rows = want.tolist()
            assert g == ([pytest.approx(r, abs=1e-6) for r in rows] if want.dim() == 2 else pytest.approx(rows, abs=1e-6))
