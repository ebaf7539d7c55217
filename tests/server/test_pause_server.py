"""`conveyor serve --enable-rl-api`: `/pause?mode=abort` ends a running request, a request
sent while paused waits for `/resume`; without the flag the routes are not served."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess


def test_the_pause_api_over_http(tiny_model: Path, long_model: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model", str(long_model), "--num-kv-blocks", "4096", "--enable-rl-api"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        long = {"prompt": [5, 6, 7], "max_tokens": 60000, "ignore_eos": True, "temperature": 0.0}
        result: dict[str, object] = {}
        reader = threading.Thread(target=lambda: result.update(
            httpx.post(server.url + "/v1/completions", json=long, timeout=120.0).json()))
        reader.start()
        time.sleep(1.0)
        assert httpx.post(server.url + "/pause", params={"mode": "abort"}, timeout=30.0).status_code == 200
        reader.join(30)
        assert result["choices"][0]["finish_reason"] == "abort"  # type: ignore[index]
        assert httpx.get(server.url + "/is_paused").json() == {"is_paused": True}
        short = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0}
        sent = threading.Thread(target=lambda: result.update(
            short=httpx.post(server.url + "/v1/completions", json=short, timeout=120.0).status_code))
        sent.start()
        time.sleep(0.5)
        assert "short" not in result  # waits while paused
        assert httpx.post(server.url + "/resume").status_code == 200
        sent.join(30)
        assert result["short"] == 200
        assert httpx.get(server.url + "/is_paused").json() == {"is_paused": False}
        assert httpx.post(server.url + "/pause", params={"mode": "later"}).status_code == 400
    finally:
        assert server.stop() == 0
    plain = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "64"], tmp_path / "plain.log")
    try:
        plain.wait_ready()
        assert httpx.post(plain.url + "/pause").status_code == 404
    finally:
        assert plain.stop() == 0


def test_new_weights_over_http(tiny_model: Path, tmp_path: Path) -> None:
    from tests.conftest import build_tiny_model

    other = build_tiny_model(tmp_path / "other", "llama", seed=5, max_position_embeddings=8192)
    server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "256", "--enable-rl-api"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                "return_tokens_as_token_ids": True}

        def tokens() -> list[str]:
            return list(httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
                        ["logprobs"]["tokens"])

        before = tokens()
        r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(other)}, timeout=60)
        assert r.status_code == 200 and r.json()["success"] is True
        after = tokens()
        assert after != before
        r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "nowhere")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
        assert tokens() == after  # (a failed update changes nothing)
        bad = httpx.post(server.url + "/update_weights_from_disk", content=b"{not json")
        assert bad.status_code == 400
    finally:
        assert server.stop() == 0


def test_sleep_mode_over_http(tiny_model: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "256", "--enable-rl-api"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}

        def ask() -> httpx.Response:
            return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

        before = ask().json()["choices"][0]["text"]
        assert httpx.post(server.url + "/sleep", params={"level": 2}, timeout=60).status_code == 200
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}
        asleep = ask()
        assert asleep.status_code == 400 and "asleep" in asleep.json()["error"]["message"]
        assert httpx.post(server.url + "/wake_up", timeout=60).status_code == 200
        assert httpx.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
        assert ask().json()["choices"][0]["text"] == before
    finally:
        assert server.stop() == 0
