"""Paged decode attention of two versions of conveyor/kernels/cpu_kernels.cpp, alternated in one
process: each version is compiled from git (`--base REV`, default the commit before the kernel's
last rewrite) or from the working tree, then both run the same calls in turn, 15 rounds of 10
calls per shape, and the median round is printed. This machine's speed drifts between minutes,
so only an alternated comparison tells two kernels apart.

    python benchmarks/attention_ab.py                 # bd27fbf's kernel against the working tree
    python benchmarks/attention_ab.py --base HEAD~3
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from conveyor.kernels import SOURCE, _build

ROOT = Path(__file__).resolve().parent.parent


def call(lib: ctypes.CDLL, q, k, v, tables, ctx, out, half: int) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    d_, h, hd = q.shape
    lib.paged_decode_attention(p(q.data_ptr()), p(k.data_ptr()), p(v.data_ptr()), p(tables.data_ptr()),
                               i64(tables.shape[1]), p(ctx.data_ptr()), i64(d_), i64(h), i64(k.shape[1]), i64(hd),
                               i64(16), ctypes.c_float(hd**-0.5), i64(0), p(out.data_ptr()), i64(half))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="bd27fbf")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    base = subprocess.run(["git", "show", f"{args.base}:conveyor/kernels/cpu_kernels.cpp"], cwd=ROOT,
                          capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        # Plain CDLL, not kernels.load: an old revision lacks symbols load declares; `call` passes
        # every argument as its ctypes type.
        libs = {name: ctypes.CDLL(str(_build(Path(tmp), source)))
                for name, source in ((args.base, base), ("working tree", SOURCE.read_bytes()))}
        torch.manual_seed(0)
        print(f"threads {torch.get_num_threads()}; ms per call (one layer), median of {args.rounds} alternated rounds")
        print(f"| heads / KV heads | decodes x context | cache | {args.base} | working tree | speedup |")
        print("|---|---|---|---|---|---|")
        for heads, kv_heads in ((12, 12), (9, 3)):
            for n, ctx in ((64, 160), (64, 512), (16, 300), (1, 512)):
                nb = ctx // 16 + 1
                cache = torch.randn(2, (n * nb + 1) * 16, kv_heads, 64)
                tables = torch.tensor([list(range(i * nb, (i + 1) * nb)) for i in range(n)], dtype=torch.long)
                lens = torch.full((n,), ctx, dtype=torch.long)
                q = torch.randn(n, heads, 64)
                for half in (0, 1):
                    c = cache.half() if half else cache
                    times: dict[str, list[float]] = {name: [] for name in libs}
                    for _ in range(args.rounds):
                        for name, lib in libs.items():
                            out = torch.empty_like(q)
                            call(lib, q, c[0], c[1], tables, lens, out, half)
                            t = time.perf_counter()
                            for _ in range(10):
                                call(lib, q, c[0], c[1], tables, lens, out, half)
                            times[name].append((time.perf_counter() - t) / 10 * 1e3)
                    a, b = (sorted(v)[len(v) // 2] for v in times.values())
                    print(f"| {heads} / {kv_heads} | {n} x {ctx} | {'float16' if half else 'float32'} | "
                          f"{a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
