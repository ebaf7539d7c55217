"""`conveyor serve --enable-pause-api`: `/pause?mode=abort` ends a running request, a request
sent while paused waits for `/resume`; without the flag the routes are not served."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess


def test_the_pause_api_over_http(tiny_model: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "1024", "--enable-pause-api"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        long = {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "temperature": 0.0}
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
