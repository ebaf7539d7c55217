"""A GBNF grammar of Python call lists whose keyword arguments hold to JSON Schemas: what the
`pythonic` tool parser reads (`[get_weather(city='Paris'), search(query="x")]`, each value a
literal `ast.literal_eval` takes), for `tool_choice="auto"` with a strict function.

A value is the Python literal of its schema: a string in single or double quotes (escapes:
`\\\\ \\' \\" \\n \\r \\t \\0`, `\\xHH`, `\\uHHHH`), an integer, a number (JSON's form), `True` /
`False`, `None`, a list of its `items`, a dict of its `properties` (string keys, in the schema's
order, the required ones always), an `enum` or `const` as the values' literals, `anyOf` /
`oneOf` and lists of types as alternatives; a schema that says nothing of a value's type takes
any literal. Not held: a string's length, pattern and format, numbers' bounds, items' counts
(the grammar is wider there, never narrower)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["python_call_lines_grammar", "python_calls_grammar"]

COMMON = r"""
ws ::= [ \t\n\r]*
sp ::= " "?
str ::= "'" ([^'\\\n] | esc)* "'" | "\"" ([^"\\\n] | esc)* "\""
esc ::= "\\" ([\\'"nrt0] | "x" hex hex | "u" hex hex hex hex)
hex ::= [0-9a-fA-F]
int ::= "-"? ("0" | [1-9] [0-9]*)
num ::= int ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
any ::= str | num | "True" | "False" | "None" | "[" (any ("," sp any)*)? "]" | "{" (str ":" sp any ("," sp str ":" sp any)*)? "}"
"""


def python_calls_grammar(functions: list[tuple[str, Any]], parallel: bool, text: bool = True) -> str:
    """The grammar of an output that is text whose first character past any whitespace is not
    `[` (the parser's content; not with `text=False`), or a list of calls of `functions` (name,
    parameters schema), one call where `parallel` is false."""
    g = _Grammar()
    calls = " | ".join(g.call(name, schema) for name, schema in functions)
    more = "" if not parallel else ' ("," sp call)*'
    head = [
        "root ::= " + ("text | " if text else "") + "ws \"[\" call" + more + " \"]\" ws",
        r"text ::= ws ([^\[ \t\n\r] .*)?",
        f"call ::= {calls}",
    ]
    return "\n".join(head + g.rules) + COMMON


def python_call_lines_grammar(functions: list[tuple[str, Any]], parallel: bool) -> str:
    """The grammar of calls of `functions` one a line (OLMo 3's block; one call where `parallel`
    is false), a newline before and after them or not."""
    g = _Grammar()
    calls = " | ".join(g.call(name, schema) for name, schema in functions)
    more = "" if not parallel else ' ("\\n" call)*'
    head = ['root ::= "\\n"? call' + more + ' "\\n"?', f"call ::= {calls}"]
    return "\n".join(head + g.rules) + COMMON


def lit(text: str) -> str:
    """`text` as a GBNF string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


class _Grammar:
    def __init__(self) -> None:
        self.rules: list[str] = []

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def call(self, name: str, schema: Any) -> str:
        args = self.fields(schema, key=lambda k: lit(f"{k}="), separator='"," sp') \
            if isinstance(schema, dict) and isinstance(schema.get("properties"), dict) and schema["properties"] \
            else self.rule(r'([A-Za-z_] [A-Za-z_0-9]* "=" any ("," sp [A-Za-z_] [A-Za-z_0-9]* "=" any)*)?')
        return self.rule(f'{lit(name + "(")} {args} ")"')

    def fields(self, schema: dict[str, Any], key: Any, separator: str) -> str:
        """The properties in order, each `key(name) value`, the optional ones or not, with
        `separator` between those written."""
        props = list(schema["properties"].items())
        required = set(schema.get("required", []))
        first, more = "", ""  # the rules for "from property i on", nothing / something written before
        for k, sub in reversed(props):
            item = f"{key(k)} {self.value(sub)}"
            first_next, more_next = first or '""', more or '""'
            new_more = f"{separator} {item} {more_next}"
            new_first = f"{item} {more_next}"
            if k not in required:
                new_more += f" | {more_next}"
                new_first += f" | {first_next}"
            more, first = self.rule(new_more), self.rule(new_first)
        return first

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return "any"
        if "const" in schema or isinstance(schema.get("enum"), list):
            values = [schema["const"]] if "const" in schema else schema["enum"]
            options = {lit(repr(v)) for v in values} | {lit(json.dumps(v)) for v in values if isinstance(v, str)}
            return self.rule(" | ".join(sorted(options)))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.rule(" | ".join(self.value(s) for s in schema[key]))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.rule(" | ".join(self.value({**schema, "type": k}) for k in kind)) if kind else "any"
        if kind == "string":
            return "str"
        if kind == "integer":
            return "int"
        if kind == "number":
            return "num"
        if kind == "boolean":
            return '("True" | "False")'
        if kind == "null":
            return '"None"'
        if kind == "array":
            item = self.value(schema["items"]) if isinstance(schema.get("items"), dict) else "any"
            return self.rule(f'"[" ({item} ("," sp {item})*)? "]"')
        if kind == "object":
            if isinstance(schema.get("properties"), dict) and schema["properties"]:
                inner = self.fields(schema, key=lambda k: f"({lit(repr(k))} | {lit(json.dumps(k))}) \":\" sp",
                                    separator='"," sp')
                return self.rule(f'"{{" {inner} "}}"')
            return self.rule('"{" (str ":" sp any ("," sp str ":" sp any)*)? "}"')
        return "any"
