"""Does the measured system's serving path make prompt steps slower than calibration's? The same
open-loop workload (validate_simulation's: prompts uniform 32-256, outputs uniform 16-128,
Poisson at 0.5 req/s) served two ways, alternating A B B A ...: (A) calibration's served loop
(`calibrate.measure_served`'s open-loop part) on an engine built as calibration builds it, and
(B) the measured system's run (`ConveyorSystem.run`, through `replay`). Every runner step is
priced by a saved run's fitted cost model; each round prints the median of measured / price for
the prompt-bearing steps and for the decodes.

    python benchmarks/serve_paths_ab.py results/validate-32.json --num-requests 32 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from resimulate import load  # siblings: this folder is on sys.path
from validate_simulation import StepTimes

from conveyor.bench.offline import ConveyorSystem, OfflineSystems, SystemSpec
from conveyor.bench.workload import LengthDist, at_load, parse_sweep, synthetic_requests
from conveyor.sampling_params import SamplingParams
from conveyor.sim import calibrate
from conveyor.sim.cost import RooflineCostModel
from conveyor.sim.models import get_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("saved", type=Path, help="a validate_simulation.py --out file: its fit prices the steps")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    _, _, hardware, params = load(args.saved)
    cost = RooflineCostModel(hardware, get_model("smollm2-135m"), params, 4, 16)

    base = OfflineSystems.load({"seed": 0}).base
    measured = ConveyorSystem(SystemSpec("continuous", "conveyor", {}), base, {"seed": 0})
    point = parse_sweep("0.5", None)[0]
    requests = at_load(synthetic_requests(args.num_requests, LengthDist.parse("uniform:32,256"),
                                          LengthDist.parse("uniform:16,128"), base.vocab_size, 0), point, 1.0, 0)

    def calibration_loop() -> None:
        engine = base.from_model(measured.config, base.runner.model, base.tokenizer)  # type: ignore[attr-defined]
        start, i = time.perf_counter(), 0
        while i < len(requests) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while i < len(requests) and start + requests[i].arrival_s <= now:
                r = requests[i]
                engine.add_request(f"a-{i}", list(r.prompt),
                                   SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
                i += 1
            if engine.has_unfinished_requests():
                engine.step()
            elif i < len(requests):
                time.sleep(start + requests[i].arrival_s - now)

    ways = [("A calibration's loop", calibration_loop), ("B measured run", lambda: measured.run(requests, point))]
    for rnd in range(args.rounds):
        for name, serve in ways if rnd % 2 == 0 else ways[::-1]:
            steps: list = []
            with StepTimes(base.runner, steps):
                serve()
            ratio = {k: [t / cost.runner_time(s) for s, t in steps if (calibrate.step_kind(s) == "decode") == (k == "decode")]
                     for k in ("prompt-bearing", "decode")}
            print(f"round {rnd + 1}, {name}: prompt-bearing steps {statistics.median(ratio['prompt-bearing']):.3f} x price "
                  f"({len(ratio['prompt-bearing'])}), decodes {statistics.median(ratio['decode']):.3f}", flush=True)


if __name__ == "__main__":
    main()
