"""Regular expressions compiled to a DFA over UTF-8 bytes, for constrained decoding.

A token is a byte string (it may end inside a multi-byte character), so the automaton reads
bytes: a pattern's characters and classes become the UTF-8 byte sequences that spell them,
the pattern becomes a Thompson NFA over byte ranges, and subset construction makes it a
dense table `[num_states, 256]`. State 0 is dead (no continuation matches), state 1 is the
start. The language is Python's `re.fullmatch` of the pattern on the decoded text.

Supported: literals and escapes (`\\n \\t \\xHH \\uHHHH \\d \\w \\s` and their negations),
`.`, classes with ranges and negation, groups (`(...)`, `(?:...)`, `(?P<name>...)`),
alternation and the quantifiers `* + ? {n} {n,} {n,m}` (lazy forms accepted: a full match
does not depend on laziness). Anchors `^` at the start and `$` at the end are accepted, as
the match is whole anyway. Flags (`FLAGS`): `(?isx)` at the start, `(?i:...)` over a group, or
given apart as Lark writes them. Anything else (backreferences, lookaround, `\\b`, other flags)
raises `GrammarError`: refused, never silently approximated.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 20_000

Ranges = list[tuple[int, int]]  # sorted, disjoint, inclusive code point ranges

# A special token (control, not text: `<|im_start|>`, Kimi's `<|tool_call_begin|>`) is read by
# a grammar as its text's bytes, each spelled as two continuation bytes (its high and low
# nibble), between these two bytes (`grammar.token_bytes`). Neither is ever part of UTF-8, so
# no text, and no token of ordinary text, spells one: a grammar admits a special token only
# where it names it (a structural tag's `token` format: `Bytes(special_token(text))`). And no
# text is inside the spelling, so a scan of free text for `<|tool_call_begin|>` written as
# text does not find it inside the token's.
SPECIAL_OPEN, SPECIAL_CLOSE = 0xF8, 0xF9


def special_token(text: str) -> bytes:
    """The bytes a grammar reads for the special token written `text`."""
    inner = bytes(b for c in text.encode("utf-8") for b in (0x80 | c >> 4, 0x80 | c & 0xF))
    return bytes([SPECIAL_OPEN]) + inner + bytes([SPECIAL_CLOSE])


class GrammarError(ValueError):
    """A pattern, schema or choice that cannot be compiled; the message says what and where."""


# -- the pattern's syntax tree ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CharSet:
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Concat:
    parts: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Alternate:
    options: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    node: Node
    low: int
    high: int | None  # None: unbounded


@dataclass(frozen=True, slots=True)
class Symbol:
    """An edge on one symbol past the bytes (256 + k): a context-free grammar's call of its
    rule k (`cfg.py`). Regular patterns never hold one."""

    value: int


@dataclass(frozen=True, slots=True)
class Bytes:
    """These bytes, as they are (not a text's UTF-8): a special token's (`special_token`)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Until:
    """Any bytes up to and including the first occurrence of one of `markers`, that occurrence
    being `markers[which]`: a thinking block's text and its closing tag (`</think>`), or free
    text up to a structural tag's trigger. With `which=None`, any bytes with no occurrence of
    any marker (the free text after the last tag). Its automaton is the markers'
    Aho-Corasick matcher (Knuth-Morris-Pratt's for one), so it never looks past the first
    occurrence. A special token's bytes are read only as part of a marker (the free text holds
    no special token), unless `specials` (then any special token a marker is not)."""

    markers: tuple[bytes, ...]
    which: int | None = 0
    specials: bool = False


Node = CharSet | Concat | Alternate | Repeat | Symbol | Until | Bytes

EMPTY = Concat(())


def normalize(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def negate(ranges: Ranges) -> Ranges:
    out: Ranges = []
    nxt = 0
    for lo, hi in normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return out


DIGIT: Ranges = [(0x30, 0x39)]
WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE}
SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a"}


# The flags a pattern may set, inline (`(?is)` at its start, `(?i:...)` over a group) or as
# Lark's `/.../is`: i ignores case (of ASCII letters, as Python's re.ASCII | re.IGNORECASE),
# s lets `.` match a newline, x (the whole pattern's only) drops whitespace and `#` comments
# outside classes, m and a change nothing here (a pattern matches a whole text, and its classes
# are ASCII already).
FLAGS = "ismax"


def without_verbose_space(pattern: str) -> str:
    """`pattern` as re.VERBOSE reads it: whitespace, and `#` to the end of a line, dropped
    outside character classes and where not escaped."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            if c == "]" and not (out and out[-1] in ("[", "[^")):
                in_class = False
            out.append(c)
        elif c == "[":
            in_class = True
            out.append("[^" if pattern.startswith("[^", i) else "[")
            i += 2 if pattern.startswith("[^", i) else 1
            continue
        elif c == "#":
            end = pattern.find("\n", i)
            i = len(pattern) if end < 0 else end
            continue
        elif not c.isspace():
            out.append(c)
        i += 1
    return "".join(out)


def case_folded(ranges: Ranges) -> Ranges:
    """`ranges` with the other case of every ASCII letter they hold."""
    out = list(ranges)
    for lo, hi in ranges:
        for first, last, shift in ((0x41, 0x5A, 32), (0x61, 0x7A, -32)):
            a, b = max(lo, first), min(hi, last)
            if a <= b:
                out.append((a + shift, b + shift))
    return normalize(out)


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        self.ignorecase = self.dotall = self.verbose = False  # (`set_flags`)

    def fail(self, why: str) -> GrammarError:
        return GrammarError(f"regex {self.p!r} at position {self.i}: {why}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise self.fail("unexpected end of pattern")
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self) -> Node:
        m = re.match(r"\(\?([a-zA-Z]+)\)", self.p)
        if m is not None:  # (?is): the whole pattern's flags
            self.set_flags(m.group(1), True)
            self.i = m.end()
        if self.verbose:
            self.p = self.p[: self.i] + without_verbose_space(self.p[self.i :])
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.i != len(self.p):
            raise self.fail("unbalanced ')'")
        return node

    def alternation(self) -> Node:
        options = [self.concat()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.concat())
        return options[0] if len(options) == 1 else Alternate(tuple(options))

    def concat(self) -> Node:
        parts: list[Node] = []
        while (c := self.peek()) is not None and c not in "|)":
            if c == "$" and self.i == len(self.p) - 1:
                self.i += 1
                break
            parts.append(self.quantified(self.atom()))
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def quantified(self, node: Node) -> Node:
        c = self.peek()
        if c is None or c not in "*+?{":
            return node
        if c == "{":
            bounds = self.braces()
            if bounds is None:
                return node  # a literal '{', as Python reads it
            low, high = bounds
        else:
            self.i += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if self.peek() == "?":
            self.i += 1  # lazy: the same language
        elif self.peek() == "+":
            raise self.fail("possessive quantifiers are not supported")
        c = self.peek()
        if c is not None and (c in "*+?" or (c == "{" and self.braces() is not None)):
            raise self.fail("nothing to repeat: a quantifier follows a quantifier")
        return Repeat(node, low, high)

    def braces(self) -> tuple[int, int | None] | None:
        end = self.p.find("}", self.i)
        if end < 0:
            return None
        body = self.p[self.i + 1 : end]
        lo_s, comma, hi_s = body.partition(",")
        if not (lo_s.isdigit() or (comma and lo_s == "")) or not (hi_s == "" or hi_s.isdigit()):
            return None
        low = int(lo_s) if lo_s else 0
        high = (int(hi_s) if hi_s else None) if comma else low
        if high is not None and high < low:
            raise self.fail(f"bad repetition {{{body}}}")
        self.i = end + 1
        return low, high

    def atom(self) -> Node:
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                self.i += 1
                kind = self.take()
                if kind == "P" and self.peek() == "<":
                    end = self.p.find(">", self.i)
                    if end < 0:
                        raise self.fail("unterminated group name")
                    self.i = end + 1
                elif kind.isalpha() or kind == "-":  # (?i:...), (?-i:...): flags over the group
                    m = re.match(r"([a-zA-Z]*)(?:-([a-zA-Z]+))?:", self.p[self.i - 1 :])
                    if m is None:
                        raise self.fail("flags are set for the whole pattern at its start, (?i), or over a group, (?i:...)")
                    if "x" in m.group(0):
                        raise self.fail("the x flag is set for the whole pattern only, (?x) at its start")
                    saved = self.ignorecase, self.dotall
                    self.set_flags(m.group(1), True)
                    self.set_flags(m.group(2) or "", False)
                    self.i += m.end() - 1
                    try:
                        return self.group()
                    finally:
                        self.ignorecase, self.dotall = saved
                elif kind != ":":
                    raise self.fail(f"'(?{kind}' (lookaround, references) is not supported")
            return self.group()
        if c == "[":
            return CharSet(tuple(self.char_class()))
        if c == ".":
            return CharSet(tuple(negate([] if self.dotall else [(0x0A, 0x0A)])))
        if c == "\\":
            return CharSet(tuple(self.folded(self.escape(in_class=False))))
        if c in "*+?":
            raise self.fail(f"nothing to repeat before {c!r}")
        if c in "^$":
            raise self.fail(f"{c!r} is only supported at the pattern's start or end")
        return CharSet(tuple(self.folded([(ord(c), ord(c))])))

    def group(self) -> Node:
        """A group's alternatives and its closing parenthesis."""
        node = self.alternation()
        if self.peek() != ")":
            raise self.fail("missing ')'")
        self.i += 1
        return node

    def folded(self, ranges: Ranges) -> Ranges:
        return case_folded(ranges) if self.ignorecase else ranges

    def set_flags(self, letters: str, on: bool) -> None:
        for flag in letters:
            if flag not in FLAGS:
                raise self.fail(f"flag {flag!r} is not supported (only {', '.join(FLAGS)})")
            if flag == "i":
                self.ignorecase = on
            elif flag == "s":
                self.dotall = on
            elif flag == "x":
                self.verbose = on

    def escape(self, in_class: bool) -> Ranges:
        c = self.take()
        if c.lower() in CLASS_ESCAPES:
            base = CLASS_ESCAPES[c.lower()]
            return negate(base) if c.isupper() else list(base)
        if c in SIMPLE_ESCAPES:
            v = ord(SIMPLE_ESCAPES[c])
            return [(v, v)]
        if c in "xuU":
            try:
                v, self.i = hex_escape(self.p, self.i, c)
            except ValueError as e:
                raise self.fail(str(e)) from None
            return [(v, v)]
        if c == "b" and in_class:
            return [(8, 8)]
        if c.isalnum():
            raise self.fail(f"escape \\{c} is not supported")
        return [(ord(c), ord(c))]

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: Ranges = []
        first = True
        while True:
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "[" and self.peek() == ":":
                raise self.fail("POSIX classes are not supported")
            item = self.escape(in_class=True) if c == "\\" else [(ord(c), ord(c))]
            if (
                len(item) == 1 and item[0][0] == item[0][1]
                and self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]"
            ):
                self.i += 1
                d = self.take()
                end = self.escape(in_class=True) if d == "\\" else [(ord(d), ord(d))]
                if len(end) != 1 or end[0][0] != end[0][1] or end[0][0] < item[0][0]:
                    raise self.fail("bad range in a character class")
                item = [(item[0][0], end[0][0])]
            ranges.extend(item)
        ranges = self.folded(ranges)  # (before a negation: [^a] ignoring case holds neither a nor A)
        return negate(ranges) if negated else normalize(ranges)


