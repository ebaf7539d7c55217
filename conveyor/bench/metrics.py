"""Serving metrics from per-request timestamps: pure functions, no clocks, no I/O.

Definitions (the ones vLLM's `bench serve` prints, so numbers compare across tools):
- TTFT: first token time - start (the start is when the request was sent, or its scheduled
  arrival offline: queueing before the engine looked at it counts).
- E2E: end - start, where end is when the response was complete.
- TPOT: (E2E - TTFT) / (output tokens - 1), the mean time per token after the first; undefined
  (None) for a one-token output.
- ITL: the gaps between consecutive token-carrying chunks of a response. One token per chunk
  makes it the time between tokens; a chunk carrying k tokens gives one gap, not k.
- Throughput: completed requests, their prompt tokens and their output tokens, each divided by
  the run's duration (from the first send to the last completion).
- A run stopped at a time limit (an HF baseline with `--hf-time-limit-s`) leaves requests cut:
  stopped mid-answer or before they started, with neither an end nor an error. They are not
  completed and not failed; the tokens they had made count in the generated output throughput
  (every output token made, finished or not, over the run's duration), which is how such a run
  compares with a whole one.
- Goodput (DistServe, OSDI '24, as `vllm bench serve --goodput` computes it): completed requests
  that met every given SLO (TTFT, TPOT, E2E), per second of the run. SLO attainment: the share
  of all requests (failed ones count as missing) that met them. A sweep's DistServe goodput is
  the highest load whose attainment reaches the target (`max_load_meeting`).
- Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestTiming:
    """What one request did, on one clock (seconds).

    Invariants for a completed request: start <= chunk_times[0] <= ... <= chunk_times[-1] <= end,
    and output_len >= len(chunk_times) >= 1 (a chunk carries one or more tokens). A failed
    request has `error` set; its timestamps are whatever was seen before the failure. A request
    a time limit cut has neither `end` nor `error`: `output_len` tokens made, timed by
    `chunk_times` where the system timed them.
    """

    index: int
    start: float
    output_len: int = 0
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    prompt_len: int | None = None
    error: str | None = None
    cached_tokens: int | None = None  # prompt tokens the prefix cache held, where reported
    tenant: str | None = None  # who sent it (workloads with --tenants)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times) and self.output_len > 0

    @property
    def cut(self) -> bool:
        return self.error is None and self.end is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.output_len < 2:
            return None
        return (e2e - ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_SLO_NAMES = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "e2el": "e2e_s"}


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives in seconds; None means no objective on that metric."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"SLO {name}={v} must be >= 0")

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`ttft=500ms,tpot=100ms,e2e=10s` (units us, ms, s; a bare number is ms, as in vLLM's
        `--goodput`); `:` works in place of `=`."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"(\w+)\s*[=:]\s*([0-9.eE+-]+)\s*(us|ms|s)?", part)
            if m is None or m.group(1).lower() not in _SLO_NAMES:
                raise ValueError(f"bad SLO {part!r}: use ttft=500ms,tpot=100ms,e2e=10s")
            values[_SLO_NAMES[m.group(1).lower()]] = float(m.group(2)) * _UNITS[m.group(3) or "ms"]
        if not values:
            raise ValueError(f"empty SLO {text!r}")
        return cls(**values)

    @property
    def empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2e_s is None

    def met_by(self, t: RequestTiming) -> bool:
        """A completed request meets the SLO if each given objective holds; a one-token output
        has no TPOT and so cannot miss a TPOT objective."""
        if not t.ok:
            return False
        ttft, tpot, e2e = t.ttft, t.tpot, t.e2e
        return (
            (self.ttft_s is None or (ttft is not None and ttft <= self.ttft_s))
            and (self.tpot_s is None or tpot is None or tpot <= self.tpot_s)
            and (self.e2e_s is None or (e2e is not None and e2e <= self.e2e_s))
        )

    def to_json(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s}

    def describe(self) -> str:
        parts = [f"{k[:-2]} <= {_fmt_s(v)}" for k, v in self.to_json().items() if v is not None]
        return ", ".join(parts) or "none"


def _fmt_s(v: float) -> str:
    return f"{v * 1e3:g} ms" if v < 1 else f"{v:g} s"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly like numpy.percentile."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99, max of the values (all None for no values)."""
    xs = list(values)
    if not xs:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    return {"mean": sum(xs) / len(xs), **{f"p{p}": percentile(xs, p) for p in PERCENTILES}, "max": max(xs)}


