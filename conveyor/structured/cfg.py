"""Context-free grammars (GBNF, the EBNF of llama.cpp, xgrammar and vLLM's
`structured_outputs.grammar`) compiled to a pushdown automaton over UTF-8 bytes.

    root   ::= object
    object ::= "{" ws ( pair ( "," ws pair )* )? "}"
    pair   ::= string ":" ws value          # comments run to the end of the line
    value  ::= object | string | [0-9]+
    string ::= "\\"" [^"\\\\]* "\\""
    ws     ::= [ \\t\\n]*

A rule is `name ::= alternatives`; a sequence's items are quoted strings (escapes `\\n \\t
\\r \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH`), character classes (`[a-z]`, `[^"]`), `.` (any
character), groups and rule names, each with `*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}`. The
grammar starts at `root`.

Compiling: a rule that no cycle of references leads back to is inlined into the rules that
use it, so a grammar without recursion becomes one regular pattern and compiles to the
same DFA as a regex (`regex.compile_dfa`). The rules left (the root and the recursive
ones) each compile to a DFA whose columns past the 256 bytes are calls of the others: the
state after the call. At run time (`grammar.PushdownGrammar`) a stack of (rule, state)
frames says where the output stands: a call pushes the caller's return state, a rule in an
accepting state may return. A call whose return state accepts and can go nowhere else
pushes nothing (a tail call), so right recursion (`list ::= item list?`) runs in constant
stack. Left recursion (`expr ::= expr "+" term | term`, directly or through other rules) is
rewritten first as the repetition it means (`term ("+" term)*`: `without_left_recursion`), as
xgrammar's Earley parser accepts it and llama.cpp does not. Left recursion behind something
that can match nothing (`x ::= "a"? x "b" | ...`) would call forever without reading a byte
and is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conveyor.structured.regex import (
    MAX_CODEPOINT,
    SIMPLE_ESCAPES,
    Alternate,
    ByteDFA,
    CharSet,
    Concat,
    GrammarError,
    Node,
    Repeat,
    Symbol,
    compile_dfa,
    hex_escape,
    live_states,
    negate,
    normalize,
)

ROOT = "root"
MAX_RULES = 1000


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to a rule by name, before the rules are inlined or numbered."""

    name: str


Expr = Node | Ref


def read_char(text: str, i: int, lenient: bool = False) -> tuple[int, int]:
    """The character at `text[i]`, an escape (`\\n`, `\\x41`, `\\u00e9`, ...) read whole, and where
    the next one starts; an unknown escape is refused, or with `lenient` read as the character
    escaped. Raises ValueError saying what is wrong."""
    c = text[i]
    i += 1
    if c != "\\":
        return ord(c), i
    if i >= len(text):
        raise ValueError("a lone '\\' at the end")
    e = text[i]
    i += 1
    if e in "xuU":
        return hex_escape(text, i, e)
    if e in SIMPLE_ESCAPES:
        return ord(SIMPLE_ESCAPES[e]), i
    if e in "\\\"[]-^'" or lenient:
        return ord(e), i
    raise ValueError(f"unknown escape \\{e}")


