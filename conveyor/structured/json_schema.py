"""JSON Schema to a pattern (`regex.Node`) that matches the JSON texts the schema allows.

Objects list their properties in the schema's order, one optional space around the
punctuation (`WS`), so a small model cannot loop on whitespace. Supported: `type` (one or a
list), `enum`, `const`, `properties` / `required`, `additionalProperties` (a schema, true or
false) for objects without `properties`, `items`, `prefixItems`, `minItems` / `maxItems`,
`minLength` / `maxLength` (an escape counts one character, so a character beyond the
basic plane written as a `\\u` surrogate pair counts two), `pattern` (over the string's JSON text), `format` (date,
time, date-time, uuid; a date's day is 01-31 whatever the month), an integer's `minimum` /
`maximum` / `exclusiveMinimum` / `exclusiveMaximum` (exactly: the digits of the range), a
number's bounds too (exactly, any bounds: a bounded number is written in fixed notation, without
an exponent), `anyOf` / `oneOf`, `allOf` (merged),
and `$ref` into `$defs` / `definitions`. Nesting is unbounded: a value of any type (`{}`, or
an object or array with nothing said of its contents) is a reference to a recursive JSON
value rule, and a recursive `$ref` a rule of its own, so such schemas compile to a
context-free grammar (`cfg.py`); the others stay one regular pattern. `multipleOf` and
`uniqueItems` are not enforced; keywords that would change the
language and are not listed here raise `GrammarError`.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

from conveyor.structured.cfg import Expr, Ref
from conveyor.structured.regex import (
    DIGIT,
    Alternate,
    CharSet,
    Concat,
    GrammarError,
    Node,
    Repeat,
    negate,
    parse,
)

WS = Repeat(CharSet(((0x20, 0x20),)), 0, 1)
NOTHING = CharSet(())  # matches no text (a schema of false)
ANY = "json-value"  # the rule of a value of any type

IGNORED = {  # annotations, or constraints not enforced (documented above)
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "name",
    "strict", "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
    "multipleOf", "uniqueItems", "contentEncoding", "contentMediaType",
}
KNOWN = IGNORED | {
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "exclusiveMinimum",
    "maximum", "exclusiveMaximum", "anyOf", "oneOf", "allOf", "$ref",
}


def lit(text: str) -> Node:
    return Concat(tuple(CharSet(((ord(c), ord(c)),)) for c in text))


def cat(*parts: Node) -> Node:
    return Concat(parts)


def alt(*options: Node) -> Node:
    return options[0] if len(options) == 1 else Alternate(options)


def chars(ranges: list[tuple[int, int]]) -> Node:
    return CharSet(tuple(ranges))


def digits(n: int) -> Node:
    return Repeat(chars(DIGIT), n, n)


# A string's characters as JSON writes them: anything but '"', '\' and control characters,
# or an escape.
STRING_CHAR = alt(
    chars(negate([(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])),
    cat(lit("\\"), alt(chars([(0x22, 0x22), (0x2F, 0x2F), (0x5C, 0x5C), (0x62, 0x62), (0x66, 0x66),
                              (0x6E, 0x6E), (0x72, 0x72), (0x74, 0x74)]),
                       cat(lit("u"), Repeat(chars([(0x30, 0x39), (0x41, 0x46), (0x61, 0x66)]), 4, 4)))),
)
INTEGER_DIGITS = alt(lit("0"), cat(chars([(0x31, 0x39)]), Repeat(chars(DIGIT), 0, None)))
INTEGER = cat(Repeat(lit("-"), 0, 1), INTEGER_DIGITS)
FRACTION = Repeat(cat(lit("."), Repeat(chars(DIGIT), 1, None)), 0, 1)
EXPONENT = Repeat(cat(chars([(0x45, 0x45), (0x65, 0x65)]), Repeat(chars([(0x2B, 0x2B), (0x2D, 0x2D)]), 0, 1),
                      Repeat(chars(DIGIT), 1, None)), 0, 1)
NUMBER = cat(Repeat(lit("-"), 0, 1), INTEGER_DIGITS, FRACTION, EXPONENT)
HEX = chars([(0x30, 0x39), (0x61, 0x66), (0x41, 0x46)])
def two_digits(high: int) -> Node:
    """00 .. high (high >= 20)."""
    tens, ones = divmod(high, 10)
    return alt(cat(chars([(0x30, 0x30 + tens - 1)]), chars(DIGIT)), cat(lit(str(tens)), chars([(0x30, 0x30 + ones)])))


MONTH = alt(cat(lit("0"), chars([(0x31, 0x39)])), cat(lit("1"), chars([(0x30, 0x32)])))
DAY = alt(cat(lit("0"), chars([(0x31, 0x39)])), cat(chars([(0x31, 0x32)]), chars(DIGIT)), cat(lit("3"), chars([(0x30, 0x31)])))
TIME = cat(two_digits(23), lit(":"), two_digits(59), lit(":"), two_digits(59),
           Repeat(cat(lit("."), Repeat(chars(DIGIT), 1, None)), 0, 1),
           Repeat(alt(lit("Z"), cat(chars([(0x2B, 0x2B), (0x2D, 0x2D)]), two_digits(23), lit(":"), two_digits(59))), 0, 1))
DATE = cat(digits(4), lit("-"), MONTH, lit("-"), DAY)  # days 01-31 in any month
FORMATS: dict[str, Node] = {
    "date": DATE,
    "time": TIME,
    "date-time": cat(DATE, lit("T"), TIME),
    "uuid": cat(*(part for k, n in enumerate((8, 4, 4, 4, 12))
                  for part in ((lit("-"),) if k else ()) + (Repeat(HEX, n, n),))),
}


def quoted(inner: Node) -> Node:
    return cat(lit('"'), inner, lit('"'))


def schema_to_rules(schema: Any) -> dict[str, Expr]:
    """The grammar of `schema` (a dict, or True for anything): its `root` rule, and the rules
    it refers to (none for a schema without recursion); raises GrammarError."""
    converter = _Converter(schema)
    root = converter.node(schema)
    return {"root": root, **converter.rules}


class _Converter:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.expanding: list[str] = []  # the references being expanded, outermost first
        self.names: dict[str, str] = {}  # a reference (with what its schema adds) to its rule
        self.recursive: set[str] = set()  # the rules of references met inside themselves
        self.rules: dict[str, Expr] = {}

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise GrammarError(f"$ref {ref!r}: only references inside the schema ('#/...') are supported")
        target = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise GrammarError(f"$ref {ref!r} points to nothing in the schema")
            target = target[part]
        return target

    def node(self, schema: Any) -> Node:
        if schema is True or schema == {}:
            return self.any_value()
        if schema is False:
            return NOTHING
        if not isinstance(schema, dict):
            raise GrammarError(f"a schema must be an object or a boolean, not {schema!r}")
        unknown = set(schema) - KNOWN
        if unknown:
            raise GrammarError(f"JSON Schema keyword(s) not supported: {', '.join(sorted(unknown))}")
        if "$ref" in schema:
            ref = schema["$ref"]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            key = ref + (json.dumps(rest, sort_keys=True) if rest else "")
            name = self.names.setdefault(key, f"json-ref-{len(self.names)}")
            if key in self.expanding:  # recursion: a rule of its own
                self.recursive.add(name)
                return Ref(name)  # type: ignore[return-value]
            target = self.resolve(ref)
            self.expanding.append(key)
            try:
                node = self.node({**target, **rest} if rest and isinstance(target, dict) else target)
            finally:
                self.expanding.pop()
            if name not in self.recursive:
                return node
            self.rules[name] = node
            return Ref(name)  # type: ignore[return-value]
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = self.resolve(part["$ref"]) if isinstance(part, dict) and "$ref" in part else part
                if not isinstance(part, dict):
                    raise GrammarError("allOf: each part must be an object")
                for key, value in part.items():
                    if key == "properties":
                        merged["properties"] = {**merged.get("properties", {}), **value}
                    elif key == "required":
                        merged["required"] = [*merged.get("required", []), *value]
                    else:
                        merged[key] = value
            return self.node(merged)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                return alt(*(self.node({**rest, **o} if isinstance(o, dict) else o) for o in schema[key]))
        if "const" in schema:
            return lit(json.dumps(schema["const"], ensure_ascii=False))
        if "enum" in schema:
            if not schema["enum"]:
                raise GrammarError("enum must list at least one value")
            return alt(*(lit(json.dumps(v, ensure_ascii=False)) for v in schema["enum"]))
        kind = schema.get("type")
        if kind is None:
            if "properties" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                return self.any_value()
        if isinstance(kind, list):
            return alt(*(self.node({**schema, "type": k}) for k in kind))
        return self.typed(kind, schema)

    def typed(self, kind: str, schema: dict[str, Any]) -> Node:
        if kind == "string":
            return self.string(schema)
        if kind == "integer":
            low, high = _integer_bounds(schema)
            return integer_range(low, high)
        if kind == "number":
            below, above = _number_bounds(schema)
            return NUMBER if below is None and above is None else number_range(below, above)
        if kind == "boolean":
            return alt(lit("true"), lit("false"))
        if kind == "null":
            return lit("null")
        if kind == "array":
            return self.array(schema)
        if kind == "object":
            return self.object(schema)
        raise GrammarError(f"unknown JSON Schema type {kind!r}")

    def string(self, schema: dict[str, Any]) -> Node:
        if "format" in schema:
            fmt = FORMATS.get(schema["format"])
            if fmt is None:
                raise GrammarError(f"string format {schema['format']!r} is not supported "
                                   f"(supported: {', '.join(FORMATS)})")
            return quoted(fmt)
        if "pattern" in schema:
            pattern = schema["pattern"]
            body = pattern.removeprefix("^").removesuffix("$") if isinstance(pattern, str) else pattern
            return quoted(parse(body))
        low, high = _bounds(schema, "minLength", "maxLength")
        return quoted(Repeat(STRING_CHAR, low, high))

    def array(self, schema: dict[str, Any]) -> Node:
        comma = cat(WS, lit(","), WS)
        prefix = [self.node(s) for s in schema.get("prefixItems", [])]
        items = schema.get("items", True)
        item = NOTHING if items is False else self.node(items)
        low, high = _bounds(schema, "minItems", "maxItems")
        if prefix:  # a tuple: the listed items, then more of `items` if allowed
            more = Repeat(cat(comma, item), max(0, low - len(prefix)),
                          None if high is None else max(0, high - len(prefix)))
            inner: Node = cat(prefix[0], *(cat(comma, p) for p in prefix[1:]), more)
            if low == 0:
                inner = Repeat(inner, 0, 1)
        else:
            rest = Repeat(cat(comma, item), max(0, low - 1), None if high is None else max(0, high - 1))
            inner = cat(item, rest)
            if low == 0:
                inner = Repeat(inner, 0, 1) if high != 0 else Concat(())
        return cat(lit("["), WS, inner, WS, lit("]"))

    def object(self, schema: dict[str, Any]) -> Node:
        props: dict[str, Any] = schema.get("properties") or {}
        colon = cat(WS, lit(":"), WS)
        comma = cat(WS, lit(","), WS)
        if not props:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return cat(lit("{"), WS, lit("}"))
            member = cat(quoted(Repeat(STRING_CHAR, 0, None)), colon, self.node(extra))
            return cat(lit("{"), WS, Repeat(cat(member, Repeat(cat(comma, member), 0, None)), 0, 1), WS, lit("}"))
        required = set(schema.get("required", []))
        missing = required - set(props)
        if missing:
            raise GrammarError(f"required properties not in properties: {', '.join(sorted(missing))}")
        names = list(props)
        members = [cat(lit(json.dumps(n, ensure_ascii=False)), colon, self.node(props[n])) for n in names]
        first_required = next((i for i, n in enumerate(names) if n in required), len(names))
        # The first member written is some k at or before the first required one; after it,
        # the required members follow for sure and the others may.
        options: list[Node] = []
        for k in range(min(first_required, len(names) - 1) + 1):
            tail = [cat(comma, m) if names[j] in required else Repeat(cat(comma, m), 0, 1)
                    for j, m in enumerate(members) if j > k]
            options.append(cat(members[k], *tail))
        body: Node = alt(*options)
        if first_required == len(names):  # nothing required: the empty object too
            body = Repeat(body, 0, 1)
        return cat(lit("{"), WS, body, WS, lit("}"))

    def any_value(self) -> Node:
        if ANY not in self.rules:
            self.rules[ANY] = NOTHING  # defined below; references to it meanwhile are fine
            scalars = [quoted(Repeat(STRING_CHAR, 0, None)), NUMBER, lit("true"), lit("false"), lit("null")]
            self.rules[ANY] = alt(*scalars, self.object({}), self.array({}))
        return Ref(ANY)  # type: ignore[return-value]


def _bound_value(schema: dict[str, Any], key: str) -> float | None:
    """A bound keyword's number (None: absent, or draft 4's boolean exclusive form)."""
    value = schema.get(key)
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, int | float) or value != value or value in (float("inf"), float("-inf")):
        raise GrammarError(f"{key}={value!r}: must be a finite number")
    return value


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The smallest and largest integer the schema's minimum / maximum allow (None: no
    bound). exclusiveMinimum / exclusiveMaximum are numbers (draft 6 on) or, with minimum /
    maximum, booleans (draft 4)."""

    def number(key: str) -> float | None:
        return _bound_value(schema, key)

    low: int | None = None
    high: int | None = None
    if (m := number("minimum")) is not None:
        low = math.ceil(m) + (1 if schema.get("exclusiveMinimum") is True and m == math.ceil(m) else 0)
    if (m := number("exclusiveMinimum")) is not None:
        low = max(low if low is not None else math.floor(m) + 1, math.floor(m) + 1)
    if (m := number("maximum")) is not None:
        high = math.floor(m) - (1 if schema.get("exclusiveMaximum") is True and m == math.floor(m) else 0)
    if (m := number("exclusiveMaximum")) is not None:
        high = min(high if high is not None else math.ceil(m) - 1, math.ceil(m) - 1)
    if low is not None and high is not None and low > high:
        raise GrammarError(f"no integer lies between the schema's bounds ({low} > {high})")
    return low, high


