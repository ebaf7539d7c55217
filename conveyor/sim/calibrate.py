"""`conveyor calibrate`: measure this machine's real runner and fit the cost model to it.

1. Peaks, measured on the spot: fp32 GEMM FLOP/s (a large matmul) and memory read bandwidth
   (a pass over 1 GiB). They make the `cpu` Hardware.
2. The real `ModelRunner` runs a grid of batch shapes (decode batches at short and long
   contexts, whole prompts, prompt chunks over a context, decode + prefill mixes); each shape's
   median time is one sample. Then the engine serves a short mixed workload at a few
   concurrencies, and every step it computes is one more sample: the shapes a server really
   runs, a few hundred of them, which keep the fit from trading overheads against efficiencies.
3. The fit: coordinate descent over the six efficiencies (mfu, attn_mfu, mbu, kv_mbu,
   gemv_mbu, gemv_mfu), and for each candidate the three overheads (per step, per sequence, per token)
   by non-negative least squares, all on relative error. The best fit is saved as JSON and `conveyor simulate --hardware cpu` uses it.

The overheads absorb this runner's Python work per layer, so a calibration holds for the model
it measured (by default SmolLM2, the model conveyor serves here); `simulate` says so when the
model differs.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from conveyor.sim.cost import CostParams, RooflineCostModel, StepShape
from conveyor.sim.hardware import Hardware
from conveyor.sim.models import ModelShape

logger = logging.getLogger("conveyor")

Shape = list[tuple[int, int]]  # (new tokens, start position) per sequence
# The fit keeps every efficiency at or below this. Allowing 1.5 (CostParams accepts it, as the
# peaks are read once on a machine whose bandwidth drifts) was tried: the fit then traded
# efficiencies of 1.5 against overheads of tens of ms, with no better prediction
# (docs/simulation.md, run 11).
MAX_EFFICIENCY = 1.0
PAUSE_S = 1e-3  # before each timed grid step: about what a server's host work leaves between steps
IDLE_S = 0.5  # before the "after idle" repeats of the prompt shapes
AFTER_IDLE = "after idle"
SERVED_CLOSED = "served c="  # the closed-loop part of the served workload: "served c=4"
REWEIGHT = True
# `fit` weighs each sample by its kind's count (`fit_kind`) to the power -BALANCE: a served
# calibration brings thousands of lone decodes and a few hundred prompt-bearing steps, and
# with equal weights (0) the fit traded the prompts' prices (which set TTFT) for a fraction
# of a percent on the decodes; weighting every kind alike (1) priced TPOT high. Chosen on
# saved runs 30-37, checked on new ones (docs/simulation.md, tenth session).
BALANCE = 0.5


def default_grid() -> list[tuple[str, Shape]]:
    """Batch shapes covering what a serving run does: decode batches, prompts, chunks, mixes."""
    grid: list[tuple[str, Shape]] = []
    for b in (1, 2, 4, 8, 12, 16, 24, 32, 64):
        for ctx in (64, 512):
            grid.append((f"decode b={b} ctx={ctx}", [(1, ctx - 1)] * b))
    for n in (16, 64, 128, 256, 512):
        grid.append((f"prefill {n}", [(n, 0)]))
    grid.append(("prefill 4x128", [(128, 0)] * 4))
    grid.append(("chunk 256 at 512", [(256, 512)]))
    for b, n in ((8, 64), (16, 128), (32, 256)):
        grid.append((f"decode {b} ctx=256 + prefill {n}", [(1, 255)] * b + [(n, 0)]))
    return grid


def grid_blocks(block_size: int, grid: Sequence[tuple[str, Shape]] | None = None) -> int:
    """KV blocks the largest shape of `grid` (default: `default_grid()`) takes."""
    return max(sum(-(-(start + n) // block_size) for n, start in shape)
               for _, shape in (default_grid() if grid is None else grid))


def runner_skinny_rows() -> tuple[int, int]:
    """(rows up to which this machine's runner takes the skinny kernel, rows per pass); (1, 1)
    without the kernel: only the one-row path of torch's matmul."""
    from conveyor import kernels

    if kernels.skinny_linear() is None:
        return 1, 1
    return kernels.SKINNY_MAX_ROWS, kernels.SKINNY_PASS_ROWS


def runner_fused_rows(model: Any) -> int:
    """Rows up to which the runner's `model` runs a decode-only step fused (0: never)."""
    fused = getattr(model, "fused_decode", None)
    return 0 if fused is None else fused.max_rows


def default_calibration_path() -> Path:
    root = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
    return root / "calibration" / "cpu.json"


# -- measuring ------------------------------------------------------------------------------
def measure_peaks(threads: int | None = None) -> tuple[float, float]:
    """(fp32 GEMM FLOP/s, memory read bytes/s): the best of a few runs each."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(8))
    flops = 2 * n**3 / best
    x = torch.ones((1 << 30) // 4)
    x.sum()
    read = min(_timed(x.sum) for _ in range(5))
    return flops, x.numel() * 4 / read


def best_peaks(readings: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The best FLOP/s and the best bandwidth of several `measure_peaks` readings (taken before
    and after the shapes are timed). On a shared machine a busy moment only lowers a reading;
    a peak read low binds the fit's efficiencies at their ceiling of 1, and the fit then pushes
    the rest of the error into the wrong terms."""
    return max(f for f, _ in readings), max(b for _, b in readings)


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_hardware(flops: float, bandwidth: float, threads: int) -> Hardware:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 16 << 30
    return Hardware(
        "cpu", f"{cpu_name()}, {threads} threads, float32", flops, bandwidth, memory,
        host_bandwidth=bandwidth / 2,  # swapping is a copy: read and write the same memory
        dtype_bytes=4, is_gpu=False,
        source=f"measured by `conveyor calibrate` on {time.strftime('%Y-%m-%d')}",
    )


def measure_runner(engine: Any, grid: Sequence[tuple[str, Shape]], repeats: int = 5,
                   progress: Callable[[str], Any] | None = None,
                   between: Callable[[], Any] | None = None,
                   pause_s: float = PAUSE_S, idle_s: float = IDLE_S) -> list[tuple[str, StepShape, float]]:
    """Time `engine.runner.execute` over each shape of the grid: `repeats` rounds over the whole
    grid, each shape once a round, and each shape's median over the rounds.

    This VM's memory bandwidth switches between about 30 and 55 GB/s, holding each for seconds
    to minutes, and a batch-1 decode step between about 19.5 and 14.5 ms with it
    (docs/simulation.md). Repeats timed back to back catch one level per shape; rounds spread
    every shape over the whole calibration, so that the fit sees each at the machine's usual mix
    of the two.

    Each step is timed after a pause of `pause_s`, as a server's steps come after its host
    work: on this VM a step run straight after another took 10% longer than the same step in
    a served run (`benchmarks/step_replay.py`). The shapes that begin a busy period (a prompt
    alone) are timed a second time after `idle_s` of sleep, labelled "after idle": a server
    meets them after waiting for requests, and they then took 10-25% longer."""
    from conveyor.core.scheduler import ScheduledSequence, SchedulerOutput
    from conveyor.sampling_params import SamplingParams

    runner = engine.runner
    bs = engine.config.cache.block_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.vocab_size
    steps = []
    for label, shape in grid:
        items, next_block = [], 0
        for i, (n, start) in enumerate(shape):
            total = start + n
            nblocks = -(-total // bs)
            table = list(range(next_block, next_block + nblocks))
            next_block += nblocks
            ids = [(7 * i + 13 * k) % (vocab - 200) + 100 for k in range(total)]
            items.append(ScheduledSequence(i, ids[start:], start, table, True, params, ids, total))
        if next_block > runner.num_blocks:
            raise ValueError(f"calibration shape {label!r} needs {next_block} KV blocks; the cache has {runner.num_blocks}")
        steps.append((label, SchedulerOutput(0, items)))
    if idle_s > 0:
        steps += [(f"{label} {AFTER_IDLE}", out) for label, out in steps
                  if all(len(it.token_ids) > 1 for it in out.scheduled)]
    times: dict[str, list[float]] = {label: [] for label, _ in steps}
    for _, out in steps:
        runner.execute(out)  # warm-up
    for rnd in range(repeats):
        for label, out in steps:
            if between is not None:  # untimed work between two timed steps
                between()
            time.sleep(idle_s if label.endswith(AFTER_IDLE) else pause_s)
            times[label].append(_timed(partial(runner.execute, out)))
        if progress is not None:
            progress(f"round {rnd + 1}/{repeats} over {len(steps)} shapes")
    samples = []
    for label, out in steps:
        step_shape = StepShape.of(out)
        step_shape.idle_before_s = idle_s if label.endswith(AFTER_IDLE) else pause_s
        samples.append((label, step_shape, statistics.median(times[label])))
    if progress is not None:
        for label, _, t in samples:
            progress(f"{label}: {t * 1e3:.1f} ms")
    return samples


def measure_served(engine: Any, concurrencies: Sequence[int] = (1, 4, 12), seed: int = 0,
                   progress: Callable[[str], Any] | None = None, rounds: int = 3,
                   between: Callable[[], Any] | None = None, open_rate: float = 0.5,
                   open_requests: int = 8) -> list[tuple[str, StepShape, float]]:
    """Serve a short mixed workload and time every step the runner computes: the shapes a
    server really runs, a few hundred samples beside the grid's thirty (prompts 16-384 tokens,
    outputs 8-48). Each of `rounds` rounds serves `level + 1` requests in a closed loop at each
    concurrency, then `open_requests` arriving as a Poisson stream at `open_rate` req/s, so
    that the engine idles between them as a server does: the steps after an idle period are
    the samples `fit` takes `idle_cost_s` from. The rounds spread each part over the whole
    calibration (see `measure_runner`) rather than a few seconds of it."""
    import random

    from conveyor.sampling_params import SamplingParams

    rng = random.Random(seed)
    runner = engine.runner
    samples: list[tuple[str, StepShape, float]] = []
    original = runner.execute
    label = ""
    last_end: list[float | None] = [None]
    probing = [0.0]  # seconds `between` took since the last timed step: not the engine's time
    probe = between

    def timed_between() -> None:
        t = time.perf_counter()
        assert probe is not None
        probe()
        probing[0] += time.perf_counter() - t

    if between is not None:
        between = timed_between

    def timed_execute(out: Any) -> Any:
        t = time.perf_counter()
        result = original(out)
        end = time.perf_counter()
        if out.scheduled:
            shape = StepShape.of(out)
            shape.idle_before_s = 0.0 if last_end[0] is None else max(0.0, t - last_end[0] - probing[0])
            samples.append((label, shape, end - t))
            last_end[0] = end
        probing[0] = 0.0
        return result

    def request() -> tuple[list[int], SamplingParams]:
        prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(16, 384))]
        return prompt, SamplingParams(max_tokens=rng.randint(8, 48), temperature=0.0, ignore_eos=True)

    runner.execute = timed_execute
    try:
        vocab = engine.vocab_size
        n = 0
        for _ in range(rounds):
            for level in concurrencies:
                label = f"{SERVED_CLOSED}{level}"
                pending = [request() for _ in range(level + 1)]
                in_flight = 0
                while pending or in_flight:
                    while pending and in_flight < level:
                        engine.add_request(f"calibrate-{n}", *pending.pop())
                        n += 1
                        in_flight += 1
                    if between is not None:
                        between()
                    in_flight -= sum(1 for o in engine.step() if o.finished)
                if progress is not None:
                    progress(f"served at concurrency {level}: {len(samples)} steps so far")
            label, last_end[0] = f"served open {open_rate:g}/s", None
            arrivals = list(itertools.accumulate(rng.expovariate(open_rate) for _ in range(open_requests)))
            start, i = time.perf_counter(), 0
            while i < len(arrivals) or engine.has_unfinished_requests():
                now = time.perf_counter()
                while i < len(arrivals) and start + arrivals[i] <= now:
                    engine.add_request(f"calibrate-{n}", *request())
                    n += 1
                    i += 1
                if engine.has_unfinished_requests():
                    if between is not None:
                        between()
                    engine.step()
                elif i < len(arrivals):
                    time.sleep(start + arrivals[i] - now)
            last_end[0] = None
    finally:
        del runner.execute  # back to the class's method
    return samples


