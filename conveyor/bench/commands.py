"""`conveyor bench serve | offline | compare | report`: the command line of the benchmark.

    conveyor bench serve --base-url http://127.0.0.1:8000 --request-rate 1,2,4   # any OpenAI server
    conveyor bench serve --launch --max-num-seqs 64 --concurrency 1,8,32         # starts conveyor
    conveyor bench offline --request-rate 0.5,1,inf                              # in-process + HF baselines
    conveyor bench compare static dynamic continuous+chunked hf_static --request-rate 0.5,1,2
    conveyor bench report results/bench-compare-.../result.json                  # redraw from JSON
    conveyor bench report measured/result.json simulated/result.json --out both  # side by side

Every run writes result.json, summary.md and PNG plots into --out (see conveyor/bench/report.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from conveyor.bench import report
from conveyor.bench.metrics import SLO, RequestTiming
from conveyor.bench.workload import (
    BenchRequest,
    LengthDist,
    LoadPoint,
    ShareGPTLike,
    at_load,
    describe,
    load_trace,
    parse_sweep,
    parse_tenants,
    sharegpt_requests,
    synthetic_requests,
    with_shared_prefix,
    with_tenants,
)


def add_bench_parser(sub: Any, add_engine_args: Any) -> None:
    """Register `bench` and its subcommands on the top-level `conveyor` subparsers."""
    bench = sub.add_parser("bench", help="benchmark: workloads, SLO metrics, policy comparison, plots",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    # Engine flags first: the workload's --seed then replaces the engine's (conflict "resolve");
    # it seeds the engine's sampling too, which greedy decoding never uses.
    serve = bsub.add_parser("serve", help="load an OpenAI-compatible server over HTTP (or --launch conveyor)",
                            conflict_handler="resolve")
    add_engine_args(serve)
    where = serve.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", action="store_true",
                       help="start `conveyor serve` on a free loopback port with the engine options given here")
    g = serve.add_argument_group("client")
    g.add_argument("--model-name", default=None, help="model field of each request (default: the first of /v1/models)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (token-id or text prompts) or /v1/chat/completions (text prompts)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so every output has exactly its length (vLLM's extension)")
    g.add_argument("--stream-usage", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for token counts in every chunk (stream_options.continuous_usage_stats)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--vocab-size", type=int, default=32000,
                   help="synthetic prompt ids are drawn below this (the server's vocabulary size)")
    g.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    g.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="scrape /metrics during the run (KV usage, queues, preemptions)")
    g.add_argument("--metrics-interval", type=float, default=0.25, help="seconds between /metrics scrapes")
    g.add_argument("--label", default=None, help="the system's name in the report")
    g.add_argument("--server-log", type=Path, default=None, help="--launch: the server's log (default OUT/server.log)")
    _add_common(serve)
    serve.set_defaults(func=cmd_serve)

    offline = bsub.add_parser("offline", help="run conveyor in-process, with HF transformers baselines",
                              conflict_handler="resolve")
    add_engine_args(offline)
    offline.add_argument("--label", default="conveyor", help="the conveyor system's name in the report")
    offline.add_argument("--baselines", default="hf_static,hf_continuous",
                         help="comma-separated: hf_static, hf_continuous, or none")
    _add_offline(offline)
    offline.set_defaults(func=cmd_offline)

    compare = bsub.add_parser(
        "compare", help="several conveyor configurations (and HF baselines) on one workload, one report",
        description="CONFIG: a built-in name (static, dynamic, continuous, continuous+prefill_first, "
        "continuous+mixed, continuous+chunked), a baseline (hf_static, hf_continuous), or "
        "[LABEL:]key=value,... with engine option names, applied over the engine options given as flags. "
        "Default: static dynamic continuous+prefill_first continuous+mixed continuous+chunked.",
        conflict_handler="resolve",
    )
    add_engine_args(compare)
    compare.add_argument("configs", nargs="*", metavar="CONFIG")
    _add_offline(compare)
    compare.set_defaults(func=cmd_compare)

    rep = bsub.add_parser("report", help="redraw summary.md and the plots from a result.json, or merge several "
                          "(a simulated run beside a measured one) into one report")
    rep.add_argument("result", type=Path, nargs="+")
    rep.add_argument("--out", type=Path, default=None, help="default: the result's folder (required to merge)")
    _add_plot_args(rep)
    rep.set_defaults(func=cmd_report)


def _add_common(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests per load point (default 32; with --trace, the whole trace)")
    w.add_argument("--workload", choices=("synthetic", "sharegpt"), default="synthetic",
                   help="synthetic: --input-len/--output-len distributions; sharegpt: ShareGPT-like lengths "
                   "(published means, see docs/benchmarking.md)")
    w.add_argument("--input-len", default="uniform:32,256",
                   help="prompt tokens: N | uniform:LO,HI | normal:MEAN,STD | lognormal:MEAN,STD | exponential:MEAN,MAX")
    w.add_argument("--output-len", default="uniform:16,128", help="output tokens, same forms as --input-len")
    w.add_argument("--sharegpt-scale", type=float, default=1.0, help="multiply ShareGPT-like lengths (0.25 on a CPU)")
    w.add_argument("--sharegpt-sigma", type=float, default=1.0, help="lognormal shape of the ShareGPT-like lengths (an assumption)")
    w.add_argument("--shared-prefix-len", type=int, default=0,
                   help="every prompt starts with the same N random tokens (a system prompt; prefix caching finds it)")
    w.add_argument("--prefix-groups", type=int, default=1,
                   help="with --shared-prefix-len: that many different prefixes, one drawn at random per request")
    w.add_argument("--prefix-share", type=float, default=1.0,
                   help="with --shared-prefix-len: the fraction of requests that take a prefix (the others are one-offs)")
    w.add_argument("--tenants", default=None,
                   help="requests come from these tenants, NAME:WEIGHT,... (share of requests); the report adds "
                   "a table per tenant (offline: SamplingParams.tenant; online: the request's user)")
    w.add_argument("--trace", type=Path, default=None,
                   help="JSONL trace: arrival_s, prompt | prompt_token_ids | prompt_len, output_len")
    w.add_argument("--request-rate", default=None,
                   help="sweep of request rates, e.g. 0.5,1,2,inf (req/s; inf: all at once)")
    w.add_argument("--concurrency", default=None, help="sweep of fixed concurrencies (closed loop), e.g. 1,4,16")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma arrivals: 1 = Poisson, < 1 burstier, > 1 more regular")
    w.add_argument("--seed", type=int, default=0,
                   help="the same seed gives the same workload everywhere (also the engine's sampling seed)")
    s = p.add_argument_group("SLO and output")
    s.add_argument("--slo", default=None, help="e.g. ttft=500ms,tpot=100ms,e2e=20s (goodput counts requests meeting all)")
    s.add_argument("--slo-attainment", type=float, default=0.9,
                   help="share of requests that must meet the SLO for a load to count (DistServe: 90%%)")
    s.add_argument("--out", type=Path, default=None, help="result folder (default results/bench-MODE-TIME)")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    _add_plot_args(p)


def _add_plot_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plots")
    g.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="draw the PNGs")
    g.add_argument("--cdf-point", type=int, default=-1, help="sweep index of the latency CDFs (default: the last)")
    g.add_argument("--occupancy-point", type=int, default=-1, help="sweep index of the occupancy timeline")
    g.add_argument("--occupancy", default=None,
                   help="systems drawn in the occupancy timeline, comma-separated (default: a static one and a continuous one)")
    g.add_argument("--occupancy-max-steps", type=int, default=300, help="steps shown in the occupancy timeline")


def _add_offline(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=16,
                   help="batch size of static/dynamic batching, conveyor's and HF's (max_batch_size)")
    p.add_argument("--hf-time-limit-s", type=float, default=None, metavar="S",
                   help="stop each HF baseline S seconds into each load point; a request it has not finished is "
                   "reported as cut, and its tokens count in the generated output throughput (for HF runs far "
                   "slower than conveyor's, as on a GPU)")
    _add_common(p)


# -- building the workload -----------------------------------------------------------------
def build_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[BenchRequest], list[LoadPoint], dict[str, Any]]:
    points = parse_sweep(args.request_rate, args.concurrency)
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests={args.num_requests} must be at least 1")
    n = args.num_requests or 32
    desc: dict[str, Any] = {"seed": args.seed, "burstiness": args.burstiness}
    if args.trace is not None:
        requests = load_trace(args.trace, vocab_size, args.seed, LengthDist.parse(args.output_len), args.num_requests)
        desc.update(kind="trace", description=f"trace {args.trace}")
    elif points[0].kind == "trace":
        raise ValueError("give --request-rate or --concurrency (or a --trace with arrival times)")
    elif args.workload == "sharegpt":
        mix = ShareGPTLike(sigma=args.sharegpt_sigma, scale=args.sharegpt_scale)
        requests = sharegpt_requests(n, mix, vocab_size, args.seed)
        desc.update(kind="sharegpt", description=mix.describe())
    else:
        inp, out = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
        requests = synthetic_requests(n, inp, out, vocab_size, args.seed)
        desc.update(kind="synthetic", description=f"input {inp.describe()}, output {out.describe()}",
                    input_len=inp.describe(), output_len=out.describe())
    if (args.prefix_groups != 1 or args.prefix_share != 1.0) and not args.shared_prefix_len:
        raise ValueError("--prefix-groups and --prefix-share need --shared-prefix-len")
    if args.shared_prefix_len:
        groups = args.prefix_groups
        requests = with_shared_prefix(requests, args.shared_prefix_len, vocab_size, args.seed, groups,
                                      args.prefix_share)
        desc["description"] += (
            f", a shared prefix of {args.shared_prefix_len} tokens"
            if groups == 1 else f", one of {groups} shared prefixes of {args.shared_prefix_len} tokens"
        )
        if args.prefix_share != 1.0:
            desc["description"] += f" for {args.prefix_share:.0%} of the requests"
        desc["shared_prefix_len"] = args.shared_prefix_len
        desc["prefix_groups"] = groups
    if args.tenants:
        requests = with_tenants(requests, parse_tenants(args.tenants), args.seed)
        desc["description"] += f", tenants {args.tenants}"
        desc["tenants"] = args.tenants
    kind = points[0].kind
    desc["arrivals"] = {
        "trace": "the trace's times",
        "concurrency": "closed loop (fixed concurrency)",
        "rate": "Poisson" if args.burstiness == 1 else f"gamma, burstiness {args.burstiness:g}",
    }[kind]
    desc.update(describe(requests))
    return requests, points, desc


def _require(args: argparse.Namespace, http: bool = False) -> None:
    """Fail before a long run, not after it, when an optional dependency is missing."""
    import importlib.util

    missing = [m for m, needed in (("matplotlib", args.plots), ("httpx", http)) if needed and importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} not installed: pip install 'conveyor[bench]'"
                         + (" (or run with --no-plots)" if missing == ["matplotlib"] else ""))


def _slo(args: argparse.Namespace) -> SLO | None:
    if not 0 < args.slo_attainment <= 1:
        raise ValueError(f"--slo-attainment={args.slo_attainment} must be in (0, 1]")
    return SLO.parse(args.slo) if args.slo else None


def _out_dir(args: argparse.Namespace, mode: str) -> Path:
    return args.out or Path("results") / f"bench-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"


def _bar(args: argparse.Namespace, total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="req", dynamic_ncols=True, disable=not args.progress)


def _line(name: str, point: LoadPoint, summary: dict[str, Any]) -> str:
    def ms(d: dict[str, Any], k: str) -> str:
        return "-" if d.get(k) is None else f"{d[k] * 1e3:.0f}"

    s = summary
    done = f"{s['completed']}/{s['num_requests']} done"
    if s.get("cut"):  # stopped at its time limit: the rate of every token it made
        done += f" ({s['cut']} cut at the time limit), {report.output_rate(s):.1f} out tok/s generated"
    else:
        done += f", {s['output_throughput']:.1f} out tok/s"
    text = (f"{name} @ {point.label}: {done}, TTFT p50 {ms(s['ttft_s'], 'p50')} p99 {ms(s['ttft_s'], 'p99')} ms, "
            f"TPOT p50 {ms(s['tpot_s'], 'p50')} p99 {ms(s['tpot_s'], 'p99')} ms")
    if s.get("goodput") is not None:
        text += f", goodput {s['goodput']:.2f} req/s ({s['slo_attainment']:.0%} met the SLO)"
    return text


def _finish(args: argparse.Namespace, result: dict[str, Any], out: Path) -> int:
    names = [n.strip() for n in args.occupancy.split(",")] if args.occupancy else None
    files = report.write_report(result, out, args.plots, args.cdf_point, args.occupancy_point, names, args.occupancy_max_steps)
    print()
    print(report.markdown(result))
    print("wrote " + ", ".join(str(f) for f in files))
    made = sum(p["summary"].get("generated_output_tokens", p["summary"]["total_output_tokens"])
               for s in result["systems"] for p in s["points"])
    if made == 0:
        print("error: no request made a token (see the errors above)", file=sys.stderr)
        return 1
    return 0


# -- offline and compare -------------------------------------------------------------------
def cmd_offline(args: argparse.Namespace) -> int:
    from conveyor.bench.offline import SystemSpec, parse_config

    options = _engine_options(args)
    specs = [SystemSpec(args.label, "conveyor", {})]
    for name in filter(None, (b.strip() for b in args.baselines.split(","))):
        if name != "none":
            spec = parse_config(name)
            if spec.kind == "conveyor":
                raise ValueError(f"--baselines: {name!r} is not a baseline (hf_static, hf_continuous)")
            specs.append(spec)
    return _run_offline(args, "offline", specs, options)


def cmd_compare(args: argparse.Namespace) -> int:
    from conveyor.bench.offline import SEEDS_COMPARISON, parse_config

    specs = [parse_config(c) for c in (args.configs or SEEDS_COMPARISON)]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must differ: {names}")
    return _run_offline(args, "compare", specs, _engine_options(args))


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    from conveyor.cli import engine_kwargs

    return engine_kwargs(args)


def _run_offline(args: argparse.Namespace, mode: str, specs: Sequence[Any], options: dict[str, Any]) -> int:
    from conveyor.bench.offline import OfflineSystems

    _require(args)
    slo = _slo(args)
    out = _out_dir(args, mode)
    # Systems vary only the scheduling options; the model and cache come from the flags.
    systems = OfflineSystems.load(options, args.batch_size, args.hf_time_limit_s)
    requests, points, desc = build_workload(args, systems.vocab_size)
    result = report.new_result(mode, desc, points, slo, args.slo_attainment, getattr(args, "argv", None))
    result["engine_options"] = options
    run_systems(args, result, specs, requests, points, slo, systems.build, lambda spec, _: systems.options_of(spec))
    return _finish(args, result, out)


def run_systems(
    args: argparse.Namespace,
    result: dict[str, Any],
    specs: Sequence[Any],
    requests: Sequence[BenchRequest],
    points: Sequence[LoadPoint],
    slo: SLO | None,
    build: Callable[[Any], Any],
    options_of: Callable[[Any, Any], dict[str, Any]],
    kind: str | None = None,
    on_point: Callable[[Any, Any, dict[str, Any]], Any] | None = None,
) -> None:
    """Every system (`build(spec)`) at every load point into `result`, with a progress bar.

    A refused configuration or a failed point is reported and the others still run.
    `on_point(spec, system, point_entry)` may add to each point's entry (the simulator does)."""
    from conveyor.bench.offline import failed_run
    from conveyor.config import ConfigError

    bar = _bar(args, len(specs) * len(points) * len(requests))
    try:
        for spec in specs:
            try:
                system = build(spec)
                entry = report.add_system(result, spec.name, kind or spec.kind, options_of(spec, system))
            except Exception as e:  # a refused configuration: reported, the others still run
                report.add_system(result, spec.name, kind or spec.kind, dict(spec.options), f"{type(e).__name__}: {e}")
                bar.update(len(points) * len(requests))
                bar.write(f"{spec.name}: {type(e).__name__}: {e}")
                continue
            for k, point in enumerate(points):
                reqs = at_load(requests, point, args.burstiness, args.seed)
                bar.set_description(f"{spec.name} @ {point.label}")
                before = bar.n
                try:
                    run = system.run(reqs, point, bar.update)
                except ConfigError as e:  # the engine refused the options (an unknown policy, say)
                    entry["error"] = f"{type(e).__name__}: {e}"
                    bar.update((len(points) - k) * len(reqs) - (bar.n - before))
                    bar.write(f"{spec.name}: {entry['error']}")
                    break
                except Exception as e:  # e.g. HF continuous batching unsupported here
                    run = failed_run(reqs, f"{type(e).__name__}: {e}")
                bar.update(len(reqs) - (bar.n - before))
                _tag_tenants(run.timings, reqs)
                p = report.add_point(entry, point, run.timings, run.duration_s, slo, run.engine_stats,
                                     None, run.occupancy, run.error)
                if on_point is not None and run.error is None:
                    on_point(spec, system, p)
                bar.write(f"{spec.name} @ {point.label}: error {run.error}" if run.error else _line(spec.name, point, p["summary"]))
            system.close()
    finally:
        bar.close()


