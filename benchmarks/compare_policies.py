"""Replay one mixed workload under several scheduler configurations and compare them.

Requests arrive by a Poisson process (seeded); prompt and output lengths are uniform in the
given ranges; EOS is ignored so every configuration produces exactly the same tokens. For each
configuration: output-token throughput over the whole run, and mean / p50 / p99 TTFT and TPOT.

    python benchmarks/compare_policies.py                      # static, dynamic, continuous x 3 prefill modes
    python benchmarks/compare_policies.py --num-requests 48 --rate 1.0 --json results/policies.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "static": dict(batching="static", prefill_mode="mixed"),
    "dynamic": dict(batching="dynamic", prefill_mode="mixed", batch_timeout_ms=2000),
    "continuous+prefill_first": dict(prefill_mode="prefill_first"),
    "continuous+mixed": dict(prefill_mode="mixed"),
    "continuous+chunked": dict(prefill_mode="chunked"),
}


def make_workload(n: int, rate: float, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int) -> list[Any]:
    from conveyor import SamplingParams
    from conveyor.replay import TimedRequest

    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(*prompt_range))]
        params = SamplingParams(max_tokens=rng.randint(*output_range), temperature=0.0, ignore_eos=True)
        out.append(TimedRequest(t, prompt, params, f"r{i}"))
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(outs: list[Any], elapsed: float) -> dict[str, float]:
    ttft = [o.metrics.ttft for o in outs]
    tpot = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "elapsed_s": elapsed,
        "output_tok_per_s": tokens / elapsed,
        "ttft_mean": statistics.mean(ttft), "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
        "tpot_mean": statistics.mean(tpot), "tpot_p50": pct(tpot, 0.5), "tpot_p99": pct(tpot, 0.99),
        "preemptions": sum(o.num_preemptions for o in outs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.8, help="mean arrivals per second (Poisson)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 512))
    ap.add_argument("--batch-size", type=int, default=16, help="max_batch_size of static/dynamic")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from conveyor.config import EngineConfig
    from conveyor.engine import Engine
    from conveyor.replay import replay

    results: dict[str, Any] = {
        "workload": {k: v for k, v in vars(args).items() if k not in ("json", "configs")},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "configs": {},
    }
    workload = None
    for name in args.configs:
        opts = dict(CONFIGS[name])
        if opts.get("batching", "continuous") != "continuous":
            opts["max_batch_size"] = args.batch_size
        config = EngineConfig.from_kwargs(
            model=args.model, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, **opts,
        )
        engine = Engine.from_config(config)
        if workload is None:
            workload = make_workload(args.num_requests, args.rate, tuple(args.prompt_len),
                                     tuple(args.output_len), engine.vocab_size, args.seed)
        # warm-up outside the measurement
        from conveyor import SamplingParams
        engine.add_request("warm", [100] * 16, SamplingParams(max_tokens=2, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        engine.step_trace.clear()
        t = time.perf_counter()
        outs = replay(engine, workload)
        elapsed = time.perf_counter() - t
        summary = summarize(outs, elapsed)
        summary["steps"] = len(engine.step_trace)
        summary["mean_batch"] = statistics.mean(s.num_seqs for s in engine.step_trace)
        results["configs"][name] = summary
        print(f"{name:26s} {summary['output_tok_per_s']:7.1f} tok/s  "
              f"TTFT mean {summary['ttft_mean']:6.2f}s p50 {summary['ttft_p50']:6.2f}s p99 {summary['ttft_p99']:6.2f}s  "
              f"TPOT mean {summary['tpot_mean'] * 1e3:6.0f}ms p50 {summary['tpot_p50'] * 1e3:6.0f}ms "
              f"p99 {summary['tpot_p99'] * 1e3:6.0f}ms  batch {summary['mean_batch']:.1f}", flush=True)
        del engine

    print("\n| configuration | output tok/s | TTFT mean / p50 / p99 (s) | TPOT mean / p50 / p99 (ms) | mean batch |")
    print("|---|---|---|---|---|")
    for name, s in results["configs"].items():
        print(f"| {name} | {s['output_tok_per_s']:.1f} | {s['ttft_mean']:.2f} / {s['ttft_p50']:.2f} / {s['ttft_p99']:.2f} "
              f"| {s['tpot_mean'] * 1e3:.0f} / {s['tpot_p50'] * 1e3:.0f} / {s['tpot_p99'] * 1e3:.0f} | {s['mean_batch']:.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
