"""Structural tags in xgrammar's format tree (`{"format": {...}}`): the automaton against a matcher
written from the definition (conveyor/structured/structural_tag.py's docstring: what each format
matches, and that a free-text format in the last place of a tag's content stops at the first of
that tag's ends), over random format trees and texts sampled from them and then damaged; the
examples of xgrammar's documentation; the refusals; and a run on the tiny model held to a
thinking block and a call, greedy as HF's with the same constraint."""

from __future__ import annotations

import functools
import json
import random

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.sampling_params import InvalidRequestError, StructuredOutputParams
from conveyor.structured import GrammarError, compile_automaton

# Leaves with a pattern for exactly the texts they match (conveyor's JSON has no spaces around a
# value, and no -0).
ENUM = {"type": "json_schema", "json_schema": {"enum": ["a", "b"]}}
INTEGER = {"type": "json_schema", "json_schema": {"type": "integer"}}
DIGITS = {"type": "regex", "pattern": "[0-9]+"}
YES_NO = {"type": "grammar", "grammar": 'root ::= "yes" | "no"'}
PATTERNS = {json.dumps(ENUM): r'"a"|"b"', json.dumps(INTEGER): r"0|-?[1-9][0-9]*", json.dumps(DIGITS): "[0-9]+",
            json.dumps(YES_NO): "yes|no"}


# -- the definition, as a matcher: the positions where a format can end ------------------------
def first_hit(text: str, i: int, markers: list[str]) -> tuple[int | None, list[str]]:
    """Where the first of `markers` to be completed in `text[i:]` ends, and those ending there."""
    for p in range(i + 1, len(text) + 1):
        found = [m for m in markers if text[i:p].endswith(m)]
        if found:
            return p, found
    return None, []


def then(positions: set[int], text: str, stop: tuple[str, ...] | None) -> set[int]:
    if not stop:
        return positions
    return {p + len(e) for p in positions for e in stop if text.startswith(e, p)}