def hex_escape(text: str, i: int, kind: str) -> tuple[int, int]:
    """The code point of a `\\x`, `\\u` or `\\U` escape (`kind`) whose digits start at `i`, and
    where they end; raises ValueError saying what is wrong."""
    width = {"x": 2, "u": 4, "U": 8}[kind]
    digits = text[i : i + width]
    if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
        raise ValueError(f"bad escape \\{kind}{digits}")
    v = int(digits, 16)
    if v > MAX_CODEPOINT:
        raise ValueError(f"code point {v:#x} is out of range")
    return v, i + width


def parse(pattern: str, flags: str = "") -> Node:
    """The syntax tree of `pattern` under `flags` (`FLAGS`, as Lark writes them after a
    regular expression); raises GrammarError on what is not supported."""
    parser = _Parser(pattern)
    parser.set_flags(flags, True)
    return parser.parse()


# -- code points to UTF-8 byte ranges -----------------------------------------------------
def _encode(cp: int) -> bytes:
    return chr(cp).encode("utf-8", "surrogatepass")


def utf8_sequences(lo: int, hi: int) -> Iterator[list[tuple[int, int]]]:
    """Byte-range sequences whose concatenations spell exactly the UTF-8 encodings of the
    code points in [lo, hi] (surrogates left out): each a list of (low, high) per byte."""
    for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
        if a > b:
            continue
        for limit in (0x7F, 0x7FF, 0xFFFF, MAX_CODEPOINT):  # one encoded length at a time
            if a > b:
                break
            if a <= limit:
                yield from _split(a, min(b, limit))
                a = limit + 1