def collect(engine: Any, repeats: int = 5, served: bool = True, seed: int = 0,
            progress: Callable[[str], Any] | None = None,
            between: Callable[[], Any] | None = None, served_rounds: int = 3) -> list[tuple[str, StepShape, float]]:
    """Every calibration sample of one round: `repeats` rounds over the shape grid, then (unless
    `served` is off) `served_rounds` rounds of a short served workload. `between` runs, untimed,
    before every timed step (a benchmark reads the machine's bandwidth level there)."""
    samples = measure_runner(engine, default_grid(), repeats, progress, between)
    if served:
        samples += measure_served(engine, seed=seed, progress=progress, rounds=served_rounds, between=between)
    return samples


# -- fitting --------------------------------------------------------------------------------
@dataclass
class Fit:
    params: CostParams
    rel_errors: list[float]

    @property
    def median_abs_rel_error(self) -> float:
        return statistics.median(abs(e) for e in self.rel_errors)

    @property
    def max_abs_rel_error(self) -> float:
        return max(abs(e) for e in self.rel_errors)


def step_kind(shape: StepShape) -> str:
    """decode (decodes only), prompt (prompt tokens only) or mixed."""
    if shape.decode_seqs == shape.num_seqs:
        return "decode"
    return "prompt" if shape.decode_seqs == 0 else "mixed"


