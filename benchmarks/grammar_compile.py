"""What a new grammar's compile does to the requests already running, on one model (SmolLM2
by default). Three ways to compile it:

  loop     on the engine's loop, which waits for it (`LLM.generate`; the server before the
           twenty-third session);
  thread   in a thread of the engine's process, the loop stepping meanwhile (it shares the GIL);
  process  in the grammar worker process (`conveyor/structured/compile_worker.py`), a thread
           waiting for it; what the server does.

B requests decode; after a few steps a JSON Schema not seen before is compiled, each way in
turn over the rounds ("none": ten steps and no compile, for the plain step time). Reported: the longest gap between two steps' ends while the compile
runs (what a streaming client sees as a stall), the steps done meanwhile, and the window.

    python benchmarks/grammar_compile.py --batch 4 --rounds 3 [--num-threads 1]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time

from conveyor import LLM, SamplingParams, StructuredOutputParams
from conveyor.structured.compile_worker import DFACompiler


def schema(i: int) -> dict:
    """A 5-property schema, new each time (the cache would serve a repeated one at once)."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40 + i},
            "age": {"type": "integer", "minimum": 0},
            "city": {"type": "string", "maxLength": 40},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
            "employed": {"type": "boolean"},
        },
        "required": ["name", "age", "city", "employed"],
    }


def run(llm: LLM, batch: int, spec: StructuredOutputParams, mode: str, tag: str) -> tuple[float, int, float]:
    engine = llm.engine
    grammars = engine.runner.grammars
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.8, seed=1)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [1, 2, 3, 4, 5, 6, 7, 8], params)
    for _ in range(5):  # past the prefill
        engine.step()
    ends = [time.perf_counter()]
    start = ends[0]
    if mode == "none":  # no compile: ten plain steps, for the step time
        for _ in range(10):
            engine.step()
            ends.append(time.perf_counter())
    elif mode == "loop":
        grammars.get(spec)
        engine.step()
        ends.append(time.perf_counter())
    else:
        worker = threading.Thread(target=grammars.get, args=(spec,))
        worker.start()
        while worker.is_alive():
            engine.step()
            ends.append(time.perf_counter())
        worker.join()
    took = ends[-1] - start
    for i in range(batch):
        engine.abort_request(f"{tag}-{i}")
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    return max(gaps), len(gaps), took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None, help="torch's threads (default: the engine's)")
    args = ap.parse_args()

    llm = LLM(args.model, **({"num_threads": args.num_threads} if args.num_threads else {}))
    grammars = llm.engine.runner.grammars
    grammars.get(StructuredOutputParams(json_object=True))  # the vocabulary's bytes, once
    process = DFACompiler()
    process.compile(StructuredOutputParams(choice=("a",)))  # the worker started, as a server's is by then
    modes = ["none", "loop", "thread", "process"]
    results: dict[str, list[tuple[float, int, float]]] = {m: [] for m in modes}
    n = 0
    for r in range(args.rounds + 1):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            n += 1
            grammars.compiler = process if mode == "process" else None
            got = run(llm, args.batch, StructuredOutputParams(json=schema(n)), mode, f"r{n}")
            if r:  # the first round warms up
                results[mode].append(got)
    process.close()
    print(f"batch {args.batch}, {args.rounds} rounds (medians), num_threads={args.num_threads or 'default'}")
    print("| compile | longest gap between steps (ms) | steps during the compile | compile window (ms) |")
    print("|---|---:|---:|---:|")
    for mode, rows in results.items():
        gap = statistics.median(g for g, _, _ in rows) * 1e3
        steps = statistics.median(s for _, s, _ in rows)
        window = statistics.median(t for _, _, t in rows) * 1e3
        print(f"| {mode} | {gap:.0f} | {steps:.0f} | {window:.0f} |")


if __name__ == "__main__":
    main()