def integer_range(low: int | None, high: int | None) -> Node:
    """The JSON integers n with low <= n <= high (None: unbounded), as JSON writes them: no
    leading zeros, "-" before a negative one."""
    options: list[Node] = []
    if high is None or high >= 0:  # the non-negative part
        options.append(_natural_range(max(low, 0) if low is not None else 0, high))
    if low is None or low < 0:  # the negative part: "-" and the magnitudes
        top = None if low is None else -low
        bottom = 1 if high is None or high >= 0 else -high
        options.append(cat(lit("-"), _natural_range(bottom, top)))
    return alt(*options)


def _natural_range(low: int, high: int | None) -> Node:
    """The integers low <= n <= high (high None: unbounded), low >= 0, as decimal digits."""
    options: list[Node] = []
    top_len = len(str(high)) if high is not None else len(str(low))
    for length in range(len(str(low)), top_len + 1):
        first = 0 if length == 1 else 10 ** (length - 1)
        a, b = max(low, first), min(high if high is not None else 10**length - 1, 10**length - 1)
        if a <= b:
            options.append(_same_length(str(a), str(b)))
    if high is None:  # and every longer number
        options.append(cat(chars([(0x31, 0x39)]), Repeat(chars(DIGIT), top_len, None)))
    return alt(*options)


