"""Benchmark workloads: what each request asks for, and when it arrives.

A workload is a list of `BenchRequest`s (prompt, exact output length, arrival offset) fixed by
a seed, so every system and every run sees the same requests. Lengths come from a named
distribution (`LengthDist`), a ShareGPT-like mix (`ShareGPTLike`) or a JSONL trace; arrivals
from a request rate (Poisson, or gamma with a burstiness factor), a fixed concurrency (closed
loop: arrivals are all 0 and the driver keeps N in flight), or the trace's own times.

Reproducibility: every random draw uses its own `random.Random` stream derived from the seed and
a purpose name, so changing the number of requests or the rate never changes the prompts that
are drawn, and the arrival pattern is the same shape at every rate of a sweep (the unit-rate
gaps are drawn once and scaled by 1/rate: common random numbers across the sweep).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# ShareGPT statistics, with where each number comes from (see docs/benchmarking.md):
# - means: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
#   PagedAttention" (vLLM, SOSP '23), Fig. 11a: ShareGPT input mean 161.31 tokens, output mean
#   337.99 tokens (OPT tokenizer). Its text cross-checks them against Alpaca (Fig. 11b, 19.31 and
#   58.45): "the ShareGPT dataset has 8.4x longer input prompts and 5.8x longer outputs on
#   average than the Alpaca dataset, with higher variance".
# - filter: vLLM's ShareGPT sampler keeps a request only if prompt and output have >= 4 tokens,
#   the prompt <= 1024 and prompt + output <= 2048 (`is_valid_sequence` in
#   vllm/benchmarks/datasets.py); we apply the same bounds.
# - spread: the paper gives no number for it ("higher variance"). The lognormal shape
#   SHAREGPT_SIGMA = 1.0 is our assumption, not a published statistic; override it with
#   `ShareGPTLike(sigma=...)` / `--sharegpt-sigma`.
SHAREGPT_PROMPT_MEAN = 161.31
SHAREGPT_OUTPUT_MEAN = 337.99
SHAREGPT_SIGMA = 1.0
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048

DIST_KINDS = ("fixed", "uniform", "normal", "lognormal", "exponential")


def _rng(seed: int, purpose: str) -> random.Random:
    """An independent, reproducible stream per purpose (str seeds hash with SHA-512)."""
    return random.Random(f"conveyor-bench:{seed}:{purpose}")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload.

    `prompt` is text or token ids; `prompt_len` is its length in tokens (None for text whose
    tokenization is not known here; the server's usage reports it). `output_len` is exact: the
    request asks for that many tokens with EOS ignored. `arrival_s` is the offset from the start
    of the run (0 for every request of a closed-loop, fixed-concurrency run).
    """

    index: int
    prompt: str | tuple[int, ...]
    prompt_len: int | None
    output_len: int
    arrival_s: float = 0.0
    tenant: str | None = None  # whose share it counts against (policy "vtc"; the server's `user`)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution; samples are rounded and clipped to [low, high].

    Spec strings (`parse`): `128` or `fixed:128`; `uniform:32,256` (inclusive); `normal:MEAN,STD`;
    `lognormal:MEAN,STD` (the mean and standard deviation of the lengths themselves, not of
    their logarithm); `exponential:MEAN,MAX` (clipped at MAX, as in Anyscale's continuous
    batching benchmark).
    """

    kind: str
    a: float
    b: float = 0.0
    low: int = 1
    high: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise ValueError(f"length distribution {self.kind!r} is not one of {DIST_KINDS}")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform:{self.a:g},{self.b:g}: the upper bound is below the lower")
        if self.kind == "exponential" and (self.a <= 0 or self.b < 1):
            raise ValueError(f"exponential:{self.a:g},{self.b:g}: needs mean > 0 and max >= 1")
        if self.kind in ("normal", "lognormal") and (self.b < 0 or self.a <= 0):
            raise ValueError(f"{self.kind}:{self.a:g},{self.b:g}: needs mean > 0 and std >= 0")
        if self.kind == "fixed" and self.a < 1:
            raise ValueError(f"fixed:{self.a:g}: a length must be at least 1")
        if self.low < 1 or (self.high is not None and self.high < self.low):
            raise ValueError(f"length bounds [{self.low}, {self.high}] are empty or below 1")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        text = spec.strip()
        kind, _, args = text.partition(":")
        if not args:
            kind, args = "fixed", kind
        try:
            values = [float(v) for v in args.split(",")]
        except ValueError:
            raise ValueError(f"bad length spec {spec!r}: use e.g. 128, uniform:32,256, lognormal:128,64") from None
        wanted = 1 if kind == "fixed" else 2
        if len(values) != wanted:
            raise ValueError(f"bad length spec {spec!r}: {kind} takes {wanted} number(s)")
        return cls(kind, values[0], values[1] if len(values) > 1 else 0.0)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(math.ceil(self.a), math.floor(self.b))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        elif self.kind == "exponential":
            x = min(rng.expovariate(1.0 / self.a), self.b)
        else:
            mu, sigma = lognormal_params(self.a, self.b)
            x = rng.lognormvariate(mu, sigma)
        n = max(self.low, round(x))
        return n if self.high is None else min(n, self.high)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"


def lognormal_params(mean: float, std: float) -> tuple[float, float]:
    """(mu, sigma) of the normal whose exponential has this mean and standard deviation."""
    sigma2 = math.log1p((std / mean) ** 2)
    return math.log(mean) - sigma2 / 2, math.sqrt(sigma2)


@dataclass(frozen=True, slots=True)
class ShareGPTLike:
    """Independent lognormal prompt and output lengths with ShareGPT's published means, filtered
    like vLLM's ShareGPT sampler (see the constants above), then multiplied by `scale`.

    `scale` shrinks both lengths alike (keeping their ratio and spread) so the mix fits a slow
    machine: at 0.25 the means are ~40 and ~85 tokens. Prompt and output lengths are drawn
    independently (the published means say nothing of their correlation).
    """

    prompt_mean: float = SHAREGPT_PROMPT_MEAN
    output_mean: float = SHAREGPT_OUTPUT_MEAN
    sigma: float = SHAREGPT_SIGMA
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.sigma < 0 or self.scale <= 0 or self.prompt_mean <= 0 or self.output_mean <= 0:
            raise ValueError("ShareGPTLike needs positive means and scale, and sigma >= 0")

    def sample(self, rng: random.Random) -> tuple[int, int]:
        """(prompt_len, output_len); redraws until vLLM's ShareGPT filter accepts the pair."""
        s2 = self.sigma**2
        mu_p = math.log(self.prompt_mean) - s2 / 2
        mu_o = math.log(self.output_mean) - s2 / 2
        for _ in range(10_000):
            p = round(rng.lognormvariate(mu_p, self.sigma))
            o = round(rng.lognormvariate(mu_o, self.sigma))
            if (
                p >= SHAREGPT_MIN_LEN and o >= SHAREGPT_MIN_LEN
                and p <= SHAREGPT_MAX_PROMPT and p + o <= SHAREGPT_MAX_TOTAL
            ):
                return max(1, round(p * self.scale)), max(1, round(o * self.scale))
        raise ValueError(f"{self}: the filter rejects (almost) every draw; lower sigma")

    def describe(self) -> str:
        return f"sharegpt(prompt_mean={self.prompt_mean:g}, output_mean={self.output_mean:g}, sigma={self.sigma:g}, scale={self.scale:g})"


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) of the synthetic prompt ids: away from the special tokens at both ends."""
    if vocab_size < 8:
        raise ValueError(f"vocab_size={vocab_size} is too small for synthetic prompts")
    low = min(100, vocab_size // 4)
    return low, vocab_size - low


def _prompt_ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    low, high = token_id_range(vocab_size)
    return tuple(rng.choices(range(low, high), k=n))  # 20x faster than randrange per token


def synthetic_requests(
    num_requests: int,
    input_len: LengthDist,
    output_len: LengthDist,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random token-id prompts; request i is the same whatever `num_requests` is."""
    len_rng, out_rng, ids_rng = _rng(seed, "input_len"), _rng(seed, "output_len"), _rng(seed, "ids")
    out: list[BenchRequest] = []
    for i in range(num_requests):
        p, o = input_len.sample(len_rng), output_len.sample(out_rng)
        out.append(BenchRequest(i, _prompt_ids(ids_rng, p, vocab_size), p, o))
    return out


