"""The CUDA path, measured in one run on a lent GPU: greedy agreement with HF transformers,
batch-1 decode against the HBM limit, throughput against HF static and continuous batching, and
the share of a step that the host (scheduler, outputs) adds at 256 running sequences.

    python benchmarks/gpu_speed.py --out DIR                        # every part
    python benchmarks/gpu_speed.py --parts parity,batch1 --out DIR  # some of them
    python benchmarks/gpu_speed.py --smoke                          # CPU, tiny shapes: checks the script

Models are random-weight Llamas built with transformers on the spot (nothing is downloaded):
- parity: a small Llama (4 layers, hidden 512, GQA) with a wider initialisation, so greedy
  choices are not near-ties; conveyor and HF generate 32 greedy tokens for 16 prompts, in
  float32 (TF32 off: exact) and in bfloat16 (exact on most prompts; where they part, whether
  conveyor's token is in HF's top 5 at that position);
- batch1, throughput, overhead: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 kv
  heads, intermediate 8192, vocab 128256, tied embeddings, llama3 rope), bfloat16.

gemv: the fused GEMVs alone (conveyor/kernels/triton_gemv.py), at each projection of that
shape and 1, 2, 4 and 8 rows, against cuBLAS's plain projection (`F.linear`, no fold): each
candidate config (columns and K per program, warps, pipelining depth) timed as a CUDA graph of
back-to-back launches over enough copies of the weight to miss the L2, as a graphed decode
step reads a new layer's weights each time; then the best config launched with programmatic
dependent launch. The best config of each shape is written to `gemv_configs.json` and used by
the parts after it in the same run (`CONVEYOR_GEMV_CONFIGS` names such a file later).

batch1: one sequence decodes 256 tokens; the median wall time of a step (what a client sees)
against the bytes a step reads (every weight once; the tied embedding is the LM head) over the
HBM bandwidth read on the spot (the better of a device-to-device copy and a sum over 4 GiB).
With CUDA graphs and without, with async scheduling and without, with the opt-in fused
kernels and GEMVs and without, the GEMVs with programmatic dependent launch (`+pdl`), and the
fused kernels' decode attention in three launches a layer (`+3launch`: RoPE and write,
attention, reduce) against its one; then the median step of 2, 4 and 8 sequences decoding 64
tokens.

throughput: a ShareGPT-like mix (published means, conveyor.bench.workload) all queued at once,
on conveyor, HF `generate` in padded static batches and HF continuous batching
(`generate_batch`), the same requests for all three. HF takes minutes where conveyor takes
seconds: `--hf-time-limit-s W` stops each baseline W seconds in and takes its rate so far,
which leaves out the tail of its run where few requests are left, so the ratio to conveyor's
whole run is if anything low.

overhead: 256 sequences decoding together. T_engine is the wall time per engine step in the
steady decode phase; T_runner the wall time of the same step run by the runner alone, back to
back (no scheduler, no outputs), pipelined as the engine pipelines it (with async scheduling a
step is launched before the previous one's tokens are awaited); the host share is
1 - T_runner / T_engine, with and without async scheduling (which hides the scheduler behind
the device). That runner-alone figure came out above the async engine's own step on an H100
(3.48 against 3.14 ms, 2026-11-26), so it is no valid baseline there; the device's own step is
also timed as the CUDA graph of that batch size replayed back to back, and 1 - T_graph / T_engine
is the share of an engine step spent outside it. Then the host's own time in a step, by phase:
schedule, submit (the inputs and the launch) and complete, medians.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

PARITY_SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=32000, initializer_range=0.08)
LLAMA_1B_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, initializer_range=0.08)
PARTS = ("parity", "gemv", "batch1", "throughput", "overhead")


def build_llama(folder: Path, shape: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """A random-weight Llama of `shape` saved in `folder` (in `dtype`), or the one a step
    before this one left there (`--models`: the steps of a session share them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return str(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, **shape)
    partial = folder.with_name(folder.name + ".partial")  # a step killed while saving leaves no model
    shutil.rmtree(partial, ignore_errors=True)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(partial, safe_serialization=True)
    partial.rename(folder)
    return str(folder)


def chosen(args: argparse.Namespace, variants: list[Any], name: Callable[[Any], str] = str) -> list[Any]:
    """The variants `--variants` names (all of them when it names none)."""
    return [v for v in variants if not args.variants or name(v) in args.variants]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Give back what a deleted engine held (its KV cache takes most of the GPU by default)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def guarded(name: str, device: str, run: Callable[[], dict]) -> dict:
    """One variant's figures, or the error it raised: a variant that fails (a kernel that does
    not compile on this GPU) costs its own row, not the rest of a call on a lent machine."""
    try:
        return run()
    except Exception as e:  # recorded and printed, and the run goes on
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
    release(device)  # once the exception, and the engine its frames held, is gone
    print(f"{name}: failed ({error})", flush=True)
    return {"error": error}


# A variant's name part -> (variable, value when named, value otherwise).
OPT_IN = {"fused": ("CONVEYOR_TRITON_FUSED", "1", "0"), "gemv": ("CONVEYOR_TRITON_GEMV", "1", "0"),
          "pdl": ("CONVEYOR_TRITON_PDL", "1", "0"), "3launch": ("CONVEYOR_TRITON_ONE_LAUNCH_DECODE", "0", "1")}


@contextlib.contextmanager
def opt_in_kernels(variant: str) -> Iterator[None]:
    """The opt-in Triton kernels a variant's name asks for (`+fused`: the fused element-wise
    kernels, `+gemv`: the fused GEMVs, `+pdl`: the GEMVs with programmatic dependent launch;
    `+3launch`: with the fused kernels, a decode's attention in three launches, RoPE and
    write, attention, reduce, instead of one), switched on while an engine is built and every
    other one off: they stay opt-in until measured, so parity and batch-1 run with them and
    without."""
    wanted = set(variant.split("+")[1:])
    before = {var: os.environ.get(var) for var, _, _ in OPT_IN.values()}
    for name, (var, named, otherwise) in OPT_IN.items():
        os.environ[var] = named if name in wanted else otherwise
    try:
        yield
    finally:
        for var, value in before.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def hbm_bandwidth(device: str, gib: int = 4) -> float:
    """Bytes/s: the better of a copy (read + write counted) and a sum (a read) over `gib`."""
    n = (gib << 30) // 2
    x = torch.ones(n, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    y = torch.empty_like(x)
    best = 0.0
    for fn, nbytes in ((lambda: y.copy_(x), 2 * x.numel() * x.element_size()),
                       (lambda: x.sum(dtype=torch.float32), x.numel() * x.element_size())):
        fn()
        sync(device)
        for _ in range(5):
            t = time.perf_counter()
            fn()
            sync(device)
            best = max(best, nbytes / (time.perf_counter() - t))
    return best


# -- parity -----------------------------------------------------------------------------------
def parity(args: argparse.Namespace, folder: Path) -> dict:
    path = build_llama(folder / ("parity-smoke" if args.smoke else "parity"), SMOKE_SHAPE if args.smoke else PARITY_SHAPE,
                       seed=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 64))] for _ in range(16)]
    new = 8 if args.smoke else 32
    # +fused, +gemv: the opt-in fused element-wise kernels and fused GEMVs (`opt_in_kernels`).
    dtypes = ["float32"] if args.smoke else ["float32", "bfloat16", "bfloat16+fused", "bfloat16+fused+gemv",
                                             "bfloat16+fused+gemv+pdl"]
    out: dict = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for variant in chosen(args, dtypes):
        out[variant] = guarded(variant, args.device, lambda v=variant: parity_variant(args, path, v, prompts, new))
    return out


