"""BGE-M3's three outputs on a tiny random XLM-RoBERTa with FlagEmbedding's heads beside it
(`sparse_linear.pt`, `colbert_linear.pt`), against HF's hidden states put through those heads
as FlagEmbedding defines them: the dense embedding (the first token's state, normalized), a
lexical weight a token (ReLU of the sparse head, the BOS and EOS left out) and a ColBERT vector
a token (the colbert head, normalized, the BOS left out); and the scores made of them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conveyor import LLM, InvalidRequestError, PoolingParams
from conveyor.models.loader import ModelLoadError
from conveyor.scoring import colbert_score, lexical_matching_score, lexical_weights
from tests.conftest import build_tiny_encoder
from tests.test_encoders import hf_outputs

TOL = 1e-9
BOS, EOS = 2, 3  # the tiny tokenizer's [CLS] and [SEP]


@pytest.fixture(scope="module")
def m3(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    folder = build_tiny_encoder(tmp_path_factory.mktemp("m3") / "m3", "xlmr", seed=7, pooling="cls",
                                bos_token_id=BOS, eos_token_id=EOS)
    g = torch.Generator().manual_seed(3)
    heads = {"sw": torch.randn(1, 64, generator=g), "sb": torch.randn(1, generator=g) * 0.1,
             "cw": torch.randn(48, 64, generator=g) * 0.2, "cb": torch.randn(48, generator=g) * 0.1}
    torch.save({"weight": heads["sw"], "bias": heads["sb"]}, folder / "sparse_linear.pt")
    torch.save({"weight": heads["cw"], "bias": heads["cb"]}, folder / "colbert_linear.pt")
    return str(folder), heads


def prompts() -> list[list[int]]:
    return [[BOS, 10, 11, 12, 10, EOS], [BOS, 40, 41, 42, 43, 44, 45, 46, EOS], [BOS, 7, EOS], [30, 31, 32]]


def test_dense_sparse_and_colbert_outputs_match_flagembeddings(m3) -> None:
    path, heads = m3
    batch = prompts()
    hidden = [h.double() for h in hf_outputs(path, batch)]
    llm = LLM(path, dtype="float64")
    dense = llm.embed(batch, use_tqdm=False)
    sparse = llm.encode(batch, PoolingParams(task="classify"), use_tqdm=False)  # ("all": the model's own)
    colbert = llm.encode(batch, PoolingParams("all"), use_tqdm=False)
    for ids, h, d, s, c in zip(batch, hidden, dense, sparse, colbert, strict=True):
        assert d.outputs.embedding == pytest.approx(torch.nn.functional.normalize(h[0], dim=0).tolist(), abs=TOL)
        lo = 1 if ids[0] == BOS else 0
        hi = len(ids) - (1 if ids[-1] == EOS else 0)
        want_sparse = torch.relu(h[lo:hi] @ heads["sw"].double().T + heads["sb"].double())
        assert s.outputs.data == [pytest.approx(r, abs=TOL) for r in want_sparse.tolist()]
        want_colbert = torch.nn.functional.normalize(h[lo:] @ heads["cw"].double().T + heads["cb"].double(), dim=-1)
        assert c.outputs.data == [pytest.approx(r, abs=TOL) for r in want_colbert.tolist()]
    assert any(r[0] == 0.0 for s in sparse for r in s.outputs.data) and any(r[0] > 0 for s in sparse
                                                                           for r in s.outputs.data)  # (ReLU, not a sigmoid)


def test_scores_of_the_three_kinds(m3) -> None:
    """`lexical_weights` keeps each token's largest weight (FlagEmbedding's), the match sums the
    shared tokens' products, the ColBERT score is MaxSim's mean: each against a plain loop."""
    path, _ = m3
    llm = LLM(path, dtype="float64")
    q, d = [BOS, 10, 11, 12, 10, EOS], [BOS, 10, 12, 50, EOS]
    sq, sd = (llm.encode([p], PoolingParams(task="classify"), use_tqdm=False)[0].outputs.data for p in (q, d))
    wq, wd = lexical_weights(q[1:-1], sq), lexical_weights(d[1:-1], sd)
    assert wq == {t: max(r[0] for tok, r in zip(q[1:-1], sq, strict=True) if tok == t)
                  for t in set(q[1:-1]) if max(r[0] for tok, r in zip(q[1:-1], sq, strict=True) if tok == t) > 0}
    assert lexical_matching_score(wq, wd) == pytest.approx(sum(wq[t] * wd[t] for t in (10, 12) if t in wq and t in wd))
    assert lexical_weights([5, 6], [[0.5], [0.25]], skip=[6]) == {5: 0.5}
    cq, cd = (llm.encode([p], PoolingParams("all"), use_tqdm=False)[0].outputs.data for p in (q, d))
    want = sum(max(sum(a * b for a, b in zip(x, y, strict=True)) for y in cd) for x in cq) / len(cq)
    assert colbert_score(cq, cd) == pytest.approx(want)
    assert colbert_score(cq, cq) == pytest.approx(1.0)  # (unit vectors, each its own best match)
    with pytest.raises(ValueError, match="one weight a token"):
        lexical_weights([1, 2], [[0.5]])
    assert math.isfinite(llm.score("w10 w11", "w10 w12", use_tqdm=False)[0])  # (the dense cosine, as ever)


def test_refusals(m3, tmp_path: Path) -> None:
    path, heads = m3
    llm = LLM(path, dtype="float64")
    with pytest.raises(InvalidRequestError, match="a token each: pooling_type 'all'") as info:
        llm.encode([[BOS, 5, EOS]], PoolingParams("mean", task="classify"), use_tqdm=False)
    assert info.value.param == "pooling_type"
    with pytest.raises(InvalidRequestError, match="sparse head weighs each token"):
        llm.classify([[BOS, 5, EOS]], use_tqdm=False)
    plain = build_tiny_encoder(tmp_path / "plain", "xlmr", seed=7)
    with pytest.raises(InvalidRequestError, match="no classification head"):
        LLM(str(plain), dtype="float64").encode([[5, 6]], PoolingParams(task="classify"), use_tqdm=False)
    torch.save({"weight": heads["sw"][:, :10], "bias": heads["sb"]}, plain / "sparse_linear.pt")
    with pytest.raises(ModelLoadError, match="is not a Linear from the model's 64 values to one"):
        LLM(str(plain), dtype="float64")


def test_served_over_http(m3, tmp_path: Path) -> None:
    """`/pooling`'s `token_classify` gives the lexical weights and `token_embed` the ColBERT
    vectors, `/v1/embeddings` the dense vector, each as `LLM.encode` / `embed` gives them;
    `/classify` is refused (no classes)."""
    import httpx

    from tests.server.conftest import ServerProcess, assert_openai_error

    path, _ = m3
    offline = LLM(path, dtype="float64")
    text = "w10 w11 w12 w10"
    server = ServerProcess(["--model", path, "--dtype", "float64", "--num-kv-blocks", "64"], tmp_path / "server.log")
    try:
        server.wait_ready()
        with httpx.Client(timeout=60.0) as http:
            for task, params in (("token_classify", PoolingParams(task="classify")), ("token_embed", PoolingParams("all"))):
                r = http.post(server.url + "/pooling", json={"input": text, "task": task})
                assert r.status_code == 200, r.text
                want = offline.encode(text, params, use_tqdm=False)[0].outputs.data
                assert r.json()["data"][0]["data"] == [pytest.approx(row, abs=TOL) for row in want], task
            r = http.post(server.url + "/v1/embeddings", json={"input": text})
            assert r.json()["data"][0]["embedding"] == pytest.approx(
                offline.embed(text, use_tqdm=False)[0].outputs.embedding, abs=TOL)
            assert_openai_error(http.post(server.url + "/classify", json={"input": text}), 400, param="model")
    finally:
        server.stop()