def _split(lo: int, hi: int) -> Iterator[list[tuple[int, int]]]:
    n = len(_encode(lo))
    for i in range(1, n):
        m = (1 << (6 * i)) - 1  # the low bits the last i continuation bytes hold
        if lo & ~m != hi & ~m:
            if lo & m:
                yield from _split(lo, lo | m)
                yield from _split((lo | m) + 1, hi)
                return
            if hi & m != m:
                yield from _split(lo, (hi & ~m) - 1)
                yield from _split(hi & ~m, hi)
                return
    yield list(zip(_encode(lo), _encode(hi), strict=True))


# -- NFA -----------------------------------------------------------------------------------
class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []  # (low byte, high byte, target)

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise GrammarError(f"the grammar is too large (over {MAX_NFA_STATES} automaton states)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node: Node) -> tuple[int, int]:
        """A fragment for `node`: its entry and exit states."""
        if isinstance(node, CharSet):
            start, end = self.state(), self.state()
            for lo, hi in node.ranges:
                for seq in utf8_sequences(lo, hi):
                    cur = start
                    for k, (a, b) in enumerate(seq):
                        nxt = end if k == len(seq) - 1 else self.state()
                        self.edges[cur].append((a, b, nxt))
                        cur = nxt
            return start, end
        if isinstance(node, Symbol):
            start, end = self.state(), self.state()
            self.edges[start].append((node.value, node.value, end))
            return start, end
        if isinstance(node, Until):
            return self.until(node.markers, node.which, node.specials)
        if isinstance(node, Bytes):
            start = end = self.state()
            for b in node.data:
                nxt = self.state()
                self.edges[end].append((b, b, nxt))
                end = nxt
            return start, end
        if isinstance(node, Concat):
            start = end = self.state()
            for part in node.parts:
                s, e = self.build(part)
                self.eps[end].append(s)
                end = e
            return start, end
        if isinstance(node, Alternate):
            start, end = self.state(), self.state()
            for option in node.options:
                s, e = self.build(option)
                self.eps[start].append(s)
                self.eps[e].append(end)
            return start, end
        start = end = self.state()
        for _ in range(node.low):
            s, e = self.build(node.node)
            self.eps[end].append(s)
            end = e
        if node.high is None:
            s, e = self.build(node.node)
            self.eps[end].append(s)
            self.eps[e].append(s)
            after = self.state()
            self.eps[end].append(after)
            self.eps[e].append(after)
            return start, after
        exit_ = self.state()
        for _ in range(node.high - node.low):
            self.eps[end].append(exit_)
            s, e = self.build(node.node)
            self.eps[end].append(s)
            end = e
        self.eps[end].append(exit_)
        return start, exit_

    def until(self, markers: tuple[bytes, ...], which: int | None, specials: bool = False) -> tuple[int, int]:
        """A fragment for `Until(markers, which)`: a state for each node of the markers' trie
        that ends no marker (what has been read since the last hopeless byte, as Aho-Corasick
        tracks it); each byte moves it along the matcher's transitions, a marker's last byte
        leaves the fragment if that marker is `markers[which]` and is dead otherwise, and with
        `which=None` every state may leave without reading."""
        if (not markers and which is not None) or not all(markers):
            raise GrammarError("a tag to stop at must not be empty")
        if which is not None and not 0 <= which < len(markers):
            raise GrammarError(f"no marker {which}")
        rows, ends = _aho_corasick(markers)
        nfa = {n: self.state() for n in range(len(rows)) if not ends[n]}
        end = self.state()
        for n, state in nfa.items():
            for target, group in itertools.groupby(range(256), key=rows[n].__getitem__):
                run = list(group)  # the bytes of one run that go to the same node
                if target == 0 and not specials:  # (a special token's bytes only on the way into a marker)
                    run = [b for b in run if b not in (SPECIAL_OPEN, SPECIAL_CLOSE)]
                    if not run:
                        continue
                    if run[-1] - run[0] + 1 != len(run):  # split around the bytes taken out
                        for lo, hi in _runs(run):
                            self.edges[state].append((lo, hi, nfa[0]))
                        continue
                if not ends[target]:
                    self.edges[state].append((run[0], run[-1], nfa[target]))
                elif which in ends[target]:
                    self.edges[state].append((run[0], run[-1], end))
            if which is None:
                self.eps[state].append(end)
        return nfa[0], end

    def closure(self, states: set[int]) -> frozenset[int]:
        stack = list(states)
        seen = set(states)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)


