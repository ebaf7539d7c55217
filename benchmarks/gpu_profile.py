"""Where a batch-1 decode step's time goes on a GPU: the graphed model body, the LM head and
sampler, the runner as a whole and the engine step around it, each timed apart, then the
torch profiler's tables for graphed and eager steps.

    python benchmarks/gpu_profile.py --out DIR          # on a lent GPU
    python benchmarks/gpu_profile.py --fused --out DIR  # with the fused elementwise kernels
    python benchmarks/gpu_profile.py --fused --gemv --out DIR  # and the fused GEMVs
    python benchmarks/gpu_profile.py --fused --gemv --pdl --out DIR  # launched with PDL
    python benchmarks/gpu_profile.py --smoke        # CPU, tiny shapes: checks the script

The model is gpu_speed.py's Llama-3.2-1B-shaped random model in bfloat16. Each figure is the
median of `--iters` repetitions; device-side figures come from CUDA events around back-to-back
launches, wall figures from the host clock around a synchronised call.

The profiled engine steps' device timeline comes out of the profiler's trace (`timeline` in the
JSON). It gives the kernels a step runs, the time at least one of them ran (busy), and the
time between them (idle) out of the span from the first kernel's start to the last one's end.
It also gives each kernel by name and grid, with its count and mean time. A batch-1 step that
misses the HBM limit loses time in one of two ways: idle time at the kernels' boundaries, or
busy time in kernels that read the weights slower than the bandwidth allows. This tells the
two apart.

    python benchmarks/gpu_profile.py --fused --gemv --pdl --modes graphs --models DIR --out DIR
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


def profiled(fn: Callable[[], object], steps: int, cuda: bool) -> Any:
    """The profiler after `steps` calls of `fn`, with the device's kernels where there is one."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync("cuda" if cuda else "cpu")
    return prof


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's device activity


def kernel_timeline(events: list[dict], steps: int, top: int = 20) -> dict | None:
    """The device's side of a profiled run of `steps` steps, from a Chrome trace's events (`ts`
    and `dur` in microseconds): kernels a step, the time at least one ran (the union of their
    intervals: kernels that overlap count once), the idle time between them inside the span
    from the first start to the last end, the longest gaps, and each kernel by name and grid
    (count a step, mean and total microseconds, share of the busy time). None without device
    events (a CPU run)."""
    spans = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e) for e in events
                    if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"), key=lambda x: x[:2])
    if not spans:
        return None
    busy, gaps = 0.0, []
    first = start = spans[0][0]
    end = spans[0][1]
    for s, e, _ in spans[1:]:
        if s > end:  # the device idle from `end` to `s`
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = end - first
    groups: dict[tuple[str, str], list[float]] = {}
    for s, e, ev in spans:
        grid = (ev.get("args") or {}).get("grid")
        key = (str(ev.get("name", "?")), "x".join(str(g) for g in grid) if grid else "")
        groups.setdefault(key, []).append(e - s)
    kernels = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    return {
        "steps": steps,
        "kernels_per_step": len(spans) / steps,
        "span_us_per_step": span / steps,
        "busy_us_per_step": busy / steps,
        "idle_us_per_step": (span - busy) / steps,
        "idle_share": (span - busy) / span if span > 0 else 0.0,
        "longest_gaps_us": sorted(gaps, reverse=True)[:10],
        "kernels": [{"name": name[:120], "grid": grid, "per_step": len(d) / steps, "mean_us": sum(d) / len(d),
                     "total_us_per_step": sum(d) / steps, "busy_share": sum(d) / busy if busy else 0.0}
                    for (name, grid), d in kernels[:top]],
    }


def trace_events(prof: Any) -> list[dict]:
    """The profiler's Chrome trace, read back as its list of events."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        data = json.loads(path.read_text())
    return data.get("traceEvents", []) if isinstance(data, dict) else data


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
    prof = profiled(engine.step, 20, cuda)
    for sort in ("self_cuda_time_total", "cpu_time_total") if cuda else ("cpu_time_total",):
        tables.append(f"## {name}: 20 engine steps, sorted by {sort}\n{prof.key_averages().table(sort_by=sort, row_limit=25)}")
    timeline = kernel_timeline(trace_events(prof), 20)
    if timeline is not None:
        part["timeline"] = timeline
        print(name, "device timeline a step:", json.dumps({k: round(v, 2) for k, v in timeline.items()
                                                           if isinstance(v, float)}), flush=True)
    return part


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--fused", action="store_true", help="with the opt-in fused elementwise kernels (CONVEYOR_TRITON_FUSED=1)")
    ap.add_argument("--gemv", action="store_true", help="with the opt-in fused GEMVs (CONVEYOR_TRITON_GEMV=1)")
    ap.add_argument("--pdl", action="store_true",
                    help="with programmatic dependent launch (CONVEYOR_TRITON_PDL=1; the GEMVs' best path on an H100)")
    ap.add_argument("--modes", default="graphs,eager", help="comma-separated, of graphs and eager")
    ap.add_argument("--models", type=Path, default=None,
                    help="where gpu_speed.py's models are, or are built (`--models` there): one build a session")
    ap.add_argument("--out", type=Path, default=Path("results/gpu-profile"))
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"graphs", "eager"}:
        ap.error("--modes takes graphs and/or eager")
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here: run with --smoke to check the script on a CPU", file=sys.stderr)
        return 2
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    os.environ["CONVEYOR_TRITON_FUSED"] = "1" if args.fused else "0"
    os.environ["CONVEYOR_TRITON_GEMV"] = "1" if args.gemv else "0"
    os.environ["CONVEYOR_TRITON_PDL"] = "1" if args.pdl else "0"
    from conveyor import LLM

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    tables: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        # gpu_speed.py's model, in the same folder and dtype: a session builds it once.
        folder = args.models or Path(tmp)
        path = build_llama(folder / ("llama-smoke" if args.smoke else "llama-1b"),
                           SMOKE_SHAPE if args.smoke else LLAMA_1B_SHAPE, dtype=getattr(torch, dtype))
        for name in modes:
            options = dict(enforce_eager=True) if name == "eager" else {}
            # Graphs up to 8 sequences: a batch-1 step replays the first, and fewer captures start sooner.
            report[name] = measure(name, LLM(path, device=device, dtype=dtype, num_kv_blocks=512, max_model_len=2048,
                                             cuda_graph_max_batch=8, **options), args.iters, cuda, tables)
            if cuda:
                torch.cuda.empty_cache()
    text = "\n\n".join(tables)
    (args.out / "gpu_profile.txt").write_text(text)
    (args.out / "gpu_profile.json").write_text(json.dumps(report, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