def parity_variant(args: argparse.Namespace, path: str, variant: str, prompts: list[list[int]], new: int) -> dict:
    from transformers import AutoModelForCausalLM

    from conveyor import LLM, SamplingParams

    dtype = variant.split("+")[0]
    with opt_in_kernels(variant):
        llm = LLM(path, device=args.device, dtype=dtype, num_kv_blocks=256, max_model_len=1024)
    ours = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)]
    del llm
    release(args.device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(args.device).eval()
    exact, within_top5, parted = 0, 0, []
    for prompt, mine in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            g = hf.generate(torch.tensor([prompt], device=args.device), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, output_scores=True, return_dict_in_generate=True,
                            pad_token_id=0, eos_token_id=None)
        theirs = g.sequences[0, len(prompt):].tolist()
        if theirs == mine:
            exact += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        top5 = g.scores[k][0].float().topk(5).indices.tolist()
        within_top5 += mine[k] in top5
        parted.append(k)
    del hf
    release(args.device)
    print(f"parity {variant}: {exact}/{len(prompts)} exact; where they part (positions {parted}), "
          f"conveyor's token is in HF's top 5 in {within_top5}", flush=True)
    return {"prompts": len(prompts), "tokens": new, "exact": exact, "parted_at": parted,
            "ours_in_hf_top5_where_parted": within_top5}


# -- the fused GEMVs alone --------------------------------------------------------------------
def gemv_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, int, dict]]:
    """(N, K, folds) of each projection of a Llama of `shape`, as `DecoderLayer.forward_gemv`
    calls them, and of the LM head."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = h // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * head_dim
    return {"qkv_proj": (qkv, h, dict(norm=True)), "o_proj": (h, h, dict(residual=True)),
            "gate_up_proj": (2 * inter, h, dict(norm=True)), "down_proj": (h, inter, dict(silu_mul=True, residual=True)),
            "lm_head": (shape["vocab_size"], h, {})}


def gemv_candidates(rows: int, n: int, k: int, smoke: bool) -> list[Any]:
    """The configs to time for one shape: the heuristic's first, then a grid of columns and K
    per program, warps, pipelining depth and the next tile's load before or after the
    multiply, whose product tile is 512-16384 elements and whose float32 tile is at most 128
    values a thread."""
    from conveyor.kernels.triton_gemv import Config, config_for

    default = config_for(rows, n, k)
    if smoke:
        return [default, Config(4, 32, 2, prefetch=True)]
    m = 1 << (rows - 1).bit_length()
    out = [default]
    if rows > 1:
        # The tiles as matrix products (`Config.dot`), first: the few-row path that reduces in
        # registers lost to cuBLAS at 2-8 rows on an H100 (2026-11-26).
        out += [Config(16, 256), Config(16, 512), Config(32, 256), Config(32, 256, 8, prefetch=True),
                Config(64, 128), Config(64, 256, 8)]
        out = [out[0]] + [dataclasses.replace(c, dot=True) for c in out[1:]]
    for block_n in (2, 4, 8, 16, 32):
        for block_k in (64, 128, 256, 512, 1024, 2048):
            for warps in (2, 4, 8):
                tile = m * block_n * block_k
                if not 512 <= tile <= 16384 or tile // (32 * warps) > 128 or block_k > max(64, k):
                    continue
                for stages in ((None, 1) if rows == 1 else (None,)):
                    for prefetch in (False, True):
                        cfg = Config(block_n, block_k, warps, stages, prefetch)
                        if cfg != default:
                            out.append(cfg)
    return out


def time_per_launch(launches: list[Callable[[], Any]], device: str, rounds: int = 5) -> float:
    """Seconds per launch of `launches` run back to back: on CUDA captured once as a CUDA graph
    and replayed (no launch overhead, as a graphed decode step), the median of `rounds`."""
    for fn in launches[: 1 if device != "cuda" else 2]:
        fn()  # compiles
    sync(device)
    if device != "cuda":
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            for fn in launches:
                fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) / len(launches)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in launches:
            fn()  # every copy once outside the capture: the allocator's blocks exist
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in launches:
            fn()
    graph.replay()
    sync(device)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / len(launches)


def gemv(args: argparse.Namespace, path: str) -> dict:
    from conveyor.kernels import triton_gemv

    shape = SMOKE_SHAPE if args.smoke else LLAMA_1B_SHAPE
    bandwidth = hbm_bandwidth(args.device, 1 if args.smoke else 4)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if args.device == "cuda" else 1 << 20
    started = time.perf_counter()
    out: dict = {"hbm_GBps_measured": bandwidth / 1e9, "L2_bytes": l2, "shapes": {}}
    table: dict[tuple[int, int, int], Any] = {}
    print("| projection | rows | cuBLAS us (GB/s) | default us (GB/s) | best us (GB/s, of HBM) | best config | "
          "best + PDL us |", flush=True)
    print("|---|---|---|---|---|---|---|", flush=True)
    row_counts = (1,) if args.smoke else (1, 2, 4, 8)  # the interpreter takes about a second a launch
    for i, rows in enumerate(row_counts):
        # Each row count its share of the budget: the later ones are timed too.
        deadline = started + args.gemv_budget_s * (i + 1) / len(row_counts)
        for name, (n, k, fold) in gemv_shapes(shape).items():
            entry, best = gemv_shape(args, rows, n, k, fold, bandwidth, l2, deadline)
            release(args.device)  # the weight copies
            table[(1 << (rows - 1).bit_length(), n, k)] = best
            out["shapes"][f"{name} x{rows}"] = entry
            pdl = entry["pdl_us"]
            print(f"| {name} | {rows} | {entry['cublas_us']:.1f} ({entry['cublas_GBps']:.0f}) | "
                  f"{entry['default_us']:.1f} ({entry['default_GBps']:.0f}) | {entry['best_us']:.1f} "
                  f"({entry['best_GBps']:.0f}, {entry['best_fraction_of_hbm']:.0%}) | n{best.block_n} k{best.block_k} "
                  f"w{best.num_warps} s{best.num_stages}{' prefetch' if best.prefetch else ''}{' dot' if best.dot else ''} | "
                  f"{'' if pdl is None else f'{pdl:.1f}'} |", flush=True)
    triton_gemv.set_configs(table)  # the parts after this one run the tuned GEMVs
    args.out.mkdir(parents=True, exist_ok=True)
    triton_gemv.save_configs(table, args.out / "gemv_configs.json")
    out["configs_file"] = str(args.out / "gemv_configs.json")
    print(f"wrote {args.out / 'gemv_configs.json'} (CONVEYOR_GEMV_CONFIGS=that file uses it)", flush=True)
    return out


def gemv_shape(args: argparse.Namespace, rows: int, n: int, k: int, fold: dict, bandwidth: float, l2: int,
               deadline: float) -> tuple[dict, Any]:
    """One projection at one row count: cuBLAS, then each candidate config until `deadline`,
    then the best with PDL. (figures, best config)"""
    import torch.nn.functional as F

    from conveyor.kernels import triton_gemv

    device, dtype = args.device, getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(rows * n + k)
    wbytes = n * k * dtype.itemsize
    copies = max(2, min(64, -(-3 * l2 // wbytes)))  # together 3x the L2: every read misses it
    weights = [torch.randn(n, k, generator=gen, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, 2 * k if fold.get("silu_mul") else k, generator=gen, device=device, dtype=dtype)
    plain_x = x[:, :k].contiguous()
    norm = torch.rand(k, generator=gen, device=device, dtype=dtype) + 0.5 if fold.get("norm") else None
    residual = torch.randn(rows, n, generator=gen, device=device, dtype=dtype) if fold.get("residual") else None
    reps = 2 if args.smoke else max(copies, 24)
    rounds = 1 if args.smoke else 5
    order = [weights[i % copies] for i in range(reps)]

    def launches(cfg: Any, pdl: bool = False) -> list[Callable[[], Any]]:
        return [functools.partial(triton_gemv.linear, x, w, norm=norm, eps=1e-5, silu_mul=bool(fold.get("silu_mul")),
                                  residual=residual, config=cfg, pdl=pdl) for w in order]

    cublas = time_per_launch([functools.partial(F.linear, plain_x, w) for w in order], device, rounds)
    timed: list[tuple[float, Any]] = []
    for cfg in gemv_candidates(rows, n, k, args.smoke):
        if timed and time.perf_counter() > deadline:
            break  # the budget is spent: the best so far (the default is timed first)
        try:
            timed.append((time_per_launch(launches(cfg), device, rounds), cfg))
        except Exception as e:  # a config that does not compile here (resources) is skipped
            print(f"  {n}x{k}, {rows} row(s), {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
    default_s, default_cfg = timed[0]
    best_s, best_cfg = min(timed, key=lambda t: t[0])
    pdl_s = None
    if device == "cuda" and torch.cuda.get_device_capability()[0] >= 9:
        timing = guarded(f"{n}x{k} PDL", device, lambda: {"s": time_per_launch(launches(best_cfg, True), device)})
        pdl_s = timing.get("s")
    return {"rows": rows, "n": n, "k": k, "weight_bytes": wbytes, "copies": copies,
            "cublas_us": cublas * 1e6, "cublas_GBps": wbytes / cublas / 1e9,
            "default_us": default_s * 1e6, "default_GBps": wbytes / default_s / 1e9,
            "default_config": dataclasses.asdict(default_cfg),
            "best_us": best_s * 1e6, "best_GBps": wbytes / best_s / 1e9, "best_config": dataclasses.asdict(best_cfg),
            "best_fraction_of_hbm": wbytes / best_s / bandwidth, "configs_timed": len(timed),
            "pdl_us": None if pdl_s is None else pdl_s * 1e6}, best_cfg


# -- batch 1 ----------------------------------------------------------------------------------
def decode_bytes(model: Any) -> int:
    """Bytes one decode step reads: every weight once (a tied embedding is the LM head)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def batch1(args: argparse.Namespace, path: str) -> dict:
    steps = 32 if args.smoke else 256
    bandwidth = hbm_bandwidth(args.device, 1 if args.smoke else 4)
    out: dict = {"hbm_GBps_measured": bandwidth / 1e9}
    asynchronous = dict(async_scheduling=True)
    variants: list[tuple[str, dict]] = [
        ("graphs+async+fused+gemv+pdl", asynchronous), ("graphs+async+fused+gemv", asynchronous),
        ("graphs+async+fused+gemv+3launch", asynchronous), ("graphs+async+fused", asynchronous),
        ("graphs+async", asynchronous), ("graphs", {}), ("eager", dict(enforce_eager=True))]
    if args.smoke:  # the script's paths, not the kernels (the interpreter would time Python)
        variants = variants[4:]
    for name, options in chosen(args, variants, lambda v: v[0]):
        out[name] = guarded(name, args.device, lambda n=name, o=options: batch1_variant(args, path, n, o, steps, bandwidth))
    return out


