"""LoRA adapters: what serving them costs beside the base model, on one model (SmolLM2 by default).

Random adapters of rank `--rank` on all seven projections of every layer, written in PEFT's
layout. The same requests (greedy, `--max-tokens` each, no early end) run on:

  base         an engine without enable_lora (the baseline)
  lora-off     an engine with enable_lora, the requests without adapters
  1 adapter    every request with the same adapter
  1 DoRA       every request with the same DoRA adapter (a gain an output row besides)
  4 adapters   the requests spread over 4 adapters, max_loras=4 (one step holds them all)
  4 serial     the same, max_loras=1 (one adapter at a time)

in turns (A B C D E, then E D C B A ...), after a warm-up round each; the figure is output
tokens per second over the whole batch, and its ratio to the base in the same turn. Then the
time per output token of one request alone, base against an adapter.

    python benchmarks/lora.py --batch 32 --rounds 3
    python benchmarks/lora.py --batch 0 --rounds 3    # batch 1 only
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from conveyor import LLM, LoRARequest, SamplingParams
from conveyor.config import EngineConfig
from conveyor.engine import Engine
from conveyor.models.arch import ArchConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, arch: ArchConfig, rank: int, seed: int, dora: bool = False) -> Path:
    from safetensors.torch import save_file

    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for name in PROJECTIONS:
            fan_in, fan_out = dims[name]
            part = "self_attn" if name in PROJECTIONS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 1e-3
            if dora:  # (any positive magnitudes: what is timed is the gain's multiply)
                tensors[f"{key}.lora_magnitude_vector"] = 0.5 + torch.rand(fan_out, generator=g)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS), "bias": "none",
         "use_dora": dora}))
    return folder


def run(engine: Engine, prompts: list[list[int]], loras: list[LoRARequest | None], params: SamplingParams) -> float:
    """Output tokens per second of the batch, all requests added at once."""
    start = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_request=lora)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--single-tokens", type=int, default=128)
    args = ap.parse_args()

    common = dict(kv_cache_memory=512 << 20, max_model_len=1024)
    base = LLM(args.model, **common).engine
    lora_llm = LLM(args.model, enable_lora=True, max_loras=4, max_cpu_loras=5, max_lora_rank=args.rank, **common)
    parallel = lora_llm.engine
    serial = Engine.from_model(
        EngineConfig.from_kwargs(enable_lora=True, max_loras=1, max_cpu_loras=4, max_lora_rank=args.rank, **common),
        parallel.runner.model, parallel.tokenizer,
    )
    arch = parallel.arch  # type: ignore[attr-defined]
    root = Path(tempfile.mkdtemp(prefix="conveyor-lora-"))
    adapters = [LoRARequest(f"a{k}", k + 1, str(write_adapter(root / f"a{k}", arch, args.rank, k))) for k in range(4)]
    dora = LoRARequest("dora", 9, str(write_adapter(root / "dora", arch, args.rank, 0, dora=True)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, arch.vocab_size - 100, (args.prompt_len,), generator=g).tolist()
               for _ in range(max(args.batch, 1))]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    none: list[LoRARequest | None] = [None] * args.batch
    spread: list[LoRARequest | None] = [adapters[i % 4] for i in range(args.batch)]
    variants = {
        "base": (base, none),
        "lora-off": (parallel, none),
        "1 adapter": (parallel, [adapters[0]] * args.batch),
        "1 DoRA": (parallel, [dora] * args.batch),
        "4 adapters": (parallel, spread),
        "4 serial": (serial, spread),
    }
    print(f"# {Path(getattr(parallel, 'model_path', '') or 'model').name}: batch {args.batch}, prompts "
          f"{args.prompt_len}, {args.max_tokens} tokens each, rank {args.rank} on all 7 projections, "
          f"{torch.get_num_threads()} threads")
    if args.batch:
        batched(variants, prompts, params, args.rounds)
    single(base, parallel, adapters[0], dora, prompts[0], args)


def batched(variants: dict[str, tuple[Engine, list[LoRARequest | None]]], prompts: list[list[int]],
            params: SamplingParams, rounds: int) -> None:
    for engine, loras in variants.values():  # warm-up: loads, kernels, caches
        run(engine, prompts[:4], loras[:4], params)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        turn = names if r % 2 == 0 else names[::-1]
        got = {}
        for name in turn:
            engine, loras = variants[name]
            engine.reset_prefix_cache()
            got[name] = run(engine, prompts, loras, params)
        for name in names:
            rates[name].append(got[name])
            ratios[name].append(got[name] / got["base"])
        print(f"round {r + 1}: " + ", ".join(f"{n} {got[n]:.1f}" for n in names))
    print("\n| run | output tok/s (median) | vs base, per round |")
    print("|---|---|---|")
    for name in names:
        print(f"| {name} | {statistics.median(rates[name]):.1f} | "
              f"{', '.join(f'{x:.2f}' for x in ratios[name])} |")



def single(base: Engine, engine: Engine, adapter: LoRARequest, dora: LoRARequest, prompt: list[int],
           args: argparse.Namespace) -> None:
    """One request alone: the base (fused decode), the same through the modules (the path a
    step with an adapter takes, without the adapter), and with the adapter."""
    model = engine.runner.model  # type: ignore[attr-defined]
    fused = model.fused_decode

    def through_modules() -> float:
        model.fused_decode = None
        try:
            return run(engine, [prompt], [None], one)
        finally:
            model.fused_decode = fused

    one = SamplingParams(max_tokens=args.single_tokens, temperature=0.0, ignore_eos=True)
    runs = {
        "base": lambda: run(base, [prompt], [None], one),
        "base through the modules": through_modules,
        "1 adapter": lambda: run(engine, [prompt], [adapter], one),
        "1 DoRA": lambda: run(engine, [prompt], [dora], one),
    }
    tpot: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds + 1):
        for name in list(runs)[:: 1 if r % 2 else -1]:
            rate = runs[name]()
            if r:
                tpot[name].append(1e3 / rate)
    print("\n| batch 1 | ms per output token (median) | vs base, per round |")
    print("|---|---|---|")
    for name, values in tpot.items():
        print(f"| {name} | {statistics.median(values):.2f} | "
              f"{', '.join(f'{v / b:.2f}' for v, b in zip(values, tpot['base'], strict=True))} |")

if __name__ == "__main__":
    main()