class Reference:
    def __init__(self, text: str) -> None:
        self.text = text
        self.ends = functools.cache(self._ends)

    def _ends(self, key: str, i: int, stop: tuple[str, ...] | None) -> frozenset[int]:
        fmt, text = json.loads(key), self.text
        kind = fmt["type"]
        if kind == "const_string":
            return frozenset(then({i + len(fmt["value"])} if text.startswith(fmt["value"], i) else set(), text, stop))
        if key in PATTERNS:
            return frozenset(then({j for j in range(i, len(text) + 1) if regex.fullmatch(PATTERNS[key], text[i:j])},
                                  text, stop))
        if kind == "any_text":
            return frozenset(self.free(i, [], fmt.get("excludes", []), stop))
        if kind == "sequence":
            at = {i}
            for k, e in enumerate(fmt["elements"]):
                last = k == len(fmt["elements"]) - 1
                at = {q for p in at for q in self.of(e, p, stop if last else None)}
            return frozenset(at)
        if kind == "or":
            return frozenset(q for e in fmt["elements"] for q in self.of(e, i, stop))
        if kind in ("optional", "star", "plus", "repeat"):
            low, high = {"optional": (0, 1), "star": (0, None), "plus": (1, None)}.get(kind) or (fmt["min"], fmt["max"])
            high = None if high == -1 else high
            return frozenset(then(self.repeated(lambda p: self.of(fmt["content"], p, None), i, low, high), text, stop))
        if kind == "tag":
            return frozenset(then(self.tag(fmt, i), text, stop))
        if kind == "tags_with_separator":
            sep = fmt["separator"]
            one = lambda p: {q for t in fmt["tags"] for q in self.tag(t, p)}  # noqa: E731
            more = lambda p: one(p + len(sep)) if text.startswith(sep, p) else set()  # noqa: E731
            calls = one(i) if fmt.get("stop_after_first") else {q for p in one(i) for q in self.repeated(more, p, 0, None)}
            return frozenset(then(calls | (set() if fmt.get("at_least_one") else {i}), text, stop))
        if kind == "triggered_tags":
            triggers = fmt["triggers"]
            whole = {q for t in fmt["tags"] for q in self.tag(t, i)}
            if fmt.get("at_least_one") and fmt.get("stop_after_first"):
                return frozenset(then(whole, text, stop))

            def body(k: int, p: int) -> set[int]:  # after trigger k, ending at p: a tag it begins
                out = set()
                for t in fmt["tags"]:
                    owner = min(range(len(triggers)), key=lambda m: (first_hit(t["begin"], 0, [triggers[m]])[0] or 1e9))
                    tail = t["begin"][len(triggers[owner]):]
                    if owner == k and text.startswith(tail, p):
                        out |= self.of(t["content"], p + len(tail), ends_of(t))
                return out

            starts = whole if fmt.get("at_least_one") else {i}
            once = fmt.get("stop_after_first", False)
            return frozenset(q for p in starts for q in self.dispatch(p, triggers, body, fmt.get("excludes", []), stop, not once))
        if kind == "dispatch":
            rules = fmt["rules"]
            patterns = [r[0] for r in rules]
            return frozenset(self.dispatch(i, patterns, lambda k, p: self.of(rules[k][1], p, None),
                                           fmt.get("excludes", []), stop, fmt.get("loop", True)))
        raise AssertionError(kind)

    def of(self, fmt: dict, i: int, stop: tuple[str, ...] | None) -> frozenset[int]:
        return self.ends(json.dumps(fmt), i, stop)

    def tag(self, t: dict, i: int) -> set[int]:
        if not self.text.startswith(t["begin"], i):
            return set()
        return set(self.of(t["content"], i + len(t["begin"]), ends_of(t)))

    def free(self, i: int, markers: list[str], excludes: list[str], stop: tuple[str, ...] | None) -> set[int]:
        """Free text from `i` holding no marker or excluded string: with a non-empty end to stop
        at, through the first end; else to any point before the first marker."""
        ends = [e for e in stop or () if e]
        p, found = first_hit(self.text, i, markers + ends + excludes)
        if ends:
            return {p} if p is not None and set(found) & set(ends) else set()
        last = len(self.text) if p is None else p - 1
        return then(set(range(i, last + 1)), self.text, stop)

    def dispatch(self, i: int, markers: list[str], body, excludes: list[str], stop, loop: bool) -> set[int]:
        out = self.free(i, markers, excludes, stop)
        ends = [e for e in stop or () if e]
        p, found = first_hit(self.text, i, markers + ends + excludes)
        for k, m in enumerate(markers):
            if p is not None and m in found:
                for q in body(k, p):
                    out |= self.dispatch(q, markers, body, excludes, stop, loop) if loop else then({q}, self.text, stop)
        return out

    @staticmethod
    def repeated(step, i: int, low: int, high: int | None) -> set[int]:
        out, at = set(), {i}
        for count in range(0, 40):
            if count >= low:
                out |= at
            if (high is not None and count >= high) or not at:
                break
            at = {q for p in at for q in step(p)}
        return out


def ends_of(t: dict) -> tuple[str, ...]:
    return (t["end"],) if isinstance(t["end"], str) else tuple(t["end"])


def reference_matches(fmt: dict, text: str) -> bool:
    return len(text) in Reference(text).of(fmt, 0, None)


# -- random format trees, and texts sampled from them ------------------------------------------
LEAVES = [ENUM, INTEGER, DIGITS, YES_NO, {"type": "const_string", "value": "a"}, {"type": "const_string", "value": "<t>"},
          {"type": "any_text"}, {"type": "any_text", "excludes": ["!"]}]
FUNCTIONS = [{"type": "tag", "begin": "<f=a>", "content": ENUM, "end": "</f>"},
             {"type": "tag", "begin": "<f=b>", "content": {"type": "any_text"}, "end": "</f>"},
             {"type": "tag", "begin": "<g>", "content": INTEGER, "end": ["!", "?"]}]


