"""The arithmetic probe of `validate_simulation.py --track-level` (a 256 x 576 x 1536 float32
matmul) read after idle periods of different lengths, in shuffled order over rounds: whether
the probe's level depends on how long the machine idled before it.

    python benchmarks/probe_after_idle.py --rounds 12

Each reading follows five back-to-back matmuls (a busy step), then the idle period; the first
matmul after it and the one straight after that are reported, as medians over the rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    flop = 2 * 256 * 576 * 1536

    def rate() -> float:
        t = time.perf_counter()
        a @ b
        return flop / (time.perf_counter() - t) / 1e9

    for _ in range(20):
        a @ b
    idles = [0.0, 0.001, 0.01, 0.05, 0.2, 0.5, 1.5]
    readings: dict[float, list[tuple[float, float]]] = {idle: [] for idle in idles}
    rng = random.Random(args.seed)
    for _ in range(args.rounds):
        for idle in rng.sample(idles, len(idles)):
            for _ in range(5):
                a @ b
            time.sleep(idle)
            first = rate()
            readings[idle].append((first, rate()))
    print("| idle before | first matmul GFLOP/s | the next one |")
    print("|---|---|---|")
    for idle in idles:
        first, second = zip(*readings[idle], strict=True)
        print(f"| {idle * 1e3:g} ms | {statistics.median(first):.1f} | {statistics.median(second):.1f} |")


if __name__ == "__main__":
    main()
