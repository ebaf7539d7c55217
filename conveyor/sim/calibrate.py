"""`conveyor calibrate`: measure this machine's real runner and fit the cost model to it.

1. Peaks, measured on the spot: fp32 GEMM FLOP/s (a large matmul) and memory read bandwidth
   (a pass over 1 GiB). They make the `cpu` Hardware.
2. The real `ModelRunner` runs a grid of batch shapes (decode batches at short and long
   contexts, whole prompts, prompt chunks over a context, decode + prefill mixes); each shape's
   median time is one sample.
3. The fit: a grid search over the three efficiencies (mfu, attn_mfu, mbu), and for each, the
   three overheads (per step, per sequence, per token) by non-negative least squares, all on
   relative error. The best fit is saved as JSON and `conveyor simulate --hardware cpu` uses it.

The overheads absorb this runner's Python work per layer, so a calibration holds for the model
it measured (by default SmolLM2, the model conveyor serves here); `simulate` says so when the
model differs.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.sim.cost import CostParams, RooflineCostModel, StepShape
from conveyor.sim.hardware import Hardware
from conveyor.sim.models import ModelShape

Shape = list[tuple[int, int]]  # (new tokens, start position) per sequence


def default_grid() -> list[tuple[str, Shape]]:
    """Batch shapes covering what a serving run does: decode batches, prompts, chunks, mixes."""
    grid: list[tuple[str, Shape]] = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (64, 512):
            grid.append((f"decode b={b} ctx={ctx}", [(1, ctx - 1)] * b))
    for n in (16, 64, 128, 256, 512):
        grid.append((f"prefill {n}", [(n, 0)]))
    grid.append(("prefill 4x128", [(128, 0)] * 4))
    grid.append(("chunk 256 at 512", [(256, 512)]))
    for b, n in ((8, 64), (16, 128), (32, 256)):
        grid.append((f"decode {b} ctx=256 + prefill {n}", [(1, 255)] * b + [(n, 0)]))
    return grid


def default_calibration_path() -> Path:
    root = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
    return root / "calibration" / "cpu.json"


# -- measuring ------------------------------------------------------------------------------
def measure_peaks(threads: int | None = None) -> tuple[float, float]:
    """(fp32 GEMM FLOP/s, memory read bytes/s): the best of a few runs each."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    n = 1536
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    flops = 2 * n**3 / best
    x = torch.ones((1 << 30) // 4)
    x.sum()
    read = min(_timed(x.sum) for _ in range(5))
    return flops, x.numel() * 4 / read


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_hardware(flops: float, bandwidth: float, threads: int) -> Hardware:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 16 << 30
    return Hardware(
        "cpu", f"{cpu_name()}, {threads} threads, float32", flops, bandwidth, memory,
        host_bandwidth=bandwidth / 2,  # swapping is a copy: read and write the same memory
        dtype_bytes=4, is_gpu=False,
        source=f"measured by `conveyor calibrate` on {time.strftime('%Y-%m-%d')}",
    )


def measure_runner(engine: Any, grid: Sequence[tuple[str, Shape]], repeats: int = 5,
                   progress: Callable[[str], Any] | None = None) -> list[tuple[str, StepShape, float]]:
    """Time `engine.runner.execute` over each shape of the grid (median of `repeats`)."""
    from conveyor.core.scheduler import ScheduledSequence, SchedulerOutput
    from conveyor.sampling_params import SamplingParams

    runner = engine.runner
    bs = engine.config.cache.block_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.vocab_size
    samples = []
    for label, shape in grid:
        items, next_block = [], 0
        for i, (n, start) in enumerate(shape):
            total = start + n
            nblocks = -(-total // bs)
            table = list(range(next_block, next_block + nblocks))
            next_block += nblocks
            ids = [(7 * i + 13 * k) % (vocab - 200) + 100 for k in range(total)]
            items.append(ScheduledSequence(i, ids[start:], start, table, True, params, ids, total))
        if next_block > runner.num_blocks:
            raise ValueError(f"calibration shape {label!r} needs {next_block} KV blocks; the cache has {runner.num_blocks}")
        out = SchedulerOutput(0, items)
        runner.execute(out)  # warm-up
        times = [_timed(lambda o=out: runner.execute(o)) for _ in range(repeats)]
        samples.append((label, StepShape.of(out), statistics.median(times)))
        if progress is not None:
            progress(f"{label}: {samples[-1][2] * 1e3:.1f} ms")
    return samples


# -- fitting --------------------------------------------------------------------------------
@dataclass
class Fit:
    params: CostParams
    rel_errors: list[float]

    @property
    def median_abs_rel_error(self) -> float:
        return statistics.median(abs(e) for e in self.rel_errors)

    @property
    def max_abs_rel_error(self) -> float:
        return max(abs(e) for e in self.rel_errors)


def fit(hardware: Hardware, model: ModelShape, samples: Sequence[tuple[str, StepShape, float]],
        block_size: int = 16) -> Fit:
    """Efficiencies by grid search (coarse, then fine around the best); overheads by
    non-negative least squares on relative error, for each candidate."""
    import numpy as np

    shapes = [s for _, s, _ in samples]
    y = np.array([t for _, _, t in samples])
    w = 1.0 / y
    X = np.array([[1.0, s.num_seqs, s.num_tokens] for s in shapes])
    base = RooflineCostModel(hardware, model, CostParams(1.0, 1.0, 1.0, 0.0, 0.0, 0.0), hardware.dtype_bytes, block_size)
    # Per-sample times at efficiency 1 for each part: (compute, memory) pairs.
    lin = np.array([[base._lin_flop_s * s.num_tokens, base._lin_mem_s] for s in shapes])
    head = np.array([[base._head_flop_s * s.num_sampled, base._head_mem_s if s.num_sampled else 0.0] for s in shapes])
    attn_p = np.array([[base._attn_flop_s * s.prefill_pairs, base._kv_mem_s * s.prefill_context] for s in shapes])
    attn_d = np.array([[base._attn_flop_s * s.decode_context, base._kv_mem_s * s.decode_context] for s in shapes])

    def evaluate(mfu: float, attn: float, mbu: float) -> tuple[float, np.ndarray]:
        r = (np.maximum(lin[:, 0] / mfu, lin[:, 1] / mbu) + np.maximum(head[:, 0] / mfu, head[:, 1] / mbu)
             + np.maximum(attn_p[:, 0] / attn, attn_p[:, 1] / mbu) + np.maximum(attn_d[:, 0] / attn, attn_d[:, 1] / mbu))
        best_loss, best_c = float("inf"), np.zeros(3)
        target = (y - r) * w
        Xw = X * w[:, None]
        for mask in itertools.product((0, 1), repeat=3):  # NNLS by enumerating active sets
            cols = [i for i in range(3) if mask[i]]
            c = np.zeros(3)
            if cols:
                sol = np.linalg.lstsq(Xw[:, cols], target, rcond=None)[0]
                if (sol < 0).any():
                    continue
                c[cols] = sol
            loss = float(((target - Xw @ c) ** 2).sum())
            if loss < best_loss:
                best_loss, best_c = loss, c
        return best_loss, best_c

    coarse = np.geomspace(0.01, 1.0, 21)
    best = min(((evaluate(a, b, c)[0], (a, b, c)) for a in coarse for b in coarse for c in coarse))
    a0, b0, c0 = best[1]
    fine = [np.clip(v * np.geomspace(0.8, 1.25, 11), 1e-3, 1.0) for v in (a0, b0, c0)]
    best = min(((evaluate(a, b, c)[0], (a, b, c)) for a in fine[0] for b in fine[1] for c in fine[2]))
    mfu, attn, mbu = (float(v) for v in best[1])
    _, c = evaluate(mfu, attn, mbu)
    params = CostParams(mfu, attn, mbu, float(c[0]), float(c[1]), float(c[2]))
    model_ = RooflineCostModel(hardware, model, params, hardware.dtype_bytes, block_size)
    errors = [(model_.step_time(s) - t) / t for _, s, t in samples]
    return Fit(params, errors)


# -- saving and loading ---------------------------------------------------------------------
def save(path: Path, hardware: Hardware, model: ModelShape, model_path: str | None, fit_: Fit,
         samples: Sequence[tuple[str, StepShape, float]], block_size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "hardware": asdict(hardware),
        "params": fit_.params.to_dict(),
        "model": asdict(model),
        "model_path": model_path,
        "block_size": block_size,
        "fit": {"median_abs_rel_error": fit_.median_abs_rel_error, "max_abs_rel_error": fit_.max_abs_rel_error},
        "samples": [
            {"label": label, "shape": asdict(shape), "measured_s": t, "rel_error": e}
            for (label, shape, t), e in zip(samples, fit_.rel_errors, strict=True)
        ],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


@dataclass(frozen=True)
class Calibration:
    hardware: Hardware
    params: CostParams
    model: ModelShape
    path: Path


def load(path: Path | None = None) -> Calibration:
    path = path or default_calibration_path()
    if not path.is_file():
        raise ValueError(f"no calibration at {path}: run `conveyor calibrate` first (about a minute)")
    try:
        data = json.loads(path.read_text())
        hw = data["hardware"]
        model = data["model"]
        return Calibration(
            Hardware(**{**hw, "memory_bytes": int(hw["memory_bytes"])}),
            CostParams.from_dict(data["params"]),
            ModelShape(**{**model, "eos_token_ids": tuple(model.get("eos_token_ids", ()))}),
            path,
        )
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a conveyor calibration ({e}); run `conveyor calibrate` again") from None
