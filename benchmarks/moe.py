"""A mixture of experts against dense models, by batch size, on this machine.

Three random-weight models with the same attention (Qwen3-style, `--hidden` wide, `--layers`
deep) and different MLPs:

  moe            `--experts` experts of `--expert-size`, `--top-k` a token (Qwen3-MoE)
  dense-active   one MLP as wide as the k experts a token uses: the same FLOPs a token
  dense-total    one MLP as wide as all the experts: the same weights

The same requests (`--prompt-len` random tokens, `--max-tokens` out, no early end) run at each
batch size, the models in turns (A B C, then C B A ...) after a warm-up; the figure is the
median time per output token (TPOT) of the batch's requests, which at one batch is the decode
step's time. A dense model's step streams all its weights at any batch; the mixture's streams
the experts its tokens chose, about E (1 - (1 - k/E)^B) of E at batch B, so its step grows
with the batch towards the dense-total one. The expected count is printed beside the step.
Then HF transformers' `generate` on the mixture at each batch (static batching, its default
experts kernel) against conveyor's output tokens per second over the same batch.

    python benchmarks/moe.py --batch 1 4 16 64 --rounds 2
    python benchmarks/moe.py --batch 1 4 16 --rounds 3 --int8 --no-hf   # and the mixture in int8

With `--int8` the mixture runs a fourth time in the turns, with `quantization="int8"` (every
projection and each expert in int8, the routers float32), and a second table gives its step
time against the float32 mixture's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from conveyor import LLM, SamplingParams


def spread_routers(model: torch.nn.Module) -> None:
    """HF starts routers at zero (every expert tied): give each token a clear, varied choice,
    and the stacked experts the initializer's spread."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif ".experts." in name:
                p.normal_(0, 0.02)


def build(folder: Path, moe: bool, intermediate: int, args: argparse.Namespace) -> Path:
    import transformers as tf

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=args.hidden // 8,
                  max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    if moe:
        config = tf.Qwen3MoeConfig(**common, intermediate_size=intermediate, num_experts=args.experts,
                                   num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_size,
                                   norm_topk_prob=True)
        model = tf.Qwen3MoeForCausalLM(config)
        spread_routers(model)
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, intermediate_size=intermediate))
    model.save_pretrained(folder)
    return folder


def tpot(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(median TPOT in seconds, output tokens per second over the batch)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    return statistics.median(tpots), sum(len(o.outputs[0].token_ids) for o in outs) / wall


def hf_throughput(folder: Path, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:1, :4], attention_mask=torch.ones_like(ids[:1, :4]), max_new_tokens=2,
                       do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-size", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--int8", action="store_true", help="the mixture in int8 too")
    args = ap.parse_args()
    k, e = args.top_k, args.experts
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = {
            "moe": build(root / "moe", True, args.expert_size * k, args),
            "dense-active": build(root / "active", False, args.expert_size * k, args),
            "dense-total": build(root / "total", False, args.expert_size * e, args),
        }
        biggest = max(args.batch)
        llms = {name: LLM(str(f), dtype="float32", max_num_seqs=biggest, num_kv_blocks=biggest * 8 + 64)
                for name, f in folders.items()}
        if args.int8:
            llms["moe-int8"] = LLM(str(folders["moe"]), quantization="int8", max_num_seqs=biggest,
                                   num_kv_blocks=biggest * 8 + 64)
        arch = llms["moe"].engine.arch  # type: ignore[attr-defined]
        print(f"models: hidden {args.hidden}, {args.layers} layers; moe {e} experts x {args.expert_size} top-{k} "
              f"({arch.num_params / 1e6:.1f}M weights, {arch.num_active_params / 1e6:.1f}M active); "
              f"dense-active {llms['dense-active'].engine.arch.num_params / 1e6:.1f}M; "  # type: ignore[attr-defined]
              f"dense-total {llms['dense-total'].engine.arch.num_params / 1e6:.1f}M")  # type: ignore[attr-defined]
        gen = torch.Generator().manual_seed(1)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        order = list(llms)
        rows = []
        for batch in args.batch:
            prompts = torch.randint(3, args.vocab, (batch, args.prompt_len), generator=gen).tolist()
            for llm in llms.values():  # warm-up
                llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            seen: dict[str, list[tuple[float, float]]] = {name: [] for name in llms}
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    seen[name].append(tpot(llms[name], prompts, params))
            step = {name: statistics.median(t for t, _ in v) for name, v in seen.items()}
            tput = {name: statistics.median(x for _, x in v) for name, v in seen.items()}
            hf = None if args.no_hf else hf_throughput(folders["moe"], prompts, args.max_tokens)
            touched = e * (1 - (1 - k / e) ** batch)
            rows.append((batch, step, tput, hf, touched))
            line = "  ".join(f"{n} {step[n] * 1e3:.2f} ms" for n in order)
            extra = "" if hf is None else f"; moe {tput['moe']:.0f} tok/s vs HF generate {hf:.0f} ({tput['moe'] / hf:.2f}x)"
            print(f"batch {batch:3d}: {line}; experts read ~{touched:.1f}/{e}{extra}", flush=True)
        print("\n| batch | moe ms/step | dense-active | dense-total | moe / active | moe / total "
              "| experts read (expected) | moe tok/s | HF generate tok/s | ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for batch, step, tput, hf, touched in rows:
            m, a, t = step["moe"], step["dense-active"], step["dense-total"]
            hf_cols = "– | –" if hf is None else f"{hf:.0f} | {tput['moe'] / hf:.2f}x"
            print(f"| {batch} | {m * 1e3:.2f} | {a * 1e3:.2f} | {t * 1e3:.2f} | {m / a:.2f}x | {m / t:.2f}x "
                  f"| {touched:.1f} / {e} | {tput['moe']:.0f} | {hf_cols} |")
        if args.int8:
            print("\n| batch | moe float32 ms/step | moe int8 ms/step | int8 / float32 |")
            print("|---|---|---|---|")
            for batch, step, _, _, _ in rows:
                print(f"| {batch} | {step['moe'] * 1e3:.2f} | {step['moe-int8'] * 1e3:.2f} | "
                      f"{step['moe-int8'] / step['moe']:.2f}x |")


if __name__ == "__main__":
    main()
