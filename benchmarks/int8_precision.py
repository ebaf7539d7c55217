"""What `quantization="int8"` costs in precision, against float32, on SmolLM2-135M.

Both engines read the same text with teacher forcing (every position's next-token distribution
given the true prefix), as llama.cpp's `perplexity --kl-divergence` does. Reported: perplexity of
each, the mean and 99th percentile KL(float32 || int8) per token, how often the two agree on the
top token, and how often float32's top token is in int8's top 5. Then greedy generation on chat
prompts: how many continuations are identical, and the mean length of the common prefix.

    python benchmarks/int8_precision.py              # SmolLM2 (the embedded GGUF)
    python benchmarks/int8_precision.py --json out.json

The evaluation text is different from the calibration text (conveyor/models/quantize.py).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from conveyor import LLM, SamplingParams

EVAL_TEXT = (
    "The lighthouse stood at the end of a long stone pier, and for ninety years its keepers had "
    "climbed the same spiral stair every evening to light the lamp. In winter the waves broke over "
    "the pier so violently that the keeper sometimes had to wait for a lull before crossing. The "
    "last keeper, a quiet man named Tomas, kept a logbook in which he recorded the weather, the "
    "ships that passed, and the birds that sheltered on the gallery during storms.\n\n"
    "Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, "
    "water is split and oxygen is released; the energy captured is stored in ATP and NADPH, which "
    "the Calvin cycle then uses to fix carbon dioxide into sugars.\n\n"
    "To reverse a string in Python, use slicing: reversed_text = text[::-1]. To count words, "
    "split on whitespace and take the length of the resulting list.\n\n"
    "Q: A train leaves at 9:15 and arrives at 11:40. How long is the journey?\n"
    "A: Two hours and twenty-five minutes.\n"
)

CHAT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "List three prime numbers.", "How do I sort a list in Python?", "Who wrote Hamlet?",
    "Describe a cat in one sentence.", "What is 12 times 7?", "Give me a tip for better sleep.",
    "Translate 'good morning' to Spanish.", "What causes rain?", "Name two planets in the solar system.",
    "Why is the sky blue?", "Suggest a name for a bakery.", "What does a CPU do?",
    "How many legs does a spider have?",
]


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits `[len(ids), vocab]` at every position of `ids`, read in one prefill."""
    model = llm.engine.runner.model
    return model.compute_logits(model.forward_sequence(ids)).float()


def compare(reference: LLM, quantized: LLM, max_tokens: int) -> dict:
    ids = reference.engine.tokenizer.encode(EVAL_TEXT)
    ref = teacher_forced_logits(reference, ids)[:-1]
    q8 = teacher_forced_logits(quantized, ids)[:-1]
    targets = torch.tensor(ids[1:])
    ref_lp, q8_lp = ref.log_softmax(-1), q8.log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - q8_lp)).sum(-1)
    top5 = q8.topk(5, dim=-1).indices
    result = {
        "eval_tokens": len(targets),
        "ppl_float32": math.exp(-ref_lp.gather(1, targets[:, None]).mean().item()),
        "ppl_int8": math.exp(-q8_lp.gather(1, targets[:, None]).mean().item()),
        "kl_mean": kl.mean().item(),
        "kl_p99": kl.quantile(0.99).item(),
        "top1_agreement": (ref.argmax(-1) == q8.argmax(-1)).float().mean().item(),
        "top1_in_int8_top5": (top5 == ref.argmax(-1)[:, None]).any(-1).float().mean().item(),
    }
    convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs_ref = [o.outputs[0].token_ids for o in reference.chat(convs, params, use_tqdm=False)]
    outs_q8 = [o.outputs[0].token_ids for o in quantized.chat(convs, params, use_tqdm=False)]
    prefixes = []
    for a, b in zip(outs_ref, outs_q8, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    result.update(
        greedy_prompts=len(convs),
        greedy_identical=sum(list(a) == list(b) for a, b in zip(outs_ref, outs_q8, strict=True)),
        greedy_mean_common_prefix=sum(prefixes) / len(prefixes),
        greedy_max_tokens=max_tokens,
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reference = LLM(args.model)
    quantized = LLM(args.model, quantization="int8")
    result = compare(reference, quantized, args.max_tokens)
    print(f"teacher-forced over {result['eval_tokens']} tokens:")
    print(f"  perplexity float32 {result['ppl_float32']:.3f}  int8 {result['ppl_int8']:.3f} "
          f"({result['ppl_int8'] / result['ppl_float32'] - 1:+.2%})")
    print(f"  KL(float32 || int8) mean {result['kl_mean']:.4f}  p99 {result['kl_p99']:.4f}")
    print(f"  top-1 agreement {result['top1_agreement']:.1%}; float32's top-1 in int8's top-5 "
          f"{result['top1_in_int8_top5']:.1%}")
    print(f"greedy, {result['greedy_prompts']} chat prompts x {result['greedy_max_tokens']} tokens: "
          f"{result['greedy_identical']} identical, mean common prefix {result['greedy_mean_common_prefix']:.1f} tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