def summarize(
    timings: Sequence[RequestTiming], duration_s: float, slo: SLO | None = None, by_tenant: bool = True
) -> dict[str, Any]:
    """Throughputs, latency distributions and (with an SLO) goodput of one run; with tenants,
    the same for each tenant's requests under `per_tenant` (fairness is how these differ).

    `duration_s` is the run's wall time, from the first send to the last completion.
    Throughputs count completed requests only, but for the generated output throughput, which
    counts every output token made (cut requests' too).
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be > 0")
    done = [t for t in timings if t.ok]
    cut = sum(1 for t in timings if t.cut)
    in_tokens = sum(t.prompt_len or 0 for t in done)
    out_tokens = sum(t.output_len for t in done)
    made = out_tokens + sum(t.output_len for t in timings if t.cut)
    out: dict[str, Any] = {
        "num_requests": len(timings),
        "completed": len(done),
        "failed": len(timings) - len(done) - cut,
        "cut": cut,
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "generated_output_tokens": made,
        "request_throughput": len(done) / duration_s,
        "input_throughput": in_tokens / duration_s,
        "output_throughput": out_tokens / duration_s,
        "generated_output_throughput": made / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_s": distribution(t.ttft for t in done if t.ttft is not None),
        "tpot_s": distribution(t.tpot for t in done if t.tpot is not None),
        "itl_s": distribution(x for t in done for x in t.itls),
        "e2e_s": distribution(t.e2e for t in done if t.e2e is not None),
    }
    cached = [t.cached_tokens for t in done if t.cached_tokens is not None]
    if cached:
        out["total_cached_tokens"] = sum(cached)
        out["prefix_cache_hit_rate"] = sum(cached) / in_tokens if in_tokens else 0.0
    if slo is not None and not slo.empty:
        good = sum(1 for t in timings if slo.met_by(t))
        out["goodput"] = good / duration_s
        out["slo_attainment"] = good / len(timings) if timings else 0.0
        out["requests_meeting_slo"] = good
    errors = sorted({t.error for t in timings if t.error})
    if errors:
        out["errors"] = errors[:5]
    tenants = sorted({t.tenant for t in timings if t.tenant is not None}) if by_tenant else []
    if tenants:
        out["per_tenant"] = {
            name: summarize([t for t in timings if t.tenant == name], duration_s, slo, by_tenant=False)
            for name in tenants
        }
    return out


def max_load_meeting(points: Sequence[tuple[float, float | None]], target: float) -> float | None:
    """DistServe's goodput of a sweep: the highest load (rate or concurrency) whose SLO
    attainment is >= target, among (load, attainment) pairs. None if no point reaches it."""
    ok = [load for load, att in points if att is not None and att >= target]
    return max(ok) if ok else None


def per_request_rows(timings: Sequence[RequestTiming]) -> list[dict[str, Any]]:
    """Compact per-request records for the JSON result (enough to redraw the CDFs)."""
    return [
        {
            "index": t.index,
            "ok": t.ok,
            "prompt_len": t.prompt_len,
            "output_len": t.output_len,
            "ttft_s": t.ttft,
            "tpot_s": t.tpot,
            "e2e_s": t.e2e,
            **({"cached_tokens": t.cached_tokens} if t.cached_tokens is not None else {}),
            **({"tenant": t.tenant} if t.tenant is not None else {}),
            **({"error": t.error} if t.error else {}),
            **({"cut": True} if t.cut else {}),
        }
        for t in timings
    ]
