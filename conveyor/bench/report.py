"""Benchmark results: the JSON document, its Markdown summary and its plots.

The JSON result is the single source: `write_report` draws everything from it, so
`conveyor bench report result.json` redraws a report without running anything. Shape:

    {"mode", "date", "machine", "command", "workload": {...}, "slo": {...} | null,
     "slo_attainment_target", "sweep": [{"kind", "value", "label"}, ...],
     "systems": [{"name", "kind", "options", "error",
                  "max_load_meeting_slo",            # DistServe goodput of the sweep
                  "points": [{"load", "summary", "engine", "server_metrics", "occupancy",
                              "requests", "error"}, ...]}, ...]}

`summary` is `metrics.summarize`; `requests` has each request's TTFT / TPOT / E2E (the CDFs);
`occupancy` (in-process runs) has one bar per run of steps a request was computed in.

A point stopped at a time limit (`--hf-time-limit-s`) has cut requests; its output rate, in the
table, the plots and the ratios to the baselines, is its generated output throughput (every
token made by the limit over the time run), marked with `*`.

Plots are PNGs drawn with matplotlib's Agg backend at 100 dpi, each well under 200 KB:
throughput against load, TTFT / TPOT against load, latency CDFs at one load point, and the batch
occupancy timeline (requests as bars across steps, systems side by side).
"""

from __future__ import annotations

import json
import math
import platform
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conveyor.bench.metrics import SLO, RequestTiming, max_load_meeting, per_request_rows, summarize
from conveyor.bench.workload import LoadPoint

DPI = 100
MAX_PNG_BYTES = 200_000


def output_rate(summary: dict[str, Any]) -> float:
    """A point's output tokens per second: its completed requests' over the run, or, for a run
    a time limit cut short, every token it made (`generated_output_throughput`)."""
    if summary.get("cut"):
        return float(summary["generated_output_throughput"])
    return float(summary["output_throughput"])


