"""In-process benchmark: conveyor configurations and HF transformers baselines, one workload.

Systems, each run once per load point on a fresh instance:
- `ConveyorSystem`: an `Engine` built from the shared model's weights (`Engine.from_model`: one
  load for every configuration) with its own options; timed workloads go through
  `conveyor.replay.replay`, fixed concurrency through a closed loop here. Per request, the
  engine's own timestamps (scheduled arrival, each token, finish); per step, its step trace,
  from which the batch-occupancy timeline is drawn.
- `HFStaticSystem`: HF transformers `generate` in padded batches of up to `batch_size` requests
  that have arrived (static batching: a batch runs until its longest member is done, nobody
  joins, and its responses return when `generate` does). Tokens are timed by a streamer.
- `HFContinuousSystem`: HF transformers continuous batching. `generate_batch` itself is used
  when it can run the workload as given (everything at t=0, one output length); otherwise the
  same manager `generate_batch` drives (`continuous_batching_context_manager`) takes each
  request at its arrival time with its own `max_new_tokens`, since `generate_batch` has neither
  arrivals nor per-request lengths. Per-token timestamps come from `record_timestamps`.
A system that fails (HF's continuous batching on an unsupported device, say) records the error
in the results instead of ending the benchmark.

Both HF systems take a `time_limit_s`: the run stops that long after it starts (static batching
at the end of a `generate` step, continuous batching where its scheduler stands then), and
each request counts the tokens it had. A cut request has no `end`, and one never started is
reported as cut with no tokens; `engine_stats` says how many of each. It is for a GPU loan too short for HF to finish a
mix conveyor runs in seconds: the rate over HF's first seconds, with the long tail where few
requests are left (or a static batch's padded rows) not reached, is if anything higher than its
rate over the whole run would be.

EOS is ignored everywhere, so every system produces exactly the workload's output lengths.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.bench.metrics import RequestTiming
from conveyor.bench.workload import BenchRequest, LoadPoint

if TYPE_CHECKING:
    from conveyor.engine import Engine
    from conveyor.outputs import RequestOutput
    from conveyor.sampling_params import SamplingParams

clock = time.perf_counter

# The seeds' comparison: static vs dynamic vs continuous batching, and the three prefill modes.
# Static and dynamic run whole prompts in the batch's first step ("mixed").
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "static": dict(batching="static", prefill_mode="mixed"),
    "dynamic": dict(batching="dynamic", prefill_mode="mixed", batch_timeout_ms=2000),
    "continuous": dict(batching="continuous"),
    "continuous+prefill_first": dict(batching="continuous", prefill_mode="prefill_first"),
    "continuous+mixed": dict(batching="continuous", prefill_mode="mixed"),
    "continuous+chunked": dict(batching="continuous", prefill_mode="chunked"),
}
SEEDS_COMPARISON = ("static", "dynamic", "continuous+prefill_first", "continuous+mixed", "continuous+chunked")
BASELINES = ("hf_static", "hf_continuous")


@dataclass(frozen=True)
class SystemSpec:
    """A named system: a conveyor configuration (engine options over the shared base options)
    or an HF baseline."""

    name: str
    kind: str  # "conveyor" | "hf_static" | "hf_continuous"
    options: dict[str, Any] = field(default_factory=dict)


def parse_config(text: str) -> SystemSpec:
    """`static`, `continuous+mixed`, `hf_static` (built-in names), or `[LABEL:]key=value,...`
    with engine option names (`chunked-512:prefill_mode=chunked,max_num_batched_tokens=512`)."""
    text = text.strip()
    if text in BUILTIN_CONFIGS:
        return SystemSpec(text, "conveyor", dict(BUILTIN_CONFIGS[text]))
    if text in BASELINES:
        return SystemSpec(text, text)
    label, sep, body = text.partition(":")
    if not sep:
        label, body = text, text
    if "=" not in body:
        known = ", ".join([*BUILTIN_CONFIGS, *BASELINES])
        raise ValueError(f"unknown configuration {text!r}: use one of {known}, or [LABEL:]key=value,...")
    options: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"configuration {text!r}: {item!r} is not key=value")
        key = key.strip().replace("-", "_")
        if key in BUILTIN_CONFIGS or key == "base":
            raise ValueError(f"configuration {text!r}: {key!r} is a name, not an option")
        options[key] = _value(value.strip())
    return SystemSpec(label, "conveyor", options)


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


@dataclass(slots=True)
class SystemRun:
    """One system at one load point."""

    timings: list[RequestTiming]
    duration_s: float
    engine_stats: dict[str, Any] | None = None
    occupancy: dict[str, Any] | None = None
    error: str | None = None


def failed_run(requests: Sequence[BenchRequest], error: str) -> SystemRun:
    return SystemRun([RequestTiming(r.index, 0.0, prompt_len=r.prompt_len, error=error) for r in requests], 1.0, error=error)


Progress = Callable[[int], Any]


def _timing_from_output(index: int, out: RequestOutput) -> RequestTiming:
    m = out.metrics
    return RequestTiming(
        index=index,
        start=m.arrival_time,
        output_len=len(out.outputs[0].token_ids),
        chunk_times=list(m.token_times),
        end=m.finished_time,
        prompt_len=len(out.prompt_token_ids),
        cached_tokens=out.num_cached_tokens,
    )


class _Counting:
    """The engine as `replay` sees it, counting finished requests for the progress bar."""

    def __init__(self, engine: Engine, progress: Progress | None) -> None:
        self._engine = engine
        self._progress = progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self) -> list[RequestOutput]:
        outs = self._engine.step()
        if self._progress is not None:
            done = sum(1 for o in outs if o.finished)
            if done:
                self._progress(done)
        return outs


class ConveyorSystem:
    """conveyor with one set of engine options; the weights are shared with `base`."""

    def __init__(self, spec: SystemSpec, base: Engine, base_options: dict[str, Any], batch_size: int = 16) -> None:
        from conveyor.config import EngineConfig

        self.spec = spec
        self.base = base
        self.options = {**base_options, **spec.options}
        if self.options.get("batching", "continuous") != "continuous":
            self.options.setdefault("max_batch_size", min(batch_size, self.options.get("max_num_seqs", 256)))
        self.config = EngineConfig.from_kwargs(**self.options)  # refuses bad options up front

    def _engine(self) -> Engine:
        from conveyor.engine import Engine
        from conveyor.sampling_params import SamplingParams

        # `runner.model` is how `Engine.from_model` documents sharing one load between engines.
        model = self.base.runner.model  # type: ignore[attr-defined]
        engine = Engine.from_model(self.config, model, self.base.tokenizer, getattr(self.base, "model_path", None))
        engine.add_request("bench-warmup", [min(100, engine.vocab_size // 4)] * 8, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.step_trace.clear()
        engine.finished_requests.clear()
        return engine

    def params_of(self, r: BenchRequest) -> SamplingParams:
        return bench_params(r)

    def run(self, requests: Sequence[BenchRequest], point: LoadPoint, progress: Progress | None = None) -> SystemRun:
        from conveyor.replay import TimedRequest, replay
        from conveyor.trace import trace_dict

        engine = self._engine()
        try:
            params = {r.index: self.params_of(r) for r in requests}
            t0 = engine.clock()
            if point.concurrency is not None:
                outs = _closed_loop(engine, requests, params, point.concurrency, progress)
            else:
                timed = [TimedRequest(r.arrival_s, _prompt(r), params[r.index], f"bench-{r.index}") for r in requests]
                results = replay(_Counting(engine, progress), timed)  # type: ignore[arg-type]
                outs = {r.index: o for r, o in zip(requests, results, strict=True)}
            timings = [_timing_from_output(i, outs[i]) for i in sorted(outs)]
            end = max((t.end for t in timings if t.end is not None), default=engine.clock())
            trace = trace_dict(engine)
            return SystemRun(timings, max(end - t0, 1e-9), engine_stats(trace["steps"]), occupancy_from_trace(trace))
        finally:
            del engine
            gc.collect()

    def close(self) -> None:
        pass


def bench_params(r: BenchRequest, max_tokens_factor: float = 1.0) -> SamplingParams:
    """A bench request's sampling: greedy, exactly its output length. With `max_tokens_factor`
    F > 1 (the simulator's `--max-tokens-factor`), `max_tokens` is F times the output length,
    as a client asks for more than an answer takes, and the request ends at its length on
    `SIM_STOP_TOKEN`, which the simulated runner samples there (`SimRunner`; `extra["sim_output_len"]`)."""
    from conveyor.sampling_params import SamplingParams

    if max_tokens_factor <= 1.0:
        return SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True, tenant=r.tenant)
    from conveyor.sim.engine import SIM_STOP_TOKEN

    return SamplingParams(max_tokens=math.ceil(r.output_len * max_tokens_factor), temperature=0.0, tenant=r.tenant,
                          stop_token_ids=(SIM_STOP_TOKEN,), extra={"sim_output_len": r.output_len})


def _prompt(r: BenchRequest) -> str | list[int]:
    return r.prompt if isinstance(r.prompt, str) else list(r.prompt)


def _closed_loop(
    engine: Engine,
    requests: Sequence[BenchRequest],
    params: dict[int, Any],
    concurrency: int,
    progress: Progress | None,
) -> dict[int, RequestOutput]:
    """Keep `concurrency` requests in flight; each is sent (arrives) when a seat frees up."""
    pending = list(requests)
    outs: dict[int, RequestOutput] = {}
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < concurrency:
            r = pending.pop(0)
            engine.add_request(f"bench-{r.index}", _prompt(r), params[r.index])
            in_flight += 1
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id.split("-")[1])] = out
                in_flight -= 1
                if progress is not None:
                    progress(1)
    return outs


def engine_stats(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch composition over a run, from the step trace."""
    if not steps:
        return {"steps": 0}
    n = len(steps)
    seqs = [s["num_seqs"] for s in steps]
    tokens = [s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps]
    kv = [s["kv_blocks_used"] for s in steps]
    return {
        "steps": n,
        "mean_batch": sum(seqs) / n,
        "max_batch": max(seqs),
        "mean_tokens_per_step": sum(tokens) / n,
        "mean_step_ms": 1e3 * sum(s["duration_s"] for s in steps) / n,
        "kv_blocks_max": max(kv),
        "kv_blocks_mean": sum(kv) / n,
        "preemptions": sum(s["num_preempted"] for s in steps),
        "max_waiting": max(s["num_waiting"] for s in steps),
    }


def occupancy_from_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Which request each step computed, as bars: [request index, first step, last step, 0] for
    every run of consecutive steps a request is in (a preempted request has several bars)."""
    by_seq = {r["seq_id"]: r["request_id"] for r in trace["requests"]}
    steps = trace["steps"]
    open_bars: dict[int, list[int]] = {}
    bars: list[list[int]] = []
    for i, step in enumerate(steps):
        ids = set(step["seq_ids"])
        for seq in [s for s in open_bars if s not in ids]:
            bars.append(open_bars.pop(seq))
        for seq in ids:
            if seq in open_bars:
                open_bars[seq][2] = i
            else:
                rid = str(by_seq.get(seq, ""))
                if rid.startswith("bench-") and rid[6:].isdigit():
                    open_bars[seq] = [int(rid[6:]), i, i, 0]
    bars.extend(open_bars.values())
    bars.sort(key=lambda b: (b[1], b[0]))
    t0 = steps[0]["start"] if steps else 0.0
    return {
        "num_steps": len(steps),
        "bars": bars,
        "step_start_s": [round(s["start"] - t0, 6) for s in steps],
    }


# -- HF transformers baselines -------------------------------------------------------------
def load_hf_model(model_path: str) -> Any:
    """The same weights in HF transformers, float32 (a GGUF is dequantized by transformers)."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.suffix.lower() == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def _pad_id(model: Any) -> int:
    cfg = model.config
    for v in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


def _token_ids(r: BenchRequest, tokenizer: Any) -> list[int]:
    if isinstance(r.prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer for the HF baselines")
        return list(tokenizer.encode(r.prompt))
    return list(r.prompt)


class _StepClock:
    """A generate() streamer that records when each step's tokens exist (put 0 is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(clock())

    def end(self) -> None:
        pass


def _limit_stats(limit: float | None, timings: list[RequestTiming], order: Sequence[BenchRequest],
                 t0: float) -> dict[str, Any]:
    """A run stopped at its time limit: how many requests it cut mid-answer and how many it never
    started; those join `timings` as cut too (no tokens, no end), so every request is reported."""
    seen = {t.index for t in timings}
    stats = {"time_limit_s": limit, "cut": sum(t.end is None for t in timings), "not_started": len(order) - len(seen)}
    timings.extend(RequestTiming(r.index, t0 + r.arrival_s, 0, [], None, r.prompt_len)
                   for r in order if r.index not in seen)
    return stats


class HFStaticSystem:
    """HF `generate` over padded batches of arrived requests; a batch runs to its longest output."""

    def __init__(self, spec: SystemSpec, model: Any, tokenizer: Any, batch_size: int,
                 time_limit_s: float | None = None) -> None:
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.time_limit_s = time_limit_s
        self.pad = _pad_id(model)

    def _generate(self, prompts: list[list[int]], new_tokens: int, max_time: float | None = None) -> list[float]:
        """The time each step's tokens existed; with `max_time`, `generate` stops at the first
        step end past that many seconds (fewer times than `new_tokens`)."""
        import torch

        width = max(len(p) for p in prompts)
        device = self.model.device
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        streamer = _StepClock()
        limit = {} if max_time is None else {"max_time": max(max_time, 0.0)}
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=self.pad, streamer=streamer, **limit,
            )
        return streamer.times[1:]

    def run(self, requests: Sequence[BenchRequest], point: LoadPoint, progress: Progress | None = None) -> SystemRun:
        self._generate([[self.pad + 1] * 4], 2)  # warm-up
        order = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        prompts = {r.index: _token_ids(r, self.tokenizer) for r in order}
        limit = min(self.batch_size, point.concurrency or self.batch_size)
        timings: list[RequestTiming] = []
        bars: list[list[int]] = []
        step_times: list[float] = []
        t0 = clock()
        deadline = None if self.time_limit_s is None else t0 + self.time_limit_s
        cut = False
        i = 0
        while i < len(order) and not cut:
            wait = t0 + order[i].arrival_s - clock()
            if deadline is not None and clock() + max(wait, 0.0) >= deadline:
                break
            if wait > 0:
                time.sleep(wait)
            now = clock() - t0
            batch = [order[i]]
            while i + len(batch) < len(order) and len(batch) < limit and order[i + len(batch)].arrival_s <= now:
                batch.append(order[i + len(batch)])
            i += len(batch)
            longest = max(r.output_len for r in batch)
            first_step = len(step_times)
            times = self._generate([prompts[r.index] for r in batch], longest,
                                   None if deadline is None else deadline - clock())
            end = clock()
            step_times.extend(times)
            cut = len(times) < longest  # the time limit stopped this batch
            for r in batch:
                start = t0 + r.arrival_s
                made = min(len(times), r.output_len)
                timings.append(RequestTiming(r.index, start, made, times[:made], end if made == r.output_len else None,
                                             len(prompts[r.index])))
                if made:
                    bars.append([r.index, first_step, first_step + made - 1, 0])
                if made < len(times):  # the seat stays taken, generating waste
                    bars.append([r.index, first_step + made, first_step + len(times) - 1, 1])
            if progress is not None:
                progress(len(batch))
        stats: dict[str, Any] = {"steps": len(step_times), "batch_size": self.batch_size}
        if deadline is None:
            duration = max(t.end for t in timings if t.end is not None) - t0
        else:
            duration = clock() - t0
            stats |= _limit_stats(self.time_limit_s, timings, order, t0)
        timings.sort(key=lambda t: t.index)
        occupancy = {"num_steps": len(step_times), "bars": bars, "step_start_s": [round(t - t0, 6) for t in step_times]}
        return SystemRun(timings, duration, stats, occupancy)

    def close(self) -> None:
        pass


class HFContinuousSystem:
    """HF transformers continuous batching (`generate_batch` and the manager behind it)."""

    def __init__(self, spec: SystemSpec, model: Any, tokenizer: Any, max_batch_tokens: int | None = None,
                 time_limit_s: float | None = None) -> None:
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.time_limit_s = time_limit_s

    def _configs(self, prompts: Sequence[list[int]], outputs: Sequence[int]) -> tuple[Any, Any]:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        page = 256
        blocks = sum(math.ceil((len(p) + o) / page) for p, o in zip(prompts, outputs, strict=True)) + 8
        gen = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1, pad_token_id=_pad_id(self.model))
        cb = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=self.max_batch_tokens)
        return gen, cb

    def run(self, requests: Sequence[BenchRequest], point: LoadPoint, progress: Progress | None = None) -> SystemRun:
        prompts = {r.index: _token_ids(r, self.tokenizer) for r in requests}
        self._warmup()
        same_length = len({r.output_len for r in requests}) == 1
        if point.concurrency is None and same_length and all(r.arrival_s == 0 for r in requests) and self.time_limit_s is None:
            return self._generate_batch(requests, prompts, progress)
        return self._manager(requests, prompts, point.concurrency, progress)

    def _warmup(self) -> None:
        gen, cb = self._configs([[5] * 4], [2])
        self.model.generate_batch(inputs=[[5] * 4], generation_config=gen, continuous_batching_config=cb)

    def _generate_batch(
        self, requests: Sequence[BenchRequest], prompts: dict[int, list[int]], progress: Progress | None
    ) -> SystemRun:
        order = list(requests)
        gen, cb = self._configs([prompts[r.index] for r in order], [r.output_len for r in order])
        t0 = clock()
        results = self.model.generate_batch(
            inputs=[prompts[r.index] for r in order], generation_config=gen,
            continuous_batching_config=cb, record_timestamps=True,
        )
        if progress is not None:
            progress(len(order))
        outs = list(results.values())
        if len(outs) != len(order):
            raise RuntimeError(f"generate_batch returned {len(outs)} of {len(order)} results")
        # Results come back in input order (generate_batch re-orders them).
        timings = [self._timing(r, out, t0) for r, out in zip(order, outs, strict=True)]
        return self._finish(timings, t0)

    def _manager(
        self,
        requests: Sequence[BenchRequest],
        prompts: dict[int, list[int]],
        concurrency: int | None,
        progress: Progress | None,
    ) -> SystemRun:
        order = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        gen, cb = self._configs([prompts[r.index] for r in order], [r.output_len for r in order])
        by_id = {f"bench-{r.index}": r for r in order}
        timings: dict[int, RequestTiming] = {}
        sent: dict[int, float] = {}
        with self.model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, warmup=False
        ) as manager:
            t0 = clock()
            i = 0
            while len(timings) < len(order):
                if self.time_limit_s is not None and clock() >= t0 + self.time_limit_s:
                    return self._cut(manager, order, by_id, sent, timings, t0, progress)
                in_flight = i - len(timings)
                room = concurrency is None or in_flight < concurrency
                if i < len(order) and room and (concurrency is not None or clock() >= t0 + order[i].arrival_s):
                    r = order[i]
                    sent[r.index] = clock() if concurrency is not None else t0 + r.arrival_s
                    manager.add_request(prompts[r.index], request_id=f"bench-{r.index}", max_new_tokens=r.output_len, record_timestamps=True)
                    i += 1
                    continue
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped unexpectedly")
                wait = 0.05
                if i < len(order) and concurrency is None:
                    wait = max(0.0, min(wait, t0 + order[i].arrival_s - clock()))
                result = manager.get_result(timeout=wait) if wait > 0 else manager.get_result(timeout=0.001)
                if result is not None:
                    self._take(result, by_id, sent, timings, progress)
        return self._finish([timings[k] for k in sorted(timings)], t0)

    def _take(self, result: Any, by_id: dict[str, BenchRequest], sent: dict[int, float],
              timings: dict[int, RequestTiming], progress: Progress | None) -> None:
        """A result from the manager's queue: a finished request of this run gets its timing."""
        if result.is_finished() and result.request_id in by_id:
            r = by_id[result.request_id]
            timings[r.index] = self._timing(r, result, sent[r.index])
            if progress is not None:
                progress(1)

    def _cut(self, manager: Any, order: Sequence[BenchRequest], by_id: dict[str, BenchRequest],
             sent: dict[int, float], timings: dict[int, RequestTiming], t0: float,
             progress: Progress | None) -> SystemRun:
        """The run stopped at its time limit: each request sent and unfinished counts the tokens its
        state in HF's scheduler holds now (a read of the manager's internals, the same in
        transformers 5.17 and 5.24), then the finished results still queued replace theirs,
        and the manager stops without finishing the rest."""
        now = clock()
        processor = getattr(manager, "batch_processor", None)
        active = getattr(getattr(processor, "scheduler", None), "active_requests", None)
        if active is None:
            raise RuntimeError("this transformers' continuous batching does not show its running requests: "
                               "no time limit for HF continuous batching")
        for r in order:
            if r.index in sent and r.index not in timings:
                state = active.get(f"bench-{r.index}")
                made = state.generated_len() if state is not None else 0
                stamps = list(getattr(state, "timestamps", None) or [])[:made]
                timings[r.index] = RequestTiming(r.index, sent[r.index], made, stamps, None, r.prompt_len)
        while (result := manager.get_result(timeout=0)) is not None:
            self._take(result, by_id, sent, timings, progress)
        manager.stop(block=True, timeout=30, hard_stop=True)
        cut = list(timings.values())
        stats = _limit_stats(self.time_limit_s, cut, order, t0)
        return SystemRun(sorted(cut, key=lambda t: t.index), now - t0, stats)

    def _timing(self, r: BenchRequest, out: Any, start: float) -> RequestTiming:
        """HF's timestamps and `start` are both on time.perf_counter."""
        stamps = list(out.timestamps or [])
        end = out.lifespan[1] if out.lifespan and out.lifespan[1] > 0 else (stamps[-1] if stamps else None)
        timing = RequestTiming(r.index, start, len(out.generated_tokens), stamps, end, r.prompt_len)
        if out.error is not None:
            timing.error = str(out.error)
        return timing

    def _finish(self, timings: list[RequestTiming], t0: float) -> SystemRun:
        ends = [t.end for t in timings if t.end is not None]
        return SystemRun(timings, max(max(ends, default=t0) - t0, 1e-9))

    def close(self) -> None:
        pass


@dataclass
class OfflineSystems:
    """Everything an offline comparison loads once: the base engine and (lazily) the HF model."""

    base: Engine
    base_options: dict[str, Any]
    batch_size: int = 16  # static/dynamic batches, conveyor's and HF's alike
    hf_time_limit_s: float | None = None  # the HF baselines stop this long into a point's run
    _hf_model: Any = None

    @classmethod
    def load(cls, base_options: dict[str, Any], batch_size: int = 16,
             hf_time_limit_s: float | None = None) -> OfflineSystems:
        from conveyor.config import EngineConfig
        from conveyor.engine import Engine

        if hf_time_limit_s is not None and not hf_time_limit_s > 0:
            raise ValueError(f"the HF baselines' time limit must be > 0 seconds, not {hf_time_limit_s}")
        base = Engine.from_config(EngineConfig.from_kwargs(**base_options))
        return cls(base, base_options, batch_size, hf_time_limit_s)

    @property
    def vocab_size(self) -> int:
        return int(self.base.vocab_size)

    @property
    def tokenizer(self) -> Any:
        return self.base.tokenizer

    def hf_model(self) -> Any:
        if self._hf_model is None:
            path = getattr(self.base, "model_path", None)
            if path is None:
                raise RuntimeError("the engine does not say which model file it loaded")
            self._hf_model = load_hf_model(path)
        return self._hf_model

    def build(self, spec: SystemSpec) -> ConveyorSystem | HFStaticSystem | HFContinuousSystem:
        if spec.kind == "conveyor":
            return ConveyorSystem(spec, self.base, self.base_options, self.batch_size)
        limit = self.hf_time_limit_s
        if spec.kind == "hf_static":
            return HFStaticSystem(spec, self.hf_model(), self.tokenizer, self.batch_size, time_limit_s=limit)
        if spec.kind == "hf_continuous":
            budget = self.base_options.get("max_num_batched_tokens")
            return HFContinuousSystem(spec, self.hf_model(), self.tokenizer, budget, time_limit_s=limit)
        raise ValueError(f"unknown system kind {spec.kind!r}")

    def options_of(self, spec: SystemSpec) -> dict[str, Any]:
        """The options a system really runs with, for the report."""
        if spec.kind == "conveyor":
            return dataclasses.asdict(ConveyorSystem(spec, self.base, self.base_options, self.batch_size).config.scheduler)
        limit = {} if self.hf_time_limit_s is None else {"time_limit_s": self.hf_time_limit_s}
        if spec.kind == "hf_static":
            return {"batch_size": self.batch_size, **limit}
        return {"max_batch_tokens": self.base_options.get("max_num_batched_tokens"), **limit}