@dataclass(slots=True)
class ByteDFA:
    """`table[s, b]` is the state after byte `b` in state `s`; 0 is dead, 1 the start.
    (A context-free grammar's rule has columns past 256 too: the state after each call.)"""

    table: np.ndarray  # [num_states, 256] int32
    accepting: np.ndarray  # [num_states] bool

    @property
    def num_states(self) -> int:
        return int(self.table.shape[0])

    def walk(self, state: int, data: bytes) -> int:
        table = self.table
        for b in data:
            state = int(table[state, b])
            if not state:
                return 0
        return state

    def matches(self, text: str) -> bool:
        return self.reads(text.encode("utf-8"))

    def reads(self, data: bytes) -> bool:
        """Whether these bytes (a special token's spelling among them, `special_token`) match."""
        return bool(self.accepting[self.walk(1, data)])


def _runs(values: list[int]) -> Iterator[tuple[int, int]]:
    """Sorted integers as (first, last) runs of consecutive ones."""
    for _, group in itertools.groupby(enumerate(values), key=lambda iv: iv[1] - iv[0]):
        run = [v for _, v in group]
        yield run[0], run[-1]


def _aho_corasick(markers: tuple[bytes, ...]) -> tuple[list[list[int]], list[frozenset[int]]]:
    """The markers' matcher over bytes: each trie node's next node for every byte (`rows`),
    and the markers that end at each node, suffixes included (`ends`)."""
    children: list[dict[int, int]] = [{}]
    ends: list[set[int]] = [set()]
    for k, marker in enumerate(markers):
        node = 0
        for b in marker:
            if b not in children[node]:
                children[node][b] = len(children)
                children.append({})
                ends.append(set())
            node = children[node][b]
        ends[node].add(k)
    rows = [[0] * 256 for _ in children]
    fail = [0] * len(children)
    order = []
    for b, child in children[0].items():
        rows[0][b] = child
        order.append(child)
    for node in order:  # breadth first: a node's failure link is done before its children's
        ends[node] |= ends[fail[node]]
        rows[node] = list(rows[fail[node]])
        for b, child in children[node].items():
            rows[node][b] = child
            fail[child] = rows[fail[node]][b]
            order.append(child)
    return rows, [frozenset(e) for e in ends]


