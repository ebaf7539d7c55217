"""vLLM's `--enable-request-id-headers`: completions and chats answer with an X-Request-Id header
holding the response's id (the client's own `request_id` or X-Request-Id in it), streamed or
not; without the flag there is none."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess


def test_responses_carry_their_id_in_a_header(tiny_model: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "64", "--enable-request-id-headers"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json={**body, "request_id": "mine"}, timeout=60)
        assert r.headers["x-request-id"] == r.json()["id"] == "cmpl-mine"
        r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "theirs"}, timeout=60)
        assert r.headers["x-request-id"] == "cmpl-theirs"
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            assert s.headers["x-request-id"].startswith("cmpl-")
            s.read()
    finally:
        assert server.stop() == 0
    plain = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "64"], tmp_path / "plain.log")
    try:
        plain.wait_ready()
        r = httpx.post(plain.url + "/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and "x-request-id" not in r.headers
    finally:
        assert plain.stop() == 0