def _tag_tenants(timings: list[RequestTiming], requests: list[BenchRequest]) -> None:
    """Each timing gets its request's tenant (whatever system ran it)."""
    tenant = {r.index: r.tenant for r in requests}
    for t in timings:
        t.tenant = tenant.get(t.index)


# -- serve ---------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    _require(args, http=True)
    from conveyor.bench.client import Target, launch_conveyor, run_online

    slo = _slo(args)
    out = _out_dir(args, "serve")
    out.mkdir(parents=True, exist_ok=True)
    options = _engine_options(args)
    extra = sorted(k for k in options if k != "seed")
    if extra and not args.launch:
        raise ValueError(f"engine options ({', '.join(extra)}) apply only with --launch")
    requests, points, desc = build_workload(args, args.vocab_size)
    result = report.new_result("serve", desc, points, slo, args.slo_attainment, getattr(args, "argv", None))

    def run(base_url: str, label: str) -> None:
        target = Target(base_url, args.model_name, args.endpoint, args.ignore_eos, args.stream_usage, args.api_key)
        entry = report.add_system(result, label, "server", {"base_url": base_url, **({"engine": options} if args.launch else {})})
        for i, point in enumerate(points):
            reqs = at_load(requests, point, args.burstiness, args.seed)
            bar = _bar(args, len(reqs))
            bar.set_description(f"{label} @ {point.label}")
            try:
                r = run_online(target, reqs, point.concurrency, args.metrics, args.metrics_interval,
                               args.warmup if i == 0 else 0, bar)
            finally:
                bar.close()
            _tag_tenants(r.timings, reqs)
            p = report.add_point(entry, point, r.timings, r.duration_s, slo, server_metrics=r.server_metrics)
            print(_line(label, point, p["summary"]))

    if args.launch:
        log = args.server_log or out / "server.log"
        with launch_conveyor(_serve_flags(options), log) as url:
            run(url, args.label or "conveyor")
    else:
        run(args.base_url, args.label or args.base_url)
    return _finish(args, result, out)


def _serve_flags(options: dict[str, Any]) -> list[str]:
    """Engine options back into `conveyor serve` flags."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


def cmd_report(args: argparse.Namespace) -> int:
    _require(args)
    if len(args.result) > 1:
        if args.out is None:
            raise ValueError("merging several results needs --out")
        result = report.merge_results([report.load_result(p) for p in args.result], [str(p) for p in args.result])
        out = args.out
    else:
        result = report.load_result(args.result[0])
        out = args.out or args.result[0].parent
    names = [n.strip() for n in args.occupancy.split(",")] if args.occupancy else None
    files = report.write_report(result, out, args.plots, args.cdf_point, args.occupancy_point, names, args.occupancy_max_steps)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m conveyor.bench.commands ...` is `conveyor bench ...`."""
    from conveyor.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


__all__ = ["add_bench_parser", "build_workload", "main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
