"""Time SmolLM2's runner on lone prompts of several lengths, as calibration times its grid (a
1 ms pause before each step, the median of `repeats` rounds): where the native skinny kernel
hands over to MKL's GEMM (SKINNY_MAX_ROWS), the price jumps by a fixed cost.

    python benchmarks/prefill_curve.py                      # 64,80,96,...,256, 3 rounds
    python benchmarks/prefill_curve.py --lengths 16,64,65,128 --repeats 5
    python benchmarks/prefill_curve.py --compare-rows 64,128 --rounds 2

`--compare-rows A,B` sets where the projections hand over (`SkinnyLinear.max_rows`) to A, then
B, alternately for `--rounds` rounds, and gives each length's best time under each and their
ratio: how the hand-over point was chosen (BENCHMARKS.md, eleventh session).
"""

import argparse

from conveyor.bench.offline import OfflineSystems
from conveyor.models.llama import SkinnyLinear
from conveyor.sim import calibrate

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--lengths", default="64,80,96,112,128,144,160,192,224,256")
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--compare-rows", default=None, help="A,B: two hand-over points, timed alternately")
ap.add_argument("--rounds", type=int, default=2, help="with --compare-rows: alternations")
args = ap.parse_args()

engine = OfflineSystems.load({"seed": 0}).base
lengths = [int(n) for n in args.lengths.split(",")]
grid = [(f"prefill {n}", [(n, 0)]) for n in lengths]
if args.compare_rows is None:
    print("| prompt tokens | ms | ms a token |")
    print("|---|---|---|")
    for _, shape, t in calibrate.measure_runner(engine, grid, repeats=args.repeats, idle_s=0):
        print(f"| {shape.num_tokens} | {t * 1e3:.1f} | {t * 1e3 / shape.num_tokens:.3f} |")
else:
    a, b = map(int, args.compare_rows.split(","))
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for rows in (a, b):
            for module in engine.runner.model.modules():
                if isinstance(module, SkinnyLinear):
                    module.max_rows = rows
            for _, shape, t in calibrate.measure_runner(engine, grid, repeats=args.repeats, idle_s=0):
                times.setdefault((rows, shape.num_tokens), []).append(t)
    print(f"| prompt tokens | kernel up to {a} rows (ms) | up to {b} rows (ms) | ratio |")
    print("|---|---|---|---|")
    for n in lengths:
        ta, tb = min(times[(a, n)]), min(times[(b, n)])
        print(f"| {n} | {ta * 1e3:.1f} | {tb * 1e3:.1f} | {tb / ta:.3f} |")
