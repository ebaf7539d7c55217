"""Simulate a saved validation run again, with some cost parameters changed: what a term of the
cost model is worth, without measuring anything.

    python benchmarks/resimulate.py results/validate-22.json --set idle_factor=0
    python benchmarks/resimulate.py results/validate-25.json --set idle_factor=0 --set seq_overhead_s=0
    python benchmarks/resimulate.py results/validate-24.json --refit   # today's fit on the saved samples
    python benchmarks/resimulate.py results/validate-27.json --fit-measured   # priced by the measured steps

Reads the fitted parameters, the peaks and the measured medians that
`benchmarks/validate_simulation.py --out FILE` saved, rebuilds its workload from the saved
arguments, and prints measured against simulated as that script does, once as fitted and once
with the changes. `--refit` fits the saved calibration samples again with the current
`conveyor.sim.calibrate.fit` (the run's own skinny and fused row counts: 64) before the changes;
`--fit-measured` fits the measured runs' own steps instead, which leaves the error that does
not come from calibrating at another time than measuring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from validate_simulation import METRICS as ALL_METRICS  # a sibling: this folder is on sys.path
from validate_simulation import pieces, run_pieces

from conveyor.bench.metrics import summarize
from conveyor.bench.offline import SystemSpec
from conveyor.bench.workload import LengthDist, parse_sweep, synthetic_requests
from conveyor.sim import calibrate
from conveyor.sim.commands import SimSystem
from conveyor.sim.cost import CostParams, StepShape
from conveyor.sim.hardware import Hardware
from conveyor.sim.models import get_model

METRICS = {name: get for name, get in ALL_METRICS.items() if "p99" not in name}


def load(path: Path) -> tuple[dict, argparse.Namespace, Hardware, CostParams]:
    """A saved run: its JSON, its workload flags (validate_simulation's defaults where the run
    left them out), the CPU hardware of its best peak readings, and its fitted parameters."""
    saved = json.loads(path.read_text())
    run = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, default in (("--num-requests", 32), ("--request-rate", "0.5"), ("--input-len", "uniform:32,256"),
                          ("--output-len", "uniform:16,128"), ("--seed", 0), ("--slices", 1)):
        run.add_argument(name, default=default, type=type(default))
    workload, _ = run.parse_known_args(saved["argv"])
    flops, bandwidth = calibrate.best_peaks([tuple(p) for p in saved["steps"]["peaks"]])
    return saved, workload, calibrate.cpu_hardware(flops, bandwidth, 2), CostParams.from_dict(saved["params"])


def saved_requests(workload: argparse.Namespace, vocab_size: int) -> list:
    """The saved run's requests, rebuilt from its workload flags."""
    return synthetic_requests(workload.num_requests, LengthDist.parse(workload.input_len),
                              LengthDist.parse(workload.output_len), vocab_size, workload.seed)


def measured_figures(saved: dict) -> dict[tuple[str, str], float]:
    """The saved run's measured figures (all rounds pooled), by (load label, metric name)."""
    return {(r["load"], r["metric"]): r["measured"] for r in saved["rows"] if r["simulation"] == "fitted"}


def simulate(workload: argparse.Namespace, hardware: Hardware, params: CostParams,
             cost_model: Any = None, first_only: bool = False) -> list[tuple[str, dict]]:
    """The saved run's workload simulated on SmolLM2's shape under `params` (or `cost_model`):
    `(load label, summarize(...))` for each of its load points (`first_only`: the first)."""
    model = get_model("smollm2-135m")
    system = SimSystem(SystemSpec("continuous", "conveyor", {}), {"seed": workload.seed}, hardware, model, params, 16,
                       cost_model)
    requests = saved_requests(workload, model.vocab_size)
    out = []
    points = parse_sweep(workload.request_rate, None)
    for point in points[:1] if first_only else points:
        parts = pieces(requests, point, workload.seed, workload.slices)
        out.append((point.label, summarize(*run_pieces(system, parts, point))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("saved", type=Path)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a CostParams field")
    ap.add_argument("--refit", action="store_true", help="fit the saved calibration samples again first")
    ap.add_argument("--fit-measured", action="store_true",
                    help="fit the measured runs' own steps instead of the calibration's: what is left of the "
                         "error is the simulator's, not the calibration's")
    args = ap.parse_args()
    saved, workload, hardware, params = load(args.saved)
    model = get_model("smollm2-135m")
    if args.refit or args.fit_measured:
        samples = ([("measured", StepShape(**shape), t) for shape, t in saved["steps"]["measured"]] if args.fit_measured
                   else [(label, StepShape(**shape), t) for label, shape, t in saved["steps"]["calibration"]])
        params = calibrate.fit(hardware, model, samples, skinny=(params.skinny_rows, params.skinny_pass_rows),
                               fused_rows=params.fused_rows).params
    changed = CostParams.from_dict({**params.to_dict(), **dict(item.split("=", 1) for item in args.set)})
    measured = measured_figures(saved)
    print("| parameters | load | metric | measured | simulated | error |")
    print("|---|---|---|---|---|---|")
    fitted = "fit to the measured steps" if args.fit_measured else "refitted" if args.refit else "fitted"
    for label, p in ((fitted, params), (" ".join(args.set) or fitted, changed)):
        for load_label, summary in simulate(workload, hardware, p):
            for metric, get in METRICS.items():
                want = measured[(load_label, metric)]
                print(f"| {label} | {load_label} | {metric} | {want:.1f} | {get(summary):.1f} | "
                      f"{get(summary) / want - 1:+.1%} |")
        if dataclasses.asdict(p) == dataclasses.asdict(params) and not args.set:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