def _same_length(a: str, b: str) -> Node:
    """The digit strings of a's length from a to b (a <= b), digit by digit."""
    if not a:
        return lit("")
    if a[0] == b[0]:
        return cat(lit(a[0]), _same_length(a[1:], b[1:]))
    rest = len(a) - 1
    if a[1:] == "0" * rest and b[1:] == "9" * rest:  # whole decades: one class and any digits
        return cat(chars([(ord(a[0]), ord(b[0]))]), digits(rest))
    options = [cat(lit(a[0]), _same_length(a[1:], "9" * rest))]
    if ord(a[0]) + 1 <= ord(b[0]) - 1:
        options.append(cat(chars([(ord(a[0]) + 1, ord(b[0]) - 1)]), digits(rest)))
    options.append(cat(lit(b[0]), _same_length("0" * rest, b[1:])))
    return alt(*options)


# -- numbers between bounds ---------------------------------------------------------------------
# A bound: (its value, inclusive). A bounded number is written in fixed notation (no exponent),
# so that its digits can be held to the range exactly: the integer part by `_natural_range`,
# the fraction digit by digit against the bounds' fractions.
Bound = tuple[Decimal, bool]


def _number_bounds(schema: dict[str, Any]) -> tuple[Bound | None, Bound | None]:
    """A number schema's lower and upper bounds (draft 4's boolean exclusives too)."""

    def value(key: str) -> Decimal | None:
        v = _bound_value(schema, key)
        return None if v is None else Decimal(str(v))

    low: Bound | None = None
    high: Bound | None = None
    if (m := value("minimum")) is not None:
        low = (m, schema.get("exclusiveMinimum") is not True)
    if (m := value("exclusiveMinimum")) is not None and (low is None or m >= low[0]):
        low = (m, False)
    if (m := value("maximum")) is not None:
        high = (m, schema.get("exclusiveMaximum") is not True)
    if (m := value("exclusiveMaximum")) is not None and (high is None or m <= high[0]):
        high = (m, False)
    if low is not None and high is not None and (low[0] > high[0] or (low[0] == high[0] and not (low[1] and high[1]))):
        raise GrammarError(f"no number lies between the schema's bounds ({low[0]}, {high[0]})")
    return low, high


