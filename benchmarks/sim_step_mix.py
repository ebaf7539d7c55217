"""A saved validation run's measured steps against the steps its simulation ran, by kind: how
many per round and how many seconds, under the run's calibrated prices and under a fit to the
measured steps themselves; and the host's gaps between the measured steps. Tells a simulation
that runs the wrong steps from one that runs the right steps but spreads them differently over
the requests. A third simulation charges every step the mean gap between calibration's served
steps: host time the cost model does not price (with `--track-level` it includes the level
probe's reads, about 10 ms once a second, in calibration and measured runs alike).

    python benchmarks/sim_step_mix.py 34 35   # results/validate-34.json, results/validate-35.json
"""

import collections
import dataclasses
import statistics
import sys
from pathlib import Path

from resimulate import load, measured_figures, simulate  # siblings: this folder is on sys.path
from validate_simulation import METRICS

from conveyor.sim import calibrate
from conveyor.sim.cost import CostParams, RooflineCostModel, StepShape
from conveyor.sim.models import get_model


def kind(s: StepShape) -> str:
    k = calibrate.step_kind(s)
    if k == "decode":
        return f"decode x{min(s.decode_seqs, 5)}{'+' if s.decode_seqs >= 5 else ''}"
    if k == "prompt":
        return "prompt after idle" if s.idle_before_s >= CostParams.idle_threshold_s else "prompt"
    return "decodes + prompt"


class Recording(RooflineCostModel):
    """The cost model, keeping every priced step that computed (with its idle mark)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.steps: list[tuple[StepShape, float]] = []

    def step_time(self, s: StepShape) -> float:
        t = super().step_time(s)
        if s.num_tokens:
            self.steps.append((dataclasses.replace(s), t))
        return t


model = get_model("smollm2-135m")
for n in sys.argv[1:]:
    d, workload, hw, params = load(Path(f"results/validate-{n}.json"))
    argv = d.get("argv", [])
    rounds = int(argv[argv.index("--runs") + 1]) if "--runs" in argv else 1  # the script's default
    measured = [(StepShape(**s), t) for s, t in d["steps"]["measured"]]
    gaps = [s.idle_before_s for s, _ in measured if 0 < s.idle_before_s < CostParams.idle_threshold_s]
    busy = sum(t for s, t in measured if s.idle_before_s < CostParams.idle_threshold_s)
    print(f"run {n}: host gaps between busy steps: median {statistics.median(gaps) * 1e3:.2f} ms, "
          f"mean {statistics.mean(gaps) * 1e3:.2f} ms, together {sum(gaps) / busy:.2%} of the busy steps' time")
    fitted = calibrate.fit(hw, model, [("measured", s, t) for s, t in measured],
                           skinny=(params.skinny_rows, params.skinny_pass_rows), fused_rows=params.fused_rows).params
    wanted = measured_figures(d)
    served_gaps = [x["idle_before_s"] for label, x, _ in d["steps"]["calibration"]
                   if label.startswith("served") and 0 < x["idle_before_s"] < CostParams.idle_threshold_s]
    gap = statistics.mean(served_gaps)  # host time between a served loop's steps, probe reads included
    for name, p in (("calibrated", params), ("fit to the measured steps", fitted),
                    (f"calibrated + the served part's mean gap ({gap * 1e3:.2f} ms) a step",
                     dataclasses.replace(params, step_overhead_s=params.step_overhead_s + gap))):
        cost = Recording(hw, model, p, hw.dtype_bytes, 16)
        [(load_label, s)] = simulate(workload, hw, p, cost, first_only=True)  # steps of one load point
        errs = " / ".join(f"{m} {METRICS[m](s) / wanted[(load_label, m)] - 1:+.1%}"
                          for m in ("TTFT p50 (ms)", "TPOT p50 (ms)"))
        print(f"  {name}: {errs}")
        mc, sc = collections.Counter(kind(x) for x, _ in measured), collections.Counter(kind(x) for x, _ in cost.steps)
        mt, st = collections.defaultdict(float), collections.defaultdict(float)
        for x, t in measured:
            mt[kind(x)] += t
        for x, t in cost.steps:
            st[kind(x)] += t
        print("  | kind | measured steps a round | simulated | measured s a round | simulated s |")
        for k in sorted(set(mc) | set(sc)):
            print(f"  | {k} | {mc[k] / rounds:.1f} | {sc[k]} | {mt[k] / rounds:.2f} | {st[k]:.2f} |")
        print(f"  | all | {len(measured) / rounds:.1f} | {len(cost.steps)} | {sum(mt.values()) / rounds:.2f} | "
              f"{sum(st.values()):.2f} |", flush=True)
