"""`conveyor simulate` and `conveyor calibrate`.

    conveyor simulate --hardware h100-sxm --model llama-3.1-8b --request-rate 5,10,20 --num-requests 1000
    conveyor simulate --hardware a100-40gb --model opt-13b static continuous --request-rate inf
    conveyor calibrate                       # measure this CPU with SmolLM2; then --hardware cpu
    conveyor simulate --hardware cpu --model smollm2-135m --request-rate 0.5

`simulate` takes the workload, SLO, plot and scheduler flags of `conveyor bench compare`
(CONFIGs too) and writes the same report: result.json, summary.md and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.bench.offline import ConveyorSystem
from conveyor.sim.hardware import Hardware, get_hardware, hardware_names
from conveyor.sim.models import ModelShape, get_model, model_names


def add_sim_parsers(sub: Any, add_engine_args: Any) -> None:
    from conveyor.bench.commands import _add_offline

    sim = sub.add_parser(
        "simulate", help="run the real scheduler on a hardware cost model (virtual clock, no model)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve",
    )
    add_engine_args(sim)
    from conveyor.cli import add_router_args

    add_router_args(sim)
    g = sim.add_argument_group("simulation")
    g.add_argument("--hardware", required=True, help=f"one of {', '.join(hardware_names())} (cpu: calibrated)")
    g.add_argument("--model", default="smollm2-135m",
                   help=f"one of {', '.join(model_names())}, or an HF config.json (or its folder)")
    g.add_argument("--calibration", type=Path, default=None,
                   help="--hardware cpu: the calibration file (default: the one `conveyor calibrate` saved)")
    for name, help_ in (("mfu", "share of peak FLOP/s reached by linear layers"),
                        ("attn-mfu", "share of peak FLOP/s reached by attention"),
                        ("mbu", "share of memory bandwidth reached streaming weights"),
                        ("kv-mbu", "share of memory bandwidth reached reading K/V in attention"),
                        ("step-overhead-ms", "fixed time per step"),
                        ("seq-overhead-us", "time per sequence in a step"),
                        ("allreduce-latency-us", "tensor_parallel_size > 1: fixed time of one all-reduce "
                                                 "(default 10)"),
                        ("link-efficiency", "tensor_parallel_size > 1: share of the device link's bandwidth "
                                            "an all-reduce reaches (default 0.8)")):
        g.add_argument(f"--{name}", type=float, default=None, help=f"cost model: {help_} (overrides the default)")
    g.add_argument("--pipeline-link-gbps", type=float, default=None,
                   help="pipeline_parallel_size > 1: the link between stages, in GB/s (default: the devices' own, "
                        "NVLink's 450 on an H100: stages in one machine; 50: a 400 Gb/s NIC between machines)")
    g.add_argument("--kv-transfer-gbps", type=float, default=50.0,
                   help="with --prefill-replicas/--decode-replicas: the link a handoff's K/V cross, in GB/s "
                        "(default 50: one 400 Gb/s NIC between machines; NVLink within one is ~450)")
    g.add_argument("--max-tokens-factor", type=float, default=1.0, metavar="F",
                   help="each request asks for F times its output length as max_tokens and ends at its length "
                        "(a stop token the simulated model samples there), as clients ask for more than answers take: "
                        "what kv_reservation=reserve or estimate hold back for (default 1: exactly its length)")
    g.add_argument("--spec-acceptance-rate", type=float, default=None,
                   help="with --speculative-method: the chance that the (absent) model accepts a draft, "
                        "independently per position (the simulator has no model to verify drafts)")
    g.add_argument("--spec-rank-acceptance", type=float, nargs="+", default=None, metavar="RATE",
                   help="with a --speculative-token-tree: the chances that the model's token is the drafter's "
                        "second, third, ... candidate at a depth (the first's is --spec-acceptance-rate)")
    sim.add_argument("configs", nargs="*", metavar="CONFIG",
                     help="systems as in `conveyor bench compare` (default: one, with the flags given)")
    _add_offline(sim)
    sim.set_defaults(func=cmd_simulate)

    cal = sub.add_parser("calibrate", help="measure this machine's runner and fit the simulator's CPU cost model",
                         conflict_handler="resolve")
    add_engine_args(cal)
    cal.add_argument("--out", type=Path, default=None, help="where to save (default ~/.cache/conveyor/calibration/cpu.json)")
    cal.add_argument("--repeats", type=int, default=5,
                     help="rounds over the shape grid, each shape timed once a round (median)")
    cal.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                     help="also time every step of a short served workload (about 30 s)")
    cal.set_defaults(func=cmd_calibrate)


# -- simulate -------------------------------------------------------------------------------
def resolve(args: argparse.Namespace) -> tuple[Hardware, ModelShape, Any]:
    """(hardware, model, cost params) from the flags; --hardware cpu reads the calibration."""
    from conveyor.sim import calibrate
    from conveyor.sim.cost import CostParams

    model = get_model(args.model)
    if args.hardware.lower() == "cpu":
        cal = calibrate.load(args.calibration)
        hardware, params = cal.hardware, cal.params
        if (cal.model.layer_params, cal.model.num_layers) != (model.layer_params, model.num_layers):
            print(f"note: {cal.path} was calibrated with {cal.model.name}; its overheads may not carry over "
                  f"to {model.name}", file=sys.stderr)
    else:
        hardware, params = get_hardware(args.hardware), CostParams()
    overrides = {
        "mfu": args.mfu, "attn_mfu": args.attn_mfu, "mbu": args.mbu, "kv_mbu": args.kv_mbu,
        "step_overhead_s": None if args.step_overhead_ms is None else args.step_overhead_ms / 1e3,
        "seq_overhead_s": None if args.seq_overhead_us is None else args.seq_overhead_us / 1e6,
        "allreduce_latency_s": None if args.allreduce_latency_us is None else args.allreduce_latency_us / 1e6,
        "link_efficiency": args.link_efficiency,
    }
    params = dataclasses.replace(params, **{k: v for k, v in overrides.items() if v is not None})
    return hardware, model, params


class SimSystem(ConveyorSystem):
    """One scheduler configuration on the cost model. The measured system's run loop (replay,
    closed loop, traces) with a simulated engine in place of the real one; with
    `data_parallel_size` > 1 (a flag, or a CONFIG's option, as the router's), that many replicas
    of it, one device each, behind the router."""

    def __init__(self, spec: Any, options: dict[str, Any], hardware: Hardware, model: ModelShape,
                 params: Any, batch_size: int, cost_model: Any = None, router: dict[str, Any] | None = None,
                 acceptance_rate: float | None = None, link_bandwidth: float = 50e9,
                 rank_acceptance: tuple[float, ...] = (),
                 pipeline_link_bandwidth: float | None = None, max_tokens_factor: float = 1.0) -> None:
        """`cost_model` replaces the roofline model that `params` would build (a profiled table,
        or one that records the steps it prices); `router` holds `RouterConfig` options;
        `acceptance_rate` is the chance a speculative draft is accepted (`rank_acceptance`: a token
        tree's, that its rank-1, 2, ... candidate is the model's token); `link_bandwidth` (bytes/s)
        carries the K/V from prefill to decode replicas."""
        from conveyor.core.routing import RouterConfig

        names = {f.name for f in dataclasses.fields(RouterConfig)}
        router_options = {**(router or {}), **{k: v for k, v in spec.options.items() if k in names}}
        spec = dataclasses.replace(spec, options={k: v for k, v in spec.options.items() if k not in names})
        super().__init__(spec, None, options, batch_size)  # type: ignore[arg-type]  # no base engine
        self.router_config = RouterConfig(**router_options)
        self.check_backend(self.router_config.data_parallel_backend)
        self.hardware, self.model, self.params, self.cost_model = hardware, model, params, cost_model
        self.acceptance_rate = acceptance_rate
        self.rank_acceptance = rank_acceptance
        self.link_bandwidth = link_bandwidth
        self.pipeline_link_bandwidth = pipeline_link_bandwidth
        self.last_engine: Any = None
        self.last_engines: list[Any] = []
        self.max_tokens_factor = max_tokens_factor  # --max-tokens-factor

    def params_of(self, r: Any) -> Any:
        from conveyor.bench.offline import bench_params

        return bench_params(r, self.max_tokens_factor)

    @staticmethod
    def check_backend(backend: str) -> None:
        if backend != "mp":
            from conveyor.config import ConfigError

            raise ConfigError("the simulator runs its replicas on a virtual clock: --data-parallel-backend does not apply")

    def _engine(self) -> Any:
        from conveyor.sim.engine import build_sim_engine

        self.last_engine = build_sim_engine(self.config, self.hardware, self.model, self.params, self.cost_model,
                                            acceptance_rate=self.acceptance_rate, rank_acceptance=self.rank_acceptance,
                                            pipeline_link_bandwidth=self.pipeline_link_bandwidth)
        self.last_engines = [self.last_engine]
        return self.last_engine

    def run(self, requests: Any, point: Any, progress: Any = None) -> Any:
        import gc

        # Millions of short-lived step objects and no cycles among them: the cyclic collector
        # would only rescan the live ones (a quarter of the wall time at 10,000 requests).
        gc.disable()
        try:
            if self.router_config.disaggregated:
                return self._run_disaggregated(requests, point, progress)
            if self.router_config.data_parallel_size > 1:
                return self._run_replicas(requests, point, progress)
            return super().run(requests, point, progress)
        finally:
            gc.enable()

    def _run_engines(self, engines: list[Any], requests: Any, point: Any,
                     replay: Callable[[list[Any], int | None], Any],
                     describe: Callable[[Any, list[Any], list[Any], dict[str, Any]], None]) -> Any:
        """One load point over several simulated engines: `replay(timed, concurrency)` serves
        the requests (its result has `outputs` in their order), `describe(done, timings, traces,
        stats)` adds what the layout has to say to the pooled engine stats."""
        from conveyor.bench.offline import (
            SystemRun,
            _prompt,
            _timing_from_output,
            engine_stats,
            occupancy_from_trace,
        )
        from conveyor.replay import TimedRequest
        from conveyor.trace import trace_dict

        timed = [TimedRequest(r.arrival_s, _prompt(r), self.params_of(r), f"bench-{r.index}") for r in requests]
        concurrency = int(point.value) if point.kind == "concurrency" else None
        t0 = max(e.clock() for e in engines)
        done = replay(timed, concurrency)
        timings = [_timing_from_output(r.index, out) for r, out in zip(requests, done.outputs, strict=True)]
        end = max((t.end for t in timings if t.end is not None), default=t0)
        traces = [trace_dict(e) for e in engines]
        stats = engine_stats([s for t in traces for s in t["steps"]])
        describe(done, timings, traces, stats)
        return SystemRun(timings, max(end - t0, 1e-9), stats, occupancy_from_trace(traces[engines.index(self.last_engine)]))

    def _run_replicas(self, requests: Any, point: Any, progress: Any) -> Any:
        from conveyor.bench.offline import engine_stats
        from conveyor.core.routing import make_router
        from conveyor.sim.engine import build_sim_engine
        from conveyor.sim.replicas import replay_on_replicas

        n = self.router_config.data_parallel_size
        engines = [build_sim_engine(self.config, self.hardware, self.model, self.params, self.cost_model,
                                    acceptance_rate=self.acceptance_rate, rank_acceptance=self.rank_acceptance,
                                    pipeline_link_bandwidth=self.pipeline_link_bandwidth, seed=i) for i in range(n)]
        self.last_engine, self.last_engines = engines[0], engines

        def describe(done: Any, timings: list[Any], traces: list[Any], stats: dict[str, Any]) -> None:
            served: list[list[Any]] = [[] for _ in engines]  # each replica's timings
            for t, k in zip(timings, done.routed, strict=True):
                served[k].append(t)
            stats["replicas"] = [
                {"requests": len(mine), "busy_s": e.runner_busy_s,
                 "prompt_tokens": sum(t.prompt_len or 0 for t in mine),
                 "cached_tokens": sum(t.cached_tokens or 0 for t in mine),
                 "max_kv_blocks": engine_stats(tr["steps"]).get("kv_blocks_max", 0)}
                for mine, e, tr in zip(served, engines, traces, strict=True)
            ]
            stats["routing"] = {"policy": self.router_config.router_policy, "reasons": dict(done.reasons),
                                "migrations": done.migrations, "migrated_bytes": done.migrated_bytes}

        router = make_router(self.router_config)
        return self._run_engines(engines, requests, point,
                                 lambda timed, c: replay_on_replicas(engines, router, timed, c, progress,
                                                                     migration=self.router_config.replica_migration,
                                                                     link_bandwidth=self.link_bandwidth), describe)

    def _run_disaggregated(self, requests: Any, point: Any, progress: Any) -> Any:
        from conveyor.bench.offline import engine_stats
        from conveyor.core.routing import make_router
        from conveyor.sim.engine import build_sim_engine
        from conveyor.sim.replicas import replay_disaggregated

        rc = self.router_config
        # The decode replicas receive K/V into host memory: a host's share a device unless set.
        receive = self.config.cache.kv_receive_space or DEFAULT_SIM_RECEIVE_SPACE
        decode_config = dataclasses.replace(self.config, cache=dataclasses.replace(self.config.cache,
                                                                                  kv_receive_space=receive))

        def build(config: Any, seed: int) -> Any:
            return build_sim_engine(config, self.hardware, self.model, self.params, self.cost_model,
                                    acceptance_rate=self.acceptance_rate, rank_acceptance=self.rank_acceptance,
                                    pipeline_link_bandwidth=self.pipeline_link_bandwidth, seed=seed)

        prefill = [build(self.config, i) for i in range(rc.prefill_replicas)]
        decode = [build(decode_config, rc.prefill_replicas + i) for i in range(rc.decode_replicas)]
        engines = [*prefill, *decode]
        self.last_engine, self.last_engines = decode[0], engines

        def describe(done: Any, timings: list[Any], traces: list[Any], stats: dict[str, Any]) -> None:
            roles = [("prefill", k, done.prefill_routed) for k in range(len(prefill))]
            roles += [("decode", k, done.decode_routed) for k in range(len(decode))]
            stats["replicas"] = [
                {"role": role, "requests": routed.count(k), "busy_s": e.runner_busy_s,
                 "max_kv_blocks": engine_stats(tr["steps"]).get("kv_blocks_max", 0)}
                for (role, k, routed), e, tr in zip(roles, engines, traces, strict=True)
            ]
            n = len(done.transfer_s)
            stats["kv_transfer"] = {
                "handoffs": n, "bytes": done.transfer_bytes, "link_gbps": self.link_bandwidth / 1e9,
                "mean_s": sum(done.transfer_s) / n if n else 0.0, "max_s": max(done.transfer_s, default=0.0),
                "recomputed": sum(e.num_kv_recomputed for e in decode),
            }

        prefill_router, decode_router = make_router(rc.pool("prefill")), make_router(rc.pool("decode"))
        return self._run_engines(engines, requests, point, lambda timed, c: replay_disaggregated(
            prefill, decode, prefill_router, decode_router, timed, self.link_bandwidth, c, progress), describe)


# What a simulated decode replica keeps for received K/V when kv_receive_space is not given.
DEFAULT_SIM_RECEIVE_SPACE = 64 << 30


def cmd_simulate(args: argparse.Namespace) -> int:
    from conveyor.bench import report
    from conveyor.bench.commands import (
        _finish,
        _out_dir,
        _require,
        _slo,
        build_workload,
        run_systems,
    )
    from conveyor.bench.offline import SystemSpec, parse_config
    from conveyor.cli import engine_kwargs, router_config
    from conveyor.sim.engine import describe_capacity

    _require(args)
    hardware, model, params = resolve(args)
    options = {k: v for k, v in engine_kwargs(args).items() if k != "model"}
    router = dataclasses.asdict(router_config(args))
    SimSystem.check_backend(router["data_parallel_backend"])
    specs = [parse_config(c) for c in args.configs] if args.configs else [SystemSpec(hardware.name, "conveyor", {})]
    for s in specs:
        if s.kind != "conveyor":
            raise ValueError(f"{s.name!r}: the simulator runs conveyor's scheduler only, not HF baselines")
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"configuration names must differ: {[s.name for s in specs]}")
    if args.spec_acceptance_rate is not None and not any(
        {**options, **s.options}.get("speculative_method") for s in specs
    ):
        raise ValueError("--spec-acceptance-rate applies only with a --speculative-method (a flag or a CONFIG's)")
    if args.max_tokens_factor < 1:
        raise ValueError(f"--max-tokens-factor {args.max_tokens_factor}: at least 1 (max_tokens covers the answer)")
    slo = _slo(args)
    out = _out_dir(args, "simulate")
    requests, points, desc = build_workload(args, model.vocab_size)
    if args.max_tokens_factor > 1:
        desc["description"] += f", max_tokens {args.max_tokens_factor:g}x each output (ended by a stop token at its length)"
        desc["max_tokens_factor"] = args.max_tokens_factor
    result = report.new_result("simulate", desc, points, slo, args.slo_attainment, getattr(args, "argv", None))
    result["engine_options"] = options
    sim: dict[str, Any] = {"hardware": dataclasses.asdict(hardware), "model": dataclasses.asdict(model),
                           "cost_params": params.to_dict(), "systems": {}}
    result["simulation"] = sim

    def on_point(spec: Any, system: SimSystem, point: dict[str, Any]) -> None:
        point["simulated_busy_s"] = sum(e.runner_busy_s for e in system.last_engines)
        rc = system.router_config
        replicas = rc.prefill_replicas + rc.decode_replicas if rc.disaggregated else rc.data_parallel_size
        sim["systems"][spec.name] = {**describe_capacity(system.last_engine), "replicas": replicas,
                                     "prefill_replicas": rc.prefill_replicas, "decode_replicas": rc.decode_replicas}

    wall = time.perf_counter()
    run_systems(
        args, result, specs, requests, points, slo,
        build=lambda spec: SimSystem(spec, options, hardware, model, params, args.batch_size, router=router,
                                     acceptance_rate=args.spec_acceptance_rate,
                                     rank_acceptance=tuple(args.spec_rank_acceptance or ()),
                                     link_bandwidth=args.kv_transfer_gbps * 1e9,
                                     pipeline_link_bandwidth=None if args.pipeline_link_gbps is None
                                     else args.pipeline_link_gbps * 1e9, max_tokens_factor=args.max_tokens_factor),
        options_of=lambda spec, system: {**dataclasses.asdict(system.config.scheduler),
                                         **dataclasses.asdict(system.router_config)},
        kind="simulated", on_point=on_point,
    )
    sim["wall_s"] = time.perf_counter() - wall
    cap = next(iter(sim["systems"].values()), None)
    if cap:
        devices = cap["tensor_parallel_size"] * cap["pipeline_parallel_size"]
        each = f" on each of {devices} devices" if devices > 1 else ""
        print(f"{model.name} on {hardware.description}: weights {cap['weight_gib']:.1f} GiB, KV cache "
              f"{cap['kv_gib']:.1f} GiB = {cap['kv_tokens']:,} tokens{each}; simulated in {sim['wall_s']:.1f} s")
    return _finish(args, result, out)


# -- calibrate ------------------------------------------------------------------------------
def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from conveyor.cli import engine_kwargs
    from conveyor.config import EngineConfig
    from conveyor.engine import Engine
    from conveyor.sim import calibrate

    options = engine_kwargs(args)
    if options.get("device", "cpu") != "cpu" and options.get("device") != "auto":
        raise ValueError("calibrate measures the CPU runner; a GPU is simulated from its datasheet")
    options.update(device="cpu")
    # Calibrate the engine as it would serve, KV cache size included (the flags are serve's);
    # only a cache too small for the grid's largest shape is enlarged. Runs 30-33 of
    # docs/simulation.md calibrated this way, runs 1-29 on 2,304 blocks.
    engine = Engine.from_config(EngineConfig.from_kwargs(**options))
    need = calibrate.grid_blocks(engine.config.cache.block_size)
    blocks: int = engine.runner.num_blocks  # type: ignore[attr-defined]  # ModelRunner's, not the protocol's
    if blocks < need:
        print(f"the KV cache holds {blocks} blocks; the calibration grid needs {need}: "
              f"calibrating with num_kv_blocks={need}")
        engine = Engine.from_model(EngineConfig.from_kwargs(**{**options, "num_kv_blocks": need}),
                                   engine.runner.model, engine.tokenizer,  # type: ignore[attr-defined]
                                   getattr(engine, "model_path", None))  # the weights already loaded
    threads = torch.get_num_threads()
    print(f"measuring peaks ({threads} threads)...")
    before = calibrate.measure_peaks()
    model = ModelShape.from_arch(engine.arch, Path(str(engine.model_path)).stem)  # type: ignore[attr-defined]
    samples = calibrate.collect(engine, args.repeats, args.served, progress=lambda s: print("  " + s))
    flops, bandwidth = calibrate.best_peaks([before, calibrate.measure_peaks()])
    hardware = calibrate.cpu_hardware(flops, bandwidth, threads)
    print(f"  fp32 GEMM {flops / 1e9:.1f} GFLOP/s, memory read {bandwidth / 1e9:.1f} GB/s (best before / after)")
    fit = calibrate.fit(hardware, model, samples, engine.config.cache.block_size,
                        skinny=calibrate.runner_skinny_rows(),
                        fused_rows=calibrate.runner_fused_rows(getattr(engine.runner, "model", None)))
    p = fit.params
    print(f"fit: mfu {p.mfu:.3f}, attn_mfu {p.attn_mfu:.3f}, mbu {p.mbu:.3f}, kv_mbu {p.kv_mbu:.3f}, "
          f"skinny kernel (<= {p.skinny_rows} rows): mbu {p.gemv_mbu or p.mbu:.3f}, mfu {p.gemv_mfu or p.mfu:.3f}; "
          f"step {p.step_overhead_s * 1e3:.2f} ms (+{p.unfused_overhead_s * 1e3:.2f} ms unless fused, "
          f"+{p.gemm_overhead_s * 1e3:.2f} ms over {p.skinny_rows} rows), "
          f"seq {p.seq_overhead_s * 1e6:.0f} us, token {p.token_overhead_s * 1e6:.0f} us; "
          f"error median {fit.median_abs_rel_error:.1%}, max {fit.max_abs_rel_error:.1%}")
    path = calibrate.save(args.out or calibrate.default_calibration_path(), hardware, model,
                          getattr(engine, "model_path", None), fit, samples, engine.config.cache.block_size)
    print(f"saved {path}; use it with `conveyor simulate --hardware cpu`")
    return 0