def position(text: str, i: int) -> str:
    """Where offset `i` of `text` is, as an error says it: `line 3, column 7`."""
    line = text.count("\n", 0, i) + 1
    column = i - text.rfind("\n", 0, i)
    return f"line {line}, column {column}"


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def fail(self, why: str) -> GrammarError:
        return GrammarError(f"grammar at {position(self.s, self.i)}: {why}")

    def space(self) -> None:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c == "#":
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end + 1
            elif c in " \t\r\n":
                self.i += 1
            else:
                return

    def name(self) -> str | None:
        j = self.i
        while j < len(self.s) and (self.s[j].isalnum() or self.s[j] in "-_"):
            j += 1
        if j == self.i:
            return None
        out = self.s[self.i : j]
        self.i = j
        return out

    def rule_starts(self) -> bool:
        """Whether `name ::=` comes next (a sequence ends where the next rule begins)."""
        at = self.i
        name = self.name()
        self.space()
        starts = name is not None and self.s.startswith("::=", self.i)
        self.i = at
        return starts

    def grammar(self) -> dict[str, Expr]:
        rules: dict[str, Expr] = {}
        self.space()
        while self.i < len(self.s):
            at = self.i
            name = self.name()
            if name is None:
                raise self.fail("expected a rule name")
            self.space()
            if not self.s.startswith("::=", self.i):
                raise self.fail(f"expected '::=' after {name!r}")
            self.i += 3
            if name in rules:
                self.i = at
                raise self.fail(f"rule {name!r} is defined twice")
            rules[name] = self.alternatives(nested=False)
            if len(rules) > MAX_RULES:
                raise self.fail(f"over {MAX_RULES} rules")
            self.space()
        if not rules:
            raise GrammarError("the grammar has no rules")
        return rules

    def alternatives(self, nested: bool) -> Expr:
        options = [self.sequence(nested)]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            options.append(self.sequence(nested))
        return options[0] if len(options) == 1 else Alternate(tuple(options))  # type: ignore[arg-type]

    def sequence(self, nested: bool) -> Expr:
        items: list[Expr] = []
        while True:
            self.space()
            if self.i >= len(self.s):
                break
            c = self.s[self.i]
            if c == "|" or (c == ")" and nested):
                break
            if c == ")":
                raise self.fail("unbalanced ')'")
            if not nested and self.rule_starts():
                break
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else Concat(tuple(items))  # type: ignore[arg-type]

    def atom(self) -> Expr:
        c = self.s[self.i]
        if c == '"':
            self.i += 1
            chars: list[Node] = []
            while True:
                if self.i >= len(self.s) or self.s[self.i] == "\n":
                    raise self.fail("unterminated string")
                c = self.s[self.i]
                if c == '"':
                    self.i += 1
                    break
                cp = self.char()
                chars.append(CharSet(((cp, cp),)))
            return chars[0] if len(chars) == 1 else Concat(tuple(chars))
        if c == "[":
            self.i += 1
            return CharSet(tuple(self.char_class()))
        if c == ".":
            self.i += 1
            return CharSet(((0, MAX_CODEPOINT),))
        if c == "(":
            self.i += 1
            inner = self.alternatives(nested=True)
            self.space()
            if self.i >= len(self.s) or self.s[self.i] != ")":
                raise self.fail("missing ')'")
            self.i += 1
            return inner
        name = self.name()
        if name is None:
            raise self.fail(f"unexpected {c!r}")
        return Ref(name)

    def char(self) -> int:
        """One character of a string or class, an escape read whole."""
        try:
            cp, self.i = read_char(self.s, self.i)
        except ValueError as e:
            raise self.fail(str(e)) from None
        return cp

    def char_class(self) -> list[tuple[int, int]]:
        negated = self.i < len(self.s) and self.s[self.i] == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        while True:
            if self.i >= len(self.s):
                raise self.fail("unterminated character class")
            if self.s[self.i] == "]":
                self.i += 1
                break
            lo = self.char()
            hi = lo
            if self.s.startswith("-", self.i) and not self.s.startswith("-]", self.i):
                self.i += 1
                if self.i >= len(self.s):
                    raise self.fail("unterminated character class")
                hi = self.char()
                if hi < lo:
                    raise self.fail("bad range in a character class")
            ranges.append((lo, hi))
        return negate(ranges) if negated else normalize(ranges)

    def quantified(self, node: Expr) -> Expr:
        while True:  # "a"+? and the like stack, as llama.cpp reads them
            self.space_inline()
            c = self.s[self.i] if self.i < len(self.s) else ""
            if c in ("*", "+", "?"):
                self.i += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{":
                end = self.s.find("}", self.i)
                body = self.s[self.i + 1 : end] if end >= 0 else ""
                lo_s, comma, hi_s = (x.strip() for x in body.partition(","))
                if end < 0 or not lo_s.isdigit() or not (hi_s == "" or hi_s.isdigit()):
                    raise self.fail("bad repetition: {m}, {m,} or {m,n}")
                low = int(lo_s)
                high = (int(hi_s) if hi_s else None) if comma else low
                if high is not None and high < low:
                    raise self.fail(f"bad repetition {{{body}}}")
                self.i = end + 1
            else:
                return node
            node = Repeat(node, low, high)  # type: ignore[arg-type]

    def space_inline(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1


def parse_grammar(text: str) -> dict[str, Expr]:
    """The rules of a GBNF grammar, each checked to refer only to defined rules; raises
    GrammarError saying what and where."""
    if not isinstance(text, str):
        raise GrammarError("grammar must be a string")
    rules = _Parser(text).grammar()
    if ROOT not in rules:
        raise GrammarError(f"the grammar has no {ROOT!r} rule (it starts there)")
    for name, body in rules.items():
        for ref in _refs(body):
            if ref not in rules:
                raise GrammarError(f"rule {name!r} refers to {ref!r}, which is not defined")
    return rules


def _refs(node: Expr) -> set[str]:
    if isinstance(node, Ref):
        return {node.name}
    if isinstance(node, Concat):
        return set().union(*(_refs(p) for p in node.parts))
    if isinstance(node, Alternate):
        return set().union(*(_refs(p) for p in node.options))
    if isinstance(node, Repeat):
        return _refs(node.node)
    return set()


Stack = tuple[int, int, Any]  # (rule, state, the stack beneath: a Stack or None)


class Config:
    """Where a context-free grammar's output stands: the stacks whose top frame reads a byte
    next (`tops`), and whether the output may end here. Hashable; false when dead."""

    __slots__ = ("_hash", "accepting", "tops")

    def __init__(self, tops: frozenset[Stack], accepting: bool) -> None:
        self.tops = tops
        self.accepting = accepting
        self._hash = hash((tops, accepting))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Config) and self._hash == other._hash
            and self.accepting == other.accepting and self.tops == other.tops
        )

    def __bool__(self) -> bool:
        return bool(self.tops) or self.accepting


