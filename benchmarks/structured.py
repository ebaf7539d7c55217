"""Structured outputs: what a grammar costs, and what it buys, on one model (SmolLM2 by default).

  1. Compile: the vocabulary's bytes (once per engine), then each grammar's automaton (a DFA,
     or a pushdown automaton for a recursive grammar), cold.
  2. Cost: the same chat requests asking for JSON, free and constrained, run in turns
     (A B C D, then D C B A ...) on one engine: by a JSON Schema (a DFA), by any JSON object
     (a pushdown automaton: values nest without bound) and by a GBNF grammar of JSON (the
     same, written by hand). Outputs differ in length, so the figure is time per output
     token; the ratio is constrained over free. The first round of each is a warm-up (the
     constrained ones compute their masks then), not counted.
     Two more since the thirty-sixth session: a structural tag (free text; where " is" is
     written, a JSON string of a city between `begin` and `end`) and the schema after an
     optional thinking block (`reasoning=("<think>", "</think>")`, which SmolLM2 never opens:
     the start rule's cost alone).
  4. Depth: the host's time per token (state step and mask) of a pushdown automaton walking a
     JSON text 40 levels deep token by token, cold (each level meets new stacks, so new masks)
     and again warm.
  3. Value: the share of outputs that end (the end token, not max_tokens), parse as JSON and
     validate against the schema, and how deep the deepest one nests.
  Compile rows since the thirty-seventh session: a left-recursive GBNF grammar, a Lark grammar,
  a structural tag as a format tree, and the strict-tool constraints of four parsers.

    python benchmarks/structured.py --batch 1 8 --rounds 3
    python benchmarks/structured.py --compile-only
    python benchmarks/structured.py --strict-tools 10 30 [--parsers kimi_k2 deepseek_v3 glm45 mistral]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from conveyor import LLM, SamplingParams, StructuredOutputParams
from conveyor.structured.cfg import Pushdown
from conveyor.structured.grammar import PushdownGrammar

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
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( string ws ":" ws value ( ws "," ws string ws ":" ws value )* )? ws "}"
array  ::= "[" ws ( value ( ws "," ws value )* )? ws "]"
string ::= "\"" ( [^"\\\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= " "?
"""
TAG = {"structures": [{"begin": " is ", "schema": {"type": "string", "maxLength": 30}, "end": "."}], "triggers": [" is"]}
LARK_JSON = r"""
?start: value
?value: dict | list | ESCAPED_STRING | SIGNED_NUMBER | "true" | "false" | "null"
list : "[" [value ("," value)*] "]"
dict : "{" [pair ("," pair)*] "}"
pair : ESCAPED_STRING ":" value
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""
FUNCTIONS = [
    {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "search", "strict": True, "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
        "required": ["query"], "additionalProperties": False}},
]
THINK_THEN_CALLS = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
    {"type": "triggered_tags", "triggers": ["<function="], "tags": [
        {"type": "tag", "begin": f"<function={f['name']}>", "end": "</function>",
         "content": {"type": "json_schema", "json_schema": f["parameters"]}} for f in FUNCTIONS]},
]}}


def strict_tools(parser: str) -> StructuredOutputParams:
    """What `tool_choice="auto"` with these strict functions holds the output to under `parser`."""
    from conveyor.server.tool_parsers import make_tool_parser
    from conveyor.server.tools import Tools

    tools = Tools.parse([{"type": "function", "function": f} for f in FUNCTIONS], "auto", True, make_tool_parser(parser))
    assert tools is not None
    spec = tools.constraint()
    assert spec is not None
    return spec
GRAMMARS = {
    "json schema (5 properties)": StructuredOutputParams(json=SCHEMA),
    "json schema after <think>": StructuredOutputParams(json=SCHEMA, reasoning=("<think>", "</think>")),
    "structural tag (' is' + string)": StructuredOutputParams(structural_tag=TAG),
    "json object (any, unbounded)": StructuredOutputParams(json_object=True),
    "GBNF: JSON": StructuredOutputParams(grammar=JSON_GBNF),
    "GBNF: arithmetic": StructuredOutputParams(
        grammar='root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
                'factor ::= [0-9]+ | "(" expr ")"'),
    "GBNF: arithmetic, left-recursive": StructuredOutputParams(
        grammar='root ::= expr\nexpr ::= expr ("+" | "-") term | term\nterm ::= term ("*" | "/") factor | factor\n'
                'factor ::= [0-9]+ | "(" expr ")"'),
    "Lark: JSON, %ignore WS": StructuredOutputParams(grammar=LARK_JSON),
    "format tree: <think>, then text and 2 calls": StructuredOutputParams(structural_tag=THINK_THEN_CALLS),
    **{f"strict tools: {parser} (2 functions)": strict_tools(parser) for parser in ("hermes", "llama3_json", "qwen3_coder",
                                                                                     "pythonic", "phi4_mini_json")},
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
    ap.add_argument("--compile-only", action="store_true", help="the compile table alone")
    ap.add_argument("--strict-tools", type=int, nargs="+", default=None, metavar="N",
                    help="only compile the strict-tool constraints of N distinct functions per parser")
    ap.add_argument("--parsers", nargs="+", default=["hermes", "llama3_json", "qwen3_coder", "pythonic", "phi4_mini_json"],
                    help="the tool parsers --strict-tools compiles for")
    args = ap.parse_args()
    if args.strict_tools:
        many_strict_tools(args.strict_tools, args.parsers)
        return

    llm = LLM(args.model)
    engine = llm.engine
    cache = engine.runner.grammars
    start = time.perf_counter()
    vocab = cache.vocab
    print(f"vocabulary as bytes: {(time.perf_counter() - start) * 1e3:.0f} ms ({vocab.size} tokens)")
    print("| grammar | automaton | compile (ms) | first mask (ms) |")
    print("|---|---|---:|---:|")
    for name, spec in GRAMMARS.items():
        start = time.perf_counter()
        grammar = cache.get(spec)
        compiled = time.perf_counter() - start
        start = time.perf_counter()
        grammar.allowed(grammar.START)
        if isinstance(grammar, PushdownGrammar):
            pda = grammar.pda
            shape = f"pushdown: {len(pda.names)} rules, {sum(t.shape[0] for t in pda.tables)} states"
        else:
            shape = f"DFA: {grammar.dfa.num_states} states"
        print(f"| {name} | {shape} | {compiled * 1e3:.0f} | {(time.perf_counter() - start) * 1e3:.1f} |")
    if args.compile_only:
        return

    variants = {
        "free": None,
        "schema (DFA)": StructuredOutputParams(json=SCHEMA),
        "json_object (pushdown)": StructuredOutputParams(json_object=True),
        "GBNF JSON (pushdown)": StructuredOutputParams(grammar=JSON_GBNF),
        "schema after <think>": StructuredOutputParams(json=SCHEMA, reasoning=("<think>", "</think>")),
        "structural tag": StructuredOutputParams(structural_tag=TAG),
    }
    print("\n| batch | constraint | ms/token | ratio to free | ended | valid JSON | valid for the schema | deepest |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        convs = [[{"role": "user", "content": ASKS[i % len(ASKS)]}] for i in range(batch)]
        runs: dict[str, list[float]] = {k: [] for k in variants}
        parsed: dict[str, list[bool]] = {k: [] for k in variants}
        ok: dict[str, list[bool]] = {k: [] for k in variants}
        ended: dict[str, list[bool]] = {k: [] for k in variants}
        deepest = dict.fromkeys(variants, 0)
        for r in range(args.rounds + 1):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for which in order:
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_outputs=variants[which])
                start = time.perf_counter()
                outs = llm.chat(convs, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                if r:  # round 0 warms up
                    runs[which].append(elapsed / tokens * 1e3)
                    for o in outs:
                        value = parse(o.outputs[0].text)
                        parsed[which].append(value is not None)
                        ended[which].append(o.outputs[0].finish_reason == "stop")
                        ok[which].append(valid(o.outputs[0].text))
                        deepest[which] = max(deepest[which], depth(value))
        free = statistics.median(runs["free"])
        for which in variants:
            t = statistics.median(runs[which])
            print(f"| {batch} | {which} | {t:.1f} | {t / free:.2f}× | {sum(ended[which])}/{len(ended[which])} "
                  f"| {sum(parsed[which])}/{len(parsed[which])} "
                  f"| {sum(ok[which])}/{len(ok[which])} | {deepest[which]} |")


    deep_walk(llm)


def many_strict_tools(counts: list[int], parsers: list[str]) -> None:
    """Compile time of `tool_choice="auto"` over N strict functions, each of 4 parameters (its own
    string property, bounded to 40 characters or not, an enum, a bounded integer, a list). A
    parser whose tag writes its markers as tokens compiles as for a tokenizer holding them as
    special tokens."""
    from conveyor.server.tool_parsers import make_tool_parser
    from conveyor.server.tools import Tools
    from conveyor.structured import compile_automaton

    def function(i: int, bounded: bool) -> dict:
        text = {"type": "string", **({"maxLength": 40} if bounded else {})}
        return {"type": "function", "function": {"name": f"tool_{i}", "strict": True, "parameters": {
            "type": "object", "properties": {f"city_{i}": text, "unit": {"enum": ["celsius", "fahrenheit"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                             "tags": {"type": "array", "items": {"type": "string"}}},
            "required": [f"city_{i}"], "additionalProperties": False}}}

    print("| functions | strings | parser | compile (ms) | automaton |")
    print("|---:|---|---|---:|---|")
    for n in counts:
        for bounded in (False, True):
            for parser in parsers:
                made = make_tool_parser(parser)
                tools = Tools.parse([function(i, bounded) for i in range(n)], "auto", True, made)
                assert tools is not None
                specials = frozenset(made.MARKERS) if made.TOKEN_TAG else None
                start = time.perf_counter()
                automaton = compile_automaton(tools.constraint(), specials)
                took = (time.perf_counter() - start) * 1e3
                shape = (f"pushdown: {len(automaton.names)} rules" if isinstance(automaton, Pushdown)
                         else f"DFA: {automaton.num_states} states")
                print(f"| {n} | {'maxLength 40' if bounded else 'free'} | {parser} | {took:.0f} | {shape} |", flush=True)


def deep_walk(llm: LLM) -> None:
    from conveyor.structured import compile_automaton

    cache = llm.engine.runner.grammars
    value: object = {"leaf": [1, 2.5, "x"]}
    for i in range(40):
        value = {f"k{i}": [value, i]} if i % 2 else {f"k{i}": value, "n": None}
    text = json.dumps(value)
    tokens = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    pda = compile_automaton(StructuredOutputParams(json_object=True))
    assert isinstance(pda, Pushdown)
    grammar = PushdownGrammar(pda, cache.vocab, cache.device)  # not the cache's: no mask computed yet
    print(f"\n{len(text)} characters, {len(tokens)} tokens, 40 levels deep")
    print("| walk | mean ms/token | max ms/token | masks computed |")
    print("|---|---:|---:|---:|")
    for label in ("cold", "warm"):
        times = []
        before = len(grammar._masks)
        state = grammar.START
        for t in tokens:
            start = time.perf_counter()
            grammar.allowed(state)
            state = grammar.advance(state, t)
            times.append((time.perf_counter() - start) * 1e3)
        assert state and grammar.is_accepting(state), "the text is in the grammar"
        computed = len(grammar._masks) - before if label == "cold" else 0
        print(f"| {label} | {statistics.mean(times):.2f} | {max(times):.1f} | {computed} |")


def parse(text: str) -> object | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


def depth(value: object) -> int:
    """How deep objects and arrays nest in a JSON value (0 for a scalar)."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


if __name__ == "__main__":
    main()