def formats(depth: int):
    leaf = st.sampled_from(LEAVES)
    if depth == 0:
        return leaf
    sub = formats(depth - 1)
    flags = st.fixed_dictionaries({}, optional={"at_least_one": st.booleans(), "stop_after_first": st.booleans()})
    return st.one_of(
        leaf,
        st.builds(lambda es: {"type": "sequence", "elements": es}, st.lists(sub, min_size=1, max_size=3)),
        st.builds(lambda es: {"type": "or", "elements": es}, st.lists(sub, min_size=1, max_size=3)),
        st.builds(lambda k, c: {"type": k, "content": c}, st.sampled_from(["optional", "star", "plus"]), sub),
        st.builds(lambda lo, extra, c: {"type": "repeat", "min": lo, "max": -1 if extra is None else lo + extra, "content": c},
                  st.integers(0, 2), st.none() | st.integers(0, 2), sub),
        st.builds(lambda b, c, e: {"type": "tag", "begin": b, "content": c, "end": e},
                  st.sampled_from(["<t>", "(", ""]), sub, st.sampled_from(["</t>", ["</t>", "!"], ")", ""])),
        st.builds(lambda tags, f, ex: {"type": "triggered_tags", "triggers": sorted({t["begin"][:2] for t in tags}),
                                       "tags": tags, **f, **({"excludes": ex} if ex else {})},
                  st.lists(st.sampled_from(FUNCTIONS), min_size=1, max_size=3, unique_by=json.dumps), flags,
                  st.sampled_from([[], ["!"]])),
        st.builds(lambda tags, sep, f: {"type": "tags_with_separator", "tags": tags, "separator": sep, **f},
                  st.lists(st.sampled_from(FUNCTIONS), min_size=1, max_size=2, unique_by=json.dumps),
                  st.sampled_from([",", "", "</t>"]), flags),
        st.builds(lambda rules, loop: {"type": "dispatch", "rules": rules, "loop": loop},
                  st.lists(st.tuples(st.sampled_from(["@", "#"]), sub).map(list), min_size=1, max_size=2,
                           unique_by=lambda r: r[0]), st.booleans()),
    )


FILLER = ["x", " ", "a", "!", "<", "</t>", "<f=", "1", "@"]


def sample(fmt: dict, rnd: random.Random, stop: tuple[str, ...] | None) -> str:
    """A text the format likely matches (the matcher decides)."""
    kind, end = fmt["type"], rnd.choice(stop) if stop else ""
    free = lambda: "".join(rnd.choice(FILLER[:4]) for _ in range(rnd.randint(0, 3)))  # noqa: E731
    if kind == "const_string":
        return fmt["value"] + end
    if json.dumps(fmt) in PATTERNS:
        return rnd.choice({"[0-9]+": ["7", "12"], "yes|no": ["yes", "no"]}.get(PATTERNS[json.dumps(fmt)], ['"a"', "-3", "0"])) + end
    if kind == "any_text":
        return free() + end
    if kind == "sequence":
        es = fmt["elements"]
        return "".join(sample(e, rnd, stop if k == len(es) - 1 else None) for k, e in enumerate(es))
    if kind == "or":
        return sample(rnd.choice(fmt["elements"]), rnd, stop)
    if kind in ("optional", "star", "plus", "repeat"):
        low = {"optional": 0, "star": 0, "plus": 1}.get(kind, fmt.get("min", 0))
        return "".join(sample(fmt["content"], rnd, None) for _ in range(low + rnd.randint(0, 1))) + end
    if kind == "tag":
        return fmt["begin"] + sample(fmt["content"], rnd, ends_of(fmt)) + end
    if kind in ("triggered_tags", "tags_with_separator"):
        sep = fmt.get("separator", "")
        once = fmt.get("stop_after_first", False)
        tags = [rnd.choice(fmt["tags"]) for _ in range(rnd.randint(0, 1 if once else 2))]
        parts = [(free() if kind == "triggered_tags" else "") + t["begin"] + sample(t["content"], rnd, ends_of(t)) for t in tags]
        return sep.join(parts) + (free() if kind == "triggered_tags" and not (once and tags) else "") + end
    if kind == "dispatch":
        rule = rnd.choice(fmt["rules"])
        return free() + rule[0] + sample(rule[1], rnd, None) + (free() if fmt.get("loop", True) else "") + end
    raise AssertionError(kind)


def damaged(text: str, rnd: random.Random) -> str:
    if not text or rnd.random() < 0.4:
        return text
    i = rnd.randrange(len(text))
    return rnd.choice([text[:i] + text[i + 1:], text[:i] + rnd.choice(FILLER) + text[i:], text[:i]])


def in_tag(fmt: dict) -> dict:
    """`fmt` as the content of a tag with a non-empty end: where a free-text format stops at it."""
    return {"type": "tag", "begin": "<t>", "content": fmt, "end": ["</t>", "?"]}


@settings(max_examples=600, deadline=None)
@given(st.one_of(formats(3), formats(2).map(in_tag)), st.randoms(use_true_random=False))
def test_the_automaton_matches_what_the_definition_allows(fmt, rnd):
    try:
        automaton = compile_automaton(StructuredOutputParams(structural_tag={"format": fmt}))
    except (InvalidRequestError, GrammarError) as e:  # a random tree may pass the automaton's size limit
        assert "trigger is also the enclosing tag's end" in str(e) or "too large" in str(e)
        return
    for _ in range(6):
        text = damaged(sample(fmt, rnd, None), rnd)
        assert automaton.matches(text) == reference_matches(fmt, text), (json.dumps(fmt), text)


