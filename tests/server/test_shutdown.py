"""Queue limits and graceful shutdown, on a tiny random-weight model (fast to load).

The model has no tokenizer, so prompts are token ids, and streams ask for `logprobs: 0` to get
one event per token (there is no text to stream).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess, assert_openai_error

LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 60000, "ignore_eos": True, "logprobs": 0, "stream": True}


def start(model: Path, tmp_path: Path, *args: str) -> ServerProcess:
    server = ServerProcess(
        ["--model", str(model), "--max-num-seqs", "1", "--num-kv-blocks", "4096", *args],
        tmp_path / "server.log",
    )
    server.wait_ready()
    return server


class StreamReader(threading.Thread):
    """Reads one streamed completion in the background; `first_event` fires on its first data."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.status: int | None = None
        self.headers_seen = threading.Event()
        self.first_event = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=60.0) as http, http.stream(
                "POST", self.url + "/v1/completions", json=self.body
            ) as r:
                self.status = r.status_code
                self.headers_seen.set()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        self.first_event.set()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.headers_seen.set()
            self.first_event.set()

    @property
    def finish_reason(self) -> str | None:
        for event in reversed(self.events):
            for choice in event.get("choices", []):
                if choice.get("finish_reason"):
                    return str(choice["finish_reason"])
        return None


@pytest.fixture
def server_factory(long_model: Path, tmp_path: Path) -> Iterator[Any]:
    started: list[ServerProcess] = []

    def make(*args: str) -> ServerProcess:
        started.append(start(long_model, tmp_path, *args))
        return started[-1]

    yield make
    for s in started:
        s.stop(timeout=5)


def test_full_queue_is_429_then_sigterm_drains_aborts_and_exits_0(server_factory: Any) -> None:
    server = server_factory("--max-queued-requests", "1", "--shutdown-timeout", "3")
    running = StreamReader(server.url, LONG)
    running.start()
    assert running.first_event.wait(30) and running.status == 200  # it is running: tokens flow
    waiting = StreamReader(server.url, LONG)
    waiting.start()
    assert waiting.headers_seen.wait(30) and waiting.status == 200  # accepted, waiting (1 seat)

    err = assert_openai_error(httpx.post(server.url + "/v1/completions", json={**LONG, "stream": False}), 429)
    assert err["code"] == "queue_full"
    assert_openai_error(httpx.post(server.url + "/v1/completions", json=LONG), 429)

    t0 = time.monotonic()
    server.signal(signal.SIGTERM)
    time.sleep(0.2)
    # Draining: the socket still answers, with 503, and /health says so too. (The timeout is
    # 3 s, not 1, so a loaded machine still has the socket open for these two requests.)
    err = assert_openai_error(httpx.post(server.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2}), 503)
    assert err["code"] == "shutting_down"
    assert httpx.get(server.url + "/health").status_code == 503

    assert server.proc.wait(timeout=30) == 0
    assert time.monotonic() - t0 < 3 + 10  # the 3 s timeout, plus the flush
    for reader in (running, waiting):
        reader.join(10)
        assert reader.error is None, reader.error
        assert reader.done and reader.finish_reason == "abort"  # ended cleanly, marked aborted
    assert "Traceback" not in server.log()


def test_sigint_lets_in_flight_work_finish_and_exits_0(server_factory: Any) -> None:
    server = server_factory("--shutdown-timeout", "60")
    body = {**LONG, "max_tokens": 300}
    reader = StreamReader(server.url, body)
    reader.start()
    assert reader.first_event.wait(30) and reader.status == 200
    server.signal(signal.SIGINT)
    reader.join(60)
    assert reader.error is None and reader.done
    assert reader.finish_reason == "length"  # finished, not cut off
    tokens = sum(len(c["logprobs"]["tokens"]) for e in reader.events for c in e["choices"] if c["logprobs"])
    assert tokens == 300
    try:
        assert server.proc.wait(timeout=30) == 0
    except subprocess.TimeoutExpired:
        pytest.fail(f"server did not exit after SIGINT:\n{server.log()}")
