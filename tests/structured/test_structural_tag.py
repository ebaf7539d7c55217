"""Structural tags (`StructuredOutputParams(structural_tag=...)`, xgrammar's as vLLM takes
them): the automaton against a scanner written from the definition (free text until the first
trigger, then one of the structures it begins, a JSON value of its schema and its end, then
free text again), the refusals, and the token masks against walking each token's bytes."""

from __future__ import annotations

import json

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.sampling_params import InvalidRequestError, StructuredOutputParams
from conveyor.structured import compile_automaton
from tests.structured.masks import walk_checking_masks

# Each schema with a pattern for exactly the JSON texts it accepts (conveyor's JSON has no
# whitespace around a value, and no -0).
ENUM = ({"enum": ["a", "b"]}, r'"a"|"b"')
INTEGER = ({"type": "integer"}, r"0|-?[1-9][0-9]*")
SPECS = [
    {"structures": [{"begin": "<f=get>", "schema": ENUM[0], "end": "</f>"},
                    {"begin": "<f=set>", "schema": INTEGER[0], "end": "</f>"}],
     "triggers": ["<f="]},
    {"structures": [{"begin": "<a>", "schema": ENUM[0], "end": "!"},
                    {"begin": "<b>x", "schema": INTEGER[0], "end": "."}],
     "triggers": ["<a>", "<b>"]},
]
PATTERNS = {json.dumps(ENUM[0]): ENUM[1], json.dumps(INTEGER[0]): INTEGER[1]}


def first_end(text: str, markers: list[str]) -> tuple[int, list[str]]:
    for end in range(1, len(text) + 1):
        found = [m for m in markers if text[:end].endswith(m)]
        if found:
            return end, found
    return -1, []


def tag_ok(text: str, spec: dict, whole: bool = True) -> bool:
    """Whether `text` is (`whole`) or can still become an output the structural tag allows."""
    end, found = first_end(text, spec["triggers"])
    if end < 0:
        return True  # free text: it may end, or go on
    rest = text[end:]
    for st_ in spec["structures"]:
        pattern, close = PATTERNS[json.dumps(st_["schema"])], st_["end"]
        for t in found:  # a trigger that ends at `end`
            if not st_["begin"].startswith(t):
                continue
            tail = st_["begin"][len(t):]
            if len(rest) < len(tail):
                if not whole and tail.startswith(rest):
                    return True
                continue
            if not rest.startswith(tail):
                continue
            body = rest[len(tail):]
            if not whole and regex.fullmatch(pattern, body, partial=True):
                return True
            for k in range(len(body) + 1):
                if regex.fullmatch(pattern, body[:k]):
                    after = body[k:]
                    if not whole and len(after) < len(close) and close.startswith(after):
                        return True
                    if after.startswith(close) and tag_ok(after[len(close):], spec, whole):
                        return True
    return False


PIECES = ["<f=get>", "<f=set>", "<f=", "<f", '"a"', '"b"', '"c"', "12", "0", "-", "</f>", "</", " ", "x", "f>",
          "<a>", "<b>", "<b>x", "!", ".", "<", "a", "b"]


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(range(len(SPECS))), st.lists(st.sampled_from(PIECES), max_size=8))
def test_the_automaton_accepts_what_the_definition_allows(k, pieces):
    spec = SPECS[k]
    text = "".join(pieces)
    automaton = compile_automaton(StructuredOutputParams(structural_tag=spec))
    assert automaton.matches(text) == tag_ok(text, spec), text


def test_examples():
    automaton = compile_automaton(StructuredOutputParams(structural_tag=SPECS[0]))
    assert automaton.matches('Let me look. <f=get>"a"</f> Then <f=set>-12</f> done')
    assert automaton.matches("no call at all") and automaton.matches("")
    assert not automaton.matches('<f=get>"c"</f>') and not automaton.matches("<f=put>1</f>")
    assert not automaton.matches('<f=get>"a"') and not automaton.matches('<f=get> "a"</f>')


def test_recursive_schemas_and_reasoning_compose():
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"],
            "additionalProperties": False}
    spec = {"structures": [{"begin": "<t>", "schema": tree, "end": "</t>"}], "triggers": ["<t>"]}
    automaton = compile_automaton(StructuredOutputParams(structural_tag=spec, reasoning=("", "</think>")))
    assert automaton.matches('hmm</think>\nA tree: <t>{"kids":[{"kids":[]}]}</t>.')
    assert not automaton.matches('hmm</think>\nA tree: <t>{"kids":[{"kids":[]]}</t>.')
    assert not automaton.matches('A tree: <t>{"kids":[]}</t>')  # still thinking: it may not end


@pytest.mark.parametrize(("spec", "match"), [
    ({"structures": [{"begin": "<x>", "schema": {}, "end": "</x>"}], "triggers": ["<y>"]}, "does not start with a trigger"),
    ({"structures": [{"begin": "a<x>", "schema": {}, "end": "</x>"}], "triggers": ["<x>"]}, "does not start with a trigger"),
    ({"structures": [{"begin": "<x>", "schema": {}, "end": "</x>"}], "triggers": ["<x>", "<z>"]}, "'<z>' starts no"),
    ({"structures": [{"begin": "<x>", "schema": {"type": "nope"}, "end": "</x>"}], "triggers": ["<x>"]}, r"structures\[0\].schema"),
    ({"structures": [], "triggers": ["<x>"]}, "at least one"),
    ({"structures": [{"begin": "<x>", "schema": {}}], "triggers": ["<x>"]}, "begin: string, schema, end: string"),
    ({"structures": [{"begin": "<x>", "schema": {}, "end": ""}], "triggers": [""]}, "non-empty"),
    ("[1, 2", "not JSON"),
])
def test_bad_structural_tags_are_refused(spec, match):
    with pytest.raises(InvalidRequestError, match=match):
        StructuredOutputParams(structural_tag=spec)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=5).filter(lambda b: b != b"\x00"), min_size=1, max_size=60),
       st.randoms(use_true_random=False))
def test_masks_allow_exactly_the_tokens_whose_bytes_stay_alive(tokens, rng):
    vocab_bytes = [None, *tokens, *(bytes([b]) for b in b'<f=getsa>"b/01 x'), b"<f=get>", b'"a"</f>', b"</f> x<f="]
    automaton = compile_automaton(StructuredOutputParams(structural_tag=SPECS[0]))
    walk_checking_masks(automaton, vocab_bytes, rng)
