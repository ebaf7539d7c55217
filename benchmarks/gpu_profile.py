"""Where a batch-1 decode step's time goes on a GPU: the graphed model body, the LM head and
sampler, the runner as a whole and the engine step around it, each timed apart, then the
torch profiler's tables for graphed and eager steps.

    python benchmarks/gpu_profile.py --out DIR          # on a lent GPU
    python benchmarks/gpu_profile.py --fused --out DIR  # with the fused elementwise kernels
    python benchmarks/gpu_profile.py --fused --gemv --out DIR  # and the fused GEMVs
    python benchmarks/gpu_profile.py --smoke        # CPU, tiny shapes: checks the script

The model is gpu_speed.py's Llama-3.2-1B-shaped random model in bfloat16. Each figure is the
median of `--iters` repetitions; device-side figures come from CUDA events around back-to-back
launches, wall figures from the host clock around a synchronised call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_speed import LLAMA_1B_SHAPE, SMOKE_SHAPE, build_llama, sync


def device_ms(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Median ms of `fn` on the device (CUDA events), or on the host clock on a CPU."""
    fn()
    sync("cuda" if cuda else "cpu")
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync("cuda" if cuda else "cpu")
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def profile_table(fn: Callable[[], object], steps: int, cuda: bool, sort: str, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync("cuda" if cuda else "cpu")
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def measure(name: str, llm: Any, iters: int, cuda: bool, tables: list[str]) -> dict:
    """One batch-1 sequence decoding on `llm`: its step's parts timed apart, and profiled."""
    from conveyor import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    engine.add_request("b1", list(range(100, 132)), SamplingParams(max_tokens=100_000, temperature=0.0,
                                                                  ignore_eos=True))
    for _ in range(4):
        engine.step()
    sync("cuda" if cuda else "cpu")
    part: dict = {"engine_step_wall_ms": wall_ms(engine.step, iters, cuda)}
    scheduled = engine.scheduler.schedule(time.perf_counter())
    part["runner_execute_wall_ms"] = wall_ms(lambda: runner.execute(scheduled), iters, cuda)
    part["runner_execute_device_ms"] = device_ms(lambda: runner.execute(scheduled), iters, cuda)
    model = runner.model
    weight = model.embed_tokens.weight
    hidden = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    part["lm_head_argmax_device_ms"] = device_ms(lambda: runner.sampler.greedy(model.compute_logits(hidden)), iters,
                                                 cuda)
    logits = model.compute_logits(hidden).float()
    part["argmax_torch_device_ms"] = device_ms(lambda: logits.argmax(-1), iters, cuda)
    part["argmax_sampler_device_ms"] = device_ms(lambda: runner.sampler.greedy(logits), iters, cuda)
    graphs = runner.graphs
    if graphs is not None and graphs.graphs:
        part["graph_body_device_ms"] = device_ms(graphs.graphs[1].replay, iters, cuda)
        part["graph_body_wall_ms"] = wall_ms(graphs.graphs[1].replay, iters, cuda)
    print(name, json.dumps({k: round(v, 4) for k, v in part.items()}), flush=True)
    for sort in ("self_cuda_time_total", "cpu_time_total") if cuda else ("cpu_time_total",):
        tables.append(f"## {name}: 20 engine steps, sorted by {sort}\n{profile_table(engine.step, 20, cuda, sort)}")
    return part


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--fused", action="store_true", help="with the opt-in fused elementwise kernels (CONVEYOR_TRITON_FUSED=1)")
    ap.add_argument("--gemv", action="store_true", help="with the opt-in fused GEMVs (CONVEYOR_TRITON_GEMV=1)")
    ap.add_argument("--out", type=Path, default=Path("results/gpu-profile"))
    args = ap.parse_args()
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here: run with --smoke to check the script on a CPU", file=sys.stderr)
        return 2
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    os.environ["CONVEYOR_TRITON_FUSED"] = "1" if args.fused else "0"
    os.environ["CONVEYOR_TRITON_GEMV"] = "1" if args.gemv else "0"
    from conveyor import LLM

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    tables: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_llama(Path(tmp) / "m", SMOKE_SHAPE if args.smoke else LLAMA_1B_SHAPE)
        for name, options in (("graphs", {}), ("eager", dict(enforce_eager=True))):
            report[name] = measure(name, LLM(path, device=device, dtype=dtype, num_kv_blocks=512, max_model_len=2048,
                                             **options), args.iters, cuda, tables)
            if cuda:
                torch.cuda.empty_cache()
    text = "\n\n".join(tables)
    (args.out / "gpu_profile.txt").write_text(text)
    (args.out / "gpu_profile.json").write_text(json.dumps(report, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
