"""Lark grammars (the EBNF of the Lark parsing toolkit, which vLLM converts for xgrammar and
llguidance reads natively) as a grammar's rules, read as one context-free grammar over
characters.

    start: value
    ?value: dict | list | ESCAPED_STRING | SIGNED_NUMBER | "true" | "false" | "null"
    list: "[" [value ("," value)*] "]"
    dict: "{" [pair ("," pair)*] "}"
    pair: ESCAPED_STRING ":" value
    %import common.ESCAPED_STRING
    %import common.SIGNED_NUMBER
    %ignore WS

Read: rules (`name: ...`, with `?` or `!` in front, a `.priority` after) and terminals
(`NAME: ...`), alternatives with `|` (also at the start of a continuation line), strings
(`"..."`, `"..."i` for any case), regular expressions (`/.../`, as conveyor's `regex` reads
them, with the flags `i`, `s`, `x`, `m` after: `/.../i` ignores case), ranges (`"a".."z"`), groups, `[optional]`, `?`, `*`, `+`, `~ n` and `~ n..m`,
`{n}` and `{n,m}` (llguidance's), aliases (`-> name`, dropped), comments (`//` and `#`),
`%import common.NAME` (and `common (A, B)`, and `-> alias`) for the terminals of Lark's
`common.lark`, and `%ignore` (the ignored terminals may come between any two items of a rule,
and around the whole). The grammar starts at `start`.

There is no lexer: a terminal is not matched longest-first, so a grammar whose tokens a lexer
would keep apart (two names with nothing between them) allows more texts here. Templates,
`%declare`, `%override`, `%extend`, imports from other files and the regex flags `u`, `l` are
refused by name.
"""

from __future__ import annotations

import re

from conveyor.structured.cfg import ROOT, Expr, Ref, _refs, position, read_char
from conveyor.structured.regex import (
    Alternate,
    CharSet,
    Concat,
    GrammarError,
    Repeat,
    parse,
)

__all__ = ["looks_like_lark", "parse_lark"]

START = "start"
IGNORED = "(ignored)"  # the rule of what %ignore allows between items
_DEFINITION = re.compile(r"^\s*[?!]?[A-Za-z_][\w]*(\.-?\d+)?\s*:(?!:)")

# Lark's common.lark terminals, as conveyor's regular expressions.
_INT = r"[0-9]+"
_DECIMAL = rf"(?:{_INT}\.(?:[0-9]+)?|\.{_INT})"
_EXP = r"[eE][+-]?[0-9]+"
_FLOAT = rf"(?:{_INT}{_EXP}|{_DECIMAL}(?:{_EXP})?)"
_NUMBER = rf"(?:{_FLOAT}|{_INT})"
COMMON = {
    "DIGIT": "[0-9]", "HEXDIGIT": "[a-fA-F0-9]", "INT": _INT, "SIGNED_INT": rf"[+-]?{_INT}",
    "DECIMAL": _DECIMAL, "FLOAT": _FLOAT, "SIGNED_FLOAT": rf"[+-]?{_FLOAT}", "NUMBER": _NUMBER,
    "SIGNED_NUMBER": rf"[+-]?{_NUMBER}", "ESCAPED_STRING": r'"(?:\\.|[^"\\\n])*"',
    "LCASE_LETTER": "[a-z]", "UCASE_LETTER": "[A-Z]", "LETTER": "[A-Za-z]", "WORD": "[A-Za-z]+",
    "CNAME": "[A-Za-z_][A-Za-z_0-9]*", "WS_INLINE": "[ \t]+", "WS": "[ \t\f\r\n]+", "CR": "\r", "LF": "\n",
    "NEWLINE": "(?:\r?\n)+", "SH_COMMENT": "#[^\n]*", "CPP_COMMENT": "//[^\n]*",
}


def looks_like_lark(text: str) -> bool:
    """Whether a grammar is Lark's rather than GBNF: no `::=`, and a line that defines a rule
    (`name:`), as vLLM decides."""
    return isinstance(text, str) and "::=" not in text and any(_DEFINITION.match(line) for line in text.splitlines())


