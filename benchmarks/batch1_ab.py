"""Batch-1 float32 decode with two versions of conveyor/kernels/cpu_kernels.cpp, alternated in one
process on one loaded model: the fused decoder layers and the LM head run from the library
compiled from git (`--base REV`, default HEAD) or from the working tree's source, in turn, round
after round. Every decode step is preceded by a read of the bytes a step reads (as in
cpu_speed.py), so each step has its own limit. This VM's read bandwidth moves between about 30
and 57 GB/s within minutes; the figures are split by the read beside the step (`--split`
GB/s), since the fixed costs of a step (thread barriers, host work) weigh more when the
stream is fast.

    python benchmarks/batch1_ab.py                       # HEAD against the working tree, SmolLM2
    python benchmarks/batch1_ab.py --base HEAD~2 --model random-134m
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cpu_speed import build_random_llama, decode_beside_reads, decode_bytes

ROOT = Path(__file__).resolve().parent.parent


def kernels_of(lib):
    """(decode_layers, skinny_linear) closures over `lib` instead of the working tree's library."""
    from conveyor import kernels

    own = kernels._library
    kernels._library = lambda: lib
    try:
        return kernels.decode_layers(), kernels.skinny_linear()
    finally:
        kernels._library = own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--model", choices=("smollm2", "random-134m"), default="smollm2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per variant per round")
    ap.add_argument("--split", type=float, default=42.0, help="GB/s separating slow and fast reads")
    args = ap.parse_args()

    from conveyor import LLM, kernels
    from conveyor.models.loader import resolve_model_path

    tmp = tempfile.TemporaryDirectory()
    path = str(build_random_llama(Path(tmp.name))) if args.model == "random-134m" else str(resolve_model_path(None))
    llm = LLM(path, dtype="float32", max_num_seqs=64)
    model = llm.engine.runner.model
    if model.fused_decode is None:
        print("the native kernels are off here: nothing to compare")
        return
    base_source = subprocess.run(["git", "show", f"{args.base}:conveyor/kernels/cpu_kernels.cpp"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
    libs = {args.base: kernels.load(kernels._build(Path(tmp.name) / "base", base_source)),
            "working tree": kernels._library()}
    variants = {name: kernels_of(lib) for name, lib in libs.items()}
    nbytes = decode_bytes(model)
    # per variant: (read GB/s, step s, read / step) of every step
    steps: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (fused, head) in variants.items():
            model.fused_decode.kernel, model._head_kernel = fused, head
            reads, times = decode_beside_reads(llm, nbytes, args.steps)
            steps[name] += [(nbytes / r / 1e9, t, r / t) for r, t in zip(reads, times, strict=True)]
    print(f"{args.model}, {nbytes / 1e6:.0f} MB read per step, {args.rounds} alternated rounds of {args.steps} steps")
    print("| reads beside the step | version | steps | median step ms | median fraction of the read's speed |")
    print("|---|---|---|---|---|")
    for label, keep in ((f"below {args.split:g} GB/s", lambda bw: bw < args.split),
                        (f"at or above {args.split:g} GB/s", lambda bw: bw >= args.split)):
        for name, rows in steps.items():
            picked = [r for r in rows if keep(r[0])]
            if not picked:
                continue
            print(f"| {label} | {name} | {len(picked)} | {statistics.median(r[1] for r in picked) * 1e3:.2f} | "
                  f"{statistics.median(r[2] for r in picked):.3f} |")


if __name__ == "__main__":
    main()
