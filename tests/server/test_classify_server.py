"""/classify, /pooling, and /score and /rerank by a cross-encoder, served from tiny random-weight
`*ForSequenceClassification` models (tests/conftest.py `build_tiny_classifier`), a BERT
cross-encoder and an XLM-RoBERTa token classifier (`build_tiny_encoder`).

What the server answers equals offline `LLM.classify` and `LLM.score` (which
tests/test_classification.py checks against HF transformers): a one-class model (a reranker)
scores each (query, document) pair read as one input; a three-class model behind two replicas
names its most probable class. A classifier refuses completions with a 400 naming `model`, and
a causal LM refuses /classify; the server goes on serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conveyor import LLM, PoolingParams
from tests.conftest import build_tiny_classifier, build_tiny_encoder
from tests.server.conftest import ServerProcess, assert_openai_error

QUERY = "w10 w11 w12"
DOCS = ["w20 w21", "w10 w11 w30", "w40 w41 w42 w43", "w10"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifier_models")
    return {"reranker": build_tiny_classifier(root / "reranker", "llama", ["relevant"], seed=11),
            "sentiment": build_tiny_classifier(root / "sentiment", "mistral", ["neg", "neu", "pos"], seed=12,
                                               sliding_window=None),
            "bert": build_tiny_encoder(root / "bert", "bert", ["relevant"], seed=13),
            "tagger": build_tiny_encoder(root / "tagger", "xlmr", ["O", "B", "I"], seed=14, tokens=True)}


def serve(model: Path, log: Path, *extra: str) -> ServerProcess:
    return ServerProcess(["--model", str(model), "--dtype", "float64", "--num-kv-blocks", "128",
                          "--served-model-name", "clf", *extra], log)


@pytest.fixture(scope="module")
def servers(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("classifier_servers")
    started = {"reranker": serve(models["reranker"], logs / "reranker.log"),
               "sentiment": serve(models["sentiment"], logs / "sentiment.log", "--data-parallel-size", "2"),
               "bert": serve(models["bert"], logs / "bert.log"),
               "tagger": serve(models["tagger"], logs / "tagger.log")}
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


def test_classify_equals_offline(servers: dict[str, ServerProcess], models: dict[str, Path]) -> None:
    offline = LLM(str(models["sentiment"]), dtype="float64", num_kv_blocks=64)
    texts = ["w5 w6 w7", "w100 w200", "w9"]
    want = offline.classify(texts, use_tqdm=False)
    url = servers["sentiment"].url
    r = httpx.post(url + "/classify", json={"model": "clf", "input": texts}, timeout=60).json()
    assert r["object"] == "list" and r["model"] == "clf" and r["id"].startswith("classify-")
    assert [d["index"] for d in r["data"]] == [0, 1, 2]
    assert [d["probs"] for d in r["data"]] == [pytest.approx(w.outputs.probs, abs=1e-12) for w in want]
    assert [d["label"] for d in r["data"]] == [w.label for w in want]
    assert {d["num_classes"] for d in r["data"]} == {3}
    assert r["usage"] == {"prompt_tokens": sum(len(w.prompt_token_ids) for w in want),
                          "total_tokens": sum(len(w.prompt_token_ids) for w in want), "completion_tokens": 0}
    ids = httpx.post(url + "/v1/classify", json={"input": want[0].prompt_token_ids, "activation": False},
                     timeout=60).json()["data"][0]
    logits = offline.classify([want[0].prompt_token_ids], PoolingParams(activation=False), use_tqdm=False)[0]
    assert ids["probs"] == pytest.approx(logits.outputs.probs, abs=1e-12)
    # a three-class model has no one relevance to score with
    assert_openai_error(httpx.post(url + "/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60), 400, "model")


def test_cross_encoder_scores_and_reranks(servers: dict[str, ServerProcess], models: dict[str, Path]) -> None:
    offline = LLM(str(models["reranker"]), dtype="float64", num_kv_blocks=64)
    want = offline.score(QUERY, DOCS, use_tqdm=False)
    url = servers["reranker"].url
    r = httpx.post(url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60).json()
    assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-12)
    assert all(0 < s < 1 for s in want) and len(set(want)) == len(want)
    ranked = httpx.post(url + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=60).json()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert [x["index"] for x in ranked["results"]] == order
    assert [x["relevance_score"] for x in ranked["results"]] == pytest.approx([want[i] for i in order], abs=1e-12)
    one = httpx.post(url + "/classify", json={"input": QUERY}, timeout=60).json()["data"][0]
    assert one["label"] == "relevant" and one["num_classes"] == 1
    # each pair is one input: the pair template's tokens, not the two texts' apart
    pair_tokens = len(offline.tokenizer.encode_pair(QUERY, DOCS[0]))  # type: ignore[union-attr]
    alone = httpx.post(url + "/score", json={"text_1": QUERY, "text_2": DOCS[0]}, timeout=60).json()
    assert alone["usage"]["prompt_tokens"] == pair_tokens == 7


def test_a_classifier_refuses_to_generate_and_goes_on(servers: dict[str, ServerProcess]) -> None:
    url = servers["reranker"].url
    body = {"model": "clf", "prompt": "w5 w6", "max_tokens": 4}
    assert_openai_error(httpx.post(url + "/v1/completions", json=body, timeout=60), 400, "model")
    chat = {"model": "clf", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400
    assert_openai_error(httpx.post(url + "/classify", json={"input": []}, timeout=60), 400, "input")
    assert_openai_error(httpx.post(url + "/classify", json={"input": [[1, 10**9]]}, timeout=60), 400, "prompt")
    emb = httpx.post(url + "/v1/embeddings", json={"input": "w5 w6"}, timeout=60).json()["data"][0]["embedding"]
    assert len(emb) == 64  # its hidden states still embed
    assert httpx.post(url + "/classify", json={"input": "w5"}, timeout=60).status_code == 200


def test_a_causal_lm_refuses_classify(smol_server: ServerProcess) -> None:
    r = httpx.post(smol_server.url + "/classify", json={"input": "Hello"}, timeout=60)
    assert_openai_error(r, 400, "model")
    assert "no classification head" in r.json()["error"]["message"]


def test_a_bert_cross_encoder_serves(servers: dict[str, ServerProcess], models: dict[str, Path]) -> None:
    """BERT's pair (`[CLS] query [SEP] doc [SEP]`, the doc in segment 1) scored as offline;
    its CLS state embeds; it generates nothing."""
    offline = LLM(str(models["bert"]), dtype="float64")
    want = offline.score(QUERY, DOCS, use_tqdm=False)
    url = servers["bert"].url
    ranked = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60).json()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [x["index"] for x in ranked["results"]] == order
    assert [x["relevance_score"] for x in ranked["results"]] == pytest.approx([want[i] for i in order], abs=1e-12)
    emb = httpx.post(url + "/v1/embeddings", json={"input": "w5 w6 w7"}, timeout=60).json()["data"][0]["embedding"]
    assert emb == pytest.approx(offline.embed("w5 w6 w7", use_tqdm=False)[0].outputs.embedding, abs=1e-12)
    body = {"model": "clf", "prompt": "w5 w6", "max_tokens": 4}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert_openai_error(r, 400, "model")
    assert "classifier" in r.json()["error"]["message"]


def test_pooling_gives_what_each_task_asks(servers: dict[str, ServerProcess], models: dict[str, Path]) -> None:
    """/pooling: a sequence classifier's default is /classify's probabilities, `token_embed`
    one vector a prompt token; a token classifier's default its rows of probabilities, as
    offline `LLM.encode` gives them, and /classify refuses it."""
    url = servers["sentiment"].url
    texts = ["w5 w6 w7", "w9"]
    pooled = httpx.post(url + "/pooling", json={"input": texts}, timeout=60).json()
    classified = httpx.post(url + "/classify", json={"input": texts}, timeout=60).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    assert [d["data"] for d in pooled["data"]] == [d["probs"] for d in classified["data"]]
    rows = httpx.post(url + "/pooling", json={"input": texts, "task": "token_embed"}, timeout=60).json()["data"]
    assert [len(d["data"]) for d in rows] == [len(t.split()) + 1 for t in texts]  # (<s> and the words)
    assert all(len(r) == 64 and sum(x * x for x in r) == pytest.approx(1.0) for d in rows for r in d["data"])
    bad = httpx.post(url + "/pooling", json={"input": texts, "task": "token_embed", "pooling_type": "last"}, timeout=60)
    assert_openai_error(bad, 400, "pooling_type")
    steps = httpx.post(url + "/pooling", json={"input": [[5, 9, 6, 9]], "task": "token_classify",
                                                "pooling_type": "step", "step_tag_id": 9}, timeout=60).json()["data"]
    every = httpx.post(url + "/pooling", json={"input": [[5, 9, 6, 9]], "task": "token_classify"},
                       timeout=60).json()["data"]
    # The rows at the tags (the head over 2 rows or 4 may round apart in the last bit: MKL's
    # kernels for a shape differ by CPU, as on an AMD EPYC).
    want = [every[0]["data"][1], every[0]["data"][3]]
    assert len(steps[0]["data"]) == 2
    assert all(got == pytest.approx(row, rel=1e-12, abs=1e-15) for got, row in zip(steps[0]["data"], want, strict=True))
    missing = httpx.post(url + "/pooling", json={"input": texts, "pooling_type": "step"}, timeout=60)
    assert_openai_error(missing, 400, "step_tag_id")

    url = servers["tagger"].url
    offline = LLM(str(models["tagger"]), dtype="float64")
    want = offline.encode(texts, use_tqdm=False)
    got = httpx.post(url + "/pooling", json={"input": texts}, timeout=60).json()["data"]
    assert [d["data"] for d in got] == [[pytest.approx(r, abs=1e-12) for r in w.outputs.data] for w in want]
    assert [len(d["data"]) for d in got] == [len(t.split()) + 2 for t in texts]  # [CLS] words [SEP]
    assert_openai_error(httpx.post(url + "/classify", json={"input": texts}, timeout=60), 400, "model")


def test_smollm2_served_as_a_reranker(smollm2: str, tmp_path: Path) -> None:
    """`--classifier-from-tokens no yes --score-template ...`: the embedded chat model reranks by
    its P(yes | yes or no), /rerank's scores equal to offline `LLM.score`'s."""
    template = ("<|im_start|>user\nQuery: {query}\nDocument: {document}\nDoes the document answer the query? "
                "Answer yes or no.<|im_end|>\n<|im_start|>assistant\n")
    server = ServerProcess(["--model", smollm2, "--kv-cache-memory", str(64 << 20), "--classifier-from-tokens",
                            "no", "yes", "--score-template", template], tmp_path / "server.log")
    try:
        server.wait_ready()
        query, docs = "What is the capital of France?", ["Bees make honey.", "Paris is the capital of France."]
        offline = LLM(smollm2, classifier_from_tokens=["no", "yes"], score_template=template, kv_cache_memory=64 << 20)
        want = offline.score(query, docs, use_tqdm=False)
        r = httpx.post(server.url + "/rerank", json={"query": query, "documents": docs}, timeout=120).json()
        assert [x["index"] for x in r["results"]] == [1, 0]
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx([want[1], want[0]], abs=1e-5)
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60), 400, "model")
    finally:
        server.stop()