def parse_lark(text: str) -> dict[str, Expr]:
    """The rules of a Lark grammar, its `start` rule as `root`; raises GrammarError saying what
    and where."""
    parser = _Lark(text)
    rules = parser.grammar()
    if START not in rules:
        raise GrammarError(f"the Lark grammar has no {START!r} rule (it starts there)")
    if ROOT in rules:
        raise GrammarError(f"a Lark grammar may not name a rule {ROOT!r} (conveyor's start rule)")
    undefined = sorted({r for body in rules.values() for r in _refs(body)} - set(rules) - set(COMMON))
    if undefined:
        raise GrammarError(f"{undefined[0]!r} is used but not defined (or imported: %import common.{undefined[0]})")
    if parser.ignored:
        rules = {name: body if _terminal(name) else _spaced(body, parser.tokens) for name, body in rules.items()}
        rules[IGNORED] = Repeat(Alternate(tuple(parser.ignored)), 0, None)  # type: ignore[arg-type]
        rules[ROOT] = Concat((Ref(IGNORED), Ref(START), Ref(IGNORED)))  # type: ignore[arg-type]
    else:
        rules[ROOT] = Ref(START)
    return rules


def _terminal(name: str) -> bool:
    """Lark's terminals are named in capitals (`NAME`, `_NAME`); its rules in small letters."""
    return name.lstrip("_")[:1].isupper()


def _spaced(node: Expr, tokens: set[int]) -> Expr:
    """A rule's body with the ignored terminals allowed between any two of its items (`tokens`:
    the ids of its strings' and regular expressions' nodes, which are whole)."""
    if id(node) in tokens:
        return node
    if isinstance(node, Concat):
        parts: list[Expr] = []
        for p in node.parts:
            if parts:
                parts.append(Ref(IGNORED))
            parts.append(_spaced(p, tokens))
        return Concat(tuple(parts))  # type: ignore[arg-type]
    if isinstance(node, Alternate):
        return Alternate(tuple(_spaced(p, tokens) for p in node.options))  # type: ignore[misc]
    if isinstance(node, Repeat):
        inner = _spaced(node.node, tokens)
        if node.high == 1:
            return Repeat(inner, node.low, 1)  # type: ignore[arg-type]
        # x+ is x (ignored x)*: the ignored text comes between the repeats too
        rest = Repeat(Concat((Ref(IGNORED), inner)), max(node.low - 1, 0), None if node.high is None else node.high - 1)  # type: ignore[arg-type]
        body = Concat((inner, rest))  # type: ignore[arg-type]
        return body if node.low >= 1 else Repeat(body, 0, 1)
    return node