def sharegpt_requests(num_requests: int, mix: ShareGPTLike, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """ShareGPT-like lengths (see `ShareGPTLike`) with random token-id prompts."""
    len_rng, ids_rng = _rng(seed, "sharegpt"), _rng(seed, "ids")
    out: list[BenchRequest] = []
    for i in range(num_requests):
        p, o = mix.sample(len_rng)
        out.append(BenchRequest(i, _prompt_ids(ids_rng, p, vocab_size), p, o))
    return out


def with_shared_prefix(
    requests: list[BenchRequest], prefix_len: int, vocab_size: int, seed: int = 0, num_groups: int = 1,
    share: float = 1.0,
) -> list[BenchRequest]:
    """Every prompt starts with a shared `prefix_len` random ids (a system prompt; vLLM's
    `--random-prefix-len`), so that prefix caching has something to find. With `num_groups`
    > 1 there are that many different prefixes and each request takes one at random (SGLang's
    generated-shared-prefix workload: several system prompts or documents, interleaved). With
    `share` < 1 only that fraction of the requests (drawn at random) takes one; the others keep
    their own prompts: one-off prompts between those that share (what an eviction policy is for)."""
    if prefix_len < 0:
        raise ValueError(f"shared prefix length {prefix_len} must be >= 0")
    if num_groups < 1:
        raise ValueError(f"prefix groups {num_groups} must be >= 1")
    if not 0 < share <= 1:
        raise ValueError(f"prefix share {share} must be in (0, 1]")
    if not prefix_len:
        return requests
    prefixes = [_prompt_ids(_rng(seed, "shared_prefix" if g == 0 else f"shared_prefix:{g}"), prefix_len, vocab_size)
                for g in range(num_groups)]
    pick = _rng(seed, "prefix_group")
    takes = _rng(seed, "prefix_share")
    out = []
    for r in requests:
        if isinstance(r.prompt, str):
            raise ValueError("a shared prefix needs token-id prompts; this workload has text prompts")
        if share < 1 and takes.random() >= share:
            out.append(r)
            continue
        prefix = prefixes[pick.randrange(num_groups)] if num_groups > 1 else prefixes[0]
        out.append(replace(r, prompt=prefix + r.prompt, prompt_len=prefix_len + len(r.prompt)))
    return out


def parse_tenants(spec: str) -> list[tuple[str, float]]:
    """`a:4,b:1` -> [("a", 0.8), ("b", 0.2)]: tenants and the share of requests each sends."""
    pairs = []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"--tenants: {part.strip()!r} is not NAME or NAME:WEIGHT") from None
        if not name or not w > 0:
            raise ValueError(f"--tenants: {part.strip()!r} needs a name and a weight > 0")
        pairs.append((name, w))
    if len({n for n, _ in pairs}) != len(pairs):
        raise ValueError(f"--tenants: a tenant is named twice in {spec!r}")
    total = sum(w for _, w in pairs)
    return [(n, w / total) for n, w in pairs]