# -- examples -------------------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def call(name: str) -> dict:
    return {"type": "tag", "begin": f"<function={name}>", "content": {"type": "json_schema", "json_schema": WEATHER},
            "end": "</function>"}


def automaton_of(fmt: dict):
    return compile_automaton(StructuredOutputParams(structural_tag={"type": "structural_tag", "format": fmt}))


def test_xgrammars_documented_examples():
    think = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
    calls = {"type": "triggered_tags", "triggers": ["<function="], "tags": [call("get_weather"), call("get_time")]}
    a = automaton_of(calls)
    assert a.matches('I will call a tool now. <function=get_weather>{"city": "San Francisco"}</function>')
    assert a.matches("no call") and not a.matches('<function=get_date>{"city": "x"}</function>')
    assert not a.matches('<function=get_time>{"town": "x"}</function>')
    exactly_one = automaton_of({**calls, "at_least_one": True, "stop_after_first": True})
    assert exactly_one.matches('<function=get_time>{"city": "x"}</function>')
    assert not exactly_one.matches('Sure: <function=get_time>{"city": "x"}</function>')
    assert not exactly_one.matches('<function=get_time>{"city": "x"}</function> ok') and not exactly_one.matches("")
    mixed = automaton_of({"type": "sequence", "elements": [think, calls]})
    assert mixed.matches('<think>weather? </function> no</think>Let me see <function=get_weather>{"city": "Oslo"}</function>')
    assert not mixed.matches("<think>never closed")
    response = automaton_of({"type": "tag", "begin": "<response>", "end": "</response>", "content": {
        "type": "dispatch", "rules": [["<function=get_weather>", {"type": "json_schema", "json_schema": WEATHER}]],
        "excludes": ["</response>"]}})
    assert response.matches('<response>So <function=get_weather>{"city": "Rome"} and</response>')
    assert not response.matches("<response>a</response>b")
    listed = automaton_of({"type": "tags_with_separator", "tags": [{"begin": "<item>", "content": DIGITS, "end": "</item>"}],
                           "separator": ",", "at_least_one": True})
    assert listed.matches("<item>1</item>,<item>23</item>") and not listed.matches("") and not listed.matches("<item>1</item>,")
    ended = automaton_of({"type": "tag", "begin": "<r>", "content": ENUM, "end": ["</r>", "</answer>"]})
    assert ended.matches('<r>"a"</answer>') and ended.matches('<r>"b"</r>') and not ended.matches('<r>"a"')
    untyped = automaton_of({"begin": "<t>", "content": {"value": "x"}, "end": "</t>"})  # read by their fields
    assert untyped.matches("<t>x</t>") and not untyped.matches("<t>y</t>")
    assert automaton_of({"type": "repeat", "min": 1, "max": 2, "content": {"type": "const_string", "value": "ab"}}).matches("abab")


def test_the_qwen_xml_style_writes_parameters_as_qwen3_coder_reads_them():
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                               "days": {"type": "integer"}, "tags": {"type": "array", "items": ENUM["json_schema"]}},
              "required": ["city", "days"]}
    a = automaton_of({"type": "json_schema", "json_schema": schema, "style": "qwen_xml"})
    assert a.matches("<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n")
    assert a.matches('<parameter=city>Oslo</parameter><parameter=unit>f</parameter><parameter=days>-2</parameter>'
                     '<parameter=tags>["a","b"]</parameter>')
    assert not a.matches("<parameter=days>3</parameter>")  # city is required
    assert not a.matches("<parameter=city>x</parameter><parameter=days>3.5</parameter>")  # not an integer
    assert not a.matches("<parameter=city>x</parameter><parameter=unit>k</parameter><parameter=days>3</parameter>")
    assert not a.matches("<parameter=city>a</function></parameter><parameter=days>3</parameter>")  # ends the call
    assert not a.matches("<parameter=days>3</parameter><parameter=city>x</parameter>")  # the schema's order
    anything = automaton_of({"type": "json_schema", "json_schema": {"type": "object"}, "style": "qwen_xml"})
    assert anything.matches("<parameter=a>1</parameter>\n<parameter=b>two</parameter>") and anything.matches("")


