"""What logit_bias, allowed_token_ids, min_tokens, bad_words and prompt logprobs cost, on one model
(SmolLM2 by default), each against the same requests without it, in turns (A B B A ...) on
one engine; the first round of each is a warm-up, not counted.

  1. Decode: a batch of chat requests, `ignore_eos` so every variant makes the same number of
     tokens; the figure is time per output token, the ratio against the free batch.
  2. Prompt logprobs: a batch of long prompts and one output token each; the figure is the
     time of the batch, with the prefix cache off so both variants compute every prompt.

    python benchmarks/logit_controls.py --batch 1 8 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from conveyor import LLM, SamplingParams

ASK = "Tell me a long story about a lighthouse keeper and a storm."
WORDS = ("storm", "lighthouse keeper", "waves", "night", "suddenly", "ocean", "light", "ship", "wind", "dark")


def timed(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    args = ap.parse_args()

    llm = LLM(args.model, enable_prefix_caching=False)
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    bias = {t: rng.uniform(-5, 5) for t in rng.sample(range(vocab), 100)}
    allowed = rng.sample(range(vocab), 2000)
    base = dict(max_tokens=args.max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    variants = {
        "logit_bias (100 tokens)": SamplingParams(**base, logit_bias=bias),
        "allowed_token_ids (2,000)": SamplingParams(**base, allowed_token_ids=allowed),
        "min_tokens = max_tokens": SamplingParams(**base, min_tokens=args.max_tokens),
        "bad_words (10 words)": SamplingParams(**base, bad_words=WORDS),
    }
    free = SamplingParams(**base)
    print("| batch | variant | free (ms/token) | with it (ms/token) | ratio |")
    print("|---:|---|---:|---:|---:|")
    for batch in args.batch:
        prompts = [[{"role": "user", "content": ASK}]] * batch
        prompt_ids = [llm.engine.tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
        for name, params in variants.items():
            times: dict[str, list[float]] = {"free": [], "with": []}
            for r in range(args.rounds + 1):
                order = [("free", free), ("with", params)] if r % 2 == 0 else [("with", params), ("free", free)]
                for key, p in order:
                    seconds, tokens = timed(llm, prompt_ids, [p] * batch)
                    if r:
                        times[key].append(seconds / tokens * 1e3)
            a, b = statistics.median(times["free"]), statistics.median(times["with"])
            print(f"| {batch} | {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")

    print()
    print("| batch | prompt tokens | without (ms) | prompt_logprobs=5 (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(batch)]
        plain = SamplingParams(max_tokens=1, temperature=0)
        asking = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
        times = {"plain": [], "asking": []}
        for r in range(args.rounds + 1):
            order = [("plain", plain), ("asking", asking)] if r % 2 == 0 else [("asking", asking), ("plain", plain)]
            for key, p in order:
                seconds, _ = timed(llm, prompts, [p] * batch)
                if r:
                    times[key].append(seconds * 1e3)
        a, b = statistics.median(times["plain"]), statistics.median(times["asking"])
        print(f"| {batch} | {args.prompt_tokens} | {a:.0f} | {b:.0f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
