"""Does a step cost the same served as in calibration? Serve the validation workload once,
record every step the runner computes (its `SchedulerOutput` and the idle time before it), then
run those very steps through the same runner again: back to back (as calibration times
shapes), and with each step's original idle gap slept before it (as a server meets them). The
three timings of one step differ only by what ran before it.

    python benchmarks/step_replay.py                          # 64 requests at 0.5 req/s, 2 replays each
    python benchmarks/step_replay.py --replays 3 --num-requests 32

Replays alternate (back to back, gapped, back to back, ...) so that the machine's bandwidth
level, which holds for seconds to minutes, falls on both alike. Prints, per kind of step and
per idle gap before it, the median of each replay's time over the served one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from conveyor.bench.offline import ConveyorSystem, OfflineSystems, SystemSpec
from conveyor.bench.workload import LengthDist, at_load, parse_sweep, synthetic_requests
from conveyor.sim.cost import StepShape


def kind(shape: StepShape) -> str:
    if shape.decode_seqs == shape.num_seqs:
        return f"decode x{shape.num_seqs}" if shape.num_seqs <= 4 else "decode x5+"
    return "prompt only" if shape.decode_seqs == 0 else "decodes + prompt"


def gap_class(gap: float) -> str:
    return "after idle >= 50 ms" if gap >= 0.05 else "after idle 1-50 ms" if gap >= 1e-3 else "no idle"


class Recorder:
    """Records every non-empty step any runner of `cls` computes: a deep copy of its
    `SchedulerOutput`, its time, and the time since the previous step ended."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.steps: list[tuple[object, float, float]] = []
        self.last_end: float | None = None

    def __enter__(self) -> Recorder:
        self.original = original = self.cls.execute

        def timed(runner, out):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            result = original(runner, out)
            end = time.perf_counter()
            if out.scheduled:
                gap = 0.0 if self.last_end is None else t - self.last_end
                self.steps.append((copy.deepcopy(out), end - t, gap))
                self.last_end = end
            return result

        self.cls.execute = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls.execute = self.original


def replay_steps(runner, steps, gapped: bool) -> list[float]:  # type: ignore[no-untyped-def]
    times = []
    for out, _, gap in steps:
        if gapped and gap > 0:
            time.sleep(gap)
        t = time.perf_counter()
        runner.execute(out)
        times.append(time.perf_counter() - t)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--request-rate", default="0.5")
    ap.add_argument("--input-len", default="uniform:32,256")
    ap.add_argument("--output-len", default="uniform:16,128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replays", type=int, default=2, help="pairs of (back to back, gapped) replays")
    ap.add_argument("--out", type=Path, default=Path("results/step-replay.json"))
    args = ap.parse_args()

    options = {"seed": args.seed}
    systems = OfflineSystems.load(options)
    engine = systems.base
    inp, outl = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
    requests = synthetic_requests(args.num_requests, inp, outl, engine.vocab_size, args.seed)
    system = ConveyorSystem(SystemSpec("continuous", "conveyor", {}), engine, options)
    point = parse_sweep(args.request_rate, None)[0]
    with Recorder(type(engine.runner)) as rec:
        t = time.perf_counter()
        system.run(at_load(requests, point, 1.0, args.seed), point)
    print(f"served {len(rec.steps)} steps in {time.perf_counter() - t:.0f} s", flush=True)

    # The served engine is gone; a fresh one over the same model has the same KV cache size,
    # so every recorded block table is valid in it.
    runner = system._engine().runner
    runs: dict[str, list[list[float]]] = {"back to back": [], "gapped": []}
    for r in range(args.replays):
        for name, gapped in (("back to back", False), ("gapped", True)):
            t = time.perf_counter()
            runs[name].append(replay_steps(runner, rec.steps, gapped))
            print(f"replay {r + 1} {name}: {time.perf_counter() - t:.0f} s", flush=True)

    groups: dict[tuple[str, str], list[int]] = {}
    for i, (out, _, gap) in enumerate(rec.steps):
        groups.setdefault((kind(StepShape.of(out)), gap_class(gap)), []).append(i)
    print()
    print("| kind | before it | steps | served median ms | back to back / served | gapped / served |")
    print("|---|---|---|---|---|---|")
    for (k, g), idx in sorted(groups.items()):
        served = [rec.steps[i][1] for i in idx]

        def ratio(name: str, idx: list[int] = idx) -> str:
            rs = [statistics.median(run[i] for run in runs[name]) / rec.steps[i][1] for i in idx]
            return f"{statistics.median(rs):.3f}"

        print(f"| {k} | {g} | {len(idx)} | {statistics.median(served) * 1e3:.1f} | "
              f"{ratio('back to back')} | {ratio('gapped')} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "steps": [{"shape": dataclasses.asdict(StepShape.of(o)), "served_s": t, "gap_s": g}
                  for o, t, g in rec.steps],
        "replays": runs,
    }))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
