"""Structural tags (xgrammar's, as vLLM's `structural_tag` response format takes them) as a
grammar's rules.

Two shapes are read. The first, `{"structures": [{"begin", "schema", "end"}], "triggers":
[...]}`, is free text in which each trigger starts a JSON value of a structure's schema between
its `begin` and `end` (xgrammar's first format; vLLM's documented one). The second,
`{"format": {...}}`, is a tree of formats (xgrammar's newer one), each a piece of text:

- `const_string` (`value`), `json_schema` (`json_schema`), `grammar` (GBNF, `grammar`), `regex`
  (`pattern`), `any_text` (any text, with no occurrence of its `excludes`);
- `sequence` and `or` of `elements`; `optional`, `plus`, `star` and `repeat` (`min`, `max`, -1
  unbounded) of a `content`;
- `tag`: `begin`, a `content`, and an `end` (a string, or a list: any one of them);
- `triggered_tags`: free text in which each of the `triggers` starts one of the `tags` (the tag
  whose `begin` it starts), then free text again; `at_least_one` (a tag first, with no text
  before it), `stop_after_first` (nothing after the first tag), `excludes` (strings the free
  text may not hold);
- `tags_with_separator`: `tags` one after another with a `separator` between, nothing else;
  `at_least_one`, `stop_after_first`;
- `dispatch` (xgrammar 0.2's): free text in which each rule's pattern is followed by that
  rule's format; `loop` (true: free text again after), `excludes`.

A format with no `type` is read by its fields, as xgrammar reads it (`begin`: a tag).

**Where a free-text format stops.** `any_text`, `triggered_tags` and `dispatch` run until the
end of the enclosing `tag`, when they are its content's last piece: the first occurrence of one
of that tag's (non-empty) ends closes them, as xgrammar's end detection does, so `{"type":
"tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}` is a thinking
block that the first `</think>` closes. Elsewhere they run to the end of the output, or (with
`excludes`, or before another element of a sequence) until what follows them.

**Tokens** (xgrammar's token-level formats): a special token (`<|tool_calls_section_begin|>`,
control, not text) has no bytes of text, so a grammar over the output's bytes reads it as bytes
that no text spells (`regex.special_token`), and admits it only where a format names it:
- `{"type": "token", "token": TEXT}`: one token, by its text (a tag's `begin` or `end` may be
  one too): the special token of that text where the served tokenizer has one (`specials`, the
  engine's compile passes them), else the text itself (an added token that is not special, or
  text of ordinary tokens); where no tokenizer is known (a check before any engine), either;
- `token_triggered_tags`: `triggered_tags` whose `trigger_tokens` are tokens, each tag's
  `begin` one of them; `exclude_tokens` the free text may not hold;
- `any_tokens`: any text and special tokens up to the enclosing tag's end, holding none of
  `exclude_tokens`;
- `token_dispatch`: `dispatch` whose `rules` start at a token, `exclude_tokens` as `excludes`.
Free text (`any_text`, a dispatch's, the text around triggers) holds no special token;
`any_tokens` (xgrammar's any token but the excluded) holds any special token but the excluded
ones and the enclosing tag's end. A token may be given by its id: the engine
reads it as its token's text before it compiles (`token_ids_as_text`). `exclude_token` (any one
token but some) is refused: a grammar over bytes has no token boundaries to count by.

`json_schema`'s `style`s other than `json` and `qwen_xml` (`qwen_xml_rules`: Qwen3-Coder's XML
parameters as conveyor's parser reads them) and `any_order`, `any_text`'s `max_tokens` and
`max_chars`, and `regex`'s `excludes` are refused with their name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from conveyor.structured.cfg import ROOT, Expr, Ref, parse_grammar
from conveyor.structured.json_schema import lit, schema_to_rules
from conveyor.structured.regex import (
    Alternate,
    Bytes,
    CharSet,
    Concat,
    GrammarError,
    Repeat,
    Until,
    parse,
    special_token,
)

__all__ = ["structural_tag_rules"]

ANY_CHAR = CharSet(((0, 0x10FFFF),))
MAX_DEPTH = 64
FORMATS = ("const_string", "json_schema", "grammar", "regex", "any_text", "sequence", "or", "optional", "plus",
           "star", "repeat", "tag", "triggered_tags", "tags_with_separator", "dispatch", "token", "any_tokens",
           "token_triggered_tags", "token_dispatch")


@dataclass(frozen=True, slots=True)
class Token:
    """One token written by its text: the special token of that text (`special`), or the text
    itself (not `special`), or either where the tokenizer is not known (None)."""

    text: str
    special: bool | None = None


Piece = str | Token  # a tag's begin or end, a trigger, an excluded string: text, or a token
Stop = tuple[Piece, ...] | None  # the enclosing tag's ends, for the content's last piece


def structural_tag_rules(text: str, specials: frozenset[str] | None = None) -> dict[str, Expr]:
    """The grammar of a structural tag given as JSON text, either shape; raises GrammarError
    with the path of what is wrong (`structural_tag.format.elements[1].end: ...`). `specials`:
    the texts of the served tokenizer's special tokens (None: not known)."""
    try:
        spec = json.loads(text)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"structural_tag is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise GrammarError("structural_tag must be an object: {format} or {structures, triggers}")
    if "format" in spec:
        if spec.get("type", "structural_tag") != "structural_tag":
            raise GrammarError('structural_tag.type must be "structural_tag"')
        compiler = _Compiler(specials)
        compiler.rules[ROOT] = compiler.format(spec["format"], "structural_tag.format", None)
        return compiler.rules
    compiler = _Compiler(specials)
    compiler.rules[ROOT] = compiler.format(_legacy(spec), "structural_tag", None)
    return compiler.rules


