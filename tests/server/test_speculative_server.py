"""`conveyor serve --speculative-method ngram` over HTTP (tests/test_speculative.py has the engine's)."""

from __future__ import annotations

import httpx

from conveyor import LLM, SamplingParams
from tests.server.conftest import ServerProcess, sample, scrape


def test_served_with_drafts_over_http(tiny_model, tmp_path):
    """`conveyor serve --speculative-method ngram`: a completion gives the tokens an engine without
    drafts gives, and /metrics counts the drafts and the accepted ones."""
    prompt = [11, 12, 13, 14] * 6
    want = LLM(str(tiny_model), dtype="float64", num_kv_blocks=256).generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].token_ids
    server = ServerProcess(
        ["--model", str(tiny_model), "--dtype", "float64", "--num-kv-blocks", "256",
         "--speculative-method", "ngram", "--num-speculative-tokens", "3"],
        tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 0,
        })
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["logprobs"]["tokens"]
        assert got == [f"token_id:{t}" for t in want]
        metrics = scrape(server.url)
        drafts = sample(metrics, "conveyor:spec_decode_num_draft_tokens_total")
        accepted = sample(metrics, "conveyor:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= drafts
        assert r.json()["usage"]["completion_tokens"] == 40
    finally:
        server.stop()


def test_served_with_a_draft_model_over_http(tiny_model, tmp_path):
    """`conveyor serve --speculative-method draft_model --speculative-model M` (the model drafting
    for itself): a completion gives the tokens of an engine without drafts,
    and every guess is accepted."""
    prompt = [21, 5, 9, 300, 17, 8]
    want = LLM(str(tiny_model), dtype="float64", num_kv_blocks=256).generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].token_ids
    server = ServerProcess(
        ["--model", str(tiny_model), "--dtype", "float64", "--num-kv-blocks", "256",
         "--speculative-method", "draft_model", "--speculative-model", str(tiny_model)],
        tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "logprobs": 0,
        })
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in want]
        metrics = scrape(server.url)
        drafts = sample(metrics, "conveyor:spec_decode_num_draft_tokens_total")
        assert sample(metrics, "conveyor:spec_decode_num_accepted_tokens_total") == drafts > 0
    finally:
        server.stop()
