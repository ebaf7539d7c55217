"""Workload replay: requests arrive at given times and the engine serves them as they come.

Policies differ only under arrivals (everything queued at t=0 hides most of what a queue
order or an admission trigger does), so comparisons replay a timed workload.

A JSONL workload has one request per line:
    {"arrival_s": 0.25, "prompt": "text"}                      # or "prompt_token_ids": [...]
    {"arrival_s": 0.40, "prompt_len": 200, "output_len": 64}   # synthetic ids, exact length
Other keys are SamplingParams fields (max_tokens, temperature, priority, ...).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.engine import Engine
    from conveyor.outputs import RequestOutput


@dataclass(slots=True)
class TimedRequest:
    arrival_s: float
    prompt: str | list[int]
    params: SamplingParams
    request_id: str | None = None


_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


def load_jsonl(path: str | Path, vocab_size: int = 32000, seed: int = 0) -> list[TimedRequest]:
    """Read a JSONL workload; `prompt_len` lines get seeded synthetic token ids."""
    rng = random.Random(seed)
    out: list[TimedRequest] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from e
        try:
            out.append(_parse_row(row, rng, vocab_size))
        except (ValueError, TypeError) as e:  # bad values too (InvalidRequestError is a ValueError)
            raise ValueError(f"{path}:{n}: {e}") from e
    return out


def _parse_row(row: dict[str, Any], rng: random.Random, vocab_size: int) -> TimedRequest:
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    prompt: str | list[int]
    if "prompt" in row:
        prompt = row["prompt"]
    elif "prompt_token_ids" in row:
        prompt = [int(t) for t in row["prompt_token_ids"]]
    elif "prompt_len" in row:
        prompt = [rng.randrange(10, vocab_size - 10) for _ in range(int(row["prompt_len"]))]
    else:
        raise ValueError("needs prompt, prompt_token_ids or prompt_len")
    kwargs = {k: v for k, v in row.items() if k in _PARAM_NAMES}
    if "output_len" in row:
        kwargs.setdefault("max_tokens", int(row["output_len"]))
        kwargs.setdefault("ignore_eos", True)
    kwargs.setdefault("temperature", 0.0)
    return TimedRequest(float(row.get("arrival_s", 0.0)), prompt, SamplingParams(**kwargs), row.get("request_id"))


def replay(engine: Engine, requests: list[TimedRequest], time_scale: float = 1.0) -> list[RequestOutput]:
    """Serve `requests` at their arrival times (scaled), in real time on the engine's clock.

    Each request's `arrival_time` is its scheduled arrival, so queueing before the engine could
    look at it still counts in its TTFT. Returns the final outputs in the given order.
    """
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    ids = [r.request_id or f"replay-{i}" for i, r in enumerate(requests)]
    start = engine.clock()
    results: dict[str, RequestOutput] = {}
    next_i = 0
    while next_i < len(order) or engine.has_unfinished_requests():
        now = engine.clock()
        while next_i < len(order) and start + requests[order[next_i]].arrival_s * time_scale <= now:
            i = order[next_i]
            r = requests[i]
            engine.add_request(ids[i], r.prompt, r.params, arrival_time=start + r.arrival_s * time_scale)
            next_i += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
        elif next_i < len(order):
            engine.wait_until(start + requests[order[next_i]].arrival_s * time_scale)
    return [results[rid] for rid in ids]