# -- building the result -------------------------------------------------------------------
def new_result(
    mode: str,
    workload: dict[str, Any],
    sweep: Sequence[LoadPoint],
    slo: SLO | None,
    target: float,
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """An empty result; `argv` is the `conveyor` command line that produced it."""
    return {
        "mode": mode,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "command": shlex.join(["conveyor", *argv]) if argv is not None else None,
        "workload": workload,
        "slo": slo.to_json() if slo is not None else None,
        "slo_attainment_target": target,
        "sweep": [p.to_json() for p in sweep],
        "systems": [],
    }


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    info["cpu"] = platform.processor() or platform.machine()
    return info


def add_system(result: dict[str, Any], name: str, kind: str, options: dict[str, Any], error: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "kind": kind, "options": options, "error": error, "points": []}
    result["systems"].append(entry)
    return entry


def add_point(
    system: dict[str, Any],
    point: LoadPoint,
    timings: Sequence[RequestTiming],
    duration_s: float,
    slo: SLO | None,
    engine: dict[str, Any] | None = None,
    server_metrics: dict[str, Any] | None = None,
    occupancy: dict[str, Any] | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    entry = {
        "load": point.to_json(),
        "summary": summarize(timings, duration_s, slo),
        "engine": engine,
        "server_metrics": server_metrics,
        "occupancy": occupancy,
        "requests": per_request_rows(timings),
        "error": error,
    }
    system["points"].append(entry)
    return entry


def finalize(result: dict[str, Any]) -> dict[str, Any]:
    """Per system, DistServe's goodput of the sweep: the highest load meeting the SLO target."""
    target = result.get("slo_attainment_target", 0.9)
    for system in result["systems"]:
        pairs = [
            (_load_value(p["load"]), p["summary"].get("slo_attainment"))
            for p in system["points"]
            if p["load"]["kind"] != "trace"
        ]
        best = max_load_meeting(pairs, target) if result.get("slo") else None
        system["max_load_meeting_slo"] = "inf" if best is not None and math.isinf(best) else best
    return result


def _load_value(load: dict[str, Any]) -> float:
    return math.inf if load["value"] is None else float(load["value"])


def write_json(result: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(result, indent=1, default=_json_default))
    return path


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return None
    if isinstance(x, tuple | set):
        return list(x)
    return str(x)


# -- Markdown ------------------------------------------------------------------------------
def _ms(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    return "–" if v is None else f"{v * 1e3:.0f}"


def _s(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    return "–" if v is None else f"{v:.2f}"


def _num(v: Any, fmt: str = ".2f") -> str:
    return "–" if v is None else format(v, fmt)


def markdown(result: dict[str, Any]) -> str:
    """The summary table (one row per system and load), the sweep's goodput and any errors."""
    w = result["workload"]
    slo = SLO(**result["slo"]) if result.get("slo") else None
    lines = [
        f"# conveyor bench ({result['mode']})",
        "",
        f"- date: {result['date']}; machine: {_machine_line(result['machine'])}",
        f"- workload: {w.get('description', '')}; {w.get('num_requests')} requests per point, "
        f"mean prompt {_num(w.get('mean_prompt_len'), '.1f')} / output {_num(w.get('mean_output_len'), '.1f')} tokens, seed {w.get('seed')}",
        f"- load: {', '.join(p['label'] for p in result['sweep'])}"
        + (f" (arrivals: {w['arrivals']})" if w.get("arrivals") else ""),
        f"- SLO: {slo.describe() if slo else 'none'}"
        + (f"; goodput target {result['slo_attainment_target']:.0%} attainment" if slo else ""),
    ]
    if result.get("command"):
        lines.append(f"- command: `{result['command']}`")
    sim = result.get("simulation")
    if sim:
        p = sim["cost_params"]
        gemv = f"one-row mbu {p['gemv_mbu']:.2f}, " if p.get("gemv_mbu") is not None else ""
        lines.append(
            f"- simulated: {sim['model']['name']} on {sim['hardware']['description']} (a cost model on a virtual clock: "
            f"mfu {p['mfu']:.2f}, attention {p['attn_mfu']:.2f}, mbu {p['mbu']:.2f}, kv {p.get('kv_mbu', 0):.2f}, {gemv}"
            f"step {p['step_overhead_s'] * 1e3:.2f} ms, sequence {p['seq_overhead_s'] * 1e6:.0f} us, "
            f"token {p.get('token_overhead_s', 0) * 1e6:.0f} us)"
        )
        for name, cap in sim.get("systems", {}).items():
            tp, pp = cap.get("tensor_parallel_size", 1), cap.get("pipeline_parallel_size", 1)
            parallel = "data-parallel attention, expert parallel" if cap.get("enable_dp_attention") else "tensor parallel"
            split = " x ".join([*([f"{tp} {parallel}"] if tp > 1 else []), *([f"{pp} pipeline stages"] if pp > 1 else [])])
            each = f" on each of {tp * pp} devices ({split})" if tp * pp > 1 else ""
            devices = cap.get("replicas", 1) * tp * pp
            lines.append(f"  - {name}: KV cache {cap['kv_gib']:.1f} GiB = {cap['kv_tokens']:,} tokens, "
                         f"weights {cap['weight_gib']:.1f} GiB{each}; {devices} device{'s' if devices > 1 else ''} in all"
                         + (f"; a host tier of {cap['offload_tokens']:,} tokens (KV offloading)"
                            if cap.get("offload_tokens") else "")
                         + (f", a disk tier of {cap['disk_tokens']:,}" if cap.get("disk_tokens") else ""))
    lines += [
        "",
        "| system | load | done | req/s | in tok/s | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
        "| ITL p50 / p99 (ms) | E2E p50 / p99 (s) | goodput (req/s) | SLO met | preemptions | KV peak | prefix hits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system in result["systems"]:
        if system.get("error") and not system["points"]:
            lines.append(f"| {system['name']} | – | error: {system['error'][:80]} |" + " |" * 12)
            continue
        for p in system["points"]:
            s = p["summary"]
            goodput = _num(s.get("goodput"))
            met = "–" if s.get("slo_attainment") is None else f"{s['slo_attainment']:.0%}"
            pre, kv = _pressure(p)
            hits = "–" if s.get("prefix_cache_hit_rate") is None else f"{s['prefix_cache_hit_rate']:.0%}"
            cut = f" ({s['cut']} cut)" if s.get("cut") else ""
            rate = f"{output_rate(s):.1f}" + ("*" if s.get("cut") else "")
            lines.append(
                f"| {system['name']} | {p['load']['label']} | {s['completed']}/{s['num_requests']}{cut} "
                f"| {s['request_throughput']:.2f} | {s['input_throughput']:.1f} | {rate} "
                f"| {_ms(s['ttft_s'], 'p50')} / {_ms(s['ttft_s'], 'p99')} "
                f"| {_ms(s['tpot_s'], 'p50')} / {_ms(s['tpot_s'], 'p99')} "
                f"| {_ms(s['itl_s'], 'p50')} / {_ms(s['itl_s'], 'p99')} "
                f"| {_s(s['e2e_s'], 'p50')} / {_s(s['e2e_s'], 'p99')} | {goodput} | {met} | {pre} | {kv} | {hits} |"
            )
    limits: list[float] = sorted({float(x) for sy in result["systems"] for p in sy["points"]
                                  if p["summary"].get("cut") and (x := (sy.get("options") or {}).get("time_limit_s"))})
    if limits:
        at = " or ".join(f"{x:g} s" for x in limits)
        lines += ["", f"\\* stopped at its time limit ({at} into the point): the requests it had not finished are cut, "
                  "and out tok/s counts every token it made by then over that time. The tail of its run, where few "
                  "requests are left, is not reached, so the rate is if anything higher than its whole run's."]
    lines += _ratios(result)
    tenant_rows = [
        (system["name"], p["load"]["label"], name, t)
        for system in result["systems"] for p in system["points"]
        for name, t in (p["summary"].get("per_tenant") or {}).items()
    ]
    if tenant_rows:
        lines += [
            "",
            "Per tenant:",
            "",
            "| system | load | tenant | done | out tok/s | TTFT p50 / p99 (ms) | E2E p50 / p99 (s) | SLO met |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, label, tenant, t in tenant_rows:
            met = "–" if t.get("slo_attainment") is None else f"{t['slo_attainment']:.0%}"
            lines.append(
                f"| {name} | {label} | {tenant} | {t['completed']}/{t['num_requests']} | {t['output_throughput']:.1f} "
                f"| {_ms(t['ttft_s'], 'p50')} / {_ms(t['ttft_s'], 'p99')} | {_s(t['e2e_s'], 'p50')} / {_s(t['e2e_s'], 'p99')} | {met} |"
            )
    if slo is not None:
        lines += ["", f"Highest load meeting the SLO for {result['slo_attainment_target']:.0%} of requests (DistServe's goodput):", ""]
        for system in result["systems"]:
            best = system.get("max_load_meeting_slo")
            kind = result["sweep"][0]["kind"] if result["sweep"] else "rate"
            unit = " req/s" if kind == "rate" else ""
            lines.append(f"- {system['name']}: " + ("none of the loads" if best is None else f"{best:g}{unit}" if isinstance(best, int | float) else f"{best}{unit}"))
    errors = [(sy["name"], p["load"]["label"], p["error"]) for sy in result["systems"] for p in sy["points"] if p.get("error")]
    errors += [(sy["name"], "all", sy["error"]) for sy in result["systems"] if sy.get("error")]
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- {name} @ {label}: {err}" for name, label, err in errors]
    return "\n".join(lines) + "\n"


def _ratios(result: dict[str, Any]) -> list[str]:
    """Each conveyor system's output rate against each baseline's (HF transformers), at each
    load both ran without an error: the comparison the seeds' articles draw."""
    def rates(kind_is_baseline: bool) -> list[tuple[str, dict[str, float]]]:
        return [(sy["name"], {p["load"]["label"]: output_rate(p["summary"]) for p in sy["points"] if not p.get("error")})
                for sy in result["systems"] if str(sy["kind"]).startswith("hf_") == kind_is_baseline]

    lines: list[str] = []
    mine = rates(False)
    for base, base_rates in rates(True):
        for label, r in base_rates.items():
            ours = [f"{name} {got[label] / r:.2f}x" for name, got in mine if label in got]
            if r > 0 and ours:
                lines.append(f"- @ {label}, against {base} ({r:.1f} out tok/s): " + ", ".join(ours))
    return ["", "Output throughput against the baselines:", "", *lines] if lines else []


def _machine_line(m: dict[str, Any]) -> str:
    parts = [str(m.get("cpu", "")), f"{m.get('threads')} threads" if m.get("threads") else "", f"torch {m['torch']}" if m.get("torch") else ""]
    if m.get("cuda"):
        parts.append(str(m["cuda"]))
    return ", ".join(p for p in parts if p)


def _pressure(point: dict[str, Any]) -> tuple[str, str]:
    """(preemptions, peak KV usage) from the server's /metrics or the engine's step trace."""
    sm, eng = point.get("server_metrics") or {}, point.get("engine") or {}
    pre = sm.get("preemptions", eng.get("preemptions"))
    if sm.get("kv_cache_usage_max") is not None:
        kv = f"{sm['kv_cache_usage_max']:.0%}"
    elif eng.get("kv_blocks_max") is not None:
        kv = f"{eng['kv_blocks_max']} blocks"
    else:
        kv = "–"
    return ("–" if pre is None else f"{pre:g}"), kv


# -- plots ---------------------------------------------------------------------------------
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _loads(result: dict[str, Any]) -> tuple[list[str], str]:
    labels = [p["label"] for p in result["sweep"]]
    kind = result["sweep"][0]["kind"] if result["sweep"] else "rate"
    return labels, {"rate": "request rate (req/s)", "concurrency": "concurrency"}.get(kind, "load")


def _series(system: dict[str, Any], labels: list[str], get: Any) -> list[float]:
    by_label = {p["load"]["label"]: p for p in system["points"]}
    out = []
    for label in labels:
        p = by_label.get(label)
        v = get(p["summary"]) if p is not None and not p.get("error") else None
        out.append(math.nan if v is None else v)
    return out


def _save(fig: Any, path: Path, legend: bool = False) -> Path:
    """Save at DPI; `legend`: one legend of the labelled lines, below the panels."""
    if legend:
        handles, names = [], []
        for ax in fig.axes:
            for h, n in zip(*ax.get_legend_handles_labels(), strict=True):
                if n not in names:
                    handles.append(h)
                    names.append(n)
        if handles:
            fig.legend(handles, names, loc="lower center", ncol=min(len(names), 5), fontsize=8, frameon=False)
            fig.tight_layout(rect=(0, 0.06 * math.ceil(len(names) / 5), 1, 1))
        else:
            fig.tight_layout()
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)
    return path


def plot_throughput(result: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    labels, xlabel = _loads(result)
    x = list(range(len(labels)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    has_slo = bool(result.get("slo"))
    for system in result["systems"]:
        ax1.plot(x, _series(system, labels, output_rate), marker="o", label=system["name"])
        key = "goodput" if has_slo else "request_throughput"
        ax2.plot(x, _series(system, labels, lambda s, k=key: s.get(k)), marker="o")
    ax1.set_ylabel("output tokens / s")
    ax2.set_ylabel("goodput (req/s meeting the SLO)" if has_slo else "completed requests / s")
    for ax in (ax1, ax2):
        ax.set_xticks(x, labels)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    ax1.set_title("throughput")
    ax2.set_title("goodput" if has_slo else "request throughput")
    return _save(fig, path, legend=True)


def plot_latency_vs_load(result: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    labels, xlabel = _loads(result)
    x = list(range(len(labels)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, system in enumerate(result["systems"]):
        c = colors[i % len(colors)]
        for ax, key in zip(axes, ("ttft_s", "tpot_s"), strict=True):
            ax.plot(x, _series(system, labels, lambda s, k=key: _scaled(s[k].get("p50"))), marker="o", color=c,
                    label=system["name"] if key == "ttft_s" else None)
            ax.plot(x, _series(system, labels, lambda s, k=key: _scaled(s[k].get("p99"))), marker="^", ls="--", color=c, alpha=0.7)
    slo = result.get("slo") or {}
    for ax, key, title in zip(axes, ("ttft_s", "tpot_s"), ("TTFT", "TPOT"), strict=True):
        if slo.get(key) is not None:
            ax.axhline(slo[key] * 1e3, color="k", lw=0.8, ls=":", label="SLO" if key == "ttft_s" else None)
        ax.set_xticks(x, labels)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{title} (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{title}: p50 (solid), p99 (dashed)")
        ax.grid(alpha=0.3, which="both")
    return _save(fig, path, legend=True)


def _scaled(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def plot_latency_cdf(result: dict[str, Any], path: Path, point: int = -1) -> Path:
    plt = _plt()
    labels, _ = _loads(result)
    label = labels[point] if labels else ""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for system in result["systems"]:
        p = next((q for q in system["points"] if q["load"]["label"] == label), None)
        if p is None:
            continue
        rows = [r for r in p["requests"] if r["ok"]]
        for ax, key in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), strict=True):
            xs = sorted(r[key] for r in rows if r[key] is not None)
            if xs:
                ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step([xs[0], *xs], ys, where="post", label=system["name"] if key == "ttft_s" else None)
    slo = result.get("slo") or {}
    for ax, key, title in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), ("TTFT (s)", "TPOT (s)", "E2E latency (s)"), strict=True):
        if slo.get(key) is not None:
            ax.axvline(slo[key], color="k", lw=0.8, ls=":")
        ax.set_xlabel(title)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(f"latency CDFs at load {label}")
    return _save(fig, path, legend=True)


def _lanes(bars: list[list[int]]) -> dict[int, int]:
    """A lane (batch slot) per request: greedy interval packing over each request's span."""
    span: dict[int, list[int]] = {}
    for idx, first, last, _ in bars:
        s = span.setdefault(idx, [first, last])
        s[0], s[1] = min(s[0], first), max(s[1], last)
    free_at: list[int] = []
    lane: dict[int, int] = {}
    for idx, (first, last) in sorted(span.items(), key=lambda kv: (kv[1][0], kv[0])):
        k = next((i for i, f in enumerate(free_at) if f < first), len(free_at))
        if k == len(free_at):
            free_at.append(last)
        else:
            free_at[k] = last
        lane[idx] = k
    return lane


def occupancy_systems(result: dict[str, Any], names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The systems drawn side by side: those named, else static-like ones next to continuous
    ones (the seeds' picture), else every system with an occupancy trace; at most four."""
    with_trace = [s for s in result["systems"] if any(p.get("occupancy") for p in s["points"])]
    if names:
        chosen = [s for n in names for s in with_trace if s["name"] == n]
    else:
        def batching(s: dict[str, Any]) -> str:
            if s["kind"] == "hf_static":
                return "static"
            return str(s["options"].get("batching", "continuous")) if s["kind"] == "conveyor" else "continuous"

        static = [s for s in with_trace if batching(s) == "static"][:1]
        cont = [s for s in with_trace if s["kind"] == "conveyor" and batching(s) == "continuous"]
        preferred = [s for s in cont if s["name"] in ("continuous+chunked", "continuous")][:1] or cont[:1]
        chosen = static + preferred if static and preferred else with_trace
    return chosen[:4]


def plot_occupancy(
    result: dict[str, Any], path: Path, point: int = -1, names: Sequence[str] | None = None, max_steps: int = 300
) -> Path | None:
    """Each request a bar across the steps it was computed in (grey: a static batch's seat
    held after its request finished, computing padding), one panel per system."""
    systems = occupancy_systems(result, names)
    labels, _ = _loads(result)
    if not systems or not labels:
        return None
    label = labels[point]
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    cmap = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(systems), figsize=(5.5 * len(systems), 4.2), squeeze=False)
    for ax, system in zip(axes[0], systems, strict=True):
        p = next((q for q in system["points"] if q["load"]["label"] == label and q.get("occupancy")), None)
        if p is None:
            ax.set_title(f"{system['name']}: no trace at {label}")
            continue
        occ = p["occupancy"]
        bars = [b for b in occ["bars"] if b[1] < max_steps]
        lanes = _lanes(bars)
        for idx, first, last, waste in bars:
            last = min(last, max_steps - 1)
            if waste:
                ax.broken_barh([(first, last - first + 1)], (lanes[idx] - 0.4, 0.8), facecolors="0.85", edgecolors="0.6", hatch="//", lw=0.3)
            else:
                ax.broken_barh([(first, last - first + 1)], (lanes[idx] - 0.4, 0.8), facecolors=cmap(idx % 20), edgecolors="none")
        shown = min(occ["num_steps"], max_steps)
        ax.set_xlim(0, max(shown, 1))
        ax.set_ylim(-0.6, max(lanes.values(), default=0) + 0.6)
        ax.set_xlabel("engine step" + (f" (first {max_steps} of {occ['num_steps']})" if occ["num_steps"] > max_steps else ""))
        ax.set_ylabel("batch slot")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{system['name']} @ {label}")
    fig.suptitle("batch occupancy: each request a bar across the steps it occupies")
    return _save(fig, path)


def write_report(
    result: dict[str, Any],
    out_dir: Path,
    plots: bool = True,
    cdf_point: int = -1,
    occupancy_point: int = -1,
    occupancy_names: Sequence[str] | None = None,
    max_steps: int = 300,
) -> list[Path]:
    """result.json, summary.md and (unless `plots` is off) the PNGs; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    finalize(result)
    files = [write_json(result, out_dir / "result.json")]
    md = out_dir / "summary.md"
    md.write_text(markdown(result))
    files.append(md)
    if plots and result["systems"]:
        files.append(plot_throughput(result, out_dir / "throughput.png"))
        files.append(plot_latency_vs_load(result, out_dir / "latency_vs_load.png"))
        files.append(plot_latency_cdf(result, out_dir / "latency_cdf.png", cdf_point))
        occ = plot_occupancy(result, out_dir / "occupancy.png", occupancy_point, occupancy_names, max_steps)
        if occ is not None:
            files.append(occ)
    return files


def load_result(path: Path) -> dict[str, Any]:
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or "systems" not in result or "sweep" not in result:
        raise ValueError(f"{path} is not a conveyor bench result")
    return result


def merge_results(results: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[str, Any]:
    """One report from several runs of the same workload and sweep: a simulated run beside a
    measured one, say. System names get the run's mode (and a number if that still collides)."""
    first = results[0]
    for r, src in zip(results[1:], sources[1:], strict=True):
        if r["sweep"] != first["sweep"]:
            raise ValueError(f"{src}: its sweep {[p['label'] for p in r['sweep']]} differs from "
                             f"{[p['label'] for p in first['sweep']]}; merged reports need the same load points")
    keys = ("description", "num_requests", "seed", "arrivals")
    differs = [src for r, src in zip(results, sources, strict=True)
               if any(r["workload"].get(k) != first["workload"].get(k) for k in keys)]
    merged = {**first, "mode": "+".join(dict.fromkeys(r["mode"] for r in results)), "systems": [],
              "sources": list(sources), "command": None}
    if differs:
        merged["workload"] = {**first["workload"], "description": first["workload"].get("description", "")
                              + f" (note: {', '.join(differs)} ran a different workload)"}
    sim = next((r["simulation"] for r in results if r.get("simulation")), None)
    if sim is not None:
        merged["simulation"] = sim
    seen: set[str] = set()
    for r in results:
        for system in r["systems"]:
            name = f"{system['name']} ({'simulated' if r['mode'] == 'simulate' else r['mode']})"
            base, n = name, 2
            while name in seen:
                name, n = f"{base} #{n}", n + 1
            seen.add(name)
            merged["systems"].append({**system, "name": name})
    return merged