def test_the_first_shape_is_a_triggered_tags_format():
    legacy = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}],
              "triggers": ["<function="]}
    new = {"type": "triggered_tags", "triggers": ["<function="], "tags": [call("get_weather")]}
    texts = ['x <function=get_weather>{"city": "a"}</function> y', "<function=get_weather>{}</function>", "plain", ""]
    a, b = compile_automaton(StructuredOutputParams(structural_tag=legacy)), automaton_of(new)
    assert [a.matches(t) for t in texts] == [b.matches(t) for t in texts] == [True, False, True, True]


@pytest.mark.parametrize(("fmt", "match"), [
    ({"type": "exclude_token", "exclude_tokens": ["<|tool|>"]}, "'exclude_token' .* is not built"),
    ({"type": "tag", "begin": {"type": "token", "token": -5}, "content": {}, "end": "x"},
     r"format.begin.token: token id -5 is not in the tokenizer's vocabulary"),
    ({"type": "token", "token": ""}, r"format.token must be a token: its text"),
    ({"type": "token_triggered_tags", "trigger_tokens": ["<t>"], "tags": [call("x")]},
     r"tags\[0\].begin must be one of the trigger tokens"),
    ({"type": "triggered_tags", "triggers": ["<t>"], "tags": [{"begin": {"type": "token", "token": "<t>"},
      "content": ENUM, "end": "."}]}, r"tags\[0\].begin: a tag that a token begins is token_triggered_tags'"),
    ({"type": "tag", "begin": {"type": "token", "token": "<a>"}, "end": {"type": "token", "token": "<b>"},
      "content": {"type": "token_triggered_tags", "trigger_tokens": ["<b>"],
                  "tags": [{"begin": {"type": "token", "token": "<b>"}, "content": ENUM, "end": "."}]}},
     "trigger is also the enclosing tag's end: token '<b>'"),
    ({"type": "token_dispatch", "rules": [["<a>", ENUM], ["<a>", INTEGER]]}, "two rules share a token"),
    ({"type": "json_schema", "json_schema": WEATHER, "style": "minimax_xml"}, "only \"json\" and \"qwen_xml\" are built"),
    ({"type": "json_schema", "json_schema": {"type": "array"}, "style": "qwen_xml"}, "needs an object schema"),
    ({"type": "json_schema", "json_schema": WEATHER, "any_order": True}, "any_order: not built"),
    ({"type": "any_text", "max_chars": 10}, "max_chars: not built"),
    ({"type": "regex", "pattern": "a+", "excludes": ["aa"]}, "excludes: not built"),
    ({"type": "sequence", "elements": [{"type": "const_string", "value": ""}]}, r"elements\[0\].value must be a non-empty"),
    ({"type": "sequence", "elements": []}, "elements must list at least one format"),
    ({"type": "or", "elements": [{"type": "what"}]}, r"elements\[0\]: type 'what' is not a format"),
    ({"type": "or", "elements": [{"begins": "<a>"}]}, r"elements\[0\]: no type, and its fields name no format"),
    ({"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": {"type": "nope"}}, "end": "</a>"},
     r"format.content.json_schema: "),
    ({"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": []}, "end must be a string, a non-empty list"),
    ({"type": "triggered_tags", "triggers": ["<f="], "tags": [call("x")] , "at_least_one": "yes"}, "at_least_one must be true or false"),
    ({"type": "triggered_tags", "triggers": ["<g>"], "tags": [call("x")]}, r"tags\[0\]: its begin '<function=x>' does not start"),
    ({"type": "triggered_tags", "triggers": ["<function=", "<z>"], "tags": [call("x")]}, "trigger '<z>' starts no tag"),
    ({"type": "tag", "begin": "<a>", "end": "</a>", "content": {"type": "triggered_tags", "triggers": ["</a>"],
      "tags": [{"begin": "</a>", "content": ENUM, "end": "."}]}}, "trigger is also the enclosing tag's end"),
    ({"type": "repeat", "min": 2, "max": 1, "content": ENUM}, "min must be a count"),
    ({"type": "dispatch", "rules": [["@", ENUM], ["@", INTEGER]]}, "two rules share a pattern"),
    ({"type": "grammar", "grammar": "root ::= missing"}, r"format.grammar: "),
])
def test_bad_formats_are_refused_with_their_path(fmt, match):
    with pytest.raises(InvalidRequestError, match=match):
        StructuredOutputParams(structural_tag={"type": "structural_tag", "format": fmt})
    with pytest.raises(InvalidRequestError, match=r"structural_tag\.type"):
        StructuredOutputParams(structural_tag={"type": "json_schema", "format": {"type": "any_text"}})
