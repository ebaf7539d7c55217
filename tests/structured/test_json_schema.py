"""JSON Schema patterns: every text the DFA accepts is JSON that the schema validates (random
walks through the automaton), and the schema's instances, written compactly or with a space
after the punctuation, are accepted."""

from __future__ import annotations

import datetime
import functools
import json
import random
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.structured import GrammarError
from conveyor.structured.cfg import Pushdown, compile_rules
from conveyor.structured.json_schema import schema_to_rules
from conveyor.structured.regex import ByteDFA

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "kind": {"enum": ["a", "b", 1, None]},
        "born": {"type": "string", "format": "date"},
        "id": {"type": "string", "format": "uuid"},
        "home": {"$ref": "#/$defs/place"},
        "alias": {"anyOf": [{"type": "string", "pattern": "^[a-z]{2,4}$"}, {"type": "null"}]},
    },
    "required": ["name", "age"],
    "$defs": {"place": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "boolean"}},
                        "required": ["x"]}},
}
SCHEMAS = [
    PERSON,
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"const": "x"}], "items": {"type": "null"}},
    {"type": ["string", "integer", "null"]},
    {"type": "object"},  # any object, nesting unbounded
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},  # none required
    {"allOf": [{"properties": {"a": {"type": "boolean"}}, "required": ["a"]},
               {"properties": {"b": {"type": "string", "format": "date-time"}}}]},
    {"type": "string", "format": "time"},
]


def compile_schema(schema) -> ByteDFA | Pushdown:
    return compile_rules(schema_to_rules(schema))


def random_accepted(automaton: ByteDFA | Pushdown, rng: random.Random, max_len: int = 400) -> bytes | None:
    """A random text the automaton accepts: a walk that stops where it may end by a coin toss."""
    out = bytearray()
    if isinstance(automaton, ByteDFA):
        table = automaton.table
        state = 1
        while len(out) < max_len:
            if automaton.accepting[state] and (rng.random() < 0.3 or not table[state].any()):
                return bytes(out)
            live = [b for b in range(256) if table[state, b]]
            if not live:
                return None
            b = rng.choice(live)
            out.append(b)
            state = int(table[state, b])
        return None
    config = automaton.start()
    while len(out) < max_len:
        # Past half the length, prefer closing brackets and quotes, so that walks end.
        closing = [b for b in b'"]}' if automaton.step(config, b)] if len(out) > max_len // 2 else []
        if config.accepting and (rng.random() < 0.3 or not config.tops):
            return bytes(out)
        live = closing or [b for b in range(256) if automaton.step(config, b)]
        if not live:
            return None
        b = rng.choice(live)
        out.append(b)
        config = automaton.step(config, b)
    return None


def dates(value) -> list[str]:
    if isinstance(value, dict):
        return [v for k, v in value.items() if k in ("born", "b") and isinstance(v, str)] + \
            [d for v in value.values() for d in dates(v)]
    return [d for v in value for d in dates(v)] if isinstance(value, list) else []


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_every_accepted_text_is_valid_json_for_the_schema(schema):
    dfa = compile_schema(schema)
    rng = random.Random(0)
    seen = 0
    for _ in range(300):
        text = random_accepted(dfa, rng)
        if text is None:
            continue
        seen += 1
        value = json.loads(text.decode("utf-8"))
        jsonschema.validate(value, schema)
        for date in dates(value):  # formats, as far as documented: a day may not exist in its month
            datetime.date.fromisoformat(date[:8] + "01")
            if "T" in date:
                datetime.time.fromisoformat(date.split("T")[1].rstrip("Z"))
    assert seen >= 50


@functools.lru_cache
def compiled(schema_text: str) -> ByteDFA | Pushdown:
    return compile_schema(json.loads(schema_text))


def accepts(schema, value) -> bool:
    dfa = compiled(json.dumps(schema))
    texts = [json.dumps(value, separators=(",", ":")), json.dumps(value), json.dumps(value, ensure_ascii=False)]
    return all(dfa.matches(t) for t in texts)


