"""What a prompt given as embeddings costs (vLLM's `prompt_embeds`, `enable_prompt_embeds`): on
one model (SmolLM2 by default), a batch of prompts sent as token ids and the same prompts as
their embedding-table rows (the same greedy tokens must come out: checked), in turns (A B B A
...), the first round a warm-up; the prefix cache off, so every prompt is computed. The figure
is the batch's time, the ratio against the token prompts'.

    python benchmarks/prompt_embeds.py --batch 16 --prompt-tokens 256 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from conveyor import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, enable_prefix_caching=False, enable_prompt_embeds=True)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    table = model.embed_tokens.weight.detach()
    rng = random.Random(0)
    ids = [[rng.randrange(100, table.shape[0]) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    embeds = [{"prompt_embeds": table[p].clone()} for p in ids]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def timed(prompts: list) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    times: dict[str, list[float]] = {"ids": [], "embeds": []}
    for r in range(args.rounds + 1):
        order = [("ids", ids), ("embeds", embeds)]
        answers = {}
        for label, prompts in order if r % 2 == 0 else order[::-1]:
            t, answers[label] = timed(prompts)
            if r:
                times[label].append(t)
        assert answers["ids"] == answers["embeds"], "the table's rows gave other tokens than the ids"
    a, b = statistics.median(times["ids"]), statistics.median(times["embeds"])
    print(f"{args.batch} prompts of {args.prompt_tokens} tokens, {args.max_tokens} generated each")
    print("| prompts as | median (s) | ratio | rounds (s) |\n|---|---:|---:|---|")
    print(f"| token ids | {a:.3f} | 1.00 | {', '.join(f'{t:.3f}' for t in times['ids'])} |")
    print(f"| embeddings | {b:.3f} | {b / a:.2f} | {', '.join(f'{t:.3f}' for t in times['embeds'])} |")


if __name__ == "__main__":
    main()