def median_step(engine: Any) -> float:
    """The median wall time of `engine`'s steps until its requests are done."""
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def batch1_variant(args: argparse.Namespace, path: str, name: str, options: dict, steps: int, bandwidth: float) -> dict:
    from conveyor import LLM, SamplingParams

    with opt_in_kernels(name):
        llm = LLM(path, device=args.device, dtype=args.dtype, num_kv_blocks=512, max_model_len=2048,
                  max_num_seqs=256, **options)
    nbytes = decode_bytes(llm.engine.runner.model)
    sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(100, 132))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    engine.add_request("b1", list(range(100, 132)), sp)
    engine.step()  # the prompt (and, async, the first decode launched)
    step = median_step(engine)
    limit = nbytes / bandwidth
    print(f"batch-1 {name}: {step * 1e3:.3f} ms/step ({1 / step:.0f} tok/s); limit {limit * 1e3:.3f} ms "
          f"({nbytes / 1e9:.2f} GB at {bandwidth / 1e9:.0f} GB/s) -> {limit / step:.1%} of the limit", flush=True)
    # A few sequences at once, where the fused GEMVs also run (up to 8 rows): a default must
    # not win batch 1 and lose these.
    small: dict[str, float] = {}
    for b in (2, 4, 8):
        for i in range(b):
            engine.add_request(f"b{b}-{i}", list(range(100 + i, 132 + i)),
                               SamplingParams(max_tokens=steps // 4, temperature=0.0, ignore_eos=True))
        small[str(b)] = median_step(engine) * 1e3  # the prompt's step is one of ~64
    print(f"batch 2 / 4 / 8 {name}: " + " / ".join(f"{ms:.3f}" for ms in small.values()) + " ms/step", flush=True)
    del llm, engine
    release(args.device)
    return {"ms_per_step": step * 1e3, "tok_per_s": 1 / step, "bytes_per_step": nbytes,
            "limit_ms": limit * 1e3, "fraction_of_limit": limit / step, "ms_per_step_at_batch": small}


# -- throughput -------------------------------------------------------------------------------
def throughput(args: argparse.Namespace, path: str, save: Callable[[dict], None] = lambda partial: None) -> dict:
    """conveyor, then each HF baseline, on the same requests. With `--hf-num-requests N` the
    baselines take the mix's first N requests and conveyor runs those N too, so each ratio is
    over the same work (HF continuous batching did not finish 256 requests in a 10-minute call
    on an H100). With `--hf-time-limit-s W` each baseline stops W seconds in, and its rate is
    the tokens it had made by then over those seconds: a rate over HF's start, the tail where
    few requests are left not reached, so if anything higher than its whole run's, and the
    ratio to conveyor's whole run if anything lower than the full runs' would be. `save` gets
    the figures so far after each system: a call that runs out of time keeps what it measured."""
    from transformers import AutoModelForCausalLM

    from conveyor import LLM, SamplingParams
    from conveyor.bench.offline import HFContinuousSystem, HFStaticSystem, SystemSpec
    from conveyor.bench.workload import BenchRequest, LoadPoint, ShareGPTLike

    rng = random.Random(0)
    mix = ShareGPTLike(scale=0.05 if args.smoke else 1.0)
    vocab = 500 if args.smoke else 128000
    lengths = [mix.sample(rng) for _ in range(args.num_requests)]
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(p)] for p, _ in lengths]
    outputs = [o for _, o in lengths]
    reqs = [BenchRequest(i, tuple(p), len(p), o) for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]
    total = sum(outputs)
    out: dict = {"requests": len(reqs), "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": total}

    llm = LLM(path, device=args.device, dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=8192,
              max_model_len=4096, async_scheduling=True)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    sync(args.device)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert sum(len(o.outputs[0].token_ids) for o in outs) == total
    out["conveyor"] = {"elapsed_s": elapsed, "output_tok_per_s": total / elapsed}
    print(f"conveyor: {total / elapsed:.0f} output tok/s ({elapsed:.1f} s)", flush=True)
    n, key = min(args.hf_num_requests or len(reqs), len(reqs)), "conveyor"
    if n < len(reqs):  # the subset the baselines run, on conveyor too
        sub_total = sum(outputs[:n])
        sync(args.device)
        t = time.perf_counter()
        llm.generate(prompts[:n], params[:n], use_tqdm=False)
        sub = time.perf_counter() - t
        key = f"conveyor_first_{n}"
        out[key] = {"elapsed_s": sub, "output_tok_per_s": sub_total / sub}
        print(f"conveyor, the first {n} requests: {sub_total / sub:.0f} output tok/s ({sub:.1f} s)", flush=True)
        reqs = reqs[:n]
    mine = out[key]["output_tok_per_s"]
    save(out)
    del llm, outs
    release(args.device)
    # The same requests with the opt-in fused element-wise kernels (measured at batch 1-8 on an
    # H100; this is their figure at up to 256 sequences and on the prompts' steps).
    with opt_in_kernels("conveyor+fused"):
        llm = LLM(path, device=args.device, dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=8192,
                  max_model_len=4096, async_scheduling=True)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    sync(args.device)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    fused_s = time.perf_counter() - t
    out["conveyor+fused"] = {"elapsed_s": fused_s, "output_tok_per_s": total / fused_s}
    print(f"conveyor+fused: {total / fused_s:.0f} output tok/s ({fused_s:.1f} s)", flush=True)
    save(out)
    del llm
    release(args.device)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    point = LoadPoint("rate", float("inf"))
    limit = args.hf_time_limit_s
    systems = {"hf_continuous": lambda: HFContinuousSystem(SystemSpec("hf_continuous", "hf_continuous"), hf, None, 8192,
                                                           time_limit_s=limit),
               "hf_static": lambda: HFStaticSystem(SystemSpec("hf_static", "hf_static"), hf, None, args.hf_batch_size,
                                                   time_limit_s=limit)}
    for name in args.baselines:
        system = systems[name]()
        try:
            sync(args.device)
            t = time.perf_counter()
            run = system.run(reqs, point)
            elapsed = time.perf_counter() - t
            if limit is not None:  # the run's own time: warm-up and the manager's stop left out
                elapsed = run.duration_s
            produced = sum(r.output_len for r in run.timings)
            out[name] = {"requests": len(reqs), "elapsed_s": elapsed, "output_tokens": produced,
                         "output_tok_per_s": produced / elapsed, "conveyor_ratio": mine / (produced / elapsed)}
            note = ""
            if limit is not None:
                stats = run.engine_stats or {}
                finished = sum(r.end is not None for r in run.timings)
                out[name] |= {"time_limit_s": limit, "finished": finished, "cut": stats.get("cut", 0),
                              "not_started": stats.get("not_started", 0)}
                note = (f", stopped at its {limit:g} s limit: {finished} finished, {stats.get('cut', 0)} cut, "
                        f"{stats.get('not_started', 0)} not started")
            print(f"{name}: {produced / elapsed:.0f} output tok/s ({elapsed:.1f} s, {len(reqs)} requests{note}); "
                  f"conveyor / {name} = {mine / (produced / elapsed):.1f}x", flush=True)
        except Exception as e:  # a baseline that fails is recorded, the others still run
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: failed ({e})", flush=True)
        save(out)
    out["hf_static_batch_size"] = args.hf_batch_size
    return out


