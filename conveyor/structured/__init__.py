"""Structured outputs: a request's grammar (JSON Schema, JSON object, regex or choice) as a
byte-level DFA (`regex.py`, `json_schema.py`), a context-free grammar (GBNF, or a schema
that nests without bound) as a pushdown automaton of such DFAs (`cfg.py`), and each state as the set of vocabulary tokens that keep
the output alive (`grammar.py`, which needs torch and numpy).

This package's top level is torch-free: `SamplingParams` checks a grammar here when it is
made, before any engine sees it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from conveyor.structured.cfg import ROOT, Expr, Pushdown, Ref, compile_rules, parse_grammar
from conveyor.structured.json_schema import lit, schema_to_rules
from conveyor.structured.lark import looks_like_lark, parse_lark
from conveyor.structured.regex import (
    Alternate,
    ByteDFA,
    Bytes,
    CharSet,
    Concat,
    GrammarError,
    Node,
    Repeat,
    Until,
    escape,
    parse,
    special_token,
)
from conveyor.structured.structural_tag import structural_tag_rules

__all__ = ["GrammarError", "Node", "check", "compile_automaton", "escape", "to_rules"]


THINKING = "(thinking)"  # the start rule of a grammar after a thinking block (no GBNF name has parentheses)
SPACE = CharSet(((9, 10), (13, 13), (32, 32)))  # what is stripped before an opening tag: tab, newline, CR, space


def check(params: Any) -> None:
    """Raise GrammarError if a `StructuredOutputParams` cannot be what it says (parsed, not
    compiled: a grammar's rules are checked for what they refer to, not yet for left
    recursion)."""
    thinking(to_rules(params), getattr(params, "reasoning", None))


def compile_automaton(params: Any, specials: frozenset[str] | None = None) -> ByteDFA | Pushdown:
    """The automaton of a `StructuredOutputParams`: a DFA, or for a recursive grammar a
    pushdown automaton; raises GrammarError. `specials`: the texts of the served tokenizer's
    special tokens, which a structural tag's `token` formats take as such (None: not known)."""
    rules = to_rules(params, specials)
    reasoning = getattr(params, "reasoning", None)
    if reasoning is None:
        return compile_rules(rules)
    return compile_rules(thinking(rules, reasoning, specials), THINKING)


def thinking(rules: dict[str, Expr], reasoning: tuple[str, str] | None,
             specials: frozenset[str] | None = None) -> dict[str, Expr]:
    """`rules` with a start rule that lets a thinking block come first, read as the server's
    reasoning parsers read it (conveyor/server/reasoning.py): with an opening tag, an output
    that opens with it (after spaces, tabs and newlines) thinks up to the first closing tag;
    without one, every output starts inside the block (the template opened it). The newlines
    after the closing tag are dropped, and the rest is the answer, which the grammar holds. An
    output that does not open the block is all answer. A tag's special tokens of the served
    tokenizer (`specials`) are read as those tokens (a tag may hold text between them: harmony's
    `<|channel|>final<|message|>`), and a block closed by one holds any special tokens (harmony's
    analysis messages). Raises GrammarError for a bad tag."""
    if reasoning is None:
        return rules
    opening, closing = reasoning
    if not isinstance(opening, str) or not isinstance(closing, str) or not closing:
        raise GrammarError("reasoning must be (opening tag, closing tag): two strings, the closing one not empty")
    def tag(text: str) -> bytes:
        present = sorted((s for s in specials or () if s and s in text), key=len, reverse=True)
        if not present:
            return text.encode("utf-8")
        out, at = b"", 0
        for m in re.finditer("|".join(map(re.escape, present)), text):
            out += text[at:m.start()].encode("utf-8") + special_token(m.group())
            at = m.end()
        return out + text[at:].encode("utf-8")

    end = tag(closing)
    block: Node = Concat((Until((end,), specials=end != closing.encode("utf-8")), Repeat(CharSet(((10, 10),)), 0, None)))
    if opening:
        block = Concat((Repeat(SPACE, 0, None), Bytes(tag(opening)), block))
        start: Expr = Concat((Alternate((block, Concat(()))), Ref(ROOT)))  # type: ignore[arg-type]
    else:
        start = Concat((block, Ref(ROOT)))  # type: ignore[arg-type]
    return {**rules, THINKING: start}


def to_rules(params: Any, specials: frozenset[str] | None = None) -> dict[str, Expr]:
    """The grammar of a `StructuredOutputParams`: its `root` rule and those it refers to (a
    GBNF grammar's, or a JSON Schema's recursive ones); raises GrammarError."""
    if params.grammar is not None:
        return parse_lark(params.grammar) if looks_like_lark(params.grammar) else parse_grammar(params.grammar)
    if params.regex is not None:
        if not isinstance(params.regex, str):
            raise GrammarError("regex must be a string")
        return {"root": parse(params.regex)}
    if params.choice is not None:
        if not params.choice or not all(isinstance(c, str) and c for c in params.choice):
            raise GrammarError("choice must list at least one non-empty string")
        return {"root": Alternate(tuple(lit(c) for c in params.choice))}
    if getattr(params, "structural_tag", None) is not None:
        return structural_tag_rules(params.structural_tag, specials)
    if params.json_object:
        return schema_to_rules({"type": "object"})
    try:
        schema = json.loads(params.json)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"json is not a JSON Schema: {e}") from None
    return schema_to_rules(schema)
