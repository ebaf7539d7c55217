"""How much of a decode step the host adds, against a device of a given speed, on a CPU.

On a GPU a step's kernels run asynchronously: the host launches them and is free until it
asks for the sampled tokens. Async scheduling spends that time on the next step (schedule,
prepare its inputs, launch it) and then takes the earlier step's tokens into the requests, so
the host's time should hide behind the device's as long as it is the shorter. This script
checks that on the real engine without a GPU, with an emulated device:

- the model's forward is replaced by a stub that writes a token into the graphed step's token
  buffer (the host's work around it, which is what is measured, is the real engine's);
- a step's device time starts when the runner's `submit` returns (its launch) or when the
  step before it ends, whichever is later, and lasts `--device-ms`; the step's `result()`
  waits until then (spinning its last 0.2 ms, as a CUDA event's synchronize spins).

Each engine step's wall time is timed; the host's share of a step is 1 - device / wall (the
median of `--steps` decode steps after the prompts). Without async scheduling the step is the
host's time plus the device's; with it, the larger of the two, if the overlap works.

    python benchmarks/overlap.py                                   # 256 sequences, 4.64 ms
    python benchmarks/overlap.py --seqs 1,256 --device-ms 0.82,4.64 --modes sync,async,stream

`--device-ms` defaults to 4.64, what a decode step of Llama-3.2-1B's shape at 256 sequences
took on the ninth session's H100 (the runner alone, BENCHMARKS.md); 0.82 ms is a batch-1
step of that model at the H100's measured HBM limit. The modes: `sync`, `async` (async
scheduling), `stream` (async, every request streaming its text in cumulative outputs, as
host_time.py's `stream`) and `served` (the same with `output_kind="delta"`, as the HTTP server
streams: each output only what is new). What the emulation cannot show: a host wait
that torch inserts on a real device (a blocking copy, `.item()`); tests/runner's GPU test
under torch's sync debug mode is for those.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_time import (  # siblings: on sys.path
    BLOCK_SIZE,
    PROMPT_LEN,
    build_model,
    decoding_engine,
    write_figures,
)

SPIN_S = 2e-4
TEXT = ("Continuous batching rebuilds the batch at every step: a finished sequence leaves at once "
        "and a waiting one joins at once, so the device never idles on padding. ")


def wait_until(t: float) -> None:
    """Sleep, then spin the last `SPIN_S` (time.sleep overshoots by tens of µs)."""
    left = t - time.perf_counter()
    if left > SPIN_S:
        time.sleep(left - SPIN_S)
    while time.perf_counter() < t:
        pass


class EmulatedDevice:
    """A device queue in front of a runner: each launched step runs `step_s` after the later of
    its launch and the previous step's end; its tokens are ready then."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.free_at = 0.0
        self.waited_s = 0.0  # the host's time blocked in result(), for the record

    def attach(self, runner: Any) -> None:
        launch = runner.submit

        def submit(scheduled: Any) -> Any:
            handle = launch(scheduled)
            self.free_at = max(time.perf_counter(), self.free_at) + self.step_s
            done_at, result = self.free_at, handle.result

            def waited() -> Any:
                t = time.perf_counter()
                wait_until(done_at)
                self.waited_s += time.perf_counter() - t
                return result()

            handle.result = waited
            return handle

        runner.submit = submit  # `execute` calls self.submit: the instance's attribute


def measure(model: str, n: int, steps: int, device_ms: float, mode: str, warmup: int = 8) -> dict[str, float]:
    import torch

    from conveyor import SamplingParams

    max_len = PROMPT_LEN + warmup + steps + 64
    model_len = max(2048, max_len)
    served = {"output_kind": "delta"} if mode == "served" else {}  # (a conveyor before it: the other modes)
    params = SamplingParams(max_tokens=max_len - PROMPT_LEN, temperature=0.0, ignore_eos=True, **served)
    # Every sequence runs to the end (none is preempted), and one can reach max_model_len.
    blocks = max(n * -(-max_len // BLOCK_SIZE) + 64, -(-model_len // BLOCK_SIZE))
    engine = decoding_engine(model, n, params, async_scheduling=mode != "sync", stream=mode in ("stream", "served"),
                             num_kv_blocks=blocks, max_model_len=model_len)  # the prompts ran on the real model
    runner = engine.runner
    graphs = runner.graphs
    # From here the device is emulated: the forward only writes tokens. They are the ids of
    # real text, read on from a different place for each sequence, so that streamed text
    # decodes as text does (a token that is a lone piece of a character forever would not).
    text = TEXT * 8
    ids = engine.tokenizer.encode(text, add_special_tokens=False) if engine.tokenizer else list(range(100, 400))
    story = torch.tensor(ids, dtype=graphs.tokens.dtype)
    offsets = torch.arange(n) * 7
    step = [0]

    def forward(b: int) -> None:
        rows = min(b, n)
        graphs.tokens[:rows].copy_(story[(offsets[:rows] + step[0]) % len(ids)])
        step[0] += 1

    graphs._forward = forward  # type: ignore[method-assign]
    device = EmulatedDevice(device_ms / 1e3)
    device.attach(runner)
    for _ in range(warmup):
        engine.step()
    walls = []
    device.waited_s = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    running = engine.scheduler.running
    assert len(running) == n and all(len(s.token_ids) > PROMPT_LEN + warmup + steps for s in running)
    wall = statistics.median(walls)
    # waited_ms is a mean: it compares with the mean step (one slow wait moves a mean, not a median).
    return {"step_ms": wall * 1e3, "host_share": 1 - device_ms / 1e3 / wall,
            "waited_ms": device.waited_s / steps * 1e3, "step_mean_ms": statistics.fmean(walls) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="256", help="running sequences, comma-separated")
    ap.add_argument("--device-ms", default="4.64", help="the emulated device's time a step, comma-separated")
    ap.add_argument("--modes", default="sync,async,stream,served", help="of sync, async, stream and served")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8,
                    help="decode steps before the timed ones: the outputs' length when timing starts")
    ap.add_argument("--rounds", type=int, default=3, help="each figure is the median over the rounds")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    device_ms = [float(d) for d in args.device_ms.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    if set(modes) - {"sync", "async", "stream", "served"}:
        ap.error("--modes takes sync, async, stream and/or served")
    rows: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model")
        texted = {"stream", "served"} & set(modes)
        texts = build_model(Path(tmp) / "with-tokenizer", tokenizer=True) if texted else model
        for _ in range(args.rounds):  # rounds interleave the cells, so the machine's drift spreads over all
            for n in seqs:
                for d in device_ms:
                    for mode in modes:
                        m = measure(texts if mode in ("stream", "served") else model, n, args.steps, d, mode, args.warmup)
                        rows.setdefault(f"{n},{d},{mode}", []).append(m)
    print("| sequences | device ms (emulated) | scheduling | step ms | host share | host blocked in result() ms |")
    print("|---|---|---|---|---|---|")
    table: dict[str, Any] = {}
    for key, runs in rows.items():
        cell_n, cell_d, cell_mode = key.split(",")
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        table[key] = med | {"rounds": runs}
        print(f"| {cell_n} | {float(cell_d):.2f} | {cell_mode} | {med['step_ms']:.3f} | {med['host_share']:.1%} "
              f"| {med['waited_ms']:.3f} |")
    if args.out:
        write_figures(args.out, figures=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