# -- host overhead ----------------------------------------------------------------------------
def overhead(args: argparse.Namespace, path: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # where this file is imported, not run
    from host_time import Timers

    from conveyor import LLM, SamplingParams

    n = 8 if args.smoke else 256
    steps = 16 if args.smoke else 64
    out: dict = {"sequences": n}
    # "+fused": with the opt-in fused element-wise kernels (`opt_in_kernels`).
    for name, async_scheduling in (("sync", False), ("async", True), ("async+fused", True)):
        with opt_in_kernels(name):
            llm = LLM(path, device=args.device, dtype=args.dtype, max_num_seqs=n, max_num_batched_tokens=8192,
                      num_kv_blocks=n * ((128 + steps * 4) // 16 + 2) + 64, max_model_len=2048,
                      async_scheduling=async_scheduling)
        engine = llm.engine
        sp = SamplingParams(max_tokens=steps * 4, temperature=0.0, ignore_eos=True)
        for i in range(n):
            engine.add_request(f"r{i}", [100 + (i + j) % 1000 for j in range(128)], sp)
        while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # the prompts
        for _ in range(4):
            engine.step()
        sync(args.device)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(args.device)
        t_engine = (time.perf_counter() - t) / steps
        # Then the host's own time in a step, by phase (benchmarks/host_time.py's timers):
        # scheduling, `submit` (inputs to the device and the launch: the device's work is
        # asynchronous) and completing the step's tokens. Async scheduling can hide them
        # while their sum stays under the device's step.
        timers = Timers()
        timers.wrap(engine.scheduler, "schedule", "schedule")
        timers.wrap(engine.runner, "submit", "submit")
        timers.wrap(engine, "_complete", "complete")
        for _ in range(steps):
            engine.step()
        sync(args.device)
        host = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in timers.times.items()}
        host["sum_ms"] = sum(host.values())
        # The same decode step by the runner alone, back to back, launched the way the engine
        # launches it: with async scheduling each step is submitted before the previous one's
        # tokens are waited for, so both sides measure a pipelined step.
        runner = engine.runner
        scheduled = engine.scheduler.schedule(time.perf_counter())
        assert len(scheduled.scheduled) == n and scheduled.num_tokens == n
        runner.execute(scheduled)
        sync(args.device)
        t = time.perf_counter()
        previous = None
        for _ in range(steps):
            handle = runner.submit(scheduled)
            if not async_scheduling:
                handle.result()
            elif previous is not None:
                previous.result()
            previous = handle
        if previous is not None:
            previous.result()
        sync(args.device)
        t_runner = (time.perf_counter() - t) / steps
        share = 1 - t_runner / t_engine
        # The device's own step: the captured graph of this batch size (the model, the LM head
        # and the argmax) replayed back to back, no host work between replays. 1 - T_graph /
        # T_engine is the share of an engine step in which the device is not running that
        # graph: the host's time and whatever the step adds outside the graph (the copies).
        t_graph = graph_step(runner, n, steps) if args.device == "cuda" else None
        out[name] = {"engine_ms_per_step": t_engine * 1e3, "runner_ms_per_step": t_runner * 1e3, "host_share": share,
                     "graph_ms_per_step": None if t_graph is None else t_graph * 1e3,
                     "share_outside_the_graph": None if t_graph is None else 1 - t_graph / t_engine,
                     "host_phases": host}
        graph_note = "" if t_graph is None else (f"; the graph alone {t_graph * 1e3:.2f} ms -> outside it "
                                                 f"{1 - t_graph / t_engine:.1%} of a step")
        print(f"{n} sequences, {name}: engine {t_engine * 1e3:.2f} ms/step, runner alone {t_runner * 1e3:.2f} ms "
              f"-> the host adds {share:.1%} of a step{graph_note}; host phases (median ms): "
              + ", ".join(f"{k} {v:.3f}" for k, v in host.items()), flush=True)
        del llm, engine, runner
        release(args.device)
    return out


def graph_step(runner: Any, n: int, steps: int) -> float | None:
    """Seconds a replay of the CUDA graph for `n` decodes takes, replays back to back (CUDA
    events around them), on the inputs the last step left; None where there is no such graph."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None or not graphs.captured or n > graphs.max_batch:
        return None
    graph = graphs.graphs.get(graphs.padded_size(n))
    if graph is None:
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in float32: checks the script")
    ap.add_argument("--num-requests", type=int, default=256, help="throughput: requests of the ShareGPT-like mix")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-num-requests", type=int, default=0,
                    help="throughput: the HF baselines take the mix's first N requests (conveyor runs them too); "
                         "0: all of them")
    ap.add_argument("--hf-time-limit-s", type=float, default=None,
                    help="throughput: stop each HF baseline this many seconds in and take its rate so far "
                         "(if anything higher than its whole run's rate); default: run every request to its end")
    ap.add_argument("--baselines", default="hf_continuous,hf_static",
                    help="throughput: the HF baselines to run, in order (hf_static took 319 s on an H100: "
                         "give each its own call to stay inside a 10-minute one)")
    ap.add_argument("--gemv-budget-s", type=float, default=300.0,
                    help="gemv: seconds of config timing after which each shape keeps the best so far")
    ap.add_argument("--variants", default="",
                    help="parity and batch1: only these variants (comma-separated names, as the output prints "
                         "them); default: all")
    ap.add_argument("--models", type=Path, default=None,
                    help="where the random-weight models are built, or found if a run before this one built them "
                         "there; default: a temporary folder")
    ap.add_argument("--out", type=Path, default=Path("results/gpu-speed"))
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    args.baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    args.variants = {v.strip() for v in args.variants.split(",") if v.strip()}
    if set(args.baselines) - {"hf_static", "hf_continuous"}:
        ap.error("--baselines takes hf_static and/or hf_continuous")
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; use {', '.join(PARTS)}")
    if args.smoke:  # the Triton GEMVs run through the interpreter (read when a kernel is defined)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.device = "cpu" if args.smoke else "cuda"
    args.dtype = "float32" if args.smoke else "bfloat16"
    if args.smoke:
        args.num_requests = min(args.num_requests, 8)
        args.hf_batch_size = min(args.hf_batch_size, 4)
    elif not torch.cuda.is_available():
        print("no CUDA device here: run with --smoke to check the script on a CPU", file=sys.stderr)
        return 2
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "argv": sys.argv[1:],
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
    }
    print(f"device: {result['device']}, torch {torch.__version__}", flush=True)

    def save() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_speed.json").write_text(json.dumps(result, indent=1))

    def save_throughput(partial: dict) -> None:
        result["throughput"] = partial
        save()

    with contextlib.ExitStack() as stack:
        folder = args.models or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        big = None
        for part in parts:
            t = time.perf_counter()
            if part == "parity":
                result["parity"] = parity(args, folder)
            else:
                # In the dtype every part runs it in: half the bytes to write and to read.
                big = big or build_llama(folder / ("llama-smoke" if args.smoke else "llama-1b"),
                                         SMOKE_SHAPE if args.smoke else LLAMA_1B_SHAPE, dtype=getattr(torch, args.dtype))
                if part == "throughput":
                    result[part] = throughput(args, big, save_throughput)
                else:
                    result[part] = {"gemv": gemv, "batch1": batch1, "overhead": overhead}[part](args, big)
            print(f"[{part}: {time.perf_counter() - t:.0f} s]", flush=True)
            save()
    print(f"wrote {args.out / 'gpu_speed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