def token_band(num_tokens: int) -> int:
    """The first token count of a step's 64-token band (0, 64, ..., 512 for 512 and more)."""
    return min(num_tokens // 64, 8) * 64


def fit_kind(shape: StepShape) -> str:
    """The finer kinds `fit` balances: decodes by their count (1, 2, 3, 4, 5-8, 9 or more),
    prompt-bearing steps by `step_kind` and `token_band`."""
    kind = step_kind(shape)
    if kind == "decode":
        n = shape.num_seqs
        return f"decode x{n}" if n <= 4 else "decode x5-8" if n <= 8 else "decode x9+"
    return f"{kind} {token_band(shape.num_tokens)}+"


def fit(hardware: Hardware, model: ModelShape, samples: Sequence[tuple[str, StepShape, float]],
        block_size: int = 16, sweeps: int = 10, skinny: tuple[int, int] = (1, 1), fused_rows: int = 0,
        reweight: bool = REWEIGHT, balance: float = BALANCE, gemm_overhead: bool = True) -> Fit:
    """The six efficiencies by coordinate descent over a log grid; for each candidate, the
    overheads (per step, per sequence, per token, per step the fused decode does not take, and
    with `gemm_overhead` per step of more than the skinny rows) by non-negative least squares;
    everything on relative error, each sample weighted by its `fit_kind`'s count to the power
    -`balance` (0: all alike; 1: every kind alike); efficiencies up to MAX_EFFICIENCY. With
    `reweight`, a second pass measures the error relative to the first fit's price instead of
    the measured time (see there). The samples that followed an idle period
    (`idle_threshold_s` or more) are left out of that fit: `idle_cost_s` is the median of their
    times less the fitted price (at least 0), a fixed wake-up cost. (Before the ninth session
    it was `idle_factor`, a multiple of the price; the probe after idle read a cost that does
    not grow with the step, docs/simulation.md.)"""
    import numpy as np

    threshold = CostParams.idle_threshold_s
    everything = samples
    cold = [(s, t) for _, s, t in samples if s.idle_before_s >= threshold]
    samples = [x for x in samples if x[1].idle_before_s < threshold]
    shapes = [s for _, s, _ in samples]
    y = np.array([t for _, _, t in samples])
    skinny_rows, pass_rows = skinny
    one = CostParams(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, skinny_rows, pass_rows, 0.0, 0.0, 0.0, fused_rows, 0.0)
    base = RooflineCostModel(hardware, model, one, hardware.dtype_bytes, block_size)
    # The overheads' columns: per step, sequence and token; per step the fused decode does not
    # take (with a fused path); per step of the matrix path (with a skinny one).
    names = ["step_overhead_s", "seq_overhead_s", "token_overhead_s"]
    columns = [[1.0] * len(shapes), [s.num_seqs for s in shapes], [s.num_tokens for s in shapes]]
    if fused_rows:
        names.append("unfused_overhead_s")
        columns.append([0.0 if base.fused(s) else 1.0 for s in shapes])
    if skinny_rows > 1 and gemm_overhead:
        names.append("gemm_overhead_s")
        columns.append([float(base.matrix_path(s)) for s in shapes])
    X = np.array(columns, dtype=float).T
    k = X.shape[1]
    # Per-sample seconds of each part at efficiency 1; the fit divides them by efficiencies.
    col = lambda f: np.array([f(s) for s in shapes], dtype=float)  # noqa: E731
    lin_c = col(lambda s: base._lin_flop_s * s.num_tokens)
    lin_m = col(lambda s: base._lin_mem_s)
    lin_1 = col(lambda s: s.num_tokens <= skinny_rows)
    lin_g = col(lambda s: base._lin_gemv_s * -(-s.num_tokens // pass_rows))  # skinny passes
    lin_gc = col(lambda s: base._lin_gemv_flop_s * s.num_tokens)
    head_c = col(lambda s: base._head_flop_s * s.num_sampled)
    head_m = col(lambda s: base._head_mem_s if s.num_sampled else 0.0)
    head_1 = col(lambda s: 0 < s.num_sampled <= skinny_rows)
    head_g = col(lambda s: base._head_gemv_s * -(-s.num_sampled // pass_rows))
    head_gc = col(lambda s: base._head_gemv_flop_s * s.num_sampled)
    attn_c = col(lambda s: base._attn_prefill_flop_s * s.prefill_pairs)
    attn_m = col(lambda s: base._kv_mem_s * s.prefill_context)
    dec_c = col(lambda s: base._attn_flop_s * s.decode_context)
    dec_m = col(lambda s: base._kv_mem_s * s.decode_context)

    def roofline(e: Sequence[float]) -> np.ndarray:
        mfu, attn, mbu, kv, gemv, gemv_f = e
        lin = np.where(lin_1 > 0, np.maximum(lin_gc / gemv_f, lin_g / gemv), np.maximum(lin_c / mfu, lin_m / mbu))
        head = np.where(head_1 > 0, np.maximum(head_gc / gemv_f, head_g / gemv), np.maximum(head_c / mfu, head_m / mbu))
        return lin + head + np.maximum(attn_c / attn, attn_m / kv) + np.maximum(dec_c / attn, dec_m / kv)

    def evaluate(e: Sequence[float], w: np.ndarray) -> tuple[float, np.ndarray]:
        """The loss and the overheads for efficiencies `e`, each sample's error weighted by `w`."""
        Xw = X * w[:, None]
        target = (y - roofline(e)) * w
        best_loss, best_c = float("inf"), np.zeros(k)
        for mask in itertools.product((0, 1), repeat=k):  # NNLS by enumerating active sets
            cols = [i for i in range(k) if mask[i]]
            c = np.zeros(k)
            if cols:
                sol = np.linalg.lstsq(Xw[:, cols], target, rcond=None)[0]
                if (sol < 0).any():
                    continue
                c[cols] = sol
            loss = float(((target - Xw @ c) ** 2).sum())
            if loss < best_loss:
                best_loss, best_c = loss, c
        return best_loss, best_c

    def search(e: list[float], sweeps: int, w: np.ndarray) -> list[float]:
        loss = evaluate(e, w)[0]
        grid = np.geomspace(0.002, MAX_EFFICIENCY, 67)
        for _ in range(sweeps):
            before = loss
            for i in range(6):
                for v in grid:
                    trial = [*e[:i], float(v), *e[i + 1:]]
                    trial_loss = evaluate(trial, w)[0]
                    if trial_loss < loss:
                        loss, e = trial_loss, trial
            if loss >= before * (1 - 1e-6):
                break
        # Then a pattern search: multiplicative moves of one or two efficiencies at a time (the
        # pairs follow the valleys where one part's time trades against another's), shrinking.
        moves = [(i, j, si, sj) for i in range(6) for j in range(i, 6) for si in (1, -1) for sj in (1, -1)
                 if i != j or si == sj]
        for factor in (1.5, 1.2, 1.1, 1.05, 1.02, 1.01, 1.005):
            improved = True
            while improved:
                improved = False
                for i, j, si, sj in moves:
                    trial = list(e)
                    trial[i] *= factor**si
                    if j != i:
                        trial[j] *= factor**sj
                    if max(trial) > MAX_EFFICIENCY:
                        continue
                    trial_loss = evaluate(trial, w)[0]
                    if trial_loss < loss * (1 - 1e-9):
                        loss, e, improved = trial_loss, trial, True
        return e

    counts = collections.Counter(fit_kind(s) for s in shapes)
    kind_weight = np.array([counts[fit_kind(s)] ** -balance for s in shapes])
    w = kind_weight / y  # relative error
    e = search([0.5] * 6, sweeps, w)
    if reweight:
        # Relative error against the measured time favours the samples that happened to run
        # fast: on noisy steps the fit lands below their mean. Against the first fit's price
        # (no noise in it) each shape's fit is its samples' mean.
        _, c = evaluate(e, w)
        w = kind_weight / (roofline(e) + X @ c)
        e = search(e, 1, w)
    _, c = evaluate(e, w)
    params = CostParams(e[0], e[1], e[2], e[3], e[4], e[5], skinny_rows, pass_rows, fused_rows=fused_rows,
                        **{name: float(v) for name, v in zip(names, c, strict=True)})
    if cold:  # how much more than the fitted price the steps after an idle period took
        warm = RooflineCostModel(hardware, model, params, hardware.dtype_bytes, block_size)
        extra = [t - warm.runner_time(dataclasses.replace(s, idle_before_s=0.0)) for s, t in cold]
        params = dataclasses.replace(params, idle_cost_s=max(0.0, statistics.median(extra)))
    # The host's time between two steps of the closed-loop served part (nothing waits there
    # for an arrival): the engine's own work, which the runner's step times leave out.
    gaps = [s.idle_before_s for label, s, _ in everything
            if label.startswith(SERVED_CLOSED) and 0 < s.idle_before_s < threshold]
    if gaps:
        params = dataclasses.replace(params, host_s=statistics.mean(gaps))
    fitted = RooflineCostModel(hardware, model, params, hardware.dtype_bytes, block_size)
    errors = [(fitted.runner_time(s) - t) / t for _, s, t in everything]
    return Fit(params, errors)


# -- saving and loading ---------------------------------------------------------------------
def save(path: Path, hardware: Hardware, model: ModelShape, model_path: str | None, fit_: Fit,
         samples: Sequence[tuple[str, StepShape, float]], block_size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "hardware": asdict(hardware),
        "params": fit_.params.to_dict(),
        "model": asdict(model),
        "model_path": model_path,
        "block_size": block_size,
        "fit": {"median_abs_rel_error": fit_.median_abs_rel_error, "max_abs_rel_error": fit_.max_abs_rel_error},
        "samples": [
            {"label": label, "shape": asdict(shape), "measured_s": t, "rel_error": e}
            for (label, shape, t), e in zip(samples, fit_.rel_errors, strict=True)
        ],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


@dataclass(frozen=True)
class Calibration:
    hardware: Hardware
    params: CostParams
    model: ModelShape
    path: Path


def load(path: Path | None = None) -> Calibration:
    path = path or default_calibration_path()
    if not path.is_file():
        raise ValueError(f"no calibration at {path}: run `conveyor calibrate` first (about a minute)")
    try:
        data = json.loads(path.read_text())
        hw = data["hardware"]
        model = data["model"]
        calibration = Calibration(
            Hardware(**{**hw, "memory_bytes": int(hw["memory_bytes"])}),
            CostParams.from_dict(data["params"]),
            ModelShape(**{**model, "eos_token_ids": tuple(model.get("eos_token_ids", ()))}),
            path,
        )
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a conveyor calibration ({e}); run `conveyor calibrate` again") from None
    fitted, runner = (calibration.params.skinny_rows, calibration.params.skinny_pass_rows), runner_skinny_rows()
    if fitted != runner:
        logger.warning("%s was fitted when the runner's skinny kernel took up to %d rows (%d a pass); this "
                       "runner's takes up to %d (%d a pass): the steps in between are priced on the other path "
                       "until `conveyor calibrate` runs again", path, *fitted, *runner)
    return calibration