def compile_dfa(node: Node, width: int = 256) -> ByteDFA:
    """Subset construction over byte ranges: each DFA state's outgoing bytes are cut at the
    bounds of its NFA states' edges, so the work grows with edges, not with 256 per state.
    `width` is the alphabet's size: 256 bytes, and for a context-free grammar's rule the
    `Symbol`s of its calls after them."""
    nfa = _NFA()
    start, final = nfa.build(node)
    ids: dict[frozenset[int], int] = {frozenset(): 0}
    sets: list[frozenset[int]] = [frozenset()]
    rows: list[np.ndarray] = [np.zeros(width, dtype=np.int32)]
    first = nfa.closure({start})
    ids[first] = 1
    sets.append(first)
    rows.append(np.zeros(width, dtype=np.int32))
    k = 1
    while k < len(sets):
        edges = [e for s in sets[k] for e in nfa.edges[s]]
        cuts = sorted({a for a, _, _ in edges} | {b + 1 for _, b, _ in edges})
        row = rows[k]
        for lo, nxt_cut in itertools.pairwise(cuts):
            targets = {t for a, b, t in edges if a <= lo <= b}
            if not targets:
                continue
            target = nfa.closure(targets)
            tid = ids.get(target)
            if tid is None:
                if len(sets) >= MAX_DFA_STATES:
                    raise GrammarError(f"the grammar is too large (over {MAX_DFA_STATES} DFA states)")
                tid = ids[target] = len(sets)
                sets.append(target)
                rows.append(np.zeros(width, dtype=np.int32))
            row[lo:nxt_cut] = tid
        k += 1
    table = np.stack(rows)
    accepting = np.array([final in s for s in sets], dtype=bool)
    # States from which no text is accepted (a branch cut to nothing) are dead too, so that
    # a live state always has a way to finish.
    live = live_states(table, accepting)
    if not live[1]:
        raise GrammarError("the grammar matches no text at all")
    table[~live[table]] = 0
    table[~live] = 0
    return _minimize(table, accepting)


