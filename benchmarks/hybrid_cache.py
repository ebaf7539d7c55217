"""The hybrid KV cache against the whole one, with the same KV memory, on this machine.

A random-weight Gemma 3 scaled down (benchmarks/windowed.py's: `--hidden` wide, `--layers`
deep, five sliding layers to one global with windows of `--window` tokens). `--requests`
requests of `--prompt-len` random tokens and `--max-tokens` out (no early end) arrive at once;
the KV cache holds `--cache-seqs` of them whole. The same requests run through the engine
with `hybrid_kv_cache` off and on, in turns after a warm-up; each figure is the median of
`--rounds`: output tokens per second over the whole run, the most sequences running at once,
and the preemptions. Greedy tokens must be equal in both.

    python benchmarks/hybrid_cache.py --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from conveyor import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from windowed import build  # benchmarks/windowed.py, beside this script


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int, list[list[int]]]:
    """(output tokens/s, most sequences running at once, preemptions, tokens)."""
    engine = llm.engine
    before = engine.scheduler.num_preemptions
    engine.step_trace.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    peak = max(s.num_running for s in engine.step_trace)
    return sum(map(len, tokens)) / wall, peak, engine.scheduler.num_preemptions - before, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    args.family = "gemma3"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "gemma3", args)
        per_token = LLM(str(folder), dtype="float32", num_kv_blocks=16).engine.arch.kv_bytes_per_token(4)  # type: ignore[attr-defined]
        memory = args.cache_seqs * -(-(args.prompt_len + args.max_tokens) // 16) * 16 * per_token
        llms = {hybrid: LLM(str(folder), dtype="float32", kv_cache_memory=memory, max_num_seqs=args.requests,
                            max_num_batched_tokens=args.max_num_batched_tokens, hybrid_kv_cache=hybrid)
                for hybrid in (False, True)}
        for llm in llms.values():  # warm-up
            run(llm, prompts[:2], params)
        results: dict[bool, list[tuple[float, int, int]]] = {False: [], True: []}
        tokens = {}
        for _ in range(args.rounds):
            for hybrid, llm in llms.items():
                rate, peak, preempted, tokens[hybrid] = run(llm, prompts, params)
                results[hybrid].append((rate, peak, preempted))
        assert tokens[True] == tokens[False], "the hybrid cache changed the tokens"
    print(f"Gemma 3 shape: hidden {args.hidden}, {args.layers} layers, windows of {args.window}; "
          f"{args.requests} requests of {args.prompt_len} + {args.max_tokens} tokens; KV memory "
          f"{memory / 2**20:.1f} MiB (whole: {args.cache_seqs} sequences); medians of {args.rounds}")
    for hybrid in (False, True):
        rate = statistics.median(r for r, _, _ in results[hybrid])
        peak = statistics.median(p for _, p, _ in results[hybrid])
        preempted = statistics.median(n for _, _, n in results[hybrid])
        blocks = llms[hybrid].engine.scheduler.block_manager.num_blocks
        print(f"  hybrid_kv_cache={hybrid!s:5}: {rate:7.1f} out tok/s, {peak:3.0f} running at most, "
              f"{preempted:3.0f} preemptions, {blocks} blocks")
    ratio = statistics.median(r for r, _, _ in results[True]) / statistics.median(r for r, _, _ in results[False])
    print(f"  hybrid / whole: {ratio:.2f}x")


if __name__ == "__main__":
    main()
