"""The host's own time in an engine step at many running sequences, by phase, on a CPU.

On a GPU the model's kernels run asynchronously, so a decode step's wall time is the larger of
the device's time and the host's: scheduling, preparing the runner's inputs and taking the
sampled tokens back into the requests. That host time is all Python and CPU work, so it can be
measured here, on the CPU box, without a GPU.

    python benchmarks/host_time.py                          # 64, 256 and 1024 sequences
    python benchmarks/host_time.py --seqs 256 --baseline 09e5008 --rounds 4
    python benchmarks/host_time.py --seqs 256 --modes async,stream   # stream: async, text streamed

The modes: `sync`, `async` (async scheduling), `stream` (async, and every request streams its
text, so the engine detokenizes every token).

A tiny random-weight Llama (hidden 64, 2 layers) keeps the model's own compute small. Every
sequence has a 128-token prompt and decodes greedily; after the prompts, `--steps` decode steps
are timed, each split into:
- schedule: `Scheduler.schedule`;
- prep: the runner's `submit` less the model's forward, the LM head and the sampler, i.e. the
  host work of turning the step into tensors. Decodes take the CUDA-graph path's inputs
  (`GraphedDecode` run eagerly, as on a CPU it must be), which is what a GPU's decode runs;
- complete: `Engine._complete`, the tokens into the sequences, stop checks, outputs (and, in
  the `stream` mode, the text: every request is streamed, through SmolLM2's tokenizer, which
  is saved beside the tiny model; its 512 token ids are real SmolLM2 tokens);
- host: the three together.
Medians over the steps, in ms a step and µs a sequence.

`--baseline REV` runs the same measurement on the conveyor of commit REV (a git worktree in a
temporary folder) in a subprocess, alternating A B B A over `--rounds`, and reports the median
of the rounds' ratios of host time (each round's A against its B), with their range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, initializer_range=0.08)
PHASES = ("schedule", "prep", "complete", "host")
PROMPT_LEN, BLOCK_SIZE = 128, 16
ROOT = Path(__file__).resolve().parent.parent


def build_model(folder: Path, tokenizer: bool = False) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, **SHAPE)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        from conveyor.models.loader import default_model_path
        from conveyor.tokenizer import Tokenizer

        Tokenizer.load(Path(default_model_path()), gguf=True).hf.save_pretrained(str(folder))
    return str(folder)


class Timers:
    """Wraps methods so that each call's wall time lands in a list under a label; a call made
    inside another call of the same label is part of that one (since the graph runs through
    the LM head, the graphed forward calls `compute_logits` itself)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.active: set[str] = set()

    def wrap(self, obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)
        times = self.times.setdefault(label, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            if label in self.active:
                return inner(*args, **kwargs)
            self.active.add(label)
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - t)
                self.active.discard(label)

        setattr(obj, name, timed)

    def clear(self) -> None:
        for v in self.times.values():
            v.clear()