DEAD = Config(frozenset(), False)


@dataclass(slots=True)
class Pushdown:
    """A compiled context-free grammar: rule 0 is the root. `tables[r]` is rule r's DFA over
    bytes (`[states, 256]`, 0 dead, 1 its start), `accepting[r]` where it may return, and
    `calls[r][s]` the calls in state s: (callee, the caller's state after it, whether that
    is a tail call that pushes nothing).

    `start()` and `step(config, byte)` recognize its language byte by byte."""

    names: list[str]
    tables: list[np.ndarray]
    accepting: list[np.ndarray]
    calls: list[list[tuple[tuple[int, int, bool], ...]]]
    # An ambiguous grammar can keep many parses alive at once; past this many stacks the
    # rest are dropped: a text one of them would take may then be refused, never one that
    # none would take accepted.
    max_stacks: int = 10_000
    _lists: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.names, self.tables, self.accepting, self.calls, self.max_stacks)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.names, self.tables, self.accepting, self.calls, self.max_stacks = state
        self._lists = None

    def start(self) -> Config:
        return self._closure([(0, 1, None)])

    def step(self, config: Config, byte: int) -> Config:
        """Where `config` stands after one more byte (DEAD if it cannot take it)."""
        rows = self._tables()[0]
        moved = [(r, rows[r][s][byte], below) for r, s, below in config.tops if rows[r][s][byte]]
        return self._closure(moved) if moved else DEAD

    def matches(self, text: str) -> bool:
        return self.reads(text.encode("utf-8"))

    def reads(self, data: bytes) -> bool:
        """Whether these bytes (a special token's spelling among them) match."""
        config = self.start()
        for b in data:
            config = self.step(config, b)
        return config.accepting

    def _tables(self) -> tuple[list[Any], list[Any], list[Any]]:
        """The tables as lists (a Python walk beats numpy scalars): rows, accepting, and
        whether each state reads a byte."""
        if self._lists is None:
            self._lists = (
                [t.tolist() for t in self.tables],
                [a.tolist() for a in self.accepting],
                [t.any(axis=1).tolist() for t in self.tables],
            )
        return self._lists

    def _closure(self, stacks: Iterable[Stack]) -> Config:
        """Every stack reachable without reading a byte: calls push their callee's start, a
        frame that accepts returns to the one beneath (or, at the bottom, may end)."""
        _, accepting, reads = self._tables()
        calls = self.calls
        seen: set[Stack] = set()
        tops: set[Stack] = set()
        ends = False
        work = list(stacks)
        while work:
            st = work.pop()
            if st in seen:
                continue
            seen.add(st)
            r, s, below = st
            if reads[r][s]:
                tops.add(st)
                if len(tops) >= self.max_stacks:
                    break
            for callee, ret, tail in calls[r][s]:
                work.append((callee, 1, below if tail else (r, ret, below)))
            if accepting[r][s]:
                if below is None:
                    ends = True
                else:
                    work.append(below)
        return Config(frozenset(tops), ends)


