"""What a new grammar's compile does to the requests already running, on one model (SmolLM2
by default): compiled on the engine's loop (as `LLM.generate` and a thread-mode server do
when a request is added) or in a worker thread while the loop goes on stepping (as the
engine process does).

B requests decode; after a few steps a JSON Schema not seen before is compiled, inline or
in a worker, in turns (A B B A ...). Reported: the longest gap between two steps' ends while
the compile runs (what a streaming client sees as a stall), and the steps done meanwhile.

    python benchmarks/grammar_compile.py --batch 4 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time

from conveyor import LLM, SamplingParams, StructuredOutputParams


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


def run(llm: LLM, batch: int, spec: StructuredOutputParams, background: bool, tag: str) -> tuple[float, int, float]:
    engine = llm.engine
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.8, seed=1)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [1, 2, 3, 4, 5, 6, 7, 8], params)
    for _ in range(5):  # past the prefill
        engine.step()
    ends = [time.perf_counter()]
    start = ends[0]
    if background:
        worker = threading.Thread(target=engine.compile_grammars, args=([spec],))
        worker.start()
        while worker.is_alive():
            engine.step()
            ends.append(time.perf_counter())
        worker.join()
    else:
        engine.compile_grammars([spec])
        engine.step()
        ends.append(time.perf_counter())
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
    args = ap.parse_args()

    llm = LLM(args.model)
    llm.engine.compile_grammars([StructuredOutputParams(json_object=True)])  # the vocabulary's bytes, once
    results: dict[str, list[tuple[float, int, float]]] = {"inline": [], "worker": []}
    n = 0
    for r in range(args.rounds + 1):
        order = ["inline", "worker"] if r % 2 == 0 else ["worker", "inline"]
        for mode in order:
            n += 1
            got = run(llm, args.batch, StructuredOutputParams(json=schema(n)), mode == "worker", f"r{n}")
            if r:  # the first round warms up
                results[mode].append(got)
    print(f"batch {args.batch}, {args.rounds} rounds (medians)")
    print("| compile | longest gap between steps (ms) | steps during the compile | compile window (ms) |")
    print("|---|---:|---:|---:|")
    for mode, rows in results.items():
        gap = statistics.median(g for g, _, _ in rows) * 1e3
        steps = statistics.median(s for _, s, _ in rows)
        window = statistics.median(t for _, _, t in rows) * 1e3
        print(f"| {mode} | {gap:.0f} | {steps:.0f} | {window:.0f} |")


if __name__ == "__main__":
    main()
