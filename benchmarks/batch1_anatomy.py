"""Where a float32 batch-1 decode step goes, each part against a memory read taken beside it.

On the 134M random Llama of cpu_speed.py (or `--model PATH`), in one process:

1. FusedDecode against the layer-by-layer path: batch-1 decode, the two alternated over rounds.
2. Huge pages: all projection and head weights swept through the skinny kernel from their
   huge-page copies and from plain copies, alternated; plus a plain sum over the same bytes.
3. One step's parts (the fused layers, the LM head, the whole step), each with a read of the
   bytes a step reads just before the step: the median fraction of the read's speed.
4. The embedding lookup and the final norm inside the fused native call (`fold_ends`) against
   in torch around it, alternated over rounds, each step beside its read.

    python benchmarks/batch1_anatomy.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_speed import build_random_llama, decode_beside_reads, decode_bytes
from offline_throughput import batch1_decode


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fused_against_layers(llm, rounds: int) -> None:
    model = llm.engine.runner.model
    fused = model.fused_decode
    ratios = []
    for _ in range(rounds):
        model.fused_decode = fused
        a = batch1_decode(llm, model.arch.vocab_size, steps=64)
        model.fused_decode = None
        b = batch1_decode(llm, model.arch.vocab_size, steps=64)
        ratios.append(b / a)
    model.fused_decode = fused
    print(f"1. layer-by-layer / fused step time, {rounds} rounds: " + " ".join(f"{r:.2f}" for r in ratios)
          + f" (median {statistics.median(ratios):.2f})")


def huge_against_plain(model, rounds: int) -> None:
    from conveyor.kernels import skinny_linear

    kernel = skinny_linear()
    huge = [m.weight for m in model.modules() if hasattr(m, "kernel")]
    huge.append(model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight)
    plain = [w.clone() for w in huge]  # torch's own allocation: small pages unless THP is "always"
    xs = {k: torch.randn(1, k) for k in {w.shape[1] for w in huge}}
    nbytes = sum(w.numel() * 4 for w in huge)
    flat = torch.ones(nbytes // 4)

    def sweep(ws):
        return lambda: [kernel(xs[w.shape[1]], w) for w in ws]

    runs: dict[str, list[float]] = {"huge": [], "plain": [], "sum": []}
    for _ in range(rounds):
        runs["huge"].append(timed(sweep(huge)))
        runs["plain"].append(timed(sweep(plain)))
        runs["sum"].append(timed(flat.sum))
    paired = statistics.median(p / h for p, h in zip(runs["plain"], runs["huge"], strict=True))
    vs_sum = statistics.median(s / h for s, h in zip(runs["sum"], runs["huge"], strict=True))
    print(f"2. {nbytes / 1e6:.0f} MB of weights, {rounds} rounds: plain / huge-page sweep time {paired:.2f} "
          f"(median of pairs); huge-page sweep speed / plain sum speed {vs_sum:.2f}")


def step_parts(llm, steps: int) -> None:
    model = llm.engine.runner.model
    nbytes = decode_bytes(model)
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    head_share = head.numel() * 4 / nbytes
    parts: dict[str, list[float]] = {"layers": [], "head": []}
    fused, logits = model.fused_decode, model.compute_logits

    class Timed:
        def applies(self, *a):
            return fused.applies(*a)

        def __call__(self, *a):
            t = time.perf_counter()
            out = fused(*a)
            parts["layers"].append(time.perf_counter() - t)
            return out

    def compute_logits(h):
        t = time.perf_counter()
        out = logits(h)
        parts["head"].append(time.perf_counter() - t)
        return out

    model.fused_decode, model.compute_logits = Timed(), compute_logits
    try:
        reads, step_times = decode_beside_reads(llm, nbytes, steps)
    finally:
        model.fused_decode, model.compute_logits = fused, logits
    # Each decode step ran the layers and the head once; the prefill's head call came first.
    times = {"layers": parts["layers"][-len(reads):], "head": parts["head"][-len(reads):], "step": step_times}
    print(f"3. {steps} steps, a {nbytes / 1e6:.0f} MB read beside each (median "
          f"{nbytes / statistics.median(reads) / 1e9:.1f} GB/s); fraction of the read's speed:")
    for key, share in (("layers", 1 - head_share), ("head", head_share), ("step", 1.0)):
        fr = statistics.median(r * share / t for r, t in zip(reads, times[key], strict=True))
        print(f"   {key}: median {statistics.median(times[key]) * 1e3:.2f} ms, {fr:.2f}")


def folded_against_unfolded(llm, rounds: int, steps: int = 24) -> None:
    model = llm.engine.runner.model
    nbytes = decode_bytes(model)
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(rounds):
        for fold in (True, False):
            model.fused_decode.fold_ends = fold
            reads, times = decode_beside_reads(llm, nbytes, steps)
            runs[fold] += list(zip(reads, times, strict=True))
    model.fused_decode.fold_ends = True
    for fold, label in ((True, "in the native call"), (False, "in torch")):
        pairs = runs[fold]
        print(f"4. embedding and final norm {label}: median step {statistics.median(t for _, t in pairs) * 1e3:.2f} ms, "
              f"median fraction of the read beside it {statistics.median(r / t for r, t in pairs):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model path (default: the 134M random Llama)")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()

    from conveyor import LLM

    tmp = tempfile.TemporaryDirectory()
    path = args.model or str(build_random_llama(Path(tmp.name)))
    llm = LLM(path, dtype="float32", max_num_seqs=64)
    if llm.engine.runner.model.fused_decode is None:
        print("the native kernels are off here: nothing to take apart")
        return
    fused_against_layers(llm, args.rounds)
    huge_against_plain(llm.engine.runner.model, args.rounds * 5)
    step_parts(llm, 128)
    folded_against_unfolded(llm, args.rounds * 2)


if __name__ == "__main__":
    main()
