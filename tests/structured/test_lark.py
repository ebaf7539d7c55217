"""Lark grammars (`StructuredOutputParams(grammar=...)` in Lark's syntax, as vLLM takes them)
against the Lark parser itself: its Earley parser with the complete dynamic lexer (every
length of every terminal tried), over random texts built from each grammar's pieces; the
syntax conveyor reads; and the refusals."""

from __future__ import annotations

import functools
import re

import lark
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import InvalidRequestError, StructuredOutputParams
from conveyor.structured import compile_automaton
from conveyor.structured.lark import looks_like_lark

# (grammar, pieces to build texts from)
GRAMMARS = {
    "json": (
        r"""
        ?start: value
        ?value: dict
              | list
              | string
              | SIGNED_NUMBER      -> number
              | "true"             -> true
              | "null"             -> null
        list : "[" [value ("," value)*] "]"
        dict : "{" [pair ("," pair)*] "}"
        pair : string ":" value
        string : ESCAPED_STRING
        %import common.ESCAPED_STRING
        %import common.SIGNED_NUMBER
        %import common.WS
        %ignore WS
        """,
        ["{", "}", "[", "]", ",", ":", " ", "\n", '"a"', '"x y"', "1", "-2.5e3", "true", "null", '"', "\\"],
    ),
    "sql (vLLM's example)": (
        """
        start: select_statement
        select_statement: "SELECT " column " from " table " where " condition
        column: "col_1" | "col_2"
        table: "table_1" | "table_2"
        condition: column "=" number
        number: "1" | "2"
        """,
        ["SELECT ", "col_1", "col_2", " from ", "table_1", "table_2", " where ", "=", "1", "2", "col_3", " "],
    ),
    "arithmetic, left-recursive": (
        """
        start: sum
        sum: sum ("+" | "-") product   // rewritten as repetition
           | product
        product: product "*" atom | atom
        atom: NUMBER | NAME | "(" sum ")"
        NAME: /[a-z]+/
        %import common.INT -> NUMBER
        %ignore " "
        """,
        ["1", "23", "x", "ab", "+", "-", "*", "(", ")", " ", "/"],
    ),
    "terminals": (
        """
        start: WORD~1..2 (SEP WORD)* TAIL?
        WORD: ("a".."c")+
        SEP: ","
            | ";"
        TAIL: "end"i
        """,
        ["a", "b", "c", "d", ",", ";", "end", "END", "eNd", " "],
    ),
    "regex flags": (
        """
        start: KEY "=" VALUE (";" KEY "=" VALUE)*
        KEY: /[a-z]+_?[0-9]*/i
        VALUE: /<.+>/s | /(?i:yes|no)/
        """,
        ["a", "B", "_", "1", "=", ";", "<", ">", "\n", "x", "yes", "YeS", "NO", "maybe"],
    ),
}


@functools.cache
def automaton(name: str):
    return compile_automaton(StructuredOutputParams(grammar=GRAMMARS[name][0]))


@functools.cache
def reference(name: str) -> lark.Lark:
    return lark.Lark(GRAMMARS[name][0], parser="earley", lexer="dynamic_complete", start="start")


def lark_accepts(name: str, text: str) -> bool:
    try:
        reference(name).parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


EXAMPLES = {
    "json": ['{"a": [1, 2.5, {"b": null}], "c" : true}', " [ ] ", '["x y", -2.5e3]', "{}", "[ 1 ,2 , 3 ]"],
    "sql (vLLM's example)": ["SELECT col_1 from table_2 where col_2=1", "SELECT col_2 from table_1 where col_1=2"],
    "arithmetic, left-recursive": ["1 + x*(2 - ab)", "(1)", "a*b*c-1"],
    "terminals": ["ab,c;bcaEnD", "a", "cc;a"],
    "regex flags": ["Ab_1=<x\ny>;b=YES", "key=no", "K=<>"],
}


@settings(max_examples=600, deadline=None)
@given(st.data())
def test_the_automaton_accepts_what_lark_parses(data):
    """Texts of random pieces, or a valid text with a few pieces put in or cut out."""
    name = data.draw(st.sampled_from(sorted(GRAMMARS)))
    pieces = GRAMMARS[name][1]
    if data.draw(st.booleans()):
        text = "".join(data.draw(st.lists(st.sampled_from(pieces), max_size=10)))
    else:
        text = data.draw(st.sampled_from(EXAMPLES[name]))
        for _ in range(data.draw(st.integers(0, 2))):
            at = data.draw(st.integers(0, len(text)))
            if data.draw(st.booleans()):
                text = text[:at] + data.draw(st.sampled_from(pieces)) + text[at:]
            else:
                text = text[:at] + text[at + data.draw(st.integers(1, 3)):]
    assert automaton(name).matches(text) == lark_accepts(name, text), (name, text)


def test_examples():
    assert automaton("json").matches('{"a": [1, 2.5, {"b": null}], "c" : true}')
    assert automaton("json").matches(" [ ] ") and not automaton("json").matches("[1,]")
    assert not automaton("json").matches("[n ull]")  # a string is one token: nothing is ignored inside it
    assert automaton("sql (vLLM's example)").matches("SELECT col_1 from table_2 where col_2=1")
    assert automaton("arithmetic, left-recursive").matches("1 + x*(2 - ab)")
    assert automaton("terminals").matches("ab,c;bcaEnD") and not automaton("terminals").matches("abcd")


def test_lark_is_told_from_gbnf():
    assert looks_like_lark('start: "a"') and looks_like_lark('?start: x\nx: "a"')
    assert not looks_like_lark('root ::= "a"') and not looks_like_lark('root ::= "a:b"\n')


@pytest.mark.parametrize(("grammar", "says"), [
    ('start: x', "'x' is used but not defined"),
    ('value: "a"', "no 'start' rule"),
    ('start: "a"\n%declare X', "%declare is not built"),
    ('start: /a/u', "flag 'u' is not supported"),
    ('start: "a"\n%import common.NOPE', "common.NOPE is not one of the common terminals"),
    ('start: "a"\n%import other.X', "only Lark's common terminals"),
    ('_sep{x, s}: x (s x)*\nstart: "a"', "templates are not built"),
    ('start: "a" "b" )', "line 1, column 16: unexpected ')'"),
    ('start: "b".."a"', "a range is two one-character strings"),
    ('start: "a"\nstart: "b"', "'start' is defined twice"),
])
def test_bad_lark_grammars_say_what_and_where(grammar, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as e:
        StructuredOutputParams(grammar=grammar)
    assert e.value.param == "structured_outputs.grammar"