def number_range(low: Bound | None, high: Bound | None) -> Node:
    """The JSON numbers x (fixed notation) with low <= x <= high (strict where a bound is
    exclusive; None: unbounded), "-" before a negative one; negative zero is not written."""
    zero = Decimal(0)
    options: list[Node] = []
    if high is None or high[0] > zero or (high[0] == zero and high[1]):  # x >= 0
        start = low if low is not None and low[0] >= zero else (zero, True)
        options += _magnitudes(start, high)
    if low is None or low[0] < zero:  # x < 0: "-" and its magnitude in (max(-high, 0), -low]
        top = None if low is None else (-low[0], low[1])
        bottom = (-high[0], high[1]) if high is not None and high[0] < zero else (zero, False)
        options += [cat(lit("-"), m) for m in _magnitudes(bottom, top)]
    if not options:
        return NOTHING
    return alt(*options)


def _split(d: Decimal) -> tuple[int, str]:
    """A non-negative decimal's integer part and fraction digits (no trailing zeros)."""
    text = format(d, "f")
    whole, _, frac = text.partition(".")
    return int(whole), frac.rstrip("0")


def _magnitudes(low: Bound, high: Bound | None) -> list[Node]:
    """Non-negative numbers between the bounds (both >= 0), as alternatives."""
    a, fa = _split(low[0])
    options: list[Node] = []
    if high is not None:
        b, fb = _split(high[0])
        if a == b:
            return _with_fraction(lit(str(a)), *_between(fa, low[1], fb, high[1]))
    options += _with_fraction(lit(str(a)), *_above(fa, low[1]))
    if high is None:
        options.append(cat(_natural_range(a + 1, None), FRACTION))
        return options
    if a + 1 <= b - 1:
        options.append(cat(_natural_range(a + 1, b - 1), FRACTION))
    options += _with_fraction(lit(str(b)), *_below(fb, high[1]))
    return options


