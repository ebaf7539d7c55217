"""Structured outputs: a request's grammar (JSON Schema, JSON object, regex or choice) as a
byte-level DFA (`regex.py`, `json_schema.py`), a context-free grammar (GBNF, or a schema
that nests without bound) as a pushdown automaton of such DFAs (`cfg.py`), and each state as the set of vocabulary tokens that keep
the output alive (`grammar.py`, which needs torch and numpy).

This package's top level is torch-free: `SamplingParams` checks a grammar here when it is
made, before any engine sees it.
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.structured.cfg import Expr, Pushdown, compile_rules, parse_grammar
from conveyor.structured.json_schema import lit, schema_to_rules
from conveyor.structured.regex import Alternate, ByteDFA, GrammarError, Node, escape, parse

__all__ = ["GrammarError", "Node", "check", "compile_automaton", "escape", "to_rules"]


def check(params: Any) -> None:
    """Raise GrammarError if a `StructuredOutputParams` cannot be what it says (parsed, not
    compiled: a grammar's rules are checked for what they refer to, not yet for left
    recursion)."""
    to_rules(params)


def compile_automaton(params: Any) -> ByteDFA | Pushdown:
    """The automaton of a `StructuredOutputParams`: a DFA, or for a recursive grammar a
    pushdown automaton; raises GrammarError."""
    return compile_rules(to_rules(params))


def to_rules(params: Any) -> dict[str, Expr]:
    """The grammar of a `StructuredOutputParams`: its `root` rule and those it refers to (a
    GBNF grammar's, or a JSON Schema's recursive ones); raises GrammarError."""
    if params.grammar is not None:
        return parse_grammar(params.grammar)
    if params.regex is not None:
        if not isinstance(params.regex, str):
            raise GrammarError("regex must be a string")
        return {"root": parse(params.regex)}
    if params.choice is not None:
        if not params.choice or not all(isinstance(c, str) and c for c in params.choice):
            raise GrammarError("choice must list at least one non-empty string")
        return {"root": Alternate(tuple(lit(c) for c in params.choice))}
    if params.json_object:
        return schema_to_rules({"type": "object"})
    try:
        schema = json.loads(params.json)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"json is not a JSON Schema: {e}") from None
    return schema_to_rules(schema)
