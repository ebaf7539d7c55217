"""Refit saved validation runs' calibration samples three ways and simulate each: all samples,
without the grid's prompt-bearing shapes, and the served part alone. Prints p50 TTFT / p50 TPOT
error against the run's pooled measured figures, one line a run.

    python benchmarks/refit_subsets.py 32 33   # results/validate-32.json, results/validate-33.json
"""

import sys
from pathlib import Path

from resimulate import load, saved_requests  # siblings: this folder is on sys.path
from validate_simulation import METRICS

from conveyor.bench.metrics import summarize
from conveyor.bench.offline import SystemSpec
from conveyor.bench.workload import at_load, parse_sweep
from conveyor.sim import calibrate
from conveyor.sim.commands import SimSystem
from conveyor.sim.cost import StepShape
from conveyor.sim.models import get_model

model = get_model("smollm2-135m")
for n in sys.argv[1:]:
    d, workload, hw, params = load(Path(f"results/validate-{n}.json"))
    cal = [(label, StepShape(**s), t) for label, s, t in d["steps"]["calibration"]]
    sets = {"all": cal,
            "no grid prompts": [x for x in cal if x[0].startswith("served") or calibrate.step_kind(x[1]) == "decode"],
            "served only": [x for x in cal if x[0].startswith("served")]}
    reqs = saved_requests(workload, model.vocab_size)
    measured = {(r["load"], r["metric"]): r["measured"] for r in d["rows"] if r["simulation"] == "fitted"}
    out = []
    for name, samples in sets.items():
        p = calibrate.fit(hw, model, samples, skinny=(params.skinny_rows, params.skinny_pass_rows), fused_rows=params.fused_rows).params
        system = SimSystem(SystemSpec("continuous", "conveyor", {}), {"seed": workload.seed}, hw, model, p, 16)
        for point in parse_sweep(workload.request_rate, None):
            run = system.run(at_load(reqs, point, 1.0, workload.seed), point)
            s = summarize(run.timings, run.duration_s)
            errs = [METRICS[m](s) / measured[(point.label, m)] - 1 for m in ("TTFT p50 (ms)", "TPOT p50 (ms)")]
            out.append(f"{name} @{point.label}: {errs[0]:+.1%} / {errs[1]:+.1%}")
    print(n, " | ".join(out), flush=True)
