"""Beam search's cost: `LLM.beam_search` against greedy `generate` of the same length, with and
without the prefix cache (which gives each round back the K/V its beams share).

Each round of beam search runs every live beam as a one-token request over its whole prefix;
with the prefix cache, only the beam's last partial block and the new token are computed, so a
round costs about a decode step of `beam_width` sequences per prompt (plus the host's work on
the requests); without it, each round computes every beam's whole sequence again.

    python benchmarks/beam_search.py --width 1 4 --max-tokens 32 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

from conveyor import LLM, SamplingParams
from conveyor.beam_search import BeamSearchParams

QUESTIONS = [
    "Explain how a bicycle stays upright.", "Write a poem about autumn leaves.", "How do bees make honey?",
    "Give advice to someone starting to cook.", "Why is the sky blue?", "Describe a rainy afternoon.",
    "What is a good habit for learning a language?", "Write a short story about a lighthouse keeper.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--width", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llms = {cache: LLM(args.model, enable_prefix_caching=cache, kv_cache_memory=256 << 20, max_model_len=1024)
            for cache in (True, False)}
    tok = llms[True].tokenizer
    assert tok is not None
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    n_prompt = sum(len(p) for p in prompts)

    def greedy(llm: LLM) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t

    def beams(llm: LLM, w: int) -> float:
        t = time.perf_counter()
        llm.beam_search(prompts, BeamSearchParams(w, args.max_tokens, ignore_eos=True))
        return time.perf_counter() - t

    runs = {("greedy generate", True): lambda: greedy(llms[True])}
    for w in args.width:
        for cache in (True, False):
            runs[(f"beam search, width {w}", cache)] = lambda w=w, cache=cache: beams(llms[cache], w)
    for f in runs.values():  # warm up
        f()
    times: dict[tuple[str, bool], list[float]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(args.rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            times[k].append(runs[k]())
    base = statistics.median(times[("greedy generate", True)])
    print(f"{len(prompts)} chat prompts ({n_prompt} tokens), {args.max_tokens} tokens each, end tokens ignored")
    print("| run | prefix cache | s by round | median s | its time over greedy's |")
    print("|---|---|---|---|---|")
    for (name, cache), ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {'on' if cache else 'off'} | {', '.join(f'{t:.2f}' for t in ts)} | {med:.2f} | "
              f"{med / base:.2f}x |")


if __name__ == "__main__":
    main()
