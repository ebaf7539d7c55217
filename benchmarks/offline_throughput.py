"""Offline throughput: conveyor vs HF transformers static `generate`, same model, same workload.

N requests with prompt and output lengths drawn uniformly (seeded), EOS ignored so every
request produces exactly its output length. Throughput counts the requested output tokens only:
the padding and the extra tokens a static batch generates while waiting for its longest member
are waste, which is the point of continuous batching.

Also measures batch-1 decode time per step against the memory-bandwidth limit
(weight bytes / bandwidth, bandwidth measured here on the spot).

    python benchmarks/offline_throughput.py                 # SmolLM2-135M, 64 requests
    python benchmarks/offline_throughput.py --skip-hf       # conveyor only
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import time
from pathlib import Path

import torch


def make_workload(n: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(rng.randint(*prompt_range))] for _ in range(n)
    ]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs


def measure_bandwidth(size_mb: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of several full passes over a large tensor."""
    x = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def run_conveyor(llm, prompts, outputs) -> dict:
    from conveyor import SamplingParams

    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.engine.step_trace.clear()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs), "every request must produce exactly its output length"
    steps = llm.engine.step_trace
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "output_tok_per_s": produced / elapsed,
        "steps": len(steps),
        "mean_batch": sum(s.num_seqs for s in steps) / max(len(steps), 1),
        "preemptions": sum(s.num_preempted for s in steps),
    }


def run_hf_static(model, prompts, outputs, batch_size: int, pad_id: int) -> dict:
    t = time.perf_counter()
    useful = 0
    generated = 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        want = outputs[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        new = max(want)
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=pad_id, eos_token_id=None,
            )
        useful += sum(want)
        generated += new * len(batch)
    elapsed = time.perf_counter() - t
    return {
        "elapsed_s": elapsed,
        "output_tokens": useful,
        "generated_tokens_incl_waste": generated,
        "output_tok_per_s": useful / elapsed,
        "batch_size": batch_size,
    }


def batch1_decode(llm, vocab: int, prompt_len: int = 32, steps: int = 128) -> float:
    """Mean seconds per decode step for a single sequence."""
    from conveyor import SamplingParams

    prompt = list(range(100, 100 + prompt_len))
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.engine.step_trace.clear()
    llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
    decode = [s.duration_s for s in llm.engine.step_trace if s.num_prefill_tokens == 0]
    decode.sort()
    return decode[len(decode) // 2]  # median: robust to a stray slow step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    from conveyor import LLM
    from conveyor.models.loader import resolve_model_path

    torch.manual_seed(args.seed)
    llm = LLM(
        args.model, dtype="float32", max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    arch = llm.engine.arch  # type: ignore[attr-defined]
    prompts, outputs = make_workload(
        args.num_requests, arch.vocab_size, tuple(args.prompt_len), tuple(args.output_len), args.seed
    )
    result: dict = {
        "model": llm.engine.model_path,  # type: ignore[attr-defined]
        "params": arch.num_params,
        "workload": vars(args) | {"json": None, "model": args.model},
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
    }
    result["conveyor"] = run_conveyor(llm, prompts, outputs)
    print(f"conveyor: {result['conveyor']['output_tok_per_s']:.1f} output tok/s "
          f"({result['conveyor']['elapsed_s']:.1f} s, mean batch {result['conveyor']['mean_batch']:.1f})")

    bw = measure_bandwidth()
    weight_bytes = arch.num_params * 4
    limit = weight_bytes / bw
    step = batch1_decode(llm, arch.vocab_size)
    result["batch1"] = {
        "decode_ms_per_step": step * 1e3,
        "bandwidth_GBps": bw / 1e9,
        "weight_MB": weight_bytes / 1e6,
        "bandwidth_limit_ms": limit * 1e3,
        "fraction_of_limit": limit / step,
    }
    print(f"batch-1 decode: {step * 1e3:.2f} ms/step; bandwidth limit {limit * 1e3:.2f} ms "
          f"({weight_bytes / 1e6:.0f} MB at {bw / 1e9:.1f} GB/s) -> {limit / step:.0%} of the limit")

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(args.model)
        if path.suffix == ".gguf":
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        hf.eval()
        pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
        run_hf_static(hf, prompts[:2], [4, 4], 2, pad)  # warm-up
        result["hf_static"] = run_hf_static(hf, prompts, outputs, args.hf_batch_size, pad)
        ratio = result["conveyor"]["output_tok_per_s"] / result["hf_static"]["output_tok_per_s"]
        result["ratio_vs_hf_static"] = ratio
        print(f"HF static generate (batch {args.hf_batch_size}): "
              f"{result['hf_static']['output_tok_per_s']:.1f} output tok/s "
              f"({result['hf_static']['elapsed_s']:.1f} s)")
        print(f"conveyor / HF static = {ratio:.2f}x")
    result["peak_rss_MB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {result['peak_rss_MB']:.0f} MB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
