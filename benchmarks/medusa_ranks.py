"""Where the model's next tokens sit among Medusa heads' ranked candidates: what a token tree
(`speculative_token_tree`) can catch, and the simulator's `--spec-acceptance-rate` /
`--spec-rank-acceptance` for a tree of such heads.

SmolLM2 answers the speculative benchmark's conversations greedily (benchmarks/speculative.py's
`echo` and `open`); at each position i before an answer token's input, head j's candidates (from
the model's last hidden state at i) are ranked and the model's own token at i + j + 2 looked up
among them. Per head: how often that token is the rank-r candidate, over every position, and
given that every earlier head's token was within the first `--width` candidates (a tree as wide
as that could have reached this depth on the right branch: what the simulator's per-depth rates
mean).

    python benchmarks/medusa_ranks.py --medusa results/medusa-smollm2 [--width 4] [--n 16]
"""

from __future__ import annotations

import argparse

import torch

from conveyor import LLM, SamplingParams


@torch.inference_mode()
def ranks(llm: LLM, convs: list, max_tokens: int, width: int) -> list[list[int]]:
    """Per head, the rank of the model's token among its candidates at every answer position
    (`width` where it is not among the first `width`), positions in order, per conversation
    concatenated; -1 where the conversation has ended before that token."""
    heads = llm.engine.drafter.heads  # type: ignore[union-attr]
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    k = heads.spec.num_heads
    out: list[list[int]] = [[] for _ in range(k)]
    for o in llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False):
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        p, t = len(o.prompt_token_ids), len(ids)
        hidden = model.forward_sequence(ids).float()
        ranked = heads.ranked(hidden[p - 1 : t - 1].to(torch.float32), [width] * k).view(t - p, k, width)
        for row, i in enumerate(range(p - 1, t - 1)):
            for j in range(k):
                if i + j + 2 >= t:
                    out[j].append(-1)
                    continue
                hits = (ranked[row, j] == ids[i + j + 2]).nonzero()
                out[j].append(int(hits[0]) if len(hits) else width)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--medusa", required=True, help="the heads' folder (benchmarks/train_medusa.py)")
    ap.add_argument("--width", type=int, default=4, help="candidates ranked a head")
    ap.add_argument("--n", type=int, default=16, help="conversations a workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", nargs="+", default=["echo", "open"])
    args = ap.parse_args()
    import speculative as bench  # (benchmarks/speculative.py: a sibling on the script's path)
    llm = LLM(None, speculative_method="medusa", speculative_model=args.medusa, num_speculative_tokens=1,
              kv_cache_memory=512 << 20)
    w = args.width
    print(f"| workload | head | positions | {' | '.join(f'rank {r}' for r in range(w))} | beyond | "
          f"given earlier heads within {w}: {' / '.join(f'rank {r}' for r in range(w))} |")
    print("|---|---|---|" + "---|" * (w + 2))
    for kind in args.workloads:
        per_head = ranks(llm, bench.conversations(kind, args.n), args.max_tokens, w)
        for j, rs in enumerate(per_head):
            seen = [r for r in rs if r >= 0]
            share = [sum(r == q for r in seen) / len(seen) for q in range(w + 1)]
            given = [r for n, r in enumerate(rs) if r >= 0 and all(per_head[e][n] < w for e in range(j))]
            cond = [sum(r == q for r in given) / len(given) if given else 0.0 for q in range(w)]
            print(f"| {kind} | {j + 1} | {len(seen)} | {' | '.join(f'{s:.1%}' for s in share[:w])} | {share[w]:.1%} | "
                  f"{' / '.join(f'{c:.1%}' for c in cond)} ({len(given)}) |")


if __name__ == "__main__":
    main()
