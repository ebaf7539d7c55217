"""The fitted cost model's error on a saved validation run's prompt-bearing steps, by 64-token
band of their size, for the measured runs, calibration's served part and its grid: where the
fit prices prompts low or high.

    python benchmarks/prompt_bands.py 37   # results/validate-37.json, with its own fitted parameters
"""

import statistics
import sys
from pathlib import Path

from resimulate import load  # a sibling: this folder is on sys.path

from conveyor.sim import calibrate
from conveyor.sim.cost import RooflineCostModel, StepShape
from conveyor.sim.models import get_model

saved, _, hardware, params = load(Path(f"results/validate-{sys.argv[1]}.json"))
cost = RooflineCostModel(hardware, get_model("smollm2-135m"), params, hardware.dtype_bytes, 16)
sources = {
    "measured run": [(StepShape(**s), t) for s, t in saved["steps"]["measured"]],
    "calibration, served": [(StepShape(**s), t) for label, s, t in saved["steps"]["calibration"] if label.startswith("served")],
    "calibration, grid": [(StepShape(**s), t) for label, s, t in saved["steps"]["calibration"] if not label.startswith("served")],
}
print("| steps | tokens | count | median error |")
print("|---|---|---|---|")
for name, steps in sources.items():
    bands: dict[int, list[float]] = {}
    for s, t in steps:
        if calibrate.step_kind(s) != "decode":  # a prompt (or a chunk of one) in the step
            bands.setdefault(calibrate.token_band(s.num_tokens), []).append(cost.runner_time(s) / t - 1)
    for band in sorted(bands):
        print(f"| {name} | {band}-{band + 63} | {len(bands[band])} | {statistics.median(bands[band]):+.1%} |")