class _Lark:
    def __init__(self, text: str) -> None:
        if not isinstance(text, str):
            raise GrammarError("grammar must be a string")
        self.s = text
        self.i = 0
        self.ignored: list[Expr] = []
        self.rules: dict[str, Expr] = {}
        self.tokens: set[int] = set()  # the ids of the nodes of strings and regular expressions (each
        # stays in the rules while they are read, so no id is reused)

    def fail(self, why: str) -> GrammarError:
        return GrammarError(f"Lark grammar at {position(self.s, self.i)}: {why}")

    # -- layout: spaces and comments; a newline ends a definition unless `|` continues it --
    def inline_space(self) -> None:
        s = self.s
        while self.i < len(s):
            if s[self.i] in " \t\r":
                self.i += 1
            elif s.startswith("//", self.i) or s[self.i] == "#":
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end
            else:
                return

    def blank_lines(self) -> None:
        while True:
            self.inline_space()
            if self.i < len(self.s) and self.s[self.i] == "\n":
                self.i += 1
            else:
                return

    def continues(self) -> bool:
        """At a newline: whether the next non-blank line goes on with `|`."""
        at = self.i
        self.blank_lines()
        if self.i < len(self.s) and self.s[self.i] == "|":
            return True
        self.i = at
        return False

    def grammar(self) -> dict[str, Expr]:
        while True:
            self.blank_lines()
            if self.i >= len(self.s):
                return self.rules
            if self.s[self.i] == "%":
                self.directive()
            else:
                self.definition()

    def definition(self) -> None:
        at = self.i
        if self.s[self.i] in "?!":
            self.i += 1
        name = self.name()
        if name is None:
            raise self.fail("expected a rule or terminal name")
        if self.s.startswith("{", self.i):
            raise self.fail(f"{name!r}: templates are not built")
        m = re.match(r"\.-?\d+", self.s[self.i:])
        if m:
            self.i += m.end()  # a priority: no lexer to order
        self.inline_space()
        if not self.s.startswith(":", self.i):
            raise self.fail(f"expected ':' after {name!r}")
        self.i += 1
        if name in self.rules:
            self.i = at
            raise self.fail(f"{name!r} is defined twice")
        self.rules[name] = self.alternatives(nested=0)
        self.end_of_line()

    def end_of_line(self) -> None:
        self.inline_space()
        if self.i < len(self.s) and self.s[self.i] != "\n":
            raise self.fail(f"unexpected {self.s[self.i]!r}")

    def directive(self) -> None:
        m = re.match(r"%(\w+)[ \t]*", self.s[self.i:])
        if m is None:
            raise self.fail("expected a directive")
        kind = m.group(1)
        self.i += m.end()
        if kind == "ignore":
            if self.s.startswith("[", self.i):
                self.i += 1
                names = self.names_until("]")
                self.ignored += [Ref(n) for n in names]
            else:
                self.ignored.append(self.item())
        elif kind == "import":
            m = re.match(r"common\.([A-Z_][A-Z_0-9]*)(?:[ \t]*->[ \t]*([A-Za-z_]\w*))?", self.s[self.i:])
            if m is not None:
                self.i += m.end()
                self.imported(m.group(1), m.group(2) or m.group(1))
            elif re.match(r"common[ \t]*\(", self.s[self.i:]):
                self.i = self.s.index("(", self.i) + 1
                for n in self.names_until(")"):
                    self.imported(n, n)
            else:
                raise self.fail("only Lark's common terminals can be imported (%import common.NAME)")
        else:
            raise self.fail(f"%{kind} is not built (conveyor reads %import common and %ignore)")
        self.end_of_line()

    def imported(self, name: str, alias: str) -> None:
        if name not in COMMON:
            raise self.fail(f"common.{name} is not one of the common terminals conveyor knows ({', '.join(sorted(COMMON))})")
        self.rules[alias] = parse(COMMON[name])

    def names_until(self, close: str) -> list[str]:
        end = self.s.find(close, self.i)
        if end < 0:
            raise self.fail(f"missing {close!r}")
        names = [n.strip() for n in self.s[self.i:end].split(",")]
        if not all(re.fullmatch(r"[A-Za-z_]\w*", n) for n in names):
            raise self.fail("expected names separated by commas")
        self.i = end + 1
        return names

    # -- expansions ----------------------------------------------------------------------
    def name(self) -> str | None:
        m = re.match(r"[A-Za-z_]\w*", self.s[self.i:])
        if m is None:
            return None
        self.i += m.end()
        return m.group(0)

    def alternatives(self, nested: int) -> Expr:
        options = [self.sequence(nested)]
        while True:
            self.inline_space()
            if self.i < len(self.s) and self.s[self.i] == "\n" and (nested or self.continues()):
                if nested:
                    self.blank_lines()
                continue
            if self.i < len(self.s) and self.s[self.i] == "|":
                self.i += 1
                options.append(self.sequence(nested))
                continue
            return options[0] if len(options) == 1 else Alternate(tuple(options))  # type: ignore[arg-type]

    def sequence(self, nested: int) -> Expr:
        items: list[Expr] = []
        while True:
            self.inline_space()
            if nested:
                self.blank_lines()
            if self.i >= len(self.s) or self.s[self.i] in "|)]\n":
                break
            if self.s.startswith("->", self.i):  # an alias names the tree's node: nothing to match
                self.i += 2
                self.inline_space()
                if self.name() is None:
                    raise self.fail("expected a name after '->'")
                continue
            items.append(self.quantified(self.item()))
        return items[0] if len(items) == 1 else Concat(tuple(items))  # type: ignore[arg-type]

    def token(self, node: Expr) -> Expr:
        """`node`, a string's or a regular expression's: one token, which %ignore does not enter."""
        self.tokens.add(id(node))
        return node

    def item(self) -> Expr:
        if self.i >= len(self.s):
            raise self.fail("expected an item")
        c = self.s[self.i]
        if c == '"':
            first = self.string()
            if re.match(r"i(?!\w)", self.s[self.i:]):  # "..."i: any case
                self.i += 1
                return self.token(Concat(tuple(CharSet(tuple(sorted({(ord(x), ord(x)) for x in (ch, ch.lower(), ch.upper())
                                                                    if len(x) == 1}))) for ch in first)))
            at = self.i
            self.inline_space()
            if self.s.startswith("..", self.i):  # "a".."z"
                self.i += 2
                self.inline_space()
                last = self.string() if self.s.startswith('"', self.i) else ""
                if len(first) != 1 or len(last) != 1 or ord(last) < ord(first):
                    raise self.fail("a range is two one-character strings, the first not after the second")
                return CharSet(((ord(first), ord(last)),))
            self.i = at
            return self.token(Concat(tuple(CharSet(((ord(ch), ord(ch)),)) for ch in first)))
        if c == "/":
            return self.token(self.regex())
        if c in "([":
            self.i += 1
            inner = self.alternatives(nested=1)
            self.blank_lines()
            close = ")" if c == "(" else "]"
            if not self.s.startswith(close, self.i):
                raise self.fail(f"missing {close!r}")
            self.i += 1
            return inner if c == "(" else Repeat(inner, 0, 1)  # type: ignore[arg-type]
        name = self.name()
        if name is None:
            raise self.fail(f"unexpected {c!r}")
        return Ref(name)

    def string(self) -> str:
        self.i += 1
        out: list[str] = []
        while True:
            if self.i >= len(self.s) or self.s[self.i] == "\n":
                raise self.fail("unterminated string")
            if self.s[self.i] == '"':
                self.i += 1
                return "".join(out)
            try:
                cp, self.i = read_char(self.s, self.i, lenient=True)
            except ValueError as e:
                raise self.fail(str(e)) from None
            out.append(chr(cp))

    def regex(self) -> Expr:
        start = self.i
        self.i += 1
        while True:
            if self.i >= len(self.s) or self.s[self.i] == "\n":
                raise self.fail("unterminated regular expression")
            if self.s[self.i] == "\\":
                self.i += 2
                continue
            if self.s[self.i] == "/":
                break
            self.i += 1
        pattern = self.s[start + 1 : self.i].replace("\\/", "/")
        self.i += 1
        flags = re.match(r"[imslux]+", self.s[self.i:])
        letters = flags.group(0) if flags else ""
        self.i += len(letters)
        try:
            return parse(pattern, letters)
        except GrammarError as e:
            raise self.fail(f"/{pattern}/: {e}") from None

    def quantified(self, node: Expr) -> Expr:
        while True:
            self.inline_space()
            c = self.s[self.i] if self.i < len(self.s) else ""
            if c in ("*", "+", "?"):
                self.i += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "~":
                m = re.match(r"~[ \t]*(\d+)(?:[ \t]*\.\.[ \t]*(\d+))?", self.s[self.i:])
                if m is None:
                    raise self.fail("expected ~ n or ~ n..m")
                self.i += m.end()
                low = int(m.group(1))
                high = int(m.group(2)) if m.group(2) else low
            elif c == "{" and re.match(r"\{\s*\d*\s*(,\s*\d*\s*)?\}", self.s[self.i:]):
                m = re.match(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}", self.s[self.i:])
                assert m is not None
                self.i += m.end()
                low = int(m.group(1) or 0)
                high = (int(m.group(3)) if m.group(3) else None) if m.group(2) else low
            else:
                return node
            if high is not None and high < low:
                raise self.fail(f"bad repetition {low}..{high}")
            node = Repeat(node, low, high)  # type: ignore[arg-type]
