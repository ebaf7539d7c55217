"""/v1/embeddings, /score, /rerank, /tokenize and /detokenize on the session's SmolLM2 server.

Embeddings through the official `openai` client equal offline `LLM.embed`'s (which
tests/models/test_gguf.py checks against HF transformers), as floats and as base64, cut by
`dimensions`, pooled by `pooling_type`; they run beside a streaming completion; bad inputs get a
400 naming the field; chat `messages` embed as the template renders them. /score and /rerank
give the cosine similarities of the offline embeddings, ranked. Completions
cut a long prompt by `truncate_prompt_tokens`. /tokenize gives the offline tokenizer's ids for a prompt and for chat
messages (the chat template's), /detokenize reverses them.
"""

from __future__ import annotations

import base64
import struct
import threading

import httpx
import openai
import pytest

from conveyor import LLM, PoolingParams
from tests.server.conftest import ServerProcess, assert_openai_error

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "Hi", "a b c d e f"]


@pytest.fixture(scope="module")
def offline(smollm2: str) -> LLM:
    import torch

    torch.set_num_threads(1)
    return LLM(smollm2, kv_cache_memory=128 << 20, max_model_len=2048)


def close(got: list[float], want: list[float], tol: float = 1e-4) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < tol


def test_embeddings_equal_offline_embed(client: openai.OpenAI, offline: LLM) -> None:
    want = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    r = client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    assert all(close(d.embedding, w) for d, w in zip(r.data, want, strict=True))
    tok = offline.tokenizer
    assert tok is not None
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    assert r.model == "smollm2"

    one = client.embeddings.create(model="smollm2", input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and close(one.data[0].embedding, want[0])
    ids = client.embeddings.create(model="smollm2", input=[tok.encode(t) for t in TEXTS[:2]], encoding_format="float")
    assert all(close(d.embedding, w) for d, w in zip(ids.data, want, strict=False))


def test_base64_dimensions_and_pooling(smol_server: ServerProcess, offline: LLM) -> None:
    url = smol_server.url + "/v1/embeddings"
    floats = httpx.post(url, json={"input": TEXTS[:2]}, timeout=60).json()["data"]
    packed = httpx.post(url, json={"input": TEXTS[:2], "encoding_format": "base64"}, timeout=60).json()["data"]
    for f, b in zip(floats, packed, strict=True):
        raw = base64.b64decode(b["embedding"])
        assert struct.unpack(f"<{len(raw) // 4}f", raw) == pytest.approx(f["embedding"], rel=1e-6)
    cut = httpx.post(url, json={"input": TEXTS[0], "dimensions": 64}, timeout=60).json()["data"][0]["embedding"]
    want = offline.embed(TEXTS[0], PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.embedding
    assert len(cut) == 64 and close(cut, want)
    assert sum(x * x for x in cut) == pytest.approx(1.0, rel=1e-5)
    mean = httpx.post(url, json={"input": TEXTS[0], "pooling_type": "mean", "normalize": False},
                      timeout=60).json()["data"][0]["embedding"]
    want = offline.embed(TEXTS[0], PoolingParams("mean", normalize=False), use_tqdm=False)[0].outputs.embedding
    assert close(mean, want)


def test_embeddings_beside_a_streaming_completion(smol_server: ServerProcess, client: openai.OpenAI) -> None:
    texts: list[str] = []

    def stream() -> None:
        s = client.completions.create(model="smollm2", prompt="Count: one, two,", max_tokens=48, temperature=0,
                                      stream=True)
        texts.append("".join(c.choices[0].text for c in s if c.choices))

    t = threading.Thread(target=stream)
    t.start()
    for _ in range(3):
        r = client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
        assert len(r.data) == len(TEXTS)
    t.join(60)
    alone = client.completions.create(model="smollm2", prompt="Count: one, two,", max_tokens=48, temperature=0)
    assert texts == [alone.choices[0].text]


def test_bad_embedding_requests_get_a_400(smol_server: ServerProcess) -> None:
    url = smol_server.url + "/v1/embeddings"
    long = "word " * 3000  # more than --max-model-len 2048 tokens
    assert_openai_error(httpx.post(url, json={"input": [TEXTS[0], long]}, timeout=60), 400, "input")
    ok = httpx.post(url, json={"input": long, "truncate_prompt_tokens": -1}, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 2048
    assert_openai_error(httpx.post(url, json={"input": TEXTS[0], "dimensions": 577}, timeout=60), 400, "dimensions")
    assert_openai_error(httpx.post(url, json={"input": []}, timeout=60), 400, "input")
    assert_openai_error(httpx.post(url, json={"input": TEXTS[0], "pooling_type": "min"}, timeout=60), 400,
                        "pooling_type")
    assert_openai_error(httpx.post(url, json={"input": TEXTS[0], "truncate_prompt_tokens": 0}, timeout=60), 400,
                        "truncate_prompt_tokens")
    assert_openai_error(httpx.post(url, json={"input": [[1, 10**9]]}, timeout=60), 400, "prompt")
    assert_openai_error(httpx.post(url, json={"model": "nope", "input": "x"}, timeout=60), 404, "model")
    assert httpx.post(url, json={"input": "still serving"}, timeout=60).status_code == 200


def test_tokenize_and_detokenize(smol_server: ServerProcess, offline: LLM) -> None:
    tok = offline.tokenizer
    assert tok is not None
    url = smol_server.url
    r = httpx.post(url + "/tokenize", json={"prompt": TEXTS[0], "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(TEXTS[0]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 2048
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    messages = [{"role": "user", "content": "Hello!"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tok.apply_chat_template(messages) and chat["token_strs"] is None
    bare = httpx.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=False)
    back = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}).json()
    assert back["prompt"] == tok.decode(chat["tokens"], skip_special_tokens=False)
    assert_openai_error(httpx.post(url + "/tokenize", json={"prompt": "a", "messages": messages}), 400, "prompt")
    assert_openai_error(httpx.post(url + "/tokenize", json={}), 400, "prompt")
    assert_openai_error(httpx.post(url + "/detokenize", json={"tokens": [5, 10**7]}), 400, "tokens")
    assert_openai_error(httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "a"}), 404, "model")


def test_chat_messages_embed_as_their_template_renders_them(smol_server: ServerProcess, offline: LLM) -> None:
    tok = offline.tokenizer
    assert tok is not None
    messages = [{"role": "user", "content": "Where is Paris?"}]
    r = httpx.post(smol_server.url + "/v1/embeddings", json={"messages": messages}, timeout=60).json()
    ids = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert close(r["data"][0]["embedding"], offline.embed([ids], use_tqdm=False)[0].outputs.embedding)
    both = httpx.post(smol_server.url + "/v1/embeddings", json={"messages": messages, "input": "x"}, timeout=60)
    assert_openai_error(both, 400, "input")


def test_score_and_rerank_are_cosine_similarities_of_embeddings(smol_server: ServerProcess, offline: LLM) -> None:
    query, docs = "Where is Paris?", ["Paris is the capital of France.", "Bees make honey.", "Hi"]
    vecs = [o.outputs.embedding for o in offline.embed([query, *docs], use_tqdm=False)]
    want = [sum(a * b for a, b in zip(vecs[0], v, strict=True)) for v in vecs[1:]]
    r = httpx.post(smol_server.url + "/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["index"] for d in r["data"]] == [0, 1, 2]
    assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-4)
    pairwise = httpx.post(smol_server.url + "/score", json={"text_1": [query, docs[1]], "text_2": [docs[0], docs[1]]},
                          timeout=60).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([want[0], 1.0], abs=1e-4)
    ranked = httpx.post(smol_server.url + "/rerank", json={"query": query, "documents": docs, "top_n": 2},
                        timeout=60).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in ranked["results"]] == order
    assert [x["document"]["text"] for x in ranked["results"]] == [docs[i] for i in order]
    assert [x["relevance_score"] for x in ranked["results"]] == pytest.approx([want[i] for i in order], abs=1e-4)
    for path in ("/v1/rerank", "/v2/rerank"):
        every = httpx.post(smol_server.url + path, json={"query": query, "documents": docs}, timeout=60).json()
        assert len(every["results"]) == 3
    bad = httpx.post(smol_server.url + "/v1/score", json={"text_1": [query, query], "text_2": docs}, timeout=60)
    assert_openai_error(bad, 400, "text_2")
    assert_openai_error(httpx.post(smol_server.url + "/rerank", json={"query": query, "documents": []}, timeout=60),
                        400, "documents")


def test_completions_truncate_prompt_tokens(smol_server: ServerProcess) -> None:
    url = smol_server.url + "/v1/completions"
    long = "word " * 3000  # more than --max-model-len 2048 tokens
    assert_openai_error(httpx.post(url, json={"prompt": long, "max_tokens": 2}, timeout=60), 400, "prompt")
    cut = httpx.post(url, json={"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 100}, timeout=60)
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 100
    most = httpx.post(url, json={"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": -1}, timeout=120)
    assert most.status_code == 200 and most.json()["usage"]["prompt_tokens"] == 2047
    assert_openai_error(httpx.post(url, json={"prompt": "hi", "truncate_prompt_tokens": 0}), 400,
                        "truncate_prompt_tokens")