def decoding_engine(model: str, n: int, params: Any, *, async_scheduling: bool, stream: bool,
                    num_kv_blocks: int, max_model_len: int) -> Any:
    """An engine on the CPU whose `n` sequences (`PROMPT_LEN`-token prompts, `params`) are past
    their prompts and decoding, its decode steps on the CUDA-graph path's inputs
    (`GraphedDecode` run eagerly, as on a CPU it must be), which is what a GPU's decode runs."""
    import torch

    from conveyor import LLM
    from conveyor.runner.cuda_graphs import GraphedDecode

    # torch on one thread: an OpenMP worker that spins after each op would share the host's
    # core (2 vCPUs here), and the host's time moved by 2x from round to round with it.
    torch.set_num_threads(1)
    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=n, max_num_batched_tokens=max(8192, n),
              num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, async_scheduling=async_scheduling)
    engine = llm.engine
    runner = engine.runner
    graph_args = (runner.model, runner.kv_caches, runner.block_size, -(-max_model_len // runner.block_size),
                  runner.scratch_block, n)
    if hasattr(runner.sampler, "greedy"):
        runner.graphs = GraphedDecode(*graph_args, capture=False, greedy=runner.sampler.greedy)
    else:  # a baseline from before the graph ran through the LM head
        runner.graphs = GraphedDecode(*graph_args, capture=False)
    for i in range(n):
        engine.add_request(f"r{i}", [100 + (i + j) % 400 for j in range(PROMPT_LEN)], params, stream=stream)
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prompts
    return engine


def write_figures(out: Path, **figures: Any) -> None:
    """A script's figures as JSON, with its arguments and the time it ran."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M"), **figures}, indent=1))


def measure(model: str, n: int, steps: int, async_scheduling: bool, stream: bool = False) -> dict[str, float]:
    """Median ms a step of each phase, `n` sequences decoding."""
    from conveyor import SamplingParams

    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    engine = decoding_engine(model, n, params, async_scheduling=async_scheduling, stream=stream,
                             num_kv_blocks=max(n * 24 + 64, 2048 // BLOCK_SIZE), max_model_len=2048)
    runner = engine.runner
    for _ in range(8):
        engine.step()
    timers = Timers()
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine, "_complete", "complete")
    timers.wrap(runner, "submit", "submit")
    timers.wrap(runner.graphs, "_forward", "model")
    timers.wrap(runner.model, "compute_logits", "model")
    timers.wrap(runner.sampler, "sample", "model")
    timers.clear()
    per_step: dict[str, list[float]] = {p: [] for p in PHASES}
    for _ in range(steps):
        engine.step()
        t = timers.times
        # The graphed forward, then (until the graph ran through the LM head) the head and the sampler.
        assert len(t["schedule"]) == 1 and len(t["submit"]) == 1 and len(t["model"]) in (1, 3), "not one decode a step"
        schedule, complete = t["schedule"][0], t["complete"][0]
        prep = t["submit"][0] - sum(t["model"])
        for phase, v in zip(PHASES, (schedule, prep, complete, schedule + prep + complete), strict=True):
            per_step[phase].append(v)
        timers.clear()
    assert all(len(s.token_ids) > PROMPT_LEN for s in engine.scheduler.running)
    assert not stream or engine.tokenizer is not None, "stream: the model has no tokenizer"
    return {p: statistics.median(v) * 1e3 for p, v in per_step.items()}


def run_rounds(args: argparse.Namespace) -> dict:
    """This checkout's figures: {"seqs,mode": {phase: [ms per round]}}."""
    out: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model")
        texts = build_model(Path(tmp) / "with-tokenizer", tokenizer=True) if "stream" in args.modes else model
        for _ in range(args.rounds):
            for n in args.seqs:
                for mode in args.modes:
                    stream = mode == "stream"
                    m = measure(texts if stream else model, n, args.steps, mode != "sync", stream)
                    for phase, v in m.items():
                        out.setdefault(f"{n},{mode}", {}).setdefault(phase, []).append(v)
    return out


def child(args: argparse.Namespace, checkout: Path) -> dict:
    """One round on the conveyor in `checkout`, in a subprocess that imports it."""
    cmd = [sys.executable, __file__, "--child", "--rounds", "1", "--steps", str(args.steps),
           "--seqs", ",".join(map(str, args.seqs)), "--modes", ",".join(args.modes)]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the measurement in {checkout} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["from"]) == checkout, f"imported conveyor from {result['from']}, not {checkout}"
    return result["figures"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="64,256,1024", help="running sequences, comma-separated")
    ap.add_argument("--modes", default="sync,async,stream", help="of sync, async and stream (see above)")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed in each measurement")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--baseline", help="a commit to compare with, run side by side (A B B A)")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    if set(args.modes) - {"sync", "async", "stream"}:
        ap.error("--modes takes sync, async and/or stream")
    if args.child:
        import conveyor

        print(json.dumps({"from": str(Path(conveyor.__file__).parent.parent), "figures": run_rounds(args)}))
        return 0

    sides: dict[str, dict] = {"this": {}}
    checkouts = {"this": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            base = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
                           check=True, capture_output=True)
            checkouts["baseline"] = base
            sides["baseline"] = {}
        try:
            order = list(checkouts)
            for rnd in range(args.rounds):
                for side in order if rnd % 2 == 0 else order[::-1]:
                    for key, phases in child(args, checkouts[side]).items():
                        for phase, v in phases.items():
                            sides[side].setdefault(key, {}).setdefault(phase, []).extend(v)
                print(f"[round {rnd + 1} of {args.rounds}]", file=sys.stderr, flush=True)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkouts["baseline"])],
                               check=False, capture_output=True)

    head = "| sequences | scheduling | " + " | ".join(f"{p} ms" for p in PHASES) + " | host µs / seq |"
    if args.baseline:
        head += f" host vs {args.baseline} |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for key, phases in sides["this"].items():
        n, mode = key.split(",")
        med = {p: statistics.median(v) for p, v in phases.items()}
        row = f"| {n} | {mode} | " + " | ".join(f"{med[p]:.3f}" for p in PHASES)
        row += f" | {med['host'] * 1e3 / int(n):.2f} |"
        if args.baseline:
            # Paired by round (A and B ran next to each other), so that the machine's drift
            # between rounds cancels: the median of the rounds' ratios, and their range.
            ratios = sorted(a / b for a, b in zip(phases["host"], sides["baseline"][key]["host"], strict=True))
            row += f" {statistics.median(ratios):.2f}× ({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
        print(row)
    if args.out:
        write_figures(args.out, sides=sides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
