"""Refit saved validation runs' calibration samples with and without the tenth session's two fit
changes, and simulate each: the fit as before (no matrix-path cost, every sample weighted
alike), with `gemm_overhead_s`, with it and the kind-balanced weights (1 / sqrt(count), today's
default), and with every kind weighted alike (1 / count).
Prints tok/s / p50 TTFT / p50 TPOT error against the run's pooled measured figures, one line a
run, with the fitted matrix-path cost in brackets.

    python benchmarks/refit_terms.py 30 31 32 33 34 35 36 37   # results/validate-N.json
"""

import sys
from pathlib import Path

from resimulate import load, measured_figures, simulate  # siblings: this folder is on sys.path
from validate_simulation import METRICS

from conveyor.sim import calibrate
from conveyor.sim.cost import StepShape
from conveyor.sim.models import get_model

VARIANTS = {  # name -> fit options
    "before": {"gemm_overhead": False, "balance": 0.0},
    "+ matrix-path cost": {"gemm_overhead": True, "balance": 0.0},
    "+ balanced weights": {"gemm_overhead": True, "balance": 0.5},
    "+ every kind alike": {"gemm_overhead": True, "balance": 1.0},
}

model = get_model("smollm2-135m")
for n in sys.argv[1:]:
    saved, workload, hw, params = load(Path(f"results/validate-{n}.json"))
    samples = [(label, StepShape(**s), t) for label, s, t in saved["steps"]["calibration"]]
    measured = measured_figures(saved)
    out = []
    for name, options in VARIANTS.items():
        p = calibrate.fit(hw, model, samples, skinny=(params.skinny_rows, params.skinny_pass_rows),
                          fused_rows=params.fused_rows, **options).params
        for load_label, summary in simulate(workload, hw, p):
            errors = [METRICS[m](summary) / measured[(load_label, m)] - 1
                      for m in ("output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)")]
            out.append(f"{name} [{p.gemm_overhead_s * 1e3:.0f} ms]: " + " / ".join(f"{e:+.1%}" for e in errors))
    print(n, " | ".join(out), flush=True)