@settings(max_examples=60, deadline=None)
@given(
    # Characters of the basic plane: escaped as \uXXXX a character counts one, and one beyond
    # it is written as two (a surrogate pair), which a length bound counts twice.
    st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)), min_size=1, max_size=12),
    st.integers(0, 10**12),
    st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False)),
    st.lists(st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)), max_size=3), max_size=3),
    st.sampled_from(["a", "b", 1, None]),
    st.one_of(st.none(), st.from_regex(r"[a-z]{2,4}", fullmatch=True)),
)
def test_the_schemas_instances_are_accepted(name, age, score, tags, kind, alias):
    value = {"name": name, "age": age, "score": score, "tags": tags, "kind": kind, "born": "2024-02-29",
             "id": "123e4567-e89b-12d3-a456-426614174000", "home": {"x": 1.5, "y": True}, "alias": alias}
    jsonschema.validate(value, PERSON)
    assert accepts(PERSON, value)
    for drop in ("score", "tags", "kind", "born", "id", "home", "alias"):
        assert accepts(PERSON, {k: v for k, v in value.items() if k != drop})


def test_instances_the_schema_refuses_are_refused():
    base = {"name": "bob", "age": 3}
    for bad in ({"age": 3}, {"name": "bob"}, {**base, "age": -1}, {**base, "name": ""},
                {**base, "tags": ["a", "b", "c", "d"]}, {**base, "home": {"y": True}}, {**base, "kind": "c"},
                {**base, "extra": 1}, {"age": 3, "name": "bob"}):
        assert not accepts(PERSON, bad), bad
    assert accepts({"type": "object", "properties": {"a": {}, "b": {}}}, {})
    assert not accepts(SCHEMAS[1], [1]) and accepts(SCHEMAS[1], [1, 2]) and not accepts(SCHEMAS[1], [1, 2, 3, 4, 5])


@pytest.mark.parametrize(
    ("schema", "why"),
    [({"type": "object", "patternProperties": {}}, "not supported: patternProperties"),
     ({"type": "string", "format": "email"}, "format 'email'"),
     ({"type": "thing"}, "unknown JSON Schema type"),
     ({"$ref": "#/$defs/missing"}, "points to nothing"),
     ({"$ref": "http://x/schema"}, "only references inside"),
     ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required properties not in properties"),
     ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems"),
     ({"enum": []}, "at least one")],
)
def test_unsupported_or_broken_schemas_are_refused(schema, why):
    with pytest.raises(GrammarError, match=why):
        schema_to_rules(schema)


def test_recursive_references_nest_without_bound():
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}}}
    pda = compile_schema(tree)
    assert isinstance(pda, Pushdown)
    deep: dict = {"v": 0}
    for i in range(1, 40):
        deep = {"v": i, "kids": [deep, {"v": -i}]}
    assert accepts(tree, deep)
    assert not accepts(tree, {"v": 1, "kids": [{"v": 2, "kids": [{"w": 3}]}]})
    assert not pda.matches('{"v":1,"kids":[{"v":2,"kids":[{"v":3}]}]')


def test_a_schemas_own_nesting_is_not_cut():
    """Six levels of declared objects, each reached through its own $ref (as pydantic writes
    nested models), with a value of any type nested deep inside: no recursion between the
    references, so one regular pattern but for the value of any type."""
    defs = {f"L{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/L{i + 1}"}}, "required": ["next"]}
            for i in range(5)}
    defs["L5"] = {"type": "object", "properties": {"leaf": {"type": "array", "items": {"type": "array"}}}}
    value = {"next": {"next": {"next": {"next": {"next": {"leaf": [[[[1]]]]}}}}}}
    assert accepts({"$ref": "#/$defs/L0", "$defs": defs}, value)
    assert accepts({"$ref": "#/$defs/L0", "$defs": defs}, {"next": {"next": {"next": {"next": {"next": {
        "leaf": [[[[[[[[[[1, {"a": [[{}]]}]]]]]]]]]]}}}}}})
    assert not accepts({"$ref": "#/$defs/L0", "$defs": defs}, {"next": {"next": {"next": {"next": {"next": {
        "leaf": [1]}}}}}})
    assert set(schema_to_rules({"$ref": "#/$defs/L0", "$defs": defs})) == {"root", "json-value"}
    assert set(schema_to_rules({"$ref": "#/$defs/L4", "$defs": {**defs, "L5": {"type": "boolean"}}})) == {"root"}


BOUND = st.none() | st.integers(-(10**7), 10**7)


