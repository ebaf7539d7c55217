"""Step and request traces: plain JSON, and Chrome / Perfetto trace-event format.

Open a Chrome trace in https://ui.perfetto.dev or chrome://tracing: one track shows the steps
(with their batch composition as arguments), counters show KV blocks, running and waiting
requests, and one track per request slot shows each request's queueing and its run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.engine import StepRecord

if TYPE_CHECKING:
    from conveyor.engine import Engine


def trace_dict(engine: Engine) -> dict[str, Any]:
    # Field by field, not dataclasses.asdict (which deep-copies): traces hold 10^5 steps.
    names = [f.name for f in dataclasses.fields(StepRecord)]
    steps = [{n: getattr(s, n) for n in names} for s in engine.step_trace]
    requests = []
    for r in engine.finished_requests:
        m = r.metrics
        requests.append(
            {
                "request_id": r.request_id,
                "seq_id": r.seq_id,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "finish_reason": r.finish_reason,
                "priority": r.priority,
                "num_preemptions": r.num_preemptions,
                "num_cached_tokens": m.num_cached_tokens,
                "arrival_time": m.arrival_time,
                "first_scheduled_time": m.first_scheduled_time,
                "first_token_time": m.first_token_time,
                "finished_time": m.finished_time,
                "ttft": m.ttft,
                "tpot": m.tpot,
                "e2e": m.e2e,
            }
        )
    return {"config": engine.config.flat(), "steps": steps, "requests": requests}


def export_json(engine: Engine, path: str | Path) -> None:
    Path(path).write_text(json.dumps(trace_dict(engine), indent=1, default=str))


def chrome_trace(engine: Engine) -> dict[str, Any]:
    data = trace_dict(engine)
    steps, requests = data["steps"], data["requests"]
    t0 = min([s["start"] for s in steps] + [r["arrival_time"] for r in requests], default=0.0)

    def us(t: float) -> float:
        return (t - t0) * 1e6

    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "engine steps"}},
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "requests"}},
    ]
    for s in steps:
        kind = "prefill+decode" if s["num_prefill_tokens"] and s["num_decode_tokens"] else (
            "prefill" if s["num_prefill_tokens"] else "decode"
        )
        args = {k: v for k, v in s.items() if k not in ("start", "duration_s", "seq_ids")}
        events.append(
            {"name": kind, "ph": "X", "pid": 0, "tid": 0, "ts": us(s["start"]),
             "dur": s["duration_s"] * 1e6, "args": args}
        )
        events.append(
            {"name": "queues", "ph": "C", "pid": 0, "ts": us(s["start"]),
             "args": {"running": s["num_running"], "waiting": s["num_waiting"], "swapped": s["num_swapped"]}}
        )
        events.append(
            {"name": "kv_blocks_used", "ph": "C", "pid": 0, "ts": us(s["start"]),
             "args": {"blocks": s["kv_blocks_used"]}}
        )
    # Requests on a few lanes, each lane holding non-overlapping requests (greedy interval packing).
    lanes: list[float] = []
    for r in sorted(requests, key=lambda r: r["arrival_time"]):
        end = r["finished_time"] or r["arrival_time"]
        lane = next((i for i, free_at in enumerate(lanes) if free_at <= r["arrival_time"]), len(lanes))
        if lane == len(lanes):
            lanes.append(end)
        else:
            lanes[lane] = end
        start_run = r["first_scheduled_time"] or end
        events.append(
            {"name": f"{r['request_id']} queued", "ph": "X", "pid": 1, "tid": lane,
             "ts": us(r["arrival_time"]), "dur": (start_run - r["arrival_time"]) * 1e6,
             "args": {"prompt_len": r["prompt_len"]}}
        )
        events.append(
            {"name": r["request_id"], "ph": "X", "pid": 1, "tid": lane, "ts": us(start_run),
             "dur": (end - start_run) * 1e6,
             "args": {k: r[k] for k in ("prompt_len", "output_len", "finish_reason", "ttft", "tpot", "num_preemptions")}}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def export_chrome_trace(engine: Engine, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(engine)))
