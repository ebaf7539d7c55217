"""Whisper's memory under load: many clips at once against a KV cache of a fixed budget.

The random Whisper of whisper-base's shape from `benchmarks/whisper.py` (float32), `--clips`
clips of 10 s submitted at once, each decoded greedily for `--max-tokens` tokens, with
`kv_cache_memory` of `--kv-memory-mb`. Prints the process's peak resident memory (before the
model loads and at the end), the time, and how many requests ran at once at most.

Each request's cross-attention keys and values (6 layers x 1500 positions x 512 x 2, 36.9 MB in
float32) now lie in 94 of the cache's blocks, so the cache's budget bounds them and the requests
beyond its room wait; before (conveyor up to the forty-ninth session) they were kept beside the
cache, every running request's on top of the budget. Run it against an older checkout with
`PYTHONPATH=that/checkout` to compare (it uses only the public API).

With `--pairs`, each clip's request comes with a one-token request of the same clip after
`<|startoftranscript|>` alone, as a transcription scored for the temperature fallback or for
timestamps asks its no-speech probability: each holds cross blocks of its own, the one-token
request for its one step. "At most at once" counts the clips' own requests.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from whisper import PROMPT, RATE, build

from conveyor import LLM, SamplingParams


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-memory-mb", type=int, default=256)
    parser.add_argument("--pairs", action="store_true", help="each clip with a no-speech request of its own")
    args = parser.parse_args()
    torch.set_num_threads(2)
    g = np.random.default_rng(0)
    t = np.arange(10 * RATE) / RATE
    clips = [(0.1 * np.sin(2 * np.pi * g.uniform(100, 3000) * t) + 0.02 * g.standard_normal(t.shape)).astype(np.float32)
             for _ in range(args.clips)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "whisper")
        llm = LLM(str(path), kv_cache_memory=args.kv_memory_mb << 20)
        loaded = peak_mb()
        engine = llm.engine
        quiet = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
        for k, c in enumerate(clips):
            engine.add_request(str(k), {"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (c, RATE)}}, params)
            if args.pairs:
                engine.add_request(f"{k}q", {"prompt_token_ids": PROMPT[:1], "multi_modal_data": {"audio": (c, RATE)}},
                                   quiet)
        most, done, start = 0, 0, time.perf_counter()
        while engine.has_unfinished_requests():
            done += sum(o.finished for o in engine.step())
            most = max(most, sum(not s.request_id.endswith("q") for s in engine.scheduler.running))
        took = time.perf_counter() - start
    print(f"{args.clips} clips of 10 s, {args.max_tokens} tokens each, kv_cache_memory {args.kv_memory_mb} MB: "
          f"{done} requests done in {took:.2f} s, at most {most} clips' at once{' (and pairs)' if args.pairs else ''}; peak RSS {loaded:.0f} MB loaded, "
          f"{peak_mb():.0f} MB at the end (+{peak_mb() - loaded:.0f} MB)")


if __name__ == "__main__":
    main()
