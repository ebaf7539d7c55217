"""A grammar after a thinking block (`StructuredOutputParams.reasoning`): the closing tag's
matcher against the first occurrence found by `str.find`, the whole automaton against the
server's own reasoning parsers (the grammar must accept exactly the outputs whose answer, as
the parser splits it off, matches), and its token masks against walking each token's bytes."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conveyor.sampling_params import InvalidRequestError, StructuredOutputParams
from conveyor.server.reasoning import INLINE, TAGS, split_reasoning
from conveyor.structured import compile_automaton
from conveyor.structured.cfg import Pushdown
from conveyor.structured.regex import GrammarError, Until, compile_dfa
from tests.structured.masks import walk_checking_masks

MARKERS = ["</think>", "[/THINK]", "aab", "abab", "aaa", "a", "◁/think▷"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(MARKERS), st.text(alphabet="ab</think>[/THINK]◁▷", max_size=24))
def test_until_stops_at_the_first_occurrence_of_its_marker(marker, text):
    """`Until(m)` accepts exactly the texts whose first occurrence of m ends them (markers with
    borders, `aab` and `abab`, test the matcher's fallbacks; `◁/think▷` is multi-byte)."""
    dfa = compile_dfa(Until((marker.encode(),)))
    for t in (text, text + marker):
        assert dfa.matches(t) == (marker in t and t.find(marker) == len(t) - len(marker)), t


def first_end(text: str, markers: list[str]) -> tuple[int, set[int]]:
    """Where the first occurrence of any marker ends in `text` (-1: none), and which end there."""
    for end in range(1, len(text) + 1):
        found = {k for k, m in enumerate(markers) if text[:end].endswith(m)}
        if found:
            return end, found
    return -1, set()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*MARKERS, "b", "ab", "<t", "think"]), min_size=1, max_size=3, unique=True),
       st.text(alphabet="ab</think>◁▷", max_size=20), st.data())
def test_until_one_of_several_markers_stops_at_the_first_to_end(markers, text, data):
    """Several markers (a structural tag's triggers), one the suffix or prefix of another at
    times: `Until(markers, k)` accepts the texts whose first marker to end ends them and is
    marker k; `Until(markers, None)` the texts where none occurs."""
    k = data.draw(st.integers(0, len(markers) - 1))
    avoid = compile_dfa(Until(tuple(m.encode() for m in markers), None))
    end, found = first_end(markers[k], markers)
    if end < len(markers[k]):  # another marker ends inside marker k: k is never the first
        with pytest.raises(GrammarError, match="no text"):
            compile_dfa(Until(tuple(m.encode() for m in markers), k))
        return
    dfa = compile_dfa(Until(tuple(m.encode() for m in markers), k))
    for t in (text, text + markers[k]):
        end, found = first_end(t, markers)
        assert dfa.matches(t) == (end == len(t) and k in found), (t, markers, k)
        assert avoid.matches(t) == (end < 0), (t, markers)


PATTERN = r"(cat|dog) [0-9]{1,2}"
PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<thi", "</th", "\n", " ", "a", "cat 1", "dog 22", "cat",
                                   " 7", "[THINK]", "[/THINK]", "nk>", "2"]), max_size=8)


def tags(parser: str) -> tuple[str, str]:
    opening, closing, inside = TAGS[parser]
    return ("" if inside else opening, closing)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(sorted(TAGS)), PIECES)
@example("minimax_m2_append_think", ["</think>", "cat 1"])  # (found in CI: an inline parser's answer)
def test_the_grammar_accepts_what_the_parser_reads_as_a_matching_answer(parser, pieces):
    text = "".join(pieces)
    automaton = compile_automaton(StructuredOutputParams(regex=PATTERN, reasoning=tags(parser)))
    # (an inline parser gives the thinking back in the content: the answer is what follows it,
    # as the parser of the same tags without it reads it)
    plain = next(p for p in sorted(TAGS) if p not in INLINE and TAGS[p] == TAGS[parser]) if parser in INLINE else parser
    _, content = split_reasoning(text, plain)
    assert automaton.matches(text) == (content is not None and re.fullmatch(PATTERN, content) is not None), text


@pytest.mark.parametrize("parser", sorted(TAGS))
def test_a_recursive_grammar_after_the_thinking(parser):
    spec = StructuredOutputParams(grammar='root ::= "(" root ")" | "x"', reasoning=tags(parser))
    automaton = compile_automaton(spec)
    assert isinstance(automaton, Pushdown)
    opening, closing = tags(parser)
    assert automaton.matches(f"  {opening}why (x)?{closing}\n\n((x))")
    assert not automaton.matches(f"{opening}why{closing}((x)")
    assert not automaton.matches(f"{opening}still thinking")
    assert automaton.matches("((x))") == bool(opening)  # no block opened: all answer


def test_bad_tags_are_refused_and_the_key_tells_grammars_apart():
    with pytest.raises(InvalidRequestError, match="closing tag"):
        StructuredOutputParams(regex="a", reasoning=("<think>", ""))
    with pytest.raises(InvalidRequestError, match="opening tag, closing tag"):
        StructuredOutputParams(regex="a", reasoning=("</think>",))  # type: ignore[arg-type]
    plain = StructuredOutputParams(regex="a")
    after = StructuredOutputParams(regex="a", reasoning=["", "</think>"])  # type: ignore[arg-type]
    assert after.reasoning == ("", "</think>") and after.key != plain.key
    assert after.key != StructuredOutputParams(regex="a", reasoning=("<think>", "</think>")).key


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=6).filter(lambda b: b != b"\x00"), min_size=1, max_size=80),
       st.randoms(use_true_random=False))
def test_masks_allow_exactly_the_tokens_whose_bytes_stay_alive(tokens, rng):
    """In the thinking (everything but the end and tokens that close the block into a wrong
    answer) and after it, over random vocabularies that also spell the tags in pieces."""
    vocab_bytes = [None, *tokens, *(bytes([b]) for b in b"</think>\ncatdog 0123"), b"</think>", b"k>\ncat", b"k>x"]
    automaton = compile_automaton(StructuredOutputParams(regex=PATTERN, reasoning=("", "</think>")))
    walk_checking_masks(automaton, vocab_bytes, rng)
