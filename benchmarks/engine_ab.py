"""Is an engine built for a measured run slower than calibration's engine on the same steps?
Two engines over one loaded SmolLM2: (A) built as validate_simulation's calibration builds it
and warmed on the whole calibration grid, (B) built by the measured system for a run (warmed
on one tiny request). Three step shapes are timed on each, alternating A B B A over the rounds,
each shape's median of five per round.

    python benchmarks/engine_ab.py --rounds 4
"""

from __future__ import annotations

import argparse
import statistics

from conveyor.bench.offline import ConveyorSystem, OfflineSystems, SystemSpec
from conveyor.sim import calibrate

SHAPES = [("2 decodes + a 150-token prompt", [(1, 120), (1, 200), (150, 0)]),
          ("a 200-token prompt", [(200, 0)]), ("1 decode at 200", [(1, 200)])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    base = OfflineSystems.load({"seed": 0}).base
    measured = ConveyorSystem(SystemSpec("continuous", "conveyor", {}), base, {"seed": 0})
    calibration = base.from_model(measured.config, base.runner.model, base.tokenizer)  # type: ignore[attr-defined]
    calibrate.measure_runner(calibration, calibrate.default_grid(), 1, idle_s=0)  # calibration's warm-up
    engines = [("A calibration's engine", calibration), ("B measured system's engine", measured._engine())]
    times: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for name, engine in engines if rnd % 2 == 0 else engines[::-1]:
            for label, _, t in calibrate.measure_runner(engine, SHAPES, 5, idle_s=0):
                times.setdefault((label, name), []).append(t)
    print("| shape | engine | ms by round | median |")
    print("|---|---|---|---|")
    for (label, name), ts in sorted(times.items()):
        print(f"| {label} | {name} | {', '.join(f'{t * 1e3:.1f}' for t in ts)} | {statistics.median(ts) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
