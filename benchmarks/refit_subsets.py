"""Refit saved validation runs' calibration samples three ways and simulate each: all samples,
without the grid's prompt-bearing shapes, and the served part alone. Prints p50 TTFT / p50 TPOT
error against the run's pooled measured figures, one line a run.

    python benchmarks/refit_subsets.py 32 33   # results/validate-32.json, results/validate-33.json
"""

import json
import sys
from pathlib import Path

from validate_simulation import METRICS  # a sibling: this folder is on sys.path

from conveyor.bench.metrics import summarize
from conveyor.bench.offline import SystemSpec
from conveyor.bench.workload import LengthDist, at_load, parse_sweep, synthetic_requests
from conveyor.sim import calibrate
from conveyor.sim.commands import SimSystem
from conveyor.sim.cost import CostParams, StepShape
from conveyor.sim.models import get_model

model = get_model("smollm2-135m")
for n in sys.argv[1:]:
    d = json.loads(Path(f"results/validate-{n}.json").read_text())
    argv = d["argv"]

    def get(flag: str, default: str, argv: list = argv) -> str:
        return argv[argv.index(flag) + 1] if flag in argv else default

    nreq, rate = int(get("--num-requests", "32")), get("--request-rate", "0.5")
    params = CostParams.from_dict(d["params"])
    hw = calibrate.cpu_hardware(*calibrate.best_peaks([tuple(p) for p in d["steps"]["peaks"]]), 2)
    cal = [(label, StepShape(**s), t) for label, s, t in d["steps"]["calibration"]]
    sets = {"all": cal,
            "no grid prompts": [x for x in cal if x[0].startswith("served") or calibrate.step_kind(x[1]) == "decode"],
            "served only": [x for x in cal if x[0].startswith("served")]}
    reqs = synthetic_requests(nreq, LengthDist.parse("uniform:32,256"), LengthDist.parse("uniform:16,128"), model.vocab_size, 0)
    measured = {(r["load"], r["metric"]): r["measured"] for r in d["rows"] if r["simulation"] == "fitted"}
    out = []
    for name, samples in sets.items():
        p = calibrate.fit(hw, model, samples, skinny=(params.skinny_rows, params.skinny_pass_rows), fused_rows=params.fused_rows).params
        system = SimSystem(SystemSpec("continuous", "conveyor", {}), {"seed": 0}, hw, model, p, 16)
        for point in parse_sweep(rate, None):
            run = system.run(at_load(reqs, point, 1.0, 0), point)
            s = summarize(run.timings, run.duration_s)
            errs = [METRICS[m](s) / measured[(point.label, m)] - 1 for m in ("TTFT p50 (ms)", "TPOT p50 (ms)")]
            out.append(f"{name} @{point.label}: {errs[0]:+.1%} / {errs[1]:+.1%}")
    print(n, " | ".join(out), flush=True)