def live_states(table: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """The states from which some path over `table`'s columns reaches an accepting state
    (state 0, the dead one, never accepts and goes nowhere)."""
    live = accepting.copy()
    while True:
        grown = live | live[table].any(axis=1)
        if (grown == live).all():
            return live
        live = grown


def _minimize(table: np.ndarray, accepting: np.ndarray) -> ByteDFA:
    """Moore's partition refinement: states that accept the same continuations are merged,
    so each distinct set of allowed tokens is computed once. The dead state stays 0 and the
    start 1."""
    # Bytes that every state treats alike (the letters inside a string, say) are one column.
    _, columns = np.unique(table, axis=1, return_index=True)
    narrow = table[:, np.sort(columns)]
    cls = accepting.astype(np.int64)
    cls[0] = 2  # the dead state apart from the live non-accepting ones
    count = len(np.unique(cls))
    while True:
        signature = np.concatenate([cls[:, None], cls[narrow]], axis=1)
        ids: dict[tuple[int, ...], int] = {}
        cls = np.array([ids.setdefault(row, len(ids)) for row in map(tuple, signature.tolist())], dtype=np.int64)
        if len(ids) == count:
            break
        count = len(ids)
    order = [int(cls[0]), int(cls[1])]  # dead, start, then the rest by first appearance
    seen = set(order)
    for c in cls.tolist():
        if c not in seen:
            seen.add(c)
            order.append(c)
    renumber = np.empty(count, dtype=np.int32)
    renumber[order] = np.arange(count, dtype=np.int32)
    first = np.unique(cls, return_index=True)[1]  # a representative state of each class
    reps = np.empty(count, dtype=np.int64)
    reps[renumber[np.arange(count)]] = first
    return ByteDFA(renumber[cls[table[reps]]], accepting[reps])


def escape(text: str) -> str:
    """`text` as a pattern that matches it literally."""
    return "".join("\\" + c if c in ".^$*+?{}[]\\|()-" else c for c in text)