def with_tenants(requests: list[BenchRequest], tenants: list[tuple[str, float]], seed: int = 0) -> list[BenchRequest]:
    """Each request is sent by one of `tenants` (name, share), drawn per request: with Poisson
    arrivals each tenant's requests are a Poisson stream of its share of the rate."""
    if not tenants:
        return requests
    rng = _rng(seed, "tenants")
    names, weights = [n for n, _ in tenants], [w for _, w in tenants]
    return [replace(r, tenant=rng.choices(names, weights)[0]) for r in requests]


def load_trace(
    path: str | Path,
    vocab_size: int,
    seed: int = 0,
    default_output_len: LengthDist | None = None,
    limit: int | None = None,
) -> list[BenchRequest]:
    """Requests from a JSONL trace, one object per line (the format of `conveyor.replay`):

        {"arrival_s": 0.25, "prompt": "text", "output_len": 64}
        {"arrival_s": 0.40, "prompt_token_ids": [1, 2, 3], "output_len": 16}
        {"arrival_s": 0.90, "prompt_len": 200, "output_len": 64}     # synthetic ids, exact length

    `timestamp` is accepted for `arrival_s` (seconds; shifted so the first request is at 0),
    `max_tokens` for `output_len`; without either, `default_output_len` is drawn. `tenant`
    (or `user`) names who sent the request (policy "vtc", the per-tenant report).
    """
    ids_rng, out_rng = _rng(seed, "ids"), _rng(seed, "output_len")
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object")
        row["_line"] = n
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    times = [float(r.get("arrival_s", r.get("timestamp", 0.0))) for r in rows]
    # Absolute timestamps start wherever the trace was recorded; offsets start at 0 already.
    uses_timestamps = any("timestamp" in r and "arrival_s" not in r for r in rows)
    t0 = min(times, default=0.0) if uses_timestamps else 0.0
    out: list[BenchRequest] = []
    for i, (row, t) in enumerate(zip(rows, times, strict=True)):
        where = f"{path}:{row['_line']}"
        prompt: str | tuple[int, ...]
        if "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise ValueError(f"{where}: prompt must be a non-empty string")
            prompt, plen = row["prompt"], None
        elif "prompt_token_ids" in row:
            prompt = tuple(int(t) for t in row["prompt_token_ids"])
            plen = len(prompt)
        elif "prompt_len" in row:
            plen = int(row["prompt_len"])
            prompt = _prompt_ids(ids_rng, plen, vocab_size)
        else:
            raise ValueError(f"{where}: needs prompt, prompt_token_ids or prompt_len")
        given = row.get("output_len", row.get("max_tokens"))
        if given is not None:
            olen = int(given)
        elif default_output_len is not None:
            olen = default_output_len.sample(out_rng)
        else:
            raise ValueError(f"{where}: needs output_len (or give a default output length)")
        if (plen is not None and plen < 1) or olen < 1:
            raise ValueError(f"{where}: prompt and output lengths must be at least 1")
        tenant = row.get("tenant", row.get("user"))
        out.append(BenchRequest(i, prompt, plen, olen, max(0.0, t - t0), None if tenant is None else str(tenant)))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One point of a sweep: a request rate (req/s; inf = all at once), a fixed concurrency
    (closed loop), or the trace's own arrival times."""

    kind: str  # "rate" | "concurrency" | "trace"
    value: float

    def __post_init__(self) -> None:
        if self.kind not in ("rate", "concurrency", "trace"):
            raise ValueError(f"load kind {self.kind!r}")
        if self.kind == "rate" and not self.value > 0:
            raise ValueError(f"request rate {self.value} must be > 0 (inf: all at once)")
        if self.kind == "concurrency" and (self.value < 1 or self.value != int(self.value)):
            raise ValueError(f"concurrency {self.value} must be a positive integer")

    @property
    def label(self) -> str:
        if self.kind == "trace":
            return "trace"
        if self.kind == "concurrency":
            return f"c={int(self.value)}"
        return "inf" if math.isinf(self.value) else f"{self.value:g}/s"

    @property
    def concurrency(self) -> int | None:
        return int(self.value) if self.kind == "concurrency" else None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": None if math.isinf(self.value) else self.value, "label": self.label}


