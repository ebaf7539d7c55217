"""Where a speculative step's time goes: one request (SmolLM2 by default, float32, greedy) written
one token a step and with an EAGLE-3 head, reporting ms a step, the head's share (its `fill` of
the guesses) and the guesses accepted.

    python benchmarks/spec_step_cost.py --eagle results/eagle3-smollm2-big --guesses 1 3
"""

from __future__ import annotations

import argparse
import time

from conveyor import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--eagle", required=True, help="an EAGLE-3 head's folder (benchmarks/train_eagle.py)")
    ap.add_argument("--guesses", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    conv = [[{"role": "user", "content": args.prompt}]]
    engines = [("one token a step", {})] + [
        (f"EAGLE-3, {k} guess{'es' if k > 1 else ''}",
         {"speculative_method": "eagle3", "speculative_model": args.eagle, "num_speculative_tokens": k})
        for k in args.guesses]
    for name, options in engines:
        llm = LLM(args.model, **options)
        llm.chat(conv, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        drafter = llm.engine.drafter
        spent = [0.0]
        if drafter is not None:
            fill = drafter.fill

            def timed(out, fill=fill, spent=spent):
                t = time.perf_counter()
                fill(out)
                spent[0] += time.perf_counter() - t

            drafter.fill = timed  # type: ignore[method-assign]
        sched = llm.engine.scheduler
        d0, a0 = sched.num_draft_tokens, sched.num_accepted_tokens
        t = time.perf_counter()
        out = llm.chat(conv, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)[0]
        total = time.perf_counter() - t
        steps = len(set(out.metrics.token_times))  # steps that gave tokens
        print(f"{name}: {total:.2f} s, {len(out.outputs[0].token_ids)} tokens in {steps} steps, "
              f"{1000 * total / steps:.1f} ms a step ({1000 * spent[0] / steps:.1f} ms the head's), "
              f"{sched.num_accepted_tokens - a0}/{sched.num_draft_tokens - d0} guesses accepted")


if __name__ == "__main__":
    main()