def _legacy(spec: dict[str, Any]) -> dict[str, Any]:
    """`{"structures", "triggers"}` as the `triggered_tags` format it means, checked."""
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError("structural_tag.triggers must list at least one non-empty string")
    if not isinstance(structures, list) or not structures:
        raise GrammarError("structural_tag.structures must list at least one {begin, schema, end}")
    tags = []
    for j, st in enumerate(structures):
        if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or not isinstance(st.get("end"), str) \
                or "schema" not in st:
            raise GrammarError(f"structural_tag.structures[{j}] must be {{begin: string, schema, end: string}}")
        tags.append({"type": "tag", "begin": st["begin"], "end": st["end"],
                     "content": {"type": "json_schema", "json_schema": st["schema"], "(path)": f"structures[{j}].schema"}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "stop_after_first": spec.get("stop_after_first", False),
            "(path)": "structures"}


class _Compiler:
    def __init__(self, specials: frozenset[str] | None = None) -> None:
        self.specials = specials
        self.rules: dict[str, Expr] = {}
        self.depth = 0
        self.adopted = 0
        self.seen: dict[tuple[str, ...], Expr] = {}  # each schema's rules, adopted once however often used

    def format(self, fmt: Any, where: str, stop: Stop) -> Expr:
        """`fmt`'s text, followed by one of `stop` (the enclosing tag's ends) where given."""
        if not isinstance(fmt, dict):
            raise GrammarError(f"{where} must be a format object")
        kind = fmt.get("type", _inferred(fmt))
        if kind == "exclude_token":
            raise GrammarError(f"{where}: 'exclude_token' (any one token but some) is not built: a grammar over "
                               "the output's bytes has no token boundaries to count one token by")
        if kind not in FORMATS:
            said = "no type, and its fields name no format" if "type" not in fmt else f"type {kind!r} is not a format"
            raise GrammarError(f"{where}: {said} ({', '.join(FORMATS)})")
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise GrammarError(f"{where}: formats nested over {MAX_DEPTH} deep")
        try:
            return getattr(self, "_" + kind)(fmt, where, stop)
        finally:
            self.depth -= 1

    # -- primitive formats: a text of their own, then the stop -----------------------------
    def _const_string(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        return _then(lit(_string(fmt, "value", where, empty=False)), stop)

    def _json_schema(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        style = fmt.get("style", "json")
        if style not in ("json", "qwen_xml"):
            raise GrammarError(f"{where}.style {style!r}: only \"json\" and \"qwen_xml\" are built")
        if fmt.get("any_order", False) is not False:
            raise GrammarError(f"{where}.any_order: not built (properties come in the schema's order)")
        if "json_schema" not in fmt:
            raise GrammarError(f"{where} needs json_schema")
        schema = fmt["json_schema"]
        key = ("json_schema", style, json.dumps(schema, sort_keys=True))
        if key not in self.seen:
            try:
                rules = schema_to_rules(schema) if style == "json" else qwen_xml_rules(schema)
            except GrammarError as e:
                raise GrammarError(f"{_path(fmt, where + '.json_schema')}: {e}") from None
            self.seen[key] = self._adopt(rules)
        return _then(self.seen[key], stop)

    def _grammar(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        try:
            rules = parse_grammar(_string(fmt, "grammar", where, empty=False))
        except GrammarError as e:
            raise GrammarError(f"{where}.grammar: {e}") from None
        return _then(self._adopt(rules), stop)

    def _regex(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        if fmt.get("excludes"):
            raise GrammarError(f"{where}.excludes: not built for a regex")
        try:
            node = parse(_string(fmt, "pattern", where, empty=False))
        except GrammarError as e:
            raise GrammarError(f"{where}.pattern: {e}") from None
        return _then(node, stop)

    def _any_text(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        for limit in ("max_tokens", "max_chars"):
            if fmt.get(limit) is not None:
                raise GrammarError(f"{where}.{limit}: not built")
        return _free_until(list(_strings(fmt, "excludes", where)), (), stop)

    # -- tokens --------------------------------------------------------------------------------
    def _token(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        return _then(_piece(self.token(fmt, where)), stop)

    def _any_tokens(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        return _free_until(self.tokens(fmt, "exclude_tokens", where), (), stop, specials=True)

    def _token_triggered_tags(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        triggers = self.tokens(fmt, "trigger_tokens", where, at_least_one=True)
        tags = _triggered_tag_list(fmt, where, where)
        groups: list[list[Expr]] = [[] for _ in triggers]
        whole: list[Expr] = []
        for j, tag in enumerate(tags):
            here = f"{where}.tags[{j}]"
            begin, ends, content = self._tag_parts(tag, here)
            if begin not in triggers:
                raise GrammarError(f"{here}.begin must be one of the trigger tokens (a token format)")
            body = self.format(content, here + ".content", ends)
            groups[triggers.index(begin)].append(body)  # (the trigger is the whole begin)
            whole.append(_cat(_piece(begin), body))
        return self._triggered(fmt, where, stop, triggers, groups, whole, self.tokens(fmt, "exclude_tokens", where))

    def _token_dispatch(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        rules = fmt.get("rules")
        if not isinstance(rules, list) or not rules or not all(isinstance(r, list) and len(r) == 2 for r in rules):
            raise GrammarError(f"{where}.rules must list at least one [token, format]")
        patterns = [self.token({"token": r[0]}, f"{where}.rules[{i}][0]") for i, r in enumerate(rules)]
        if len(set(patterns)) != len(patterns):
            raise GrammarError(f"{where}.rules: two rules share a token")
        bodies = [self.format(r[1], f"{where}.rules[{i}][1]", None) for i, r in enumerate(rules)]
        return _dispatch(bodies, list(patterns), self.tokens(fmt, "exclude_tokens", where), stop,
                         loop=_flag(fmt, "loop", where, True))

    # -- composition -----------------------------------------------------------------------
    def _sequence(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        elements = _formats(fmt, "elements", where)
        last = len(elements) - 1
        return _cat(*(self.format(e, f"{where}.elements[{i}]", stop if i == last else None) for i, e in enumerate(elements)))

    def _or(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        elements = _formats(fmt, "elements", where)
        return _alt(*(self.format(e, f"{where}.elements[{i}]", stop) for i, e in enumerate(elements)))

    def _optional(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        return self._repeated(fmt, where, stop, 0, 1)

    def _plus(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        return self._repeated(fmt, where, stop, 1, None)

    def _star(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        return self._repeated(fmt, where, stop, 0, None)

    def _repeat(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        low, high = fmt.get("min"), fmt.get("max")
        if not isinstance(low, int) or not _count(low) or not (high == -1 or (isinstance(high, int) and _count(high) and high >= low)):
            raise GrammarError(f"{where}: min must be a count and max a count no smaller, or -1 (no bound)")
        return self._repeated(fmt, where, stop, low, None if high == -1 else high)

    def _repeated(self, fmt: dict[str, Any], where: str, stop: Stop, low: int, high: int | None) -> Expr:
        if "content" not in fmt:
            raise GrammarError(f"{where} needs a content format")
        return _then(_rep(self.format(fmt["content"], where + ".content", None), low, high), stop)

    # -- tags and dispatch -----------------------------------------------------------------
    def _tag(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        begin, ends, content = self._tag_parts(fmt, where)
        return _then(_cat(_piece(begin), self.format(content, where + ".content", ends)), stop)

    def _tag_parts(self, fmt: Any, where: str) -> tuple[Piece, tuple[Piece, ...], Any]:
        if not isinstance(fmt, dict) or fmt.get("type", "tag") != "tag":
            raise GrammarError(f"{where} must be a tag: {{begin, content, end}}")
        begin: Piece = (self.token(fmt["begin"], where + ".begin") if isinstance(fmt.get("begin"), dict)
                        else _string(fmt, "begin", where))
        end = fmt.get("end")
        ends: tuple[Piece, ...] | None
        if isinstance(end, dict):
            ends = (self.token(end, where + ".end"),)
        else:
            ends = (end,) if isinstance(end, str) else tuple(end) if isinstance(end, list) and end else None
            if ends is None or not all(isinstance(e, str) for e in ends):
                raise GrammarError(f"{where}.end must be a string, a non-empty list of strings, or a token")
        if "content" not in fmt:
            raise GrammarError(f"{where} needs a content format")
        return begin, ends, fmt["content"]

    def _whole_tag(self, fmt: Any, where: str) -> Expr:
        begin, ends, content = self._tag_parts(fmt, where)
        return _cat(_piece(begin), self.format(content, where + ".content", ends))

    def _triggered_tags(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        triggers = _strings(fmt, "triggers", where, at_least_one=True)
        tags = _triggered_tag_list(fmt, where, _path(fmt, where))
        groups: list[list[Expr]] = [[] for _ in triggers]
        whole: list[Expr] = []
        for j, tag in enumerate(tags):
            here = f"{_path(fmt, where)}[{j}]" if "(path)" in fmt else f"{where}.tags[{j}]"
            begin, ends, content = self._tag_parts(tag, here)
            if isinstance(begin, Token):
                raise GrammarError(f"{here}.begin: a tag that a token begins is token_triggered_tags'")
            k = _first_trigger(begin, triggers)
            if k is None:
                raise GrammarError(f"{here}: its begin {begin!r} does not start with a trigger "
                                   "(the first trigger written in it must be its start)")
            body = self.format(content, here + ".content", ends)
            groups[k].append(_cat(lit(begin[len(triggers[k]):]), body))
            whole.append(_cat(lit(begin), body))
        return self._triggered(fmt, where, stop, list(triggers), groups, whole,
                               list(_strings(fmt, "excludes", where)))

    def _triggered(self, fmt: dict[str, Any], where: str, stop: Stop, triggers: list[Piece], groups: list[list[Expr]],
                   whole: list[Expr], excludes: list[Piece]) -> Expr:
        """Free text in which each trigger starts the rest of one of its tags (`groups`), as
        `at_least_one` and `stop_after_first` say; `whole`: each tag from its begin."""
        once, first = _flag(fmt, "stop_after_first", where), _flag(fmt, "at_least_one", where)
        unused = [t for t, g in zip(triggers, groups, strict=True) if not g]
        if unused:
            raise GrammarError(f"{where}: trigger {_shown(unused[0])} starts no tag's begin")
        if first and once:
            return _then(_alt(*whole), stop)
        rest = _dispatch([_alt(*g) for g in groups], triggers, excludes, stop, loop=not once)
        return _cat(_alt(*whole), rest) if first else rest

    def _dispatch(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        rules = fmt.get("rules")
        if not isinstance(rules, list) or not rules or not all(
                isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and r[0] for r in rules):
            raise GrammarError(f"{where}.rules must list at least one [pattern, format], each pattern a non-empty string")
        patterns = [r[0] for r in rules]
        if len(set(patterns)) != len(patterns):
            raise GrammarError(f"{where}.rules: two rules share a pattern")
        bodies = [self.format(r[1], f"{where}.rules[{i}][1]", None) for i, r in enumerate(rules)]
        return _dispatch(bodies, list(patterns), list(_strings(fmt, "excludes", where)), stop,
                         loop=_flag(fmt, "loop", where, True))

    def _tags_with_separator(self, fmt: dict[str, Any], where: str, stop: Stop) -> Expr:
        tags = fmt.get("tags")
        if not isinstance(tags, list) or not tags:
            raise GrammarError(f"{where}.tags must list at least one tag")
        one = _alt(*(self._whole_tag(t, f"{where}.tags[{j}]") for j, t in enumerate(tags)))
        separator = _string(fmt, "separator", where)
        once, first = _flag(fmt, "stop_after_first", where), _flag(fmt, "at_least_one", where)
        calls = one if once else _cat(one, _rep(_cat(lit(separator), one), 0, None))
        return _then(calls if first else _rep(calls, 0, 1), stop)

    def token(self, fmt: Any, where: str) -> Token:
        """A `{"type": "token", "token": TEXT}` format's token, special where the tokenizer says."""
        if not isinstance(fmt, dict) or fmt.get("type", "token") != "token" or "token" not in fmt:
            raise GrammarError(f"{where} must be a token: {{\"type\": \"token\", \"token\": TEXT}}")
        return self._resolved(fmt["token"], where + ".token")

    def tokens(self, fmt: dict[str, Any], key: str, where: str, at_least_one: bool = False) -> list[Piece]:
        value = fmt.get(key, [])
        if not isinstance(value, list) or (at_least_one and not value):
            raise GrammarError(f"{where}.{key} must list {'at least one token' if at_least_one else 'tokens'}, by their text")
        return [self._resolved(v, f"{where}.{key}[{i}]") for i, v in enumerate(value)]

    def _resolved(self, value: Any, where: str) -> Token:
        if isinstance(value, int) and not isinstance(value, bool):
            # An id is read as its token's text once the tokenizer is known (`token_ids_as_text`,
            # before an engine compiles); a check before that takes it as it is.
            if self.specials is not None or value < 0:
                raise GrammarError(f"{where}: token id {value} is not in the tokenizer's vocabulary")
            return Token(f"#{value}", None)
        if not isinstance(value, str) or not value:
            raise GrammarError(f"{where} must be a token: its text (a non-empty string) or its id")
        return Token(value, None if self.specials is None else value in self.specials)

    def _adopt(self, rules: dict[str, Expr]) -> Expr:
        """A sub-grammar's rules under a fresh prefix; its root's reference."""
        prefix = f"s{self.adopted}."
        self.adopted += 1
        self.rules.update({prefix + name: _renamed(body, prefix) for name, body in rules.items()})
        return Ref(prefix + ROOT)


XML_SPACE = Repeat(CharSet(((9, 10), (13, 13), (32, 32))), 0, None)
CLOSE = "</parameter>"
# A raw value runs to the first closing tag; it may not hold the call's or the block's closing
# tag either, which a parser looking for those would stop at first.
RAW = Until(tuple(t.encode() for t in (CLOSE, "</function>", "</tool_call>")), 0)


def qwen_xml_rules(schema: Any) -> dict[str, Expr]:
    """An object's properties as Qwen3-Coder's XML parameters, as conveyor's `qwen3_coder` tool
    parser reads them: `<parameter=NAME>VALUE</parameter>` for each property in the schema's
    order (the required ones always, the others or not), whitespace around. A value is raw text
    for a string (one newline on each side is dropped by the parser), the literal itself for an
    enum or const of strings, and the JSON text of its schema for a property of other types
    (numbers, booleans, null, objects, arrays); a property of no type, or of a string among
    other types, takes any text. Raw text holds no `</function>` or `</tool_call>` (where a
    parser would think the call ends). A string's length, pattern and format are not held. An
    object with no properties takes any parameters."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise GrammarError("the qwen_xml style needs an object schema (the parameters)")
    props = schema.get("properties")
    rules: dict[str, Expr] = {}
    if not isinstance(props, dict) or not props:
        name = Repeat(CharSet(((0, 9), (11, 61), (63, 0x10FFFF))), 1, None)  # no '>' or newline
        one = Concat((XML_SPACE, lit("<parameter="), name, lit(">"), RAW))
        rules[ROOT] = Concat((Repeat(one, 0, None), XML_SPACE))
        return rules
    required = set(schema.get("required", []))
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts: list[Expr] = []
    for k, (key, sub) in enumerate(props.items()):
        value = _xml_value({**sub, **defs} if isinstance(sub, dict) else sub, rules, f"p{k}.")
        param = _cat(XML_SPACE, lit(f"<parameter={key}>"), value)
        parts.append(param if key in required else _rep(param, 0, 1))
    rules[ROOT] = _cat(*parts, XML_SPACE)
    return rules


def _xml_value(sub: Any, rules: dict[str, Expr], prefix: str) -> Expr:
    """One parameter's value and its closing tag."""
    if not isinstance(sub, dict):
        return RAW
    literals = sub["enum"] if isinstance(sub.get("enum"), list) else [sub["const"]] if "const" in sub else None
    if literals is not None:
        newline = Repeat(CharSet(((10, 10),)), 0, 1)
        options = [lit(v) if isinstance(v, str) else lit(json.dumps(v)) for v in literals]
        return _cat(newline, _alt(*options), newline, lit(CLOSE))
    kind = sub.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if not kinds or "string" in kinds:
        return RAW
    value = {prefix + name: _renamed(body, prefix) for name, body in schema_to_rules(sub).items()}
    rules.update(value)
    return _cat(XML_SPACE, Ref(prefix + ROOT), XML_SPACE, lit(CLOSE))


def _dispatch(bodies: list[Expr], markers: list[Piece], excludes: list[Piece], stop: Stop, loop: bool) -> Expr:
    """Free text until one of `markers` is written, then that marker's body; again and again
    (`loop`) or once; the free text holds none of `excludes` and, inside a tag, ends at the first
    of its ends (which ends the whole)."""
    ends = tuple(e for e in stop or () if e)
    if set(markers) & set(ends):
        raise GrammarError(f"a trigger is also the enclosing tag's end: {_shown(sorted(set(markers) & set(ends), key=str)[0])}")
    every, index = _markers(markers, ends, excludes)
    dispatched = _alt(*(_cat(_until(every, index[i]), b) for i, b in enumerate(bodies)))
    free = _free_until(excludes, tuple(markers), stop)
    if loop:
        return _cat(_rep(dispatched, 0, None), free)
    return _alt(_then(dispatched, stop), free)


def _free_until(excludes: list[Piece], markers: tuple[Piece, ...], stop: Stop, specials: bool = False) -> Expr:
    """Text holding none of `markers` and `excludes` (with `specials`, and special tokens but
    those), then (inside a tag) the first of its non-empty ends; with no such end, to wherever
    the next thing starts."""
    ends = tuple(e for e in stop or () if e)
    every, index = _markers(list(markers), ends, excludes)
    if ends:
        base = len(markers)
        return _alt(*(_until(every, index[base + i], specials) for i in range(len(ends))))
    tail = Until(every, None, specials) if every or specials else Repeat(ANY_CHAR, 0, None)
    return _then(tail, stop)  # an end list of empty strings


def _markers(markers: list[Piece], ends: tuple[Piece, ...], excludes: list[Piece]) -> tuple[tuple[bytes, ...], list[list[int]]]:
    """What a scan of free text watches for, in order: the markers, the ends, the excluded
    pieces that are neither, then the texts of those that are special tokens; each piece's forms
    as bytes (a token's special token's, or its text, or either where the tokenizer is not
    known), and for each piece the indices of its forms."""
    seen = [*markers, *ends]
    seen += [x for x in dict.fromkeys(excludes) if x not in seen]
    # A special token's text, written in ordinary tokens, is what a parser of the text would
    # read as the token: free text holds none of a marker's or an exclusion's.
    seen += [t.text for t in seen if isinstance(t, Token) and t.special and t.text not in seen]
    forms: list[bytes] = []
    index: list[list[int]] = []
    for piece in seen:
        index.append([])
        for form in _forms(piece):
            if form not in forms:
                forms.append(form)
            index[-1].append(forms.index(form))
    return tuple(forms), index


def _until(every: tuple[bytes, ...], which: list[int], specials: bool = False) -> Expr:
    """Free text up to the first of `every`, that being one of `which`."""
    return _alt(*(Until(every, k, specials) for k in which))


def _piece(piece: Piece) -> Expr:
    """A piece's text: a token's special token, or its text (what the tokenizer holds it as)."""
    if not isinstance(piece, Token):
        return lit(piece)
    options: list[Expr] = []
    if piece.special is not False:
        options.append(Bytes(special_token(piece.text)))
    if not piece.special:
        options.append(lit(piece.text))
    return _alt(*options)


def _forms(piece: Piece) -> list[bytes]:
    """The bytes a piece is read as: a special token's spelling, and (where the tokenizer may
    hold it as ordinary text) its text."""
    if isinstance(piece, Token):
        special = [special_token(piece.text)] if piece.special is not False else []
        return special + ([piece.text.encode("utf-8")] if not piece.special else [])
    return [piece.encode("utf-8")]


def _shown(piece: Piece) -> str:
    return f"token {piece.text!r}" if isinstance(piece, Token) else repr(piece)


def _then(node: Expr, stop: Stop) -> Expr:
    if not stop:
        return node
    return _cat(node, _alt(*(_piece(e) for e in dict.fromkeys(stop))))


def _cat(*parts: Expr) -> Expr:
    return Concat(parts)  # type: ignore[arg-type]


def _alt(*options: Expr) -> Expr:
    return Alternate(options)  # type: ignore[arg-type]


def _rep(node: Expr, low: int, high: int | None) -> Expr:
    return Repeat(node, low, high)  # type: ignore[arg-type]


def _inferred(fmt: dict[str, Any]) -> str:
    for key, kind in (("begin", "tag"), ("value", "const_string"), ("json_schema", "json_schema"),
                      ("elements", "sequence"), ("triggers", "triggered_tags"), ("separator", "tags_with_separator"),
                      ("grammar", "grammar"), ("pattern", "regex"), ("rules", "dispatch"), ("token", "token"),
                      ("trigger_tokens", "token_triggered_tags")):
        if key in fmt:
            return kind
    return "any_text" if set(fmt) <= {"excludes"} else "(none)"


def _triggered_tag_list(fmt: dict[str, Any], where: str, path: str) -> list[Any]:
    """A triggered format's tags (at least one), its flags checked first."""
    tags = fmt.get("tags")
    if not isinstance(tags, list) or not tags:
        raise GrammarError(f"{path}.tags must list at least one tag")
    _flag(fmt, "stop_after_first", where), _flag(fmt, "at_least_one", where)
    return tags


def _path(fmt: dict[str, Any], where: str) -> str:
    """The legacy shape's own path for what it was turned into (`structural_tag.structures[0].schema`)."""
    return f"structural_tag.{fmt['(path)']}" if "(path)" in fmt else where


def _string(fmt: dict[str, Any], key: str, where: str, empty: bool = True) -> str:
    value = fmt.get(key)
    if not isinstance(value, str) or (not empty and not value):
        raise GrammarError(f"{where}.{key} must be a {'' if empty else 'non-empty '}string")
    return value


def _strings(fmt: dict[str, Any], key: str, where: str, at_least_one: bool = False) -> list[str]:
    value = fmt.get(key, [])
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value) or (at_least_one and not value):
        raise GrammarError(f"{where}.{key} must list {'at least one non-empty string' if at_least_one else 'non-empty strings'}")
    return value


def _formats(fmt: dict[str, Any], key: str, where: str) -> list[Any]:
    value = fmt.get(key)
    if not isinstance(value, list) or not value:
        raise GrammarError(f"{where}.{key} must list at least one format")
    return value


def _flag(fmt: dict[str, Any], key: str, where: str, default: bool = False) -> bool:
    value = fmt.get(key, default)
    if not isinstance(value, bool):
        raise GrammarError(f"{where}.{key} must be true or false")
    return value


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _first_trigger(begin: str, triggers: list[str]) -> int | None:
    """The trigger a scan of free text stops at when `begin` is written: the first to end in
    it, if it is also where `begin` starts (else None)."""
    for end in range(1, len(begin) + 1):
        found = [k for k, t in enumerate(triggers) if begin[:end].endswith(t)]
        if found:
            return next((k for k in found if len(triggers[k]) == end), None)
    return None


def _renamed(node: Expr, prefix: str) -> Expr:
    """`node` with every rule it refers to renamed `prefix + name`."""
    if isinstance(node, Ref):
        return Ref(prefix + node.name)
    if isinstance(node, Concat):
        return _cat(*(_renamed(p, prefix) for p in node.parts))
    if isinstance(node, Alternate):
        return _alt(*(_renamed(p, prefix) for p in node.options))
    if isinstance(node, Repeat):
        return _rep(_renamed(node.node, prefix), node.low, node.high)
    return node


TOKEN_LISTS = ("trigger_tokens", "exclude_tokens")


def token_ids_as_text(text: str, token_text: Any) -> str:
    """A structural tag (JSON text) with every token given by its id given by its text instead
    (`token_text(id)`: the token's text, or None for an id outside the vocabulary, which is left
    as it is for the compile to refuse): the `token` formats', `trigger_tokens`,
    `exclude_tokens` and `token_dispatch`'s rules'."""
    try:
        spec = json.loads(text)
    except (TypeError, ValueError):
        return text
    changed = False

    def named(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, int) and not isinstance(value, bool):
            found = token_text(value)
            if found:
                changed = True
                return found
        return value

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type", _inferred(node))
        if kind == "token" and "token" in node:
            node["token"] = named(node["token"])
        for key in TOKEN_LISTS:
            if isinstance(node.get(key), list):
                node[key] = [named(v) for v in node[key]]
        if kind == "token_dispatch" and isinstance(node.get("rules"), list):
            for rule in node["rules"]:
                if isinstance(rule, list) and rule:
                    rule[0] = named(rule[0])
        for key, value in node.items():
            if key not in TOKEN_LISTS:
                walk(value)

    walk(spec)
    return json.dumps(spec) if changed else text
