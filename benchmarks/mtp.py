"""DeepSeek-V3's MTP drafter on this machine: what speculative decoding with it costs and gives
when every guess is taken, against decoding one token a step.

No trained MTP weights load here, so the model is made to agree with its layer: a random
DeepSeek-V3 (`--hidden` wide, `--layers` deep, 8 heads, latent 128; 16 experts of 256, top 4,
one shared, the first layer dense) with a random MTP layer, the model's final norm and the
layer's head norm zeroed, so every logit is 0 and both always say token 0. Every step's
matrices are the real sizes, so the figures are the mechanism's: the drafter's steps, the
verification, the bookkeeping, at 100% acceptance (an upper bound; DeepSeek reports 85-90%
for its second token, DeepSeek-V3 report, section 5.4.3). The same requests (`--prompt-len`
random tokens, `--max-tokens` out) run without drafts and with `num_speculative_tokens` k for
each `--k`, in turns after a warm-up; the figure is output tokens per second, the median of
`--rounds`.

    python benchmarks/mtp.py --batch 1 8 --k 1 2 3 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from conveyor import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from moe import spread_routers  # benchmarks/moe.py, beside this script


def build(folder: Path, args: argparse.Namespace) -> Path:
    import transformers as tf
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    layers = args.layers
    config = tf.DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=8, intermediate_size=4 * args.hidden, max_position_embeddings=4096,
        kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    )
    model = tf.DeepseekV3ForCausalLM(config)
    spread_routers(model)
    model.save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    h = args.hidden
    mtp = f"model.layers.{layers}."
    for name, t in list(tensors.items()):  # the MTP layer's decoder layer: a copy of layer 1's shape
        if name.startswith("model.layers.1."):
            tensors[name.replace("layers.1.", f"layers.{layers}.")] = t.clone()
    tensors[mtp + "enorm.weight"] = torch.ones(h)
    tensors[mtp + "hnorm.weight"] = torch.ones(h)
    tensors[mtp + "eh_proj.weight"] = 0.02 * torch.randn(h, 2 * h)
    tensors[mtp + "shared_head.norm.weight"] = torch.zeros(h)  # the layer always says token 0...
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.norm.weight"] = torch.zeros(h)  # ... and so does the model
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def throughput(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "v3", args)
        blocks = max(args.batch) * -(-(args.prompt_len + args.max_tokens + max(args.k) + 1) // 16) + 16
        engines = {0: LLM(str(folder), dtype="float32", max_num_seqs=max(args.batch), num_kv_blocks=blocks)}
        for k in args.k:
            engines[k] = LLM(str(folder), dtype="float32", max_num_seqs=max(args.batch), num_kv_blocks=blocks,
                             speculative_method="mtp", num_speculative_tokens=k)
        gen = torch.Generator().manual_seed(1)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        rows = []
        order = list(engines)
        for batch in args.batch:
            prompts = torch.randint(3, args.vocab, (batch, args.prompt_len), generator=gen).tolist()
            for llm in engines.values():  # warm-up
                llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            seen: dict[int, list[float]] = {k: [] for k in engines}
            for r in range(args.rounds):
                for k in order if r % 2 == 0 else order[::-1]:
                    seen[k].append(throughput(engines[k], prompts, params))
            base = statistics.median(seen[0])
            line = {k: statistics.median(v) for k, v in seen.items()}
            rows.append((batch, line))
            print(f"batch {batch}: " + ", ".join(f"k={k} {v:.0f} tok/s ({v / base:.2f}x)" for k, v in line.items()),
                  flush=True)
        print("\n| batch | no drafts tok/s | " + " | ".join(f"k={k} tok/s | ratio" for k in args.k) + " |")
        print("|---|---|" + "---|---|" * len(args.k))
        for batch, line in rows:
            cells = " | ".join(f"{line[k]:.0f} | {line[k] / line[0]:.2f}x" for k in args.k)
            print(f"| {batch} | {line[0]:.0f} | {cells} |")
        scheduler = engines[max(args.k)].engine.scheduler
        print(f"\nk={max(args.k)}: {scheduler.num_accepted_tokens} of {scheduler.num_draft_tokens} guesses taken")


if __name__ == "__main__":
    main()
