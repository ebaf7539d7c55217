"""The after-idle term of saved validation runs, charged two ways: as the run's calibration
fitted it (a multiple of the step's price, `idle_factor`, before the ninth session) and as a
fixed cost (`idle_cost_s`: the median of the after-idle samples' times less their warm price,
what `calibrate.fit` now does). The warm fit is the run's own in both; each term is computed
here from the run's saved after-idle samples, as the fit computes it. Prints tok/s, p50 TTFT
and p50 TPOT error against the run's pooled measured figures, one line a run and way.

    python benchmarks/refit_idle.py 30 31 32 33   # results/validate-30.json ...
"""

import dataclasses
import statistics
import sys
from pathlib import Path

from resimulate import load, measured_figures, simulate  # siblings: this folder is on sys.path
from validate_simulation import METRICS

from conveyor.sim.cost import CostParams, RooflineCostModel, StepShape
from conveyor.sim.models import get_model

NAMES = ("output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)")
model = get_model("smollm2-135m")
for n in sys.argv[1:]:
    d, workload, hw, params = load(Path(f"results/validate-{n}.json"))
    cal = [StepShape(**s) for _, s, _ in d["steps"]["calibration"]]
    times = [t for _, _, t in d["steps"]["calibration"]]
    warm_params = dataclasses.replace(params, idle_factor=0.0, idle_cost_s=0.0)
    warm = RooflineCostModel(hw, model, warm_params, hw.dtype_bytes, 16)
    cold = [(t, warm.runner_time(dataclasses.replace(s, idle_before_s=0.0)))
            for s, t in zip(cal, times, strict=True) if s.idle_before_s >= CostParams.idle_threshold_s]
    extra = [t - price for t, price in cold]
    ways = {"factor": dataclasses.replace(warm_params, idle_factor=max(0.0, statistics.median(t / p - 1 for t, p in cold))),
            "fixed cost": dataclasses.replace(warm_params, idle_cost_s=max(0.0, statistics.median(extra)))}
    measured = measured_figures(d)
    for way, p in ways.items():
        out = []
        for load_label, s in simulate(workload, hw, p):
            errs = " / ".join(f"{METRICS[m](s) / measured[(load_label, m)] - 1:+.1%}" for m in NAMES)
            out.append(f"@{load_label}: {errs}")
        label = f"idle_factor {p.idle_factor:.2%}" if way == "factor" else f"idle_cost_s {p.idle_cost_s * 1e3:.2f} ms"
        print(f"run {n} {way} ({label}, {len(extra)} after-idle samples): {' | '.join(out)}", flush=True)