def compile_grammar(text: str) -> ByteDFA | Pushdown:
    """A GBNF grammar's automaton: a DFA when no rule is recursive, else a `Pushdown`."""
    return compile_rules(parse_grammar(text))


def compile_rules(rules: dict[str, Expr], root: str = ROOT) -> ByteDFA | Pushdown:
    """The automaton of rules starting at `root` (each reference defined).

    A rule no cycle leads back to is inlined, unless the whole would then be too large: then
    every rule stays a frame of a pushdown automaton, its own DFA called where it is used, so
    that many alternatives add up instead of multiplying in one DFA's subset construction (a
    structural tag holding the schemas of 30 strict tools)."""
    rules = without_left_recursion(rules)
    try:
        return _compile_rules(rules, root, set())
    except GrammarError as e:
        if "too large" not in str(e) or len(rules) == 1:
            raise
        return _compile_rules(rules, root, set(rules))


def _compile_rules(rules: dict[str, Expr], root: str, kept: set[str]) -> ByteDFA | Pushdown:
    reachable = _reachable(rules, root)
    recursive = _recursive(rules, reachable) | (kept & reachable)
    frames = [root, *sorted(recursive - {root})]
    index = {name: k for k, name in enumerate(frames)}
    inlined: dict[str, Node] = {}

    def expand(node: Expr) -> Node:
        if isinstance(node, Ref):
            if node.name in index:
                return Symbol(256 + index[node.name])
            if node.name not in inlined:
                inlined[node.name] = expand(rules[node.name])
            return inlined[node.name]
        if isinstance(node, Concat):
            return Concat(tuple(expand(p) for p in node.parts))
        if isinstance(node, Alternate):
            return Alternate(tuple(expand(p) for p in node.options))
        if isinstance(node, Repeat):
            return Repeat(expand(node.node), node.low, node.high)
        return node

    if not recursive:
        return compile_dfa(expand(rules[root]))
    width = 256 + len(frames)
    dfas: list[ByteDFA] = []
    for name in frames:
        try:
            dfas.append(compile_dfa(expand(rules[name]), width))
        except GrammarError as e:
            raise GrammarError(f"rule {name!r}: {e}") from None
    _check_productive(frames, dfas)
    calls = [_calls(dfa) for dfa in dfas]
    _check_left_recursion(frames, dfas, calls)
    return Pushdown(
        names=frames,
        tables=[np.ascontiguousarray(d.table[:, :256]) for d in dfas],
        accepting=[d.accepting.copy() for d in dfas],
        calls=calls,
    )


def without_left_recursion(rules: dict[str, Expr]) -> dict[str, Expr]:
    """`rules` with their left recursion rewritten as repetition, the same language: Paull's
    algorithm over the rules on a cycle of leftmost references, in name order. Each rule's
    alternatives that start with an earlier such rule get that rule's alternatives in its
    place; then `A ::= A a1 | A a2 | b1 | b2` becomes `A ::= (b1 | b2) (a1 | a2)*`. Left
    recursion behind something that can match nothing (`A ::= "x"? A "y" | ...`) is left as it
    is, for `_check_left_recursion` to refuse."""
    graph = {name: {seq[0].name for seq in _alternatives(body) if seq and isinstance(seq[0], Ref)} & set(rules)
             for name, body in rules.items()}
    left = sorted(_on_cycles(graph))
    if not left:
        return rules
    out = dict(rules)
    done: list[str] = []
    for name in left:
        alts = _alternatives(out[name])
        for earlier in done:
            alts = [head + seq[1:] for seq in alts
                    for head in (_alternatives(out[earlier]) if seq and seq[0] == Ref(earlier) else [seq[:1]])]
        again = [seq[1:] for seq in alts if seq and seq[0] == Ref(name)]
        base = [seq for seq in alts if not (seq and seq[0] == Ref(name))]
        again = [seq for seq in again if seq]  # `A ::= A` adds nothing
        if base and again:
            out[name] = Concat((_choice(base), Repeat(_choice(again), 0, None)))  # type: ignore[arg-type]
        elif base:
            out[name] = _choice(base)
        done.append(name)
    return out


