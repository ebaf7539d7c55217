"""Does the simulator predict this machine? Calibrate, serve a mixed workload for real, simulate
the same workload on the calibrated cost model, and compare throughput and p50 TTFT / TPOT.

    python benchmarks/validate_simulation.py                      # calibrate now, then compare
    python benchmarks/validate_simulation.py --calibration FILE   # reuse a saved calibration
    python benchmarks/validate_simulation.py --request-rate 0.5,1 --num-requests 32

The measured run is `conveyor bench offline` (SmolLM2, real time, Poisson arrivals); the
simulated one is `conveyor simulate --hardware cpu`, with the same workload seed. Calibrating in
the same process just before measuring keeps the two under the same machine conditions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from conveyor.bench.metrics import summarize
from conveyor.bench.offline import ConveyorSystem, OfflineSystems, SystemSpec
from conveyor.bench.workload import LengthDist, at_load, parse_sweep, synthetic_requests
from conveyor.sim import calibrate
from conveyor.sim.commands import SimSystem
from conveyor.sim.models import ModelShape


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", type=Path, default=None, help="reuse this calibration instead of measuring")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--request-rate", default="0.5")
    ap.add_argument("--input-len", default="uniform:32,256")
    ap.add_argument("--output-len", default="uniform:16,128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid-only", action="store_true", help="calibrate on the shape grid alone (no served steps)")
    ap.add_argument("--out", type=Path, default=Path("results/validate-simulation.json"))
    args = ap.parse_args()

    options = {"seed": args.seed}
    systems = OfflineSystems.load(options)
    engine = systems.base
    model = ModelShape.from_arch(engine.arch, "smollm2-135m")  # type: ignore[attr-defined]
    if args.calibration is None:
        import torch

        print("calibrating...", flush=True)
        flops, bandwidth = calibrate.measure_peaks()
        hardware = calibrate.cpu_hardware(flops, bandwidth, torch.get_num_threads())
        cal_engine = engine.from_model(
            type(engine.config).from_kwargs(num_kv_blocks=2304), engine.runner.model, engine.tokenizer  # type: ignore[attr-defined]
        )
        samples = calibrate.measure_runner(cal_engine, calibrate.default_grid())
        if not args.grid_only:
            samples += calibrate.measure_served(cal_engine)
        del cal_engine
        fit = calibrate.fit(hardware, model, samples, skinny=calibrate.runner_skinny_rows())
        params = fit.params
        print(f"  fit error per shape: median {fit.median_abs_rel_error:.1%}, max {fit.max_abs_rel_error:.1%}")
    else:
        cal = calibrate.load(args.calibration)
        hardware, params = cal.hardware, cal.params
    print(f"  {params}")

    inp, outl = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
    requests = synthetic_requests(args.num_requests, inp, outl, engine.vocab_size, args.seed)
    spec = SystemSpec("continuous", "conveyor", {})
    measured_sys = ConveyorSystem(spec, engine, options)
    sim_sys = SimSystem(spec, options, hardware, model, params, 16)
    rows = []
    for point in parse_sweep(args.request_rate, None):
        reqs = at_load(requests, point, 1.0, args.seed)
        t = time.perf_counter()
        real = measured_sys.run(reqs, point)
        wall = time.perf_counter() - t
        sim = sim_sys.run(reqs, point)
        m, s = summarize(real.timings, real.duration_s), summarize(sim.timings, sim.duration_s)
        for name, get in (("output tok/s", lambda x: x["output_throughput"]),
                          ("TTFT p50 (ms)", lambda x: x["ttft_s"]["p50"] * 1e3),
                          ("TPOT p50 (ms)", lambda x: x["tpot_s"]["p50"] * 1e3),
                          ("TTFT p99 (ms)", lambda x: x["ttft_s"]["p99"] * 1e3),
                          ("TPOT p99 (ms)", lambda x: x["tpot_s"]["p99"] * 1e3)):
            rows.append({"load": point.label, "metric": name, "measured": get(m), "simulated": get(s),
                         "error": get(s) / get(m) - 1})
        print(f"load {point.label}: measured in {wall:.0f} s", flush=True)

    print()
    print("| load | metric | measured | simulated | error |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['load']} | {r['metric']} | {r['measured']:.1f} | {r['simulated']:.1f} | {r['error']:+.1%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "hardware": hardware.description,
                                    "params": params.to_dict(), "rows": rows, "argv": sys.argv[1:]}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