def _with_fraction(whole: Node, digits_node: Node | None, bare: bool) -> list[Node]:
    """`whole` followed by no fraction (if `bare`) or by "." and digits `digits_node` matches."""
    out = [whole] if bare else []
    if digits_node is not None:
        out.append(cat(whole, lit("."), digits_node))
    return out


ANY_DIGITS = Repeat(chars(DIGIT), 0, None)


def _digit(lo: int, hi: int) -> Node | None:
    return chars([(0x30 + lo, 0x30 + hi)]) if lo <= hi else None


def _seq(first: Node | None, rest: Node | None) -> Node | None:
    return None if first is None or rest is None else cat(first, rest)


def _alts(*options: Node | None) -> Node | None:
    kept = [o for o in options if o is not None]
    return alt(*kept) if kept else None


# Each of these gives (the non-empty digit strings D meeting the condition on 0.D, or None if
# none does; whether the empty fraction (0) meets it). `g` is a bound's fraction digits.
def _above(g: str, inclusive: bool) -> tuple[Node | None, bool]:
    """0.D >= 0.g (> if not inclusive)."""
    if not g:
        nonzero = cat(ANY_DIGITS, chars([(0x31, 0x39)]), ANY_DIGITS)
        return (Repeat(chars(DIGIT), 1, None), True) if inclusive else (nonzero, False)
    c, rest = int(g[0]), g[1:]
    tail, tail_bare = _above(rest, inclusive)
    return _alts(_seq(_digit(c + 1, 9), ANY_DIGITS), lit(g[0]) if tail_bare else None, _seq(lit(g[0]), tail)), False


