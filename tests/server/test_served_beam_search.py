"""vLLM's `use_beam_search` on the session's SmolLM2 server: the `n` choices are offline
`LLM.beam_search`'s best beams (which tests/test_beam_search.py checks against a search over HF
transformers), on completions and chat; what beam search cannot do is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from conveyor import LLM
from conveyor.beam_search import BeamSearchParams
from tests.server.conftest import ServerProcess, assert_openai_error


@pytest.fixture(scope="module")
def offline(smollm2: str) -> LLM:
    import torch

    torch.set_num_threads(1)
    return LLM(smollm2, kv_cache_memory=128 << 20, max_model_len=2048)


def test_beams_are_offline_beam_search(smol_server: ServerProcess, offline: LLM) -> None:
    tok = offline.tokenizer
    assert tok is not None
    prompt = "The three primary colors are"
    body = {"prompt": prompt, "n": 3, "max_tokens": 12, "use_beam_search": True, "length_penalty": 0.5}
    r = httpx.post(smol_server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    want = offline.beam_search([prompt], BeamSearchParams(3, 12, length_penalty=0.5))[0].sequences
    assert [c["text"] for c in got["choices"]] == [s.text for s in want]
    assert [c["finish_reason"] for c in got["choices"]] == [s.finish_reason for s in want]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert got["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for s in want)

    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = httpx.post(smol_server.url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "n": 2, "max_tokens": 16, "use_beam_search": True}).json()
    ids = tok.apply_chat_template(messages)
    want = offline.beam_search([ids], BeamSearchParams(2, 16))[0].sequences
    assert [c["message"]["content"] for c in chat["choices"]] == [s.text for s in want]


def test_what_beam_search_cannot_do_is_a_400(smol_server: ServerProcess) -> None:
    url = smol_server.url + "/v1/completions"
    base = {"prompt": "Hello", "max_tokens": 4, "use_beam_search": True}
    assert_openai_error(httpx.post(url, json={**base, "stream": True}), 400, "stream")
    assert_openai_error(httpx.post(url, json={**base, "logprobs": 2}), 400, "use_beam_search")
    assert_openai_error(httpx.post(url, json={**base, "n": 11}), 400, "n")
    assert httpx.post(url, json=base, timeout=60).status_code == 200
