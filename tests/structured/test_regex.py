"""The byte-level DFA against Python's `re` (ASCII classes, as documented), and its UTF-8
ranges against encoding every code point."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.structured.regex import (
    MAX_CODEPOINT,
    SURROGATES,
    CharSet,
    GrammarError,
    compile_dfa,
    parse,
)

ALPHABET = "abAB1 é中.\n-x\U0001F600"
LEAVES = ["a", "b", "é", "中", r"\.", "[ab]", "[^a]", "[a-é]", r"\d", r"\w", r"\s", r"\S", ".", "[0-9x]",
          "x", r"\u4e2d", r"[\U0001F600-\U0001F64F]", "-", "[-a]", r"[^\n-]", "B", "[^A]", "[A-a]", r"\x41", r"\W",
          " a", "[ b]", "a#c\n", r"\ "]
FLAGS = ["", "(?i)", "(?s)", "(?is)", "(?m)", "(?a)", "(?x)", "(?ix)"]
QUANTIFIERS = ["*", "+", "?", "{2}", "{0,2}", "{1,}", "*?", "{,2}"]


def patterns() -> st.SearchStrategy[str]:
    return st.recursive(
        st.sampled_from(LEAVES),
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=3).map("".join),
            st.tuples(inner, inner).map(lambda ab: f"{ab[0]}|{ab[1]}"),
            st.tuples(inner, st.sampled_from(QUANTIFIERS), st.booleans()).map(
                lambda t: f"({'?:' if t[2] else ''}{t[0]}){t[1]}"
            ),
            st.tuples(st.sampled_from(["i", "s", "-i", "is", "-s"]), inner).map(lambda t: f"(?{t[0]}:{t[1]})"),
        ),
        max_leaves=8,
    )


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(FLAGS), patterns(), st.lists(st.text(alphabet=ALPHABET, max_size=6), min_size=20, max_size=20))
def test_the_dfa_accepts_what_re_fullmatch_accepts(flags, pattern, texts):
    """Flags too, for the whole pattern and over groups: i (ASCII letters, as re.ASCII's), s,
    and x (verbose: spaces and comments dropped) for the whole."""
    pattern = flags + pattern
    dfa = compile_dfa(parse(pattern))
    for text in texts:
        assert dfa.matches(text) == bool(re.fullmatch(pattern, text, re.ASCII)), (pattern, text)


def test_flags_given_apart_as_lark_writes_them():
    assert compile_dfa(parse("ab.", "is")).matches("AB\n") and not compile_dfa(parse("ab.")).matches("AB\n")
    assert compile_dfa(parse("a b # c", "x")).matches("ab")
    with pytest.raises(GrammarError, match="flag 'u' is not supported"):
        parse("a", "u")
    with pytest.raises(GrammarError, match="the x flag is set for the whole pattern only"):
        parse("(?x:a b)")
    with pytest.raises(GrammarError, match="flags are set for the whole pattern at its start"):
        parse("a(?i)b")


@settings(max_examples=200, deadline=None)
@given(patterns())
def test_every_live_state_can_still_reach_an_accepting_one(pattern):
    dfa = compile_dfa(parse(pattern))
    assert (dfa.table[0] == 0).all() and not dfa.accepting[0]
    reach = dfa.accepting.copy()
    for _ in range(dfa.num_states):
        reach |= reach[dfa.table].any(axis=1)
    assert reach[1:].all()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, MAX_CODEPOINT), st.integers(0, 70000), st.data())
def test_a_code_point_range_spells_exactly_its_characters(lo, width, data):
    hi = min(MAX_CODEPOINT, lo + width)
    if SURROGATES[0] <= lo and hi <= SURROGATES[1]:  # no character: UTF-8 has no surrogates
        with pytest.raises(GrammarError, match="matches no text"):
            compile_dfa(CharSet(((lo, hi),)))
        return
    dfa = compile_dfa(CharSet(((lo, hi),)))
    probes = {lo, hi, lo - 1, hi + 1, *(data.draw(st.integers(max(0, lo - 200), hi + 200)) for _ in range(30))}
    for c in (0x7F, 0x80, 0x7FF, 0x800, 0xFFFF, 0x10000, *SURROGATES):
        probes |= {c - 1, c, c + 1}
    for cp in probes:
        if not 0 <= cp <= MAX_CODEPOINT or SURROGATES[0] <= cp <= SURROGATES[1]:
            continue
        assert dfa.matches(chr(cp)) == (lo <= cp <= hi), hex(cp)


def test_a_lone_byte_of_a_character_is_a_live_prefix_not_a_match():
    dfa = compile_dfa(parse("é+"))
    first, second = "é".encode()
    state = dfa.walk(1, bytes([first]))
    assert state and not dfa.accepting[state]
    assert dfa.accepting[dfa.walk(state, bytes([second]))]
    assert dfa.walk(1, bytes([second])) == 0


@pytest.mark.parametrize(
    ("pattern", "why"),
    [("a(?=b)", "lookaround"), (r"(a)\1", "not supported"), (r"\bword", "not supported"), ("a**", "nothing to repeat"),
     ("(ab", "missing"), ("ab)", "unbalanced"), ("a{3,1}", "bad repetition"), ("[z-a]", "bad range"),
     ("a^b", "only supported"), ("[[:alpha:]]", "POSIX")],
)
def test_unsupported_syntax_is_refused_with_where_and_why(pattern, why):
    with pytest.raises(GrammarError, match=why):
        compile_dfa(parse(pattern))


def test_a_grammar_too_large_is_refused_not_built():
    with pytest.raises(GrammarError, match="too large"):
        compile_dfa(parse("[a-z]{1,3000}x{1,3000}"))


def test_equivalent_states_are_merged():
    # (a|b)*c and [ab]*c: the dead state, one looping start, the end: not a state per letter
    assert compile_dfa(parse("(a|b)*c")).num_states == compile_dfa(parse("[ab]*c")).num_states == 3
    assert np.array_equal(compile_dfa(parse("x{2}")).accepting, compile_dfa(parse("xx")).accepting)
