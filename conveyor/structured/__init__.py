"""Structured outputs: a request's grammar (JSON Schema, JSON object, regex or choice) as a
byte-level DFA (`regex.py`, `json_schema.py`), and each DFA state as the set of vocabulary
tokens that keep the output alive (`grammar.py`, which needs torch and numpy).

This package's top level is torch-free: `SamplingParams` checks a grammar here when it is
made, before any engine sees it.
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.structured.json_schema import lit, schema_to_node
from conveyor.structured.regex import Alternate, GrammarError, Node, escape, parse

__all__ = ["GrammarError", "Node", "escape", "to_node"]


def to_node(params: Any) -> Node:
    """The pattern of a `StructuredOutputParams`; raises GrammarError."""
    if params.regex is not None:
        if not isinstance(params.regex, str):
            raise GrammarError("regex must be a string")
        return parse(params.regex)
    if params.choice is not None:
        if not params.choice or not all(isinstance(c, str) and c for c in params.choice):
            raise GrammarError("choice must list at least one non-empty string")
        return Alternate(tuple(lit(c) for c in params.choice))
    if params.json_object:
        return schema_to_node({"type": "object"})
    try:
        schema = json.loads(params.json)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"json is not a JSON Schema: {e}") from None
    return schema_to_node(schema)