def parse_sweep(rates: str | None, concurrencies: str | None) -> list[LoadPoint]:
    """`--request-rate 0.5,1,2,inf` or `--concurrency 1,4,16`; neither: the trace's own times."""
    if rates and concurrencies:
        raise ValueError("give --request-rate or --concurrency, not both")
    if concurrencies:
        return [LoadPoint("concurrency", float(v)) for v in _split(concurrencies)]
    if rates:
        return [LoadPoint("rate", math.inf if v.lower() in ("inf", "infinity") else float(v)) for v in _split(rates)]
    return [LoadPoint("trace", 0.0)]


def _split(text: str) -> list[str]:
    items = [v.strip() for v in text.replace(" ", ",").split(",") if v.strip()]
    if not items:
        raise ValueError(f"empty sweep {text!r}")
    return items


def unit_gaps(n: int, burstiness: float, seed: int) -> list[float]:
    """Inter-arrival gaps of a unit-rate process: gamma(shape=b, scale=1/b), mean 1, coefficient
    of variation 1/sqrt(b). b = 1 is a Poisson process; b < 1 burstier, b > 1 more regular.
    (The same parameterisation as vLLM's `--burstiness`.)"""
    if burstiness <= 0:
        raise ValueError(f"burstiness={burstiness} must be > 0 (1 = Poisson)")
    rng = _rng(seed, "arrivals")
    return [rng.gammavariate(burstiness, 1.0 / burstiness) for _ in range(n)]


def at_load(
    requests: Sequence[BenchRequest], point: LoadPoint, burstiness: float = 1.0, seed: int = 0
) -> list[BenchRequest]:
    """The workload with the arrival times of `point`; request i's first arrival is at 0."""
    if point.kind == "trace":
        return list(requests)
    if point.kind == "concurrency" or math.isinf(point.value):
        return [replace(r, arrival_s=0.0) for r in requests]
    gaps = unit_gaps(len(requests), burstiness, seed)
    out, t = [], 0.0
    for r, gap in zip(requests, gaps, strict=True):
        out.append(replace(r, arrival_s=t))
        t += gap / point.value
    return out


def describe(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Counts and mean lengths, for the report."""
    plens = [r.prompt_len for r in requests if r.prompt_len is not None]
    olens = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(plens) if len(plens) == len(requests) else None,
        "output_tokens": sum(olens),
        "mean_prompt_len": sum(plens) / len(plens) if plens else None,
        "mean_output_len": sum(olens) / len(olens) if olens else None,
        "max_prompt_len": max(plens, default=None),
        "max_output_len": max(olens, default=None),
    }
