"""What custom logits processors cost (conveyor/logits_process.py), on one model (SmolLM2 by
default): greedy decode of a batch of chat requests, `ignore_eos` so every variant makes the
same tokens' count, each variant against the same requests without a processor, in turns
(A B B A ...); the first round of each is a warm-up, not counted. The figure is time per output
token, the ratio against the free batch.

Variants: a request's own callable that returns its row untouched (what the mechanism costs:
each row's token lists built, the general sampling path); one that bans 10 tokens (a typical
edit, in Python a row at a time); an engine-wide processor that edits no row (a second engine
built with it: every step of every request pays its rows' lists); and with `--vllm-v1`, a vLLM
v1 processor that keeps per-slot state and edits no row (a third engine: the persistent batch's
updates on top of the rows' lists).

    python benchmarks/logits_processors.py --batch 1 8 32 --rounds 3 --vllm-v1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from conveyor import LLM, LogitsProcessor, LogitsRow, SamplingParams
from conveyor.logits_process import process_dict_updates

ASK = "Tell me a long story about a lighthouse keeper and a storm."


class Untouched(LogitsProcessor):
    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        return logits


class UntouchedV1:
    """A vLLM v1 processor: state a slot (its output list), kept through every BatchUpdate."""

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.slots: dict[int, list[int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        process_dict_updates(self.slots, batch_update, lambda params, prompt, out: out)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def keep(out: list[int], row: torch.Tensor) -> torch.Tensor:
    return row


BANNED = list(range(1000, 1010))


def ban(out: list[int], row: torch.Tensor) -> torch.Tensor:
    row[BANNED] = float("-inf")
    return row


def timed(llm: LLM, prompts: list, params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start) / sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vllm-v1", action="store_true", help="also a vLLM v1 processor (a third engine)")
    args = ap.parse_args()

    plain = LLM(args.model, enable_prefix_caching=False)
    engine_wide = LLM(args.model, enable_prefix_caching=False, logits_processors=[Untouched])
    base = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    free = SamplingParams(**base)
    variants = {
        "a request's callable, untouched row": (plain, SamplingParams(**base, logits_processors=[keep])),
        "a request's callable, 10 tokens banned": (plain, SamplingParams(**base, logits_processors=[ban])),
        "an engine-wide processor, no row edited": (engine_wide, free),
    }
    if args.vllm_v1:
        v1 = LLM(args.model, enable_prefix_caching=False, logits_processors=[UntouchedV1])
        variants["a vLLM v1 processor, no row edited"] = (v1, free)
    print("| batch | variant | free (ms/token) | with it (ms/token) | ratio |")
    print("|---:|---|---:|---:|---:|")
    for batch in args.batch:
        prompts = [[{"role": "user", "content": ASK}]] * batch
        ids = [plain.engine.tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
        for name, (llm, params) in variants.items():
            times: dict[str, list[float]] = {"free": [], "with": []}
            for r in range(args.rounds + 1):
                order = [("free", plain, free), ("with", llm, params)]
                for label, engine, p in order if r % 2 == 0 else order[::-1]:
                    t = timed(engine, ids, p)
                    if r:  # the first round warms up
                        times[label].append(t)
            f, w = statistics.median(times["free"]) * 1e3, statistics.median(times["with"]) * 1e3
            print(f"| {batch} | {name} | {f:.2f} | {w:.2f} | {w / f:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
