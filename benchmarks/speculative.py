"""Speculative decoding (n-gram prompt lookup, a draft model, an EAGLE-3 head, Medusa heads) against decoding
one token a step, side by side.

Two engines on one model (SmolLM2 by default), the same greedy requests, run in turns
(A B B A ...), so both see the same machine. Greedy outputs are the same with and without
drafts (tests/test_speculative.py), so both engines generate the same tokens and the ratio of
their times is the speedup. Workloads, chat-templated:
  - echo: rewrite or repeat a passage given in the prompt (what prompt lookup is for:
    summaries, edits, extraction, retrieval-grounded answers);
  - open: open questions with nothing to copy from the prompt.

    python benchmarks/speculative.py --batch 1 8 --rounds 3 [--draft-cost 0.3]
    python benchmarks/speculative.py --draft-model self --draft-quantization int8 --no-ngram
    python benchmarks/speculative.py --eagle results/eagle3-smollm2 --eagle-tokens 2 3 --no-ngram
    python benchmarks/speculative.py --medusa results/medusa-smollm2 --medusa-tokens 1 3 --no-ngram
    python benchmarks/speculative.py --medusa results/medusa-smollm2 --medusa-tree "[(0,), (1,), (0, 0)]" --no-ngram
    python benchmarks/speculative.py --eagle results/eagle3-smollm2-big --eagle-tree "[(0,), (1,)]" --no-ngram
    python benchmarks/speculative.py --eagle results/eagle3-smollm2 --eagle-dynamic 2,3,6 --no-ngram
    python benchmarks/speculative.py --unchained   # beside each, its steps with guesses as modules

`--temperature T` samples instead (every request to `--max-tokens`, the engines' tokens then
differ, so the ratio is of times for as many tokens). A draft model's guesses for unseeded
sampled requests are drawn from its distribution and kept by speculative sampling; `--seeded`
gives each request a seed, which keeps greedy guesses matched against the sampled tokens (the
tokens of decoding one at a time): the two runs compare the two ways of verifying.

    python benchmarks/speculative.py --draft-model self --draft-quantization int8 --no-ngram --temperature 0.8
    python benchmarks/speculative.py --draft-model self --draft-quantization int8 --no-ngram --temperature 0.8 --seeded
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from conveyor import LLM, SamplingParams
from conveyor.core.speculative import TokenTree

PASSAGES = [
    "The quick brown fox jumps over the lazy dog. The dog does not move; it has seen foxes "
    "before, and it knows that this one will be back tomorrow, jumping over it again.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "def variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / len(values)\n",
    "Paged attention stores the KV cache in fixed-size blocks. A block table maps each "
    "sequence's logical blocks to physical ones, so memory is allocated as a sequence grows "
    "and freed the moment it finishes.",
    "Meeting notes: the release moves to Friday. Anna owns the changelog, Ben the migration "
    "guide, and Chris the benchmark tables. Everyone reviews the draft on Thursday morning.",
]
ECHO = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Rewrite the following text, keeping every sentence, but fix any awkward wording:\n\n{p}",
]
OPEN = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
    "What are three good habits for learning a language?", "Describe a rainy afternoon in a city.",
    "Why is the sky blue? Answer for a child.", "Give advice to someone starting to cook.",
    "Write a poem about autumn leaves.", "How do bees make honey?",
]


def conversations(kind: str, n: int) -> list[list[dict[str, str]]]:
    if kind == "echo":
        texts = [ECHO[i % len(ECHO)].format(p=PASSAGES[(i // len(ECHO)) % len(PASSAGES)]) for i in range(n)]
    else:
        texts = [OPEN[i % len(OPEN)] for i in range(n)]
    return [[{"role": "user", "content": t}] for t in texts]


def unchained(model: str | None, **options) -> LLM:
    """An engine whose runners run a step with guesses (and a draft's catch-up) as modules, as
    before such steps ran as chained decodes in the native call (CONVEYOR_CHAINED_DECODE=0)."""
    import os

    os.environ["CONVEYOR_CHAINED_DECODE"] = "0"
    try:
        return LLM(model, **options)
    finally:
        del os.environ["CONVEYOR_CHAINED_DECODE"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", default=["echo", "open"])
    ap.add_argument("--draft-cost", type=float, default=None,
                    help="also an engine with adaptive drafting (speculative_draft_cost)")
    ap.add_argument("--draft-model", default=None,
                    help="also an engine whose drafts come from this model (speculative_method="
                         "'draft_model'); 'self': the model itself")
    ap.add_argument("--draft-quantization", default=None, choices=["int8"],
                    help="--draft-model: its weights in int8 (speculative_quantization)")
    ap.add_argument("--eagle", default=None,
                    help="also an engine whose drafts come from this EAGLE-3 head's folder "
                         "(speculative_method='eagle3'; benchmarks/train_eagle.py makes one for SmolLM2)")
    ap.add_argument("--eagle-tokens", type=int, nargs="+", default=None,
                    help="--eagle: one engine a count of guesses (default: --num-speculative-tokens)")
    ap.add_argument("--medusa", default=None,
                    help="also an engine whose drafts come from these Medusa heads' folder "
                         "(speculative_method='medusa'; benchmarks/train_medusa.py makes them for SmolLM2)")
    ap.add_argument("--medusa-tokens", type=int, nargs="+", default=None,
                    help="--medusa: one engine a count of guesses (default: --num-speculative-tokens)")
    ap.add_argument("--ngram-tree", nargs="+", default=[],
                    help="one n-gram engine a token tree (speculative_token_tree) over the latest matches")
    ap.add_argument("--eagle-tree", nargs="+", default=[],
                    help="--eagle: one engine a token tree (speculative_token_tree), e.g. \"[(0,), (1,), (0, 0)]\"")
    ap.add_argument("--eagle-dynamic", nargs="+", default=[], metavar="TOPK,STEPS,NODES",
                    help="--eagle: one engine an EAGLE-2 dynamic tree (speculative_eagle_topk, speculative_num_steps, "
                         "num_speculative_tokens), e.g. 2,3,6")
    ap.add_argument("--medusa-tree", nargs="+", default=[],
                    help="--medusa: one engine a token tree (speculative_token_tree), e.g. \"[(0,), (1,), (0, 0)]\"")
    ap.add_argument("--no-ngram", action="store_true", help="leave the ngram engine out")
    ap.add_argument("--unchained", action="store_true",
                    help="beside each speculative engine, the same with its verification steps as modules "
                         "(CONVEYOR_CHAINED_DECODE=0: not as chained decodes in the native call)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (see above)")
    ap.add_argument("--seeded", action="store_true", help="sampled requests with seeds (see above)")
    ap.add_argument("--kv-cache-mib", type=int, default=None,
                    help="each engine's KV cache (default: the engine's, 2 GiB; many engines need less)")
    args = ap.parse_args()
    kv = {} if args.kv_cache_mib is None else {"kv_cache_memory": args.kv_cache_mib << 20}

    base = LLM(args.model, **kv)
    engines = [("one token a step", base)]

    def add(name: str, **options) -> None:
        engines.append((name, LLM(args.model, **kv, **options)))
        if args.unchained:
            engines.append((f"{name}, as modules", unchained(args.model, **kv, **options)))

    if not args.no_ngram:
        add("ngram drafts", speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens)
    def add_trees(label: str, trees: list[str], **options) -> None:
        for tree in trees:
            shape = TokenTree.parse(tree)
            add(f"{label}, a tree of {shape.num_nodes} (depth {shape.depth})", speculative_token_tree=tree, **options)

    add_trees("ngram", args.ngram_tree, speculative_method="ngram")
    if args.draft_model is not None:
        draft = base.engine.model_path if args.draft_model == "self" else args.draft_model  # type: ignore[attr-defined]
        add(f"draft model{', int8' if args.draft_quantization else ''}", speculative_method="draft_model",
            speculative_model=draft, speculative_quantization=args.draft_quantization,
            num_speculative_tokens=args.num_speculative_tokens)
    if args.eagle is not None:
        for k in args.eagle_tokens or [args.num_speculative_tokens]:
            add(f"EAGLE-3, {k} guesses", speculative_method="eagle3", speculative_model=args.eagle,
                num_speculative_tokens=k)
        add_trees("EAGLE-3", args.eagle_tree, speculative_method="eagle3", speculative_model=args.eagle)
        for spec in args.eagle_dynamic:
            topk, steps, nodes = (int(x) for x in spec.split(","))
            add(f"EAGLE-3, dynamic tree of {nodes} (topk {topk}, {steps} steps)", speculative_method="eagle3",
                speculative_model=args.eagle, speculative_eagle_topk=topk, speculative_num_steps=steps,
                num_speculative_tokens=nodes)
    if args.medusa is not None:
        for k in args.medusa_tokens or [args.num_speculative_tokens]:
            add(f"Medusa, {k} guesses", speculative_method="medusa", speculative_model=args.medusa,
                num_speculative_tokens=k)
        add_trees("Medusa", args.medusa_tree, speculative_method="medusa", speculative_model=args.medusa)
    if args.draft_cost is not None:
        add(f"ngram, draft cost {args.draft_cost}", speculative_method="ngram",
            num_speculative_tokens=args.num_speculative_tokens, speculative_draft_cost=args.draft_cost)
    sampled = args.temperature > 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=sampled)
    for _, llm in engines:  # warm-up
        llm.chat(conversations("echo", 1), SamplingParams(max_tokens=8), use_tqdm=False)

    print("| workload | batch | engine | s by round | median s | output tok/s | drafts accepted | tokens / step of a request |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in args.workloads:
        for batch in args.batch:
            convs = conversations(kind, batch)
            times: dict[str, list[float]] = {name: [] for name, _ in engines}
            outputs: dict[str, list[list[int]]] = {}
            stats: dict[str, tuple[int, int, int]] = {}
            for rnd in range(args.rounds):
                for name, llm in engines if rnd % 2 == 0 else engines[::-1]:
                    sched = llm.engine.scheduler
                    d0, a0 = sched.num_draft_tokens, sched.num_accepted_tokens
                    t = time.perf_counter()
                    each = ([dataclasses.replace(params, seed=1000 * rnd + i) for i in range(len(convs))]
                            if args.seeded else params)
                    outs = llm.chat(convs, each, use_tqdm=False)
                    times[name].append(time.perf_counter() - t)
                    outputs[name] = [o.outputs[0].token_ids for o in outs]
                    steps = sum(len(set(o.metrics.token_times)) for o in outs)  # steps that gave tokens
                    stats[name] = (sched.num_draft_tokens - d0, sched.num_accepted_tokens - a0, steps)
            same = all(outputs[name] == outputs[engines[0][0]] for name, _ in engines)
            n_tokens = sum(len(o) for o in outputs[engines[0][0]])
            medians = {name: statistics.median(ts) for name, ts in times.items()}
            for name, ts in times.items():
                drafts, accepted, steps = stats[name]
                acc = f"{accepted}/{drafts} ({accepted / drafts:.0%})" if drafts else "-"
                print(f"| {kind} | {batch} | {name} | {', '.join(f'{t:.2f}' for t in ts)} | {medians[name]:.2f} | "
                      f"{n_tokens / medians[name]:.1f} | {acc} | {n_tokens / steps:.2f} |")
            for name, _ in engines[1:]:
                ratio = medians[engines[0][0]] / medians[name]
                print(f"| {kind} | {batch} | **speedup, {name}** | | **{ratio:.2f}x** | | same tokens: {same} | |")


if __name__ == "__main__":
    main()
