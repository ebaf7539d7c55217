"""Refit saved validation runs' calibration samples three ways and simulate each: all samples,
without the grid's prompt-bearing shapes, and the served part alone. Prints p50 TTFT / p50 TPOT
error against the run's pooled measured figures, one line a run.

    python benchmarks/refit_subsets.py 32 33   # results/validate-32.json, results/validate-33.json
"""

import sys
from pathlib import Path

from resimulate import load, measured_figures, simulate  # siblings: this folder is on sys.path
from validate_simulation import METRICS

from conveyor.sim import calibrate
from conveyor.sim.cost import StepShape
from conveyor.sim.models import get_model

model = get_model("smollm2-135m")
for n in sys.argv[1:]:
    d, workload, hw, params = load(Path(f"results/validate-{n}.json"))
    cal = [(label, StepShape(**s), t) for label, s, t in d["steps"]["calibration"]]
    sets = {"all": cal,
            "no grid prompts": [x for x in cal if x[0].startswith("served") or calibrate.step_kind(x[1]) == "decode"],
            "served only": [x for x in cal if x[0].startswith("served")]}
    measured = measured_figures(d)
    out = []
    for name, samples in sets.items():
        p = calibrate.fit(hw, model, samples, skinny=(params.skinny_rows, params.skinny_pass_rows), fused_rows=params.fused_rows).params
        for load_label, s in simulate(workload, hw, p):
            errs = [METRICS[m](s) / measured[(load_label, m)] - 1 for m in ("TTFT p50 (ms)", "TPOT p50 (ms)")]
            out.append(f"{name} @{load_label}: {errs[0]:+.1%} / {errs[1]:+.1%}")
    print(n, " | ".join(out), flush=True)
