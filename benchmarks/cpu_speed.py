"""CPU speed: conveyor against HF transformers, static and continuous batching, in one run.

The workload of the CPU speed issue: 64 requests of 128 random prompt tokens and 64 output
tokens (EOS ignored), all queued at once, on a random-weight 134M-parameter Llama (hidden 768,
12 layers, 12 heads, intermediate 2048, vocab 32000, untied head; seed 0; float32), or with
`--model smollm2` the embedded SmolLM2-135M. Prints output tok/s of the three systems and the
ratios, batch-1 decode against the memory-bandwidth limit (weight bytes / a 1 GiB read measured
in the same run) and peak memory.

    python benchmarks/cpu_speed.py                   # the 134M random Llama
    python benchmarks/cpu_speed.py --model smollm2   # SmolLM2-135M from the GGUF
    python benchmarks/cpu_speed.py --skip-hf         # conveyor only
    python benchmarks/cpu_speed.py --quantization none   # float32 only (default: float32 and int8)

conveyor runs twice: float32 (the reference precision) and `quantization="int8"` (int8 weights and
activations; its precision cost is measured by benchmarks/int8_precision.py). The batch-1 limit
counts the bytes one decode step reads: every weight except the embedding table (one row of it is
read), which is the LM head too when the two are tied; int8 layers count one byte per weight.

llama.cpp runs in benchmarks/llama_cpp_speed.py (it needs `llama-cpp-python`).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import measure_bandwidth, run_conveyor, run_hf_static


def build_random_llama(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                      intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def decode_bytes(model) -> int:
    """Weight bytes one decode step reads: every weight but the embedding table, which is read
    whole only when it is the float32 LM head (tied)."""
    from conveyor.models.quantize import Int8Linear

    embedding_is_head = model.lm_head is None and model._head_int8 is None
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    if model._head_int8 is not None:
        int8.append(model._head_int8)
    total = sum(m.in_features * m.out_features for m in int8)
    for name, p in model.named_parameters():
        if name != "embed_tokens.weight" or embedding_is_head:
            total += p.numel() * p.element_size()
    return total


def decode_beside_reads(llm, nbytes: int, steps: int) -> tuple[list[float], list[float]]:
    """One sequence decoding `steps` tokens, every decode step preceded by a read of `nbytes`
    from plain and from huge-page memory: (the faster read, the step) in seconds, per step."""
    from conveyor import SamplingParams
    from conveyor.kernels import to_huge_pages

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    buffers = [torch.ones(nbytes // 4), to_huge_pages(torch.ones(nbytes // 4))]
    engine = llm.engine
    engine.add_request("b1", list(range(100, 132)), SamplingParams(max_tokens=steps + 1, temperature=0.0,
                                                                   ignore_eos=True))
    engine.step()  # the prefill
    reads, times = [], []
    while engine.has_unfinished_requests():
        reads.append(min(timed(b.sum) for b in buffers))
        times.append(timed(engine.step))
    return reads, times


def batch1_paired(llm, nbytes: int, steps: int = 96) -> dict:
    """Batch-1 decode with its limit measured beside every step.

    This VM's memory bandwidth moves by 2x within seconds (neighbours), so a limit read once and
    a step time taken later compare different machines. Here every decode step is preceded by
    a read of `nbytes` (what the step reads) from plain and from huge-page memory; the pair's
    limit is the faster read. Reported: the median step, the median of the per-pair fractions,
    and the best read of the run (the fraction against it is the conservative figure).
    """
    reads, times = decode_beside_reads(llm, nbytes, steps)
    fractions = sorted(r / s for r, s in zip(reads, times, strict=True))
    ordered = sorted(times)
    best = min(reads)
    step = ordered[len(ordered) // 2]
    return {"ms_per_step": step * 1e3, "bytes_per_step": nbytes, "paired_fraction": fractions[len(fractions) // 2],
            "best_read_GBps": nbytes / best / 1e9, "fraction_of_best_read": best / step}


def run_hf_continuous(model, prompts, outputs) -> dict:
    from conveyor.bench.offline import HFContinuousSystem, SystemSpec
    from conveyor.bench.workload import BenchRequest, LoadPoint

    system = HFContinuousSystem(SystemSpec("hf_continuous", "hf_continuous"), model, None, 2048)
    reqs = [BenchRequest(i, tuple(p), len(p), o) for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]
    run = system.run(reqs, LoadPoint("rate", float("inf")))
    produced = sum(t.output_len for t in run.timings)
    return {"elapsed_s": run.duration_s, "output_tokens": produced, "output_tok_per_s": produced / run.duration_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("random-134m", "smollm2"), default="random-134m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quantization", choices=("none", "int8", "both"), default="both")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"),
                    help="conveyor's KV cache dtype (llama.cpp keeps float16 by default)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from conveyor import LLM
    from conveyor.bench.offline import load_hf_model
    from conveyor.models.loader import resolve_model_path

    tmp = tempfile.TemporaryDirectory()
    path = str(build_random_llama(Path(tmp.name))) if args.model == "random-134m" else None
    variants = {"none": [None], "int8": ["int8"], "both": [None, "int8"]}[args.quantization]
    result: dict = {"model": args.model, "threads": torch.get_num_threads(), "kv_cache_dtype": args.kv_cache_dtype}
    systems = []
    bw = measure_bandwidth()
    for quantization in variants:
        name = "conveyor" if quantization is None else f"conveyor_{quantization}"
        llm = LLM(path, max_num_seqs=64, max_num_batched_tokens=2048, quantization=quantization,
                  kv_cache_dtype=args.kv_cache_dtype)
        arch = llm.engine.arch  # type: ignore[attr-defined]
        rng = random.Random(0)
        prompts = [[rng.randrange(100, arch.vocab_size - 100) for _ in range(args.prompt_len)]
                   for _ in range(args.num_requests)]
        outputs = [args.output_len] * args.num_requests
        result["params"] = arch.num_params
        result[name] = run_conveyor(llm, prompts, outputs)
        print(f"{name}: {result[name]['output_tok_per_s']:.1f} output tok/s "
              f"({result[name]['elapsed_s']:.1f} s, mean batch {result[name]['mean_batch']:.1f})", flush=True)
        read = decode_bytes(llm.engine.runner.model)  # type: ignore[attr-defined]
        result[name]["batch1"] = batch1_paired(llm, read)
        bw = max(bw, measure_bandwidth(), result[name]["batch1"]["best_read_GBps"] * 1e9)
        systems.append(name)
        del llm
    for name in systems:
        b1 = result[name]["batch1"]
        limit = b1["bytes_per_step"] / bw
        b1.update(bandwidth_GBps=bw / 1e9, limit_ms=limit * 1e3, fraction_of_limit=limit / (b1["ms_per_step"] / 1e3))
        print(f"{name} batch-1 decode: {b1['ms_per_step']:.2f} ms/step = {1e3 / b1['ms_per_step']:.1f} tok/s; "
              f"bandwidth limit {limit * 1e3:.2f} ms ({b1['bytes_per_step'] / 1e6:.0f} MB at {bw / 1e9:.1f} GB/s) "
              f"-> {b1['fraction_of_limit']:.0%} of the limit; {b1['paired_fraction']:.0%} of the limit read "
              f"beside each step (median)", flush=True)
    if not args.skip_hf:
        model_path = path if path is not None else str(resolve_model_path(None))
        hf = load_hf_model(model_path)
        result["hf_static"] = run_hf_static(hf, prompts, outputs, args.hf_batch_size, 0)
        print(f"HF static generate (batch {args.hf_batch_size}): {result['hf_static']['output_tok_per_s']:.1f} output tok/s", flush=True)
        try:
            result["hf_continuous"] = run_hf_continuous(hf, prompts, outputs)
            print(f"HF continuous batching: {result['hf_continuous']['output_tok_per_s']:.1f} output tok/s", flush=True)
        except Exception as e:  # not every transformers version has it
            result["hf_continuous"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"HF continuous batching: unavailable ({e})")
        for name in ("hf_static", "hf_continuous"):
            tps = result[name].get("output_tok_per_s")
            for system in systems if tps else []:
                print(f"{system} / {name} = {result[system]['output_tok_per_s'] / tps:.2f}x")
    result["peak_rss_MB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {result['peak_rss_MB']:.0f} MB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