def _alternatives(node: Expr) -> list[list[Expr]]:
    """`node` as alternatives, each a sequence whose first item is neither a choice nor a
    sequence (a leading group is distributed: `(a | b) c` is `a c | b c`)."""
    if isinstance(node, Alternate):
        return [seq for option in node.options for seq in _alternatives(option)]
    if isinstance(node, Concat):
        if not node.parts:
            return [[]]
        rest: list[Expr] = list(node.parts[1:])
        return [head + rest for head in _alternatives(node.parts[0])]
    return [[node]]


def _choice(alternatives: list[list[Expr]]) -> Expr:
    options = [seq[0] if len(seq) == 1 else Concat(tuple(seq)) for seq in alternatives]  # type: ignore[arg-type]
    return options[0] if len(options) == 1 else Alternate(tuple(options))  # type: ignore[arg-type]


def _reachable(rules: dict[str, Expr], root: str = ROOT) -> set[str]:
    seen = {root}
    stack = [root]
    while stack:
        for ref in _refs(rules[stack.pop()]):
            if ref not in seen:
                seen.add(ref)
                stack.append(ref)
    return seen


def _recursive(rules: dict[str, Expr], reachable: set[str]) -> set[str]:
    """The rules on a cycle of references (they cannot be inlined)."""
    return _on_cycles({n: _refs(rules[n]) for n in reachable})


def _on_cycles(graph: dict[Any, set[Any]]) -> set[Any]:
    """The nodes of `graph` (node -> its successors) from which a path leads back to them."""
    out = set()
    for start in graph:
        stack = list(graph[start])
        seen: set[Any] = set()
        while stack:
            n = stack.pop()
            if n == start:
                out.add(start)
                break
            if n not in seen:
                seen.add(n)
                stack.extend(graph[n])
    return out


def _calls(dfa: ByteDFA) -> list[tuple[tuple[int, int, bool], ...]]:
    table = dfa.table
    byte_edges = table[:, :256].any(axis=1)
    call_edges = table[:, 256:].any(axis=1)
    # A return state that accepts and has nowhere else to go: the callee's end is the caller's.
    sink = dfa.accepting & ~byte_edges & ~call_edges
    out = []
    for s in range(dfa.num_states):
        row = table[s, 256:]
        out.append(tuple((k, int(row[k]), bool(sink[row[k]])) for k in np.flatnonzero(row).tolist()))
    return out


def _check_productive(names: list[str], dfas: list[ByteDFA]) -> None:
    """Every rule must be able to finish: a path from its start to an accepting state over
    bytes and calls of rules that can."""
    productive = [False] * len(dfas)
    changed = True
    while changed:
        changed = False
        for r, dfa in enumerate(dfas):
            if not productive[r]:
                usable = [*range(256), *(256 + k for k, ok in enumerate(productive) if ok)]
                if live_states(dfa.table[:, usable], dfa.accepting)[1]:
                    productive[r] = changed = True
    stuck = [repr(names[r]) for r, ok in enumerate(productive) if not ok]
    if stuck:
        raise GrammarError(
            f"{'rule' if len(stuck) == 1 else 'rules'} {', '.join(stuck)} can never finish "
            "(every way through recurses forever)"
        )


def _check_left_recursion(names: list[str], dfas: list[ByteDFA], calls: list[list[tuple[tuple[int, int, bool], ...]]]) -> None:
    """Refuse a rule that can call itself before reading a byte: its stack would grow
    without bound. Rules that can match nothing (nullable) are stepped over on the way."""
    n = len(dfas)
    nullable = [bool(d.accepting[1]) for d in dfas]

    def reach(r: int) -> tuple[set[int], set[int]]:
        """The states of rule r reached from its start through calls of nullable rules, and
        the rules called in them."""
        states, called = {1}, set()
        stack = [1]
        while stack:
            s = stack.pop()
            for callee, ret, _ in calls[r][s]:
                called.add(callee)
                if nullable[callee] and ret not in states:
                    states.add(ret)
                    stack.append(ret)
        return states, called

    changed = True
    while changed:
        changed = False
        for r in range(n):
            if not nullable[r] and any(dfas[r].accepting[s] for s in reach(r)[0]):
                nullable[r] = changed = True
    first = {r: reach(r)[1] for r in range(n)}
    left = _on_cycles(first)
    if left:
        raise GrammarError(
            f"rule {names[min(left)]!r} is left-recursive behind something that can match nothing (it can reach "
            "itself before reading any text); write the recursion as a repetition, e.g. term (\"+\" term)*"
        )
