"""Models with sliding-window layers (Gemma 3, gpt-oss) against HF transformers, by batch size,
on this machine.

One random-weight model of the family's structure, scaled down to `--hidden` wide and
`--layers` deep with windows of `--window` tokens: Gemma 3's five sliding layers to one global,
q/k norms, the four norms a layer, GELU MLPs; or gpt-oss's sliding and global layers by turns
with sinks, biases, YaRN and 16 experts of `--hidden` (4 a token). The same requests
(`--prompt-len` random tokens, longer than the window, `--max-tokens` out, no early end) run
through conveyor and through HF transformers' `generate` (static batching; SDPA for Gemma 3,
for gpt-oss the eager attention that computes sinks and eager experts), in turns after a
warm-up; the figure is output tokens per second over the batch, each the median of `--rounds`.

    python benchmarks/windowed.py --family gemma3 --batch 1 8 32 --rounds 3
    python benchmarks/windowed.py --family gpt_oss --batch 1 8 32 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from conveyor import LLM

sys.path.insert(0, str(Path(__file__).parent))
from mla import race  # benchmarks/mla.py, beside this script


def build(folder: Path, args: argparse.Namespace) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    heads = args.hidden // 64
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
                  max_position_embeddings=4096, sliding_window=args.window, eos_token_id=2, bos_token_id=1)
    if args.family == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, intermediate_size=4 * args.hidden,
                                                         query_pre_attn_scalar=64))
    else:
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 128}
        model = tf.GptOssForCausalLM(tf.GptOssConfig(**common, intermediate_size=args.hidden, num_local_experts=16,
                                                     num_experts_per_tok=4, rope_parameters=yarn))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("router.weight"):
                    p.normal_(0, 0.5)  # every expert in use, as a trained router spreads them
    model.save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["gemma3", "gpt_oss"], default="gemma3")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / args.family, args)
        biggest = max(args.batch)
        llm = LLM(str(folder), dtype="float32", max_num_seqs=biggest,
                  num_kv_blocks=biggest * -(-(args.prompt_len + args.max_tokens) // 16) + 16)
        # gpt-oss: HF's eager attention (it computes sinks; HF has no SDPA path for them) and
        # experts; Gemma 3: its default, SDPA.
        extra = ({"experts_implementation": "eager", "attn_implementation": "eager"} if args.family == "gpt_oss"
                 else {})
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).eval()
        arch = llm.engine.arch  # type: ignore[attr-defined]
        print(f"{args.family}: hidden {args.hidden}, {args.layers} layers ({arch.layer_windows.count(0)} global), "
              f"windows of {args.window}, {arch.num_params / 1e6:.1f}M weights ({arch.num_active_params / 1e6:.1f}M "
              f"active); prompts of {args.prompt_len}, {args.max_tokens} out", flush=True)
        race(llm, hf, args)


if __name__ == "__main__":
    main()
