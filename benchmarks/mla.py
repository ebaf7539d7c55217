"""DeepSeek-style latent attention (MLA) against HF transformers, by batch size, on this machine.

One random-weight DeepSeek-V2 model (DeepSeek-V2-Lite's structure, scaled down: `--hidden`
wide, `--layers` deep, 8 heads, a latent of `--kv-rank`, rotary keys of 32, per-head keys of
64 + 32 and values of 64; 16 experts of 256, top 4, one shared, the first layer dense). The
same requests (`--prompt-len` random tokens, `--max-tokens` out, no early end) run through
conveyor and through HF transformers' `generate` (static batching, its eager experts), in turns
after a warm-up; the figure is output tokens per second over the batch, each the median of
`--rounds`. Printed beside: the K/V bytes a token that the cache keeps, against what 8 heads of
K and V of the same widths would keep.

    python benchmarks/mla.py --batch 1 8 32 --rounds 3
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

    torch.manual_seed(0)
    config = tf.DeepseekV2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=8, intermediate_size=4 * args.hidden, max_position_embeddings=4096,
        kv_lora_rank=args.kv_rank, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, n_shared_experts=1,
        first_k_dense_replace=1, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
    )
    model = tf.DeepseekV2ForCausalLM(config)
    spread_routers(model)
    model.save_pretrained(folder)
    return folder


def conveyor_throughput(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def hf_throughput(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,  # type: ignore[operator]
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def race(llm: LLM, hf: torch.nn.Module, args: argparse.Namespace) -> None:
    """Each `--batch` of random prompts (`--prompt-len` of `--vocab`, `--max-tokens` out)
    through conveyor and HF's `generate` in turns after a warm-up, `--rounds` times; prints the
    medians and a table of them."""
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in args.batch:
        prompts = torch.randint(3, args.vocab, (batch, args.prompt_len), generator=gen).tolist()
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        hf_throughput(hf, prompts[:1], 2)
        ours: list[float] = []
        theirs: list[float] = []
        for r in range(args.rounds):
            first, second = (ours, theirs) if r % 2 == 0 else (theirs, ours)
            for sink in (first, second):
                if sink is ours:
                    sink.append(conveyor_throughput(llm, prompts, params))
                else:
                    sink.append(hf_throughput(hf, prompts, args.max_tokens))
        a, b = statistics.median(ours), statistics.median(theirs)
        rows.append((batch, a, b))
        print(f"batch {batch:3d}: conveyor {a:.0f} tok/s, HF generate {b:.0f} tok/s ({a / b:.2f}x)", flush=True)
    print("\n| batch | conveyor out tok/s | HF generate out tok/s | ratio |")
    print("|---|---|---|---|")
    for batch, a, b in rows:
        print(f"| {batch} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--kv-rank", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "mla", args)
        biggest = max(args.batch)
        llm = LLM(str(folder), dtype="float32", max_num_seqs=biggest,
                  num_kv_blocks=biggest * -(-(args.prompt_len + args.max_tokens) // 16) + 16)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  experts_implementation="eager").eval()
        arch = llm.engine.arch  # type: ignore[attr-defined]
        mha = 2 * arch.num_layers * arch.num_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim) * 4
        print(f"model: hidden {args.hidden}, {args.layers} layers, {arch.num_params / 1e6:.1f}M weights "
              f"({arch.num_active_params / 1e6:.1f}M active); K/V a token {arch.kv_bytes_per_token(4)} bytes "
              f"(latent {arch.kv_lora_rank} + rotary {arch.qk_rope_head_dim} a layer) against {mha} for 8 heads "
              f"of K and V ({mha / arch.kv_bytes_per_token(4):.1f}x)", flush=True)
        race(llm, hf, args)


if __name__ == "__main__":
    main()
