"""How well an EAGLE head's confidence predicts what the model accepts: what EAGLE-2's dynamic
trees (`speculative_eagle_topk`) rest on. EAGLE-2 (Li et al. 2024) ranks a tree's candidates by
the head's probability of each branch (the product along it) as an estimate of how often the
model accepts it; the tree pays where that estimate is close.

One engine with a dynamic tree drafts for greedy chat requests; every node of every round is
set against the model's own continuation (the tokens the requests end with): a node "would be
accepted" where its branch's tokens are the model's next tokens, which is what verification
keeps under greedy decoding. Printed: nodes by confidence bin and by depth, with the share that
would be accepted and the mean confidence.

    python benchmarks/eagle_confidence.py --eagle results/eagle3-smollm2 --topk 3 --steps 3 --nodes 12
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

from conveyor import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--eagle", required=True, help="an EAGLE-3 head's folder")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=12)
    ap.add_argument("--workloads", nargs="+", default=["open", "echo"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    import speculative as bench  # (benchmarks/speculative.py: a sibling on the script's path)

    llm = LLM(args.model, speculative_method="eagle3", speculative_model=args.eagle, kv_cache_memory=512 << 20,
              speculative_eagle_topk=args.topk, speculative_num_steps=args.steps, num_speculative_tokens=args.nodes)
    drafter = llm.engine.drafter
    fill = drafter.fill
    rounds: list[tuple] = []  # (seq_id, start_pos, tree, node tokens, node scores)

    def recorded(out):
        fill(out)
        for it in out.scheduled:
            if it.num_draft:
                rounds.append((it.seq_id, it.start_pos, it.tree, list(it.token_ids[1:]), drafter.scores[it.seq_id]))

    drafter.fill = recorded  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for kind in args.workloads:
        rounds.clear()
        outs = llm.chat(bench.conversations(kind, args.requests), params, use_tqdm=False)
        ids = sorted({r[0] for r in rounds})  # (seq ids are handed out in request order)
        assert len(ids) == len(outs), "every request drafts at least once"
        final = {sid: [*o.prompt_token_ids, *o.outputs[0].token_ids] for sid, o in zip(ids, outs, strict=True)}
        bins: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        depths: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for sid, start, tree, tokens, scores in rounds:
            truth = final[sid][start + 1 :]
            for k in range(1, tree.num_nodes + 1):
                branch = tree.branch(k)
                ok = all(i < len(truth) and tokens[r - 1] == truth[i] for i, r in enumerate(branch))
                p = math.exp(scores[k - 1])
                for table, key in ((bins, min(int(p * 10), 9)), (depths, tree.depths[k])):
                    table[key][0] += 1
                    table[key][1] += ok
                    table[key][2] += p
        print(f"\n{kind}: {len(rounds)} rounds, topk {args.topk}, {args.steps} steps, {args.nodes} nodes\n")
        print("| nodes by | nodes | would be accepted | mean confidence |")
        print("|---|---|---|---|")
        for key, (n, a, p) in sorted(bins.items()):
            print(f"| confidence {key / 10:.1f}-{(key + 1) / 10:.1f} | {n:.0f} | {a / n:.1%} | {p / n:.1%} |")
        for key, (n, a, p) in sorted(depths.items()):
            print(f"| depth {key} | {n:.0f} | {a / n:.1%} | {p / n:.1%} |")


if __name__ == "__main__":
    main()
