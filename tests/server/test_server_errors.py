"""Every bad request gets its status and OpenAI's error body; none gets a 500 or hangs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess, assert_openai_error

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (path, JSON body, status, param)
CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    (COMP, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (COMP, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n"),
    (COMP, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMP, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (COMP, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMP, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (COMP, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (COMP, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (COMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (COMP, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (COMP, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    (COMP, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (COMP, {"prompt": "x", "logit_bias": {"one": 5}}, 400, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    (CHAT, {"messages": USER, "logit_bias": {"1": "up"}}, 400, "logit_bias.1"),
    (COMP, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),  # refused by the engine
    (COMP, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (COMP, {"prompt": "x", "bad_words": [" "]}, 400, "bad_words"),
    (COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMP, {"prompt": ""}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    (COMP, {"max_tokens": 5}, 400, "prompt"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": [{"role": "user"}], "n": 200}, 400, "n"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, 400, "tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "patternProperties": {}}}}]}, 400, "tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400, "tools"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
     400, "tool_choice"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    (CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, 400, "response_format"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400, "guided_regex"),
    (COMP, {"prompt": "x", "guided_regex": "a(?=b)"}, 400, "guided_regex"),
    (COMP, {"prompt": "x", "guided_json": "{not json"}, 400, "guided_json"),
    (COMP, {"prompt": "x", "guided_json": {"type": "object", "patternProperties": {}}}, 400, "guided_json"),
    (COMP, {"prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    (COMP, {"prompt": "x", "structured_outputs": {"grammar": "root ::= x"}}, 400, "structured_outputs"),
    (COMP, {"prompt": "x", "structured_outputs": {"lark": "start: x"}}, 400, "structured_outputs"),
    (COMP, {"prompt": "x", "guided_grammar": 'root ::= "a'}, 400, "guided_grammar"),
    (COMP, {"prompt": "x", "ebnf": "main ::= [a-z]"}, 400, "ebnf"),
    (COMP, {"prompt": "x", "ebnf": "root ::= [a-z]", "guided_regex": "a"}, 400, "ebnf"),
    (COMP, {"prompt": "x", "guided_choice": ["a"], "ignore_eos": True}, 400, "ignore_eos"),
    # refused by the engine (in its own process) when it compiles the grammar: still a 400
    (COMP, {"prompt": "x", "guided_regex": "[a-z]{1,3000}x{1,3000}"}, 400, "structured_outputs"),
    (COMP, {"prompt": "x", "guided_grammar": 'root ::= "a"? root "b" | "c"'}, 400, "structured_outputs"),
    (COMP, {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    (CHAT, {"messages": USER, "model": "gpt-4o"}, 404, "model"),
]


@pytest.fixture(scope="module")
def http(smol_server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=smol_server.url, timeout=30.0) as client:
        yield client  # type: ignore[misc]


@pytest.mark.parametrize(("path", "body", "status", "param"), CASES)
def test_bad_request_gets_openai_error(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    for stream in (False, True):
        payload = dict(body)
        if stream and "stream_options" not in payload:
            payload["stream"] = True
        # Streaming or not, the error comes before any event, as a plain JSON response.
        assert_openai_error(http.post(path, json=payload), status, param)


def test_prompt_that_cannot_fit_gives_the_numbers(http: httpx.Client) -> None:
    long_prompt = list(range(100, 2100))  # 2000 token ids; the server's max_model_len is 2048
    err = assert_openai_error(
        http.post(COMP, json={"prompt": long_prompt, "max_tokens": 100}), 400, "prompt"
    )
    assert err["code"] == "context_length_exceeded"
    assert all(n in err["message"] for n in ("2048", "2100", "2000", "100"))
    err = assert_openai_error(http.post(COMP, json={"prompt": list(range(100, 2200))}), 400)
    assert "2048" in err["message"] and "2100" in err["message"]
    chat = {"messages": [{"role": "user", "content": "word " * 3000}]}
    err = assert_openai_error(http.post(CHAT, json=chat), 400, "messages")
    assert err["code"] == "context_length_exceeded" and "2048" in err["message"]


def test_malformed_bodies_are_400(http: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    assert_openai_error(http.post(COMP, content=b'{"prompt": "x",', headers=headers), 400)
    assert_openai_error(http.post(COMP, content=b"[1, 2]", headers=headers), 400)
    assert_openai_error(http.post(COMP, content=b"hello"), 400)
    assert_openai_error(http.post(COMP, content=b'{"prompt": "x", "temperature": NaN}', headers=headers), 400, "temperature")
    bad_part = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert_openai_error(http.post(CHAT, json=bad_part), 400)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_openai_error(http.post("/v1/nope", json={}), 404)
    assert_openai_error(http.get(COMP), 405)


def test_unknown_fields_are_ignored_and_model_may_be_omitted(http: httpx.Client) -> None:
    r = http.post(COMP, json={"prompt": "Hi", "max_tokens": 2, "frobnicate": True, "user": "u1"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
