"""Load generator for any OpenAI-compatible server: streamed completions, timed per chunk.

Each request is one streamed `POST /v1/completions` (or `/v1/chat/completions`) with
`max_tokens` set to the workload's output length and `ignore_eos: true` (vLLM's extension, which
conveyor, vLLM and SGLang honour), so output lengths are exact where the server supports it.
`stream_options: {include_usage, continuous_usage_stats}` asks for token counts in every chunk:
where a server sends them, a chunk carrying several tokens is counted as several; where it does
not, each chunk with text counts as one token and the final usage corrects the total.

Drivers: open loop at a request rate (each request sent at its arrival offset, whatever is in
flight) and closed loop at a fixed concurrency (N in flight; the next is sent when one ends).
Before, during and after a run, `/metrics` is scraped if the server has one (conveyor's and
vLLM's names): peak and mean KV-cache usage, requests running / waiting, and preemptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from conveyor.bench.metrics import RequestTiming
from conveyor.bench.workload import BenchRequest

clock = time.perf_counter


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str
    model: str | None = None  # None: the first model /v1/models lists (or none at all)
    endpoint: str = "completions"  # or "chat" (text prompts only)
    ignore_eos: bool = True
    stream_usage: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint={self.endpoint!r}: use completions or chat")

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class OnlineRun:
    """One load point against one server."""

    timings: list[RequestTiming]
    duration_s: float
    server_metrics: dict[str, Any] | None


def request_body(target: Target, req: BenchRequest, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": req.output_len, "temperature": 0.0, "stream": True}
    if target.endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (a JSONL trace with \"prompt\")")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
    if model:
        body["model"] = model
    if target.ignore_eos:
        body["ignore_eos"] = True
    if req.tenant is not None:
        body["user"] = req.tenant
    if target.stream_usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    body.update(target.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        if chat:
            parts.append((choice.get("delta") or {}).get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


async def send_request(
    client: httpx.AsyncClient, target: Target, req: BenchRequest, model: str | None
) -> RequestTiming:
    """Send one streamed request; time every chunk that carries tokens."""
    timing = RequestTiming(req.index, clock(), prompt_len=req.prompt_len)
    chat = target.endpoint == "chat"
    counted = 0  # tokens attributed to chunks so far
    try:
        body = request_body(target, req, model)
        timing.start = clock()
        async with client.stream("POST", target.url, json=body, headers=target.headers()) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                timing.error = f"HTTP {resp.status_code}: {text[:300]}"
                return timing
            async for line in resp.aiter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    timing.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    break
                usage = chunk.get("usage") or {}
                if usage.get("prompt_tokens") is not None:
                    timing.prompt_len = int(usage["prompt_tokens"])
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if cached is not None:
                    timing.cached_tokens = int(cached)
                total = usage.get("completion_tokens")
                if chunk.get("choices"):
                    if total is not None:
                        new = int(total) - counted
                    else:
                        new = 1 if _chunk_text(chunk, chat) else 0
                    if new > 0:
                        timing.chunk_times.append(now)
                        counted += new
                elif total is not None and int(total) > counted:
                    counted = int(total)  # usage-only last chunk: the count, not a token time
            timing.output_len = counted
            timing.end = clock()
    except Exception as e:  # the request failed; the run goes on and reports it
        timing.error = f"{type(e).__name__}: {e}"
    if timing.error is None and not timing.chunk_times:
        timing.error = "the stream carried no tokens"
    return timing


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def _pick(metrics: dict[str, float], *suffixes: str) -> float | None:
    """The first sample whose name ends with one of the suffixes (any prefix: conveyor:, vllm:)."""
    for suffix in suffixes:
        for name, value in metrics.items():
            if name.endswith(suffix):
                return value
    return None


def _kv(m: dict[str, float]) -> float | None:
    return _pick(m, "kv_cache_usage_perc", "gpu_cache_usage_perc", "token_usage")


def _preemptions(m: dict[str, float]) -> float | None:
    return _pick(m, "num_preemptions_total", "num_preemptions")


class MetricsWatcher:
    """Scrapes `/metrics` before, every `interval_s` during, and after a run."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval_s: float = 0.25) -> None:
        self.client = client
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self.available = True
        self._task: asyncio.Task[None] | None = None

    async def scrape(self) -> dict[str, float] | None:
        if not self.available:
            return None
        try:
            r = await self.client.get(self.url, timeout=10.0)
            if r.status_code != 200:
                self.available = False
                return None
            m = parse_metrics(r.text)
        except (httpx.HTTPError, ValueError):
            self.available = False
            return None
        self.samples.append(m)
        return m

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    async def start(self) -> None:
        await self.scrape()
        if self.available:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[str, Any] | None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.scrape()
        return self.summary()

    def summary(self) -> dict[str, Any] | None:
        """Peak / mean KV usage (0..1), peak running and waiting, preemptions during the run;
        a value is None where the server exposes no such metric."""
        if not self.available or len(self.samples) < 2:
            return None
        kv = [v for v in map(_kv, self.samples) if v is not None]
        running = [v for m in self.samples if (v := _pick(m, "num_requests_running")) is not None]
        waiting = [v for m in self.samples if (v := _pick(m, "num_requests_waiting")) is not None]
        first, last = _preemptions(self.samples[0]), _preemptions(self.samples[-1])
        return {
            "samples": len(self.samples),
            "kv_cache_usage_max": max(kv) if kv else None,
            "kv_cache_usage_mean": sum(kv) / len(kv) if kv else None,
            "num_running_max": max(running) if running else None,
            "num_waiting_max": max(waiting) if waiting else None,
            "preemptions": None if first is None or last is None else last - first,
        }