def _below(g: str, inclusive: bool) -> tuple[Node | None, bool]:
    """0.D <= 0.g (< if not inclusive)."""
    if not g:
        return (Repeat(lit("0"), 1, None), True) if inclusive else (None, False)
    c, rest = int(g[0]), g[1:]
    tail, tail_bare = _below(rest, inclusive)
    return _alts(_seq(_digit(0, c - 1), ANY_DIGITS), lit(g[0]) if tail_bare else None,
                 _seq(lit(g[0]), tail)), True


def _between(ga: str, incl_a: bool, gb: str, incl_b: bool) -> tuple[Node | None, bool]:
    """0.ga <= 0.D <= 0.gb (strict where not inclusive), ga <= gb."""
    if not ga:
        if incl_a:
            return _below(gb, incl_b)
        return (_intersect_nonzero(gb, incl_b) if gb else None), False  # 0 < 0.D <= 0.gb
    if not gb:  # 0.gb == 0 < 0.ga: nothing
        return None, False
    ca, cb = int(ga[0]), int(gb[0])
    if ca == cb:
        tail, tail_bare = _between(ga[1:], incl_a, gb[1:], incl_b)
        return _alts(_seq(lit(ga[0]), tail), lit(ga[0]) if tail_bare else None), False
    up, up_bare = _above(ga[1:], incl_a)
    down, down_bare = _below(gb[1:], incl_b)
    return _alts(
        _seq(lit(ga[0]), up), lit(ga[0]) if up_bare else None,
        _seq(_digit(ca + 1, cb - 1), ANY_DIGITS),
        _seq(lit(gb[0]), down), lit(gb[0]) if down_bare else None,
    ), False


def _intersect_nonzero(gb: str, incl_b: bool) -> Node | None:
    """0 < 0.D <= 0.gb (< if not inclusive), gb non-empty: a nonzero digit string below gb."""
    c, rest = int(gb[0]), gb[1:]
    if c == 0:  # (gb has a nonzero digit later: its trailing zeros are stripped)
        return _seq(lit("0"), _intersect_nonzero(rest, incl_b))
    nonzero = cat(ANY_DIGITS, chars([(0x31, 0x39)]), ANY_DIGITS)
    down, down_bare = _below(rest, incl_b)
    return _alts(
        cat(lit("0"), nonzero),  # 0.0x.. with a nonzero digit later: below 0.c
        _seq(_digit(1, c - 1), ANY_DIGITS),
        _seq(lit(gb[0]), down), lit(gb[0]) if down_bare else None,
    )


def _bounds(schema: dict[str, Any], low_key: str, high_key: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
        raise GrammarError(f"{low_key}={low!r}, {high_key}={high!r}: need integers with 0 <= {low_key} <= {high_key}")
    return low, high
