"""Real `conveyor serve` processes on loopback ports, and helpers to read their /metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

# The server and the test process share 2 cores here; one torch thread each avoids
# oversubscription, which makes torch 10-100x slower.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m conveyor.cli serve ...` as a child process; its output goes to a log file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, **SERVER_ENV}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} during startup:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"server not healthy after {timeout:.0f} s:\n{self.log()}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama without tokenizer, with room for thousands of tokens (so a
    request can outlive every check made while it runs); loads in a second."""
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", max_position_embeddings=8192)


@pytest.fixture(scope="session")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with room for 65536 tokens: at the 2500 tokens a second one CPU
    makes of it, 60,000 tokens run for 25 s and more, past every timeout a test waits out while
    such a request runs, on any machine this suite runs on (4000 tokens, 1.6 s, did not outlive
    a loaded CI box's checks)."""
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("long") / "llama", "llama", max_position_embeddings=65536)


@pytest.fixture(scope="session")
def smol_server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default model (SmolLM2), started but not yet waited for, so other fixtures overlap."""
    server = ServerProcess(
        [
            "--kv-cache-memory", str(256 << 20),
            "--max-model-len", "2048",
            "--max-queued-requests", "64",
            "--served-model-name", "smollm2", "SmolLM2-135M-Instruct",
            "--shutdown-timeout", "5",
        ],
        tmp_path_factory.mktemp("smol_server") / "server.log",
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server(smol_server_process: ServerProcess) -> ServerProcess:
    smol_server_process.wait_ready()
    return smol_server_process


@pytest.fixture(scope="module")
def client(smol_server: ServerProcess) -> openai.OpenAI:
    """The official `openai` client on the session's SmolLM2 server."""
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed by prometheus_client: {(sample name, sorted labels minus model_name): value}."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def sample(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def engine_pids(server: ServerProcess) -> list[int]:
    """The server's engine processes: its children running multiprocessing's spawn entry point."""
    return child_pids(server.proc.pid, "spawn_main")


def child_pids(parent: int, marker: str) -> list[int]:
    """The processes whose parent is `parent` and whose command line holds `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and marker in cmdline:
            pids.append(int(entry.name))
    return pids


class StreamReader:
    """One streamed completion read in a thread: `events` fills with its chunks (and
    `{"done": True}` at `[DONE]`); `flowing` is set once more than 20 have come."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.events: list[dict[str, Any]] = []
        self.flowing = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict[str, Any]) -> None:
        with httpx.Client(timeout=120.0) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line[6:]))
                    if len(self.events) > 20:
                        self.flowing.set()
                elif line == "data: [DONE]":
                    self.events.append({"done": True})

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def tokens(self) -> list[str]:
        return [t for e in self.events for c in e.get("choices", []) for t in (c.get("logprobs") or {}).get("tokens", [])]

