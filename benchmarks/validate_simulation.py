"""Does the simulator predict this machine? Calibrate, serve a mixed workload for real, simulate
the same workload on the calibrated cost model, and compare throughput and p50 TTFT / TPOT.

    python benchmarks/validate_simulation.py                      # calibrate now, then compare
    python benchmarks/validate_simulation.py --calibration FILE   # reuse a saved calibration
    python benchmarks/validate_simulation.py --request-rate 0.5,1 --num-requests 32
    python benchmarks/validate_simulation.py --runs 3 --repeats 3   # rounds of calibrate + measure

The measured run is `conveyor bench offline` (SmolLM2, real time, Poisson arrivals); the
simulated one is `conveyor simulate --hardware cpu`, with the same workload seed. Calibrating in
the same process just before measuring keeps the two under the same machine conditions; with
`--runs N`, calibration and measurement alternate N times (ABBA), the fit pools every round's
samples and the measured figures pool every round's requests (a p50 over N x num_requests
requests; the median of the rounds' own figures is printed beside it): this machine's speed
drifts by 10-20% between minutes.

With `--slices S`, each round goes in S slices, and the workload with it: its requests, in
arrival order, are cut into S consecutive pieces (each one's arrivals start at 0), and every
slice calibrates a short part (a round over the grid, one round of the served workload) next
to one piece's measured run, alternating which comes first. Calibration then samples the
machine within a minute of each stretch it prices, not only in a block minutes before or
after. The simulation serves the same pieces, one after another, and pools them as the
measured runs are pooled.

Besides the calibrated simulation (`fitted`, and `level-matched` with `--track-level`) it
simulates once more on a cost model fitted to the measured runs' own steps (`measured steps`):
no calibration error is left there, so what that row misses is the simulator's (its
scheduler, its step-price formula, its idle model), and the gap between that row and
`fitted` is the calibration's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from conveyor.bench.metrics import summarize
from conveyor.bench.offline import ConveyorSystem, OfflineSystems, SystemSpec
from conveyor.bench.workload import LengthDist, at_load, parse_sweep, synthetic_requests
from conveyor.sim import calibrate
from conveyor.sim.commands import SimSystem
from conveyor.sim.cost import RooflineCostModel, StepShape
from conveyor.sim.models import ModelShape

METRICS = {  # name -> its value in a `summarize` result
    "output tok/s": lambda x: x["output_throughput"],
    "TTFT p50 (ms)": lambda x: x["ttft_s"]["p50"] * 1e3,
    "TPOT p50 (ms)": lambda x: x["tpot_s"]["p50"] * 1e3,
    "TTFT p99 (ms)": lambda x: x["ttft_s"]["p99"] * 1e3,
    "TPOT p99 (ms)": lambda x: x["tpot_s"]["p99"] * 1e3,
}


class LevelProbe:
    """The machine's speed over a run, read at most once a second just before a runner step:
    a 128 MB read (the memory bandwidth: the fifth session's VM switched between two levels
    for seconds to minutes) and a 256 x 576 x 1536 float32 matmul (arithmetic, which prompt
    steps are bound by). About 5 ms a second, 0.5% of the run."""

    def __init__(self) -> None:
        import torch

        self.buffer = torch.ones((128 << 20) // 4)
        self.a, self.b = torch.randn(256, 576), torch.randn(576, 1536)
        self.last = 0.0
        self.levels: list[float] = []  # bytes/s
        self.flops: list[float] = []  # FLOP/s

    def maybe(self) -> None:
        start = time.perf_counter()
        if start - self.last >= 1.0:
            self.buffer.sum()
            read = time.perf_counter()
            self.a @ self.b
            self.last = time.perf_counter()
            self.levels.append(self.buffer.numel() * 4 / (read - start))
            (m, k), n = self.a.shape, self.b.shape[1]
            self.flops.append(2 * m * k * n / (self.last - read))


class StepTimes:
    """Records (shape, seconds) of every step any runner of `runner`'s class computes while
    active (the measured system builds its own engine and runner on the shared model); with a
    `probe`, reads the bandwidth level at most once a second between steps."""

    def __init__(self, runner, into: list, probe: LevelProbe | None = None) -> None:
        self.cls, self.into, self.probe = type(runner), into, probe
        self.last_end: float | None = None

    def __enter__(self) -> StepTimes:
        self.original = original = self.cls.execute

        def timed(runner, out):
            ready = time.perf_counter()  # the engine's host work ends here; the probe is ours
            if self.probe is not None:
                self.probe.maybe()
            t = time.perf_counter()
            result = original(runner, out)
            end = time.perf_counter()
            if out.scheduled:
                shape = StepShape.of(out)
                shape.idle_before_s = 0.0 if self.last_end is None else ready - self.last_end
                self.into.append((shape, end - t))
                self.last_end = end
            return result

        self.cls.execute = timed
        return self

    def __exit__(self, *exc) -> None:
        self.cls.execute = self.original


def step_report(served: list, samples: list, cost: RooflineCostModel) -> None:
    """The measured runs' steps by kind against the fitted model's price for each, and the steps
    of one decode alone in order (medians per 100: the machine's speed over time) beside the
    calibration's own served ones. The p50 TPOT follows the decode steps. The price compared
    is the runner's part of a step (the model's `host_s` is the engine's time between steps)."""
    def kind(shape: StepShape) -> str:
        coarse = calibrate.step_kind(shape)
        if coarse == "decode":
            return f"decode x{shape.num_seqs}" if shape.num_seqs <= 4 else "decode x5+"
        if coarse == "mixed":
            return "decodes + prompt"
        return "prompt only, after idle" if shape.idle_before_s >= cost.params.idle_threshold_s else "prompt only"

    by: dict[tuple[str, str], list[tuple[StepShape, float]]] = {}
    for shape, t in served:
        by.setdefault(("measured run", kind(shape)), []).append((shape, t))
    for label, shape, t in samples:
        source = "calibration, served" if label.startswith("served") else "calibration, grid"
        by.setdefault((source, kind(shape)), []).append((shape, t))
    print("| steps | kind | count | measured median ms | model median ms | median error |")
    print("|---|---|---|---|---|---|")
    for source, name in sorted(by):
        steps = by[(source, name)]
        print(f"| {source} | {name} | {len(steps)} | {statistics.median(t for _, t in steps) * 1e3:.1f} | "
              f"{statistics.median(cost.runner_time(s) for s, _ in steps) * 1e3:.1f} | "
              f"{statistics.median(cost.runner_time(s) / t - 1 for s, t in steps):+.1%} |")
    run = [t for s, t in served if kind(s) == "decode x1"]
    cal = [t for label, s, t in samples if label.startswith("served") and kind(s) == "decode x1"]
    if run:
        blocks = " ".join(f"{statistics.median(run[i:i + 100]) * 1e3:.1f}" for i in range(0, len(run), 100))
        print(f"steps of one decode, medians per 100 in order: {blocks}; in the calibration's served part: "
              f"{statistics.median(cal) * 1e3 if cal else float('nan'):.1f} ms ({len(cal)} steps)")


def pieces(requests: list, point, seed: int, slices: int) -> list[list]:
    """The workload at `point`, cut into `slices` consecutive pieces of (nearly) equal size,
    each piece's arrivals moved to start at 0: what `--slices` serves, measured and simulated."""
    timed = at_load(requests, point, 1.0, seed)
    n = len(timed)
    cuts = [round(k * n / slices) for k in range(slices + 1)]
    out = []
    for a, b in itertools.pairwise(cuts):
        if b > a:
            first = timed[a].arrival_s
            out.append([dataclasses.replace(r, arrival_s=r.arrival_s - first) for r in timed[a:b]])
    return out


def run_pieces(system, parts: list[list], point) -> tuple[list, float]:
    """Serve (or simulate) `parts` one after another: every request's timing, and the summed
    durations."""
    timings, duration = [], 0.0
    for part in parts:
        run = system.run(part, point)
        timings += run.timings
        duration += run.duration_s
    return timings, duration


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", type=Path, default=None, help="reuse this calibration instead of measuring")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--request-rate", default="0.5")
    ap.add_argument("--input-len", default="uniform:32,256")
    ap.add_argument("--output-len", default="uniform:16,128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid-only", action="store_true", help="calibrate on the shape grid alone (no served steps)")
    ap.add_argument("--runs", type=int, default=1,
                    help="rounds of calibrate-then-measure; the fit pools all rounds, measured figures are medians")
    ap.add_argument("--repeats", type=int, default=5, help="rounds over the calibration shape grid in each round of calibrate + measure")
    ap.add_argument("--slices", type=int, default=1,
                    help="cut each round, calibration and workload alike, into this many alternating slices")
    ap.add_argument("--track-level", action="store_true",
                    help="read the bandwidth and arithmetic levels once a second through calibration and the "
                         "measured runs, and simulate a second time with the peaks scaled by their ratios")
    ap.add_argument("--same-config", action=argparse.BooleanOptionalAction, default=True,
                    help="calibrate on an engine configured as the measured one (its default KV cache), as "
                         "`conveyor calibrate` does; --no-same-config calibrates on 2,304 KV blocks, as "
                         "runs 1-29 of docs/simulation.md did")
    ap.add_argument("--out", type=Path, default=Path("results/validate-simulation.json"))
    args = ap.parse_args()

    options = {"seed": args.seed}
    systems = OfflineSystems.load(options)
    engine = systems.base
    model = ModelShape.from_arch(engine.arch, "smollm2-135m")  # type: ignore[attr-defined]
    inp, outl = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
    requests = synthetic_requests(args.num_requests, inp, outl, engine.vocab_size, args.seed)
    spec = SystemSpec("continuous", "conveyor", {})
    measured_sys = ConveyorSystem(spec, engine, options)
    points = parse_sweep(args.request_rate, None)

    # Calibration and measurement alternate, round after round, so that both see the same
    # machine states; the fit pools every round's samples, the measured figures are medians.
    samples: list = []
    served_steps: list[tuple[StepShape, float]] = []  # every runner step of the measured runs
    cal_probe, run_probe = LevelProbe(), LevelProbe()
    flops_bw: list[tuple[float, float]] = []
    rounds: dict[str, list[tuple[list, float]]] = {p.label: [] for p in points}  # (timings, duration) a round
    import torch

    # A slice calibrates a share of a round's grid repeats and served rounds (all of them
    # without --slices) and measures one piece of the workload; the pieces pool into the round.
    grid_repeats = max(1, round(args.repeats / args.slices))
    served_rounds = max(1, round(3 / args.slices))
    parts = {p.label: pieces(requests, p, args.seed, args.slices) for p in points}
    config = measured_sys.config if args.same_config else type(engine.config).from_kwargs(num_kv_blocks=2304)
    cal_engine = engine.from_model(config, engine.runner.model, engine.tokenizer) if args.calibration is None else None  # type: ignore[attr-defined]
    current: dict[str, tuple[list, list]] = {}  # this round's (timings, durations) by load

    def calibrate_slice(rnd: int, k: int) -> None:
        print(f"round {rnd + 1}/{args.runs}, slice {k + 1}/{args.slices}: calibrating...", flush=True)
        flops_bw.append(calibrate.measure_peaks())
        samples.extend(calibrate.collect(cal_engine, grid_repeats, not args.grid_only, seed=rnd * args.slices + k,
                                         served_rounds=served_rounds,
                                         between=cal_probe.maybe if args.track_level else None))
        flops_bw.append(calibrate.measure_peaks())

    def measure_slice(rnd: int, k: int) -> None:
        for point in points:
            t = time.perf_counter()
            with StepTimes(engine.runner, served_steps, run_probe if args.track_level else None):
                real = measured_sys.run(parts[point.label][k], point)
            timings, durations = current.setdefault(point.label, ([], []))
            timings += real.timings
            durations.append(real.duration_s)
            print(f"round {rnd + 1}, slice {k + 1}: load {point.label} measured in {time.perf_counter() - t:.0f} s",
                  flush=True)

    for rnd in range(args.runs):
        current.clear()
        for k in range(args.slices):
            # Calibrate, measure; then measure, calibrate: a machine that drifts one way through
            # the run meets calibration and measurement alike (an ABBA order).
            steps = [calibrate_slice, measure_slice] if args.calibration is None else [measure_slice]
            for step in steps if (rnd * args.slices + k) % 2 == 0 else reversed(steps):
                step(rnd, k)
        for label, (timings, durations) in current.items():
            rounds[label].append((timings, sum(durations)))
    cal_engine = None  # its KV cache back before simulating

    if args.calibration is None:
        flops, bandwidth = calibrate.best_peaks(flops_bw)  # read before and after every round
        hardware = calibrate.cpu_hardware(flops, bandwidth, torch.get_num_threads())
        fit = calibrate.fit(hardware, model, samples, skinny=calibrate.runner_skinny_rows(),
                            fused_rows=calibrate.runner_fused_rows(engine.runner.model))
        params = fit.params
        print(f"fit over {len(samples)} samples: median error {fit.median_abs_rel_error:.1%}, max {fit.max_abs_rel_error:.1%}")
    else:
        cal = calibrate.load(args.calibration)
        hardware, params = cal.hardware, cal.params
    print(f"  {params}")

    step_report(served_steps, samples, RooflineCostModel(hardware, model, params, hardware.dtype_bytes, 16))
    variants = [("fitted", hardware, params)]
    if args.track_level and cal_probe.levels and run_probe.levels:
        # The fit's efficiencies are relative to the calibration's bandwidth; the measured runs
        # met the machine at another level. Scale the bandwidth by the ratio of the two medians.
        cal_level, run_level = statistics.median(cal_probe.levels), statistics.median(run_probe.levels)
        cal_flops, run_flops = statistics.median(cal_probe.flops), statistics.median(run_probe.flops)
        print(f"bandwidth level, median of {len(cal_probe.levels)} reads in calibration: {cal_level / 1e9:.1f} GB/s; "
              f"of {len(run_probe.levels)} in the measured runs: {run_level / 1e9:.1f} GB/s")
        print(f"arithmetic level (a 256 x 576 x 1536 matmul) in calibration: {cal_flops / 1e9:.1f} GFLOP/s; "
              f"in the measured runs: {run_flops / 1e9:.1f} GFLOP/s")
        variants.append(("level-matched", dataclasses.replace(
            hardware, mem_bandwidth=hardware.mem_bandwidth * run_level / cal_level,
            peak_flops=hardware.peak_flops * run_flops / cal_flops), params))
    if served_steps:
        # The simulator's own error: the same simulation, priced by a fit to the measured steps.
        own = calibrate.fit(hardware, model, [("measured", s, t) for s, t in served_steps],
                            skinny=(params.skinny_rows, params.skinny_pass_rows), fused_rows=params.fused_rows)
        variants.append(("measured steps", hardware, own.params))
    # Each round's figures, and every round's requests pooled into one set.
    per_round = {label: [summarize(t, d) for t, d in runs] for label, runs in rounds.items()}
    pooled = {label: summarize([x for t, _ in runs for x in t], sum(d for _, d in runs)) for label, runs in rounds.items()}
    rows = []
    for variant, hw, variant_params in variants:
        sim_sys = SimSystem(spec, options, hw, model, variant_params, 16)
        for point in points:
            s = summarize(*run_pieces(sim_sys, parts[point.label], point))
            for name, get in METRICS.items():
                values = [get(m) for m in per_round[point.label]]
                whole = get(pooled[point.label])
                rows.append({"simulation": variant, "load": point.label, "metric": name, "measured": whole,
                             "measured_statistic": "pooled", "measured_median": statistics.median(values),
                             "measured_runs": values, "simulated": get(s), "error": get(s) / whole - 1})

    print()
    print("| simulation | load | metric | measured (all rounds) | median of rounds [rounds] | simulated | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        runs = ", ".join(f"{v:.1f}" for v in r["measured_runs"])
        print(f"| {r['simulation']} | {r['load']} | {r['metric']} | {r['measured']:.1f} | "
              f"{r['measured_median']:.1f} [{runs}] | {r['simulated']:.1f} | {r['error']:+.1%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    steps = {"calibration": [[label, dataclasses.asdict(s), t] for label, s, t in samples],
             "measured": [[dataclasses.asdict(s), t] for s, t in served_steps], "peaks": flops_bw,
             "levels": {name: {"bandwidth": probe.levels, "flops": probe.flops}
                        for name, probe in (("calibration", cal_probe), ("measured", run_probe))}}
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "hardware": hardware.description,
                                    "params": params.to_dict(), "rows": rows, "argv": sys.argv[1:], "steps": steps}))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
