"""Time SmolLM2's runner on lone prompts of several lengths, as calibration times its grid (a
1 ms pause before each step, the median of `repeats` rounds): where the native skinny kernel
(up to 64 rows) hands over to MKL's GEMM, the price jumps by a fixed cost.

    python benchmarks/prefill_curve.py                      # 64,80,96,...,256, 3 rounds
    python benchmarks/prefill_curve.py --lengths 16,64,65,128 --repeats 5
"""

import argparse

from conveyor.bench.offline import OfflineSystems
from conveyor.sim import calibrate

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--lengths", default="64,80,96,112,128,144,160,192,224,256")
ap.add_argument("--repeats", type=int, default=3)
args = ap.parse_args()

engine = OfflineSystems.load({"seed": 0}).base
grid = [(f"prefill {n}", [(n, 0)]) for n in map(int, args.lengths.split(","))]
print("| prompt tokens | ms | ms a token |")
print("|---|---|---|")
for _, shape, t in calibrate.measure_runner(engine, grid, repeats=args.repeats, idle_s=0):
    print(f"| {shape.num_tokens} | {t * 1e3:.1f} | {t * 1e3 / shape.num_tokens:.3f} |")
