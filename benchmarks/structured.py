"""Structured outputs: what a grammar costs, and what it buys, on one model (SmolLM2 by default).

  1. Compile: the vocabulary's bytes (once per engine), then each grammar's DFA, cold.
  2. Cost: the same chat requests asking for JSON, free and constrained by a JSON Schema, run
     in turns (A B B A ...) on one engine. Outputs differ in length, so the
     figure is time per output token; the ratio is constrained over free. The first round of
     each is a warm-up (the constrained one computes its masks then), not counted.
  3. Value: the share of outputs that parse as JSON and validate against the schema.

    python benchmarks/structured.py --batch 1 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from conveyor import LLM, SamplingParams, StructuredOutputParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "employed"],
}
ASKS = [
    "Invent a person. Reply with only a JSON object with the keys name, age, city, hobbies, employed.",
    "Describe a fictional teacher as JSON (name, age, city, hobbies, employed).",
    "Give me a JSON record of a made-up athlete: name, age, city, hobbies and whether employed.",
    "Create a character for a novel and output it as JSON with name, age, city, hobbies, employed.",
]
GRAMMARS = {
    "json schema (5 properties)": StructuredOutputParams(json=SCHEMA),
    "json object (any, 3 levels)": StructuredOutputParams(json_object=True),
    "regex (date)": StructuredOutputParams(regex=r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    "choice (3)": StructuredOutputParams(choice=("positive", "negative", "neutral")),
}


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()

    llm = LLM(args.model)
    engine = llm.engine
    cache = engine.runner.grammars
    start = time.perf_counter()
    vocab = cache.vocab
    print(f"vocabulary as bytes: {(time.perf_counter() - start) * 1e3:.0f} ms ({vocab.size} tokens)")
    print("| grammar | DFA states | compile (ms) | first mask (ms) |")
    print("|---|---:|---:|---:|")
    for name, spec in GRAMMARS.items():
        start = time.perf_counter()
        grammar = cache.get(spec)
        compiled = time.perf_counter() - start
        start = time.perf_counter()
        grammar.allowed(grammar.START)
        print(f"| {name} | {grammar.dfa.num_states} | {compiled * 1e3:.0f} | {(time.perf_counter() - start) * 1e3:.1f} |")

    spec = StructuredOutputParams(json=SCHEMA)
    print("\n| batch | free ms/token | constrained ms/token | ratio | valid free | valid constrained |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        convs = [[{"role": "user", "content": ASKS[i % len(ASKS)]}] for i in range(batch)]
        runs: dict[str, list[float]] = {"free": [], "constrained": []}
        ok: dict[str, list[bool]] = {"free": [], "constrained": []}
        for r in range(args.rounds + 1):
            order = ["free", "constrained"] if r % 2 == 0 else ["constrained", "free"]
            for which in order:
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                        structured_outputs=spec if which == "constrained" else None)
                start = time.perf_counter()
                outs = llm.chat(convs, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                if r:  # round 0 warms up
                    runs[which].append(elapsed / tokens * 1e3)
                    ok[which] += [valid(o.outputs[0].text) for o in outs]
        f, c = statistics.median(runs["free"]), statistics.median(runs["constrained"])
        share = {k: f"{sum(v)}/{len(v)}" for k, v in ok.items()}
        print(f"| {batch} | {f:.1f} | {c:.1f} | {c / f:.2f}× | {share['free']} | {share['constrained']} |")


if __name__ == "__main__":
    main()