async def resolve_model(client: httpx.AsyncClient, target: Target) -> str | None:
    """The model name to send: the configured one, else the first one /v1/models lists."""
    if target.model:
        return target.model
    try:
        r = await client.get(target.base_url.rstrip("/") + "/v1/models", headers=target.headers(), timeout=30.0)
        data = r.json().get("data") or []
        return str(data[0]["id"]) if r.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def _run(
    target: Target,
    requests: Sequence[BenchRequest],
    concurrency: int | None,
    watch_metrics: bool,
    metrics_interval_s: float,
    warmup: int,
    progress: Any,
) -> OnlineRun:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await resolve_model(client, target)
        for i in range(warmup):
            await send_request(client, target, BenchRequest(-1 - i, requests[0].prompt, None, 2), model)
        watcher = MetricsWatcher(client, target.base_url, metrics_interval_s) if watch_metrics else None
        if watcher is not None:
            await watcher.start()
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def one(req: BenchRequest) -> RequestTiming:
            if gate is None:
                timing = await send_request(client, target, req, model)
            else:
                async with gate:
                    timing = await send_request(client, target, req, model)
            if progress is not None:
                progress.update(1)
            return timing

        t0 = clock()
        tasks: list[asyncio.Task[RequestTiming]] = []
        for req in sorted(requests, key=lambda r: (r.arrival_s, r.index)):
            delay = t0 + req.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        timings = list(await asyncio.gather(*tasks))
        duration = clock() - t0
        server = await watcher.stop() if watcher is not None else None
    timings.sort(key=lambda t: t.index)
    return OnlineRun(timings, duration, server)


def run_online(
    target: Target,
    requests: Sequence[BenchRequest],
    concurrency: int | None = None,
    watch_metrics: bool = True,
    metrics_interval_s: float = 0.25,
    warmup: int = 0,
    progress: Any = None,
) -> OnlineRun:
    """Send the workload (at its arrival offsets; with `concurrency`, at most that many in
    flight) and wait for every response. `progress` is anything with `update(n)` (a tqdm bar)."""
    if not requests:
        raise ValueError("no requests to send")
    return asyncio.run(_run(target, requests, concurrency, watch_metrics, metrics_interval_s, warmup, progress))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def launch_conveyor(serve_args: Sequence[str], log_path: Path, startup_timeout_s: float = 600.0) -> Iterator[str]:
    """Run `conveyor serve SERVE_ARGS --port P` on loopback until the block ends; yield its URL.

    The server's output goes to `log_path`; it is stopped with SIGTERM (then SIGKILL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"conveyor serve exited with {proc.returncode}; see {log_path}:\n"
                                   + log_path.read_text(errors="replace")[-2000:])
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"conveyor serve not healthy after {startup_timeout_s:.0f} s; see {log_path}")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