@settings(max_examples=150, deadline=None)
@given(BOUND, BOUND, st.data())
def test_integer_bounds_accept_exactly_the_integers_between(low, high, data):
    """An integer schema's minimum / maximum: the DFA accepts `str(n)` exactly when
    low <= n <= high, probed at and beside the bounds, at powers of ten and at random."""
    if low is not None and high is not None and low > high:
        low, high = high, low
    schema = {"type": "integer", **({"minimum": low} if low is not None else {}),
              **({"maximum": high} if high is not None else {})}
    dfa = compile_schema(schema)
    probes = {0, 1, -1, 9, 10, -10, 99, 100, -100, 10**8, -(10**8)}
    for b in (low, high):
        if b is not None:
            probes |= {b - 1, b, b + 1, -b, 10 ** len(str(abs(b))), 10 ** (len(str(abs(b))) - 1) - 1}
    probes |= {data.draw(st.integers(-(10**8), 10**8)) for _ in range(30)}
    for n in probes:
        assert dfa.matches(str(n)) == ((low is None or low <= n) and (high is None or n <= high)), n
    assert not dfa.matches("-0")  # JSON's integers, as written
    assert not any(dfa.matches(t) for t in ("01", "-01", "00", "+1", ""))


@pytest.mark.parametrize(
    ("schema", "inside", "outside"),
    [
        ({"minimum": 2.5, "exclusiveMaximum": 7}, [3, 6], [2, 7]),
        ({"exclusiveMinimum": -3, "maximum": 4.9}, [-2, 4], [-3, 5]),
        ({"minimum": 5, "exclusiveMinimum": True}, [6, 60], [5]),  # draft 4's boolean form
        ({"maximum": -5, "exclusiveMaximum": True}, [-6, -60], [-5, 0]),
    ],
)
def test_exclusive_and_fractional_bounds(schema, inside, outside):
    dfa = compile_schema({"type": "integer", **schema})
    assert all(dfa.matches(str(n)) for n in inside) and not any(dfa.matches(str(n)) for n in outside)


@pytest.mark.parametrize("schema", [{"minimum": 5, "maximum": 4}, {"exclusiveMinimum": 1, "exclusiveMaximum": 2},
                                    {"minimum": "3"}, {"maximum": float("nan")}])
def test_bounds_no_integer_meets_are_refused(schema):
    with pytest.raises(GrammarError):
        schema_to_rules({"type": "integer", **schema})


DEC = st.none() | st.decimals(min_value=-1000, max_value=1000, places=3, allow_nan=False, allow_infinity=False)


def _number_text(d: Decimal, extra_zeros: int = 0) -> str:
    text = format(d, "f")
    if extra_zeros:
        text += ("" if "." in text else ".") + "0" * extra_zeros
    return text


@settings(max_examples=200, deadline=None)
@given(DEC, DEC, st.booleans(), st.booleans(), st.data())
def test_number_bounds_accept_exactly_the_numbers_between(low, high, incl_low, incl_high, data):
    """A number schema's bounds, inclusive or not: the DFA accepts a number written in fixed
    notation exactly when it lies between them, probed at, just inside and just outside each
    bound (with trailing zeros too), and at random; bounds no number meets are refused."""
    if low is not None and high is not None and low > high:
        low, high = high, low
    schema: dict = {"type": "number"}
    if low is not None:
        schema["minimum" if incl_low else "exclusiveMinimum"] = float(low)
    if high is not None:
        schema["maximum" if incl_high else "exclusiveMaximum"] = float(high)
    lo = None if low is None else Decimal(str(float(low)))
    hi = None if high is None else Decimal(str(float(high)))
    if lo is not None and hi is not None and (lo > hi or (lo == hi and not (incl_low and incl_high))):
        with pytest.raises(GrammarError):
            schema_to_rules(schema)
        return
    dfa = compile_schema(schema)

    def inside(d: Decimal) -> bool:
        return ((lo is None or (d >= lo if incl_low else d > lo)) and (hi is None or (d <= hi if incl_high else d < hi)))

    probes = {Decimal(0), Decimal(1), Decimal(-1), Decimal("0.5"), Decimal("-0.5"), Decimal(1000), Decimal(-1000)}
    for b in (lo, hi):
        if b is not None:
            for step in (Decimal(1), Decimal("0.1"), Decimal("0.001"), Decimal("0.0001")):
                probes |= {b, b - step, b + step}
    probes |= {data.draw(st.decimals(min_value=-2000, max_value=2000, places=4)) for _ in range(25)}
    for d in probes:
        for zeros in (0, 2):
            text = _number_text(d, zeros)
            if text.startswith("-") and Decimal(text) == 0:
                assert not dfa.matches(text)  # no negative zero
                continue
            assert dfa.matches(text) == inside(d), (schema, text)
    assert not any(dfa.matches(t) for t in ("01", "1.", ".5", "+1", "", "-"))
    assert dfa.matches("1e2") == (lo is None and hi is None)  # a bounded number is written without an exponent
