"""Context-free grammars (GBNF) against an independent recognizer: the `regex` module's
recursive patterns, which match the same languages. The pushdown automaton must accept the
same texts and the same prefixes, and its token masks must allow exactly the tokens that
keep the text a prefix of the language."""

from __future__ import annotations

import pytest
import regex
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import InvalidRequestError, StructuredOutputParams
from conveyor.structured import GrammarError, compile_automaton
from conveyor.structured.cfg import (
    Config,
    Pushdown,
    _compile_rules,
    _reachable,
    compile_grammar,
    parse_grammar,
    without_left_recursion,
)
from conveyor.structured.grammar import PushdownGrammar, TokenVocab
from conveyor.structured.regex import ByteDFA

EOS = 0

# (GBNF grammar, an equivalent recursive pattern for `regex`, the alphabet to draw texts from)
LANGUAGES = {
    "nested lists": (
        """
        root ::= list            # a list of numbers and lists
        list ::= "[" ( item ( "," item )* )? "]"
        item ::= num | list
        num  ::= [0-9]+
        """,
        r"(?P<l>\[(?:(?:[0-9]+|(?&l))(?:,(?:[0-9]+|(?&l)))*)?\])",
        "[],12",
    ),
    "palindromes": (
        'root ::= "a" root "a" | "b" root "b" | "c"',
        r"(?P<p>a(?&p)a|b(?&p)b|c)",
        "abc",
    ),
    "arithmetic": (
        """
        root   ::= expr
        expr   ::= term (("+" | "-") term)*
        term   ::= factor ("*" factor)*
        factor ::= [0-9]{1,2} | "(" ws expr ws ")"
        ws     ::= " "?
        """,
        r"(?P<e>(?&t)(?:[+-](?&t))*)(?(DEFINE)(?P<t>(?&f)(?:\*(?&f))*)(?P<f>[0-9]{1,2}|\( ?(?&e) ?\)))",
        "1(+*) ",
    ),
    "left recursion": (  # the arithmetic above as it is usually written: rewritten as repetition
        """
        root   ::= expr
        expr   ::= expr ("+" | "-") term | term
        term   ::= term "*" factor | factor
        factor ::= [0-9]{1,2} | "(" ws expr ws ")"
        ws     ::= " "?
        """,
        r"(?P<e>(?&t)(?:[+-](?&t))*)(?(DEFINE)(?P<t>(?&f)(?:\*(?&f))*)(?P<f>[0-9]{1,2}|\( ?(?&e) ?\)))",
        "1(+*) ",
    ),
    "indirect left recursion": (  # a through b back to a, leftmost: a = (y | w x) (z x)*, in brackets
        """
        root ::= "[" a "]" | "<" b ">"
        a    ::= b "x" | "y" | "(" root ")"
        b    ::= a "z" | "w" | b "v"
        """,
        r"(?P<r>\[(?&a)\]|<(?&b)>)(?(DEFINE)(?P<a>(?:y|\((?&r)\)|wv*x)(?:zv*x)*)(?P<b>(?&a)zv*|wv*))",
        "[]<>()xyzwv",
    ),
    "right recursion": (
        """
        root ::= "<" items ">"
        items ::= "x" items | "y" items | ""
        """,
        r"<[xy]*>",
        "<xy>",
    ),
    "json-like": (
        r"""
        root   ::= object
        value  ::= object | array | string | "1" | "true"
        object ::= "{" ( string ":" value ( "," string ":" value )* )? "}"
        array  ::= "[" ( value ( "," value )* )? "]"
        string ::= "\"" [a-z\u00e9]* "\""
        """,
        r'(?P<o>\{(?:(?&s):(?&v)(?:,(?&s):(?&v))*)?\})'
        r'(?(DEFINE)(?P<v>(?&o)|\[(?:(?&v)(?:,(?&v))*)?\]|(?&s)|1|true)(?P<s>"[a-zé]*"))',
        '{}[]":,1ae',
    ),
}


def reference(pattern: str, text: str) -> tuple[bool, bool]:
    """(a prefix of the language, in it)."""
    return bool(regex.fullmatch(pattern, text, partial=True)), bool(regex.fullmatch(pattern, text))


def byte_vocab(extra: list[bytes], top: int = 256) -> TokenVocab:
    tokens: list[bytes | None] = [None, *(bytes([b]) for b in range(1, top)), *extra]
    return TokenVocab(tokens, [EOS], len(tokens))


def read(grammar: PushdownGrammar, text: str) -> Config:
    state = grammar.START
    for b in text.encode():
        state = grammar._step(state, b)
    return state


@pytest.fixture(scope="module")
def grammars() -> dict[str, tuple[PushdownGrammar, str]]:
    vocab = byte_vocab([])
    out = {}
    for name, (gbnf, pattern, _) in LANGUAGES.items():
        pda = compile_grammar(gbnf)
        if name == "right recursion":
            assert isinstance(pda, Pushdown) and any(t for calls in pda.calls for c in calls for *_, t in c), \
                "items' self-call is a tail call"
        out[name] = (PushdownGrammar(pda, vocab, torch.device("cpu")), pattern) if isinstance(pda, Pushdown) else None
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_automaton_accepts_what_the_reference_accepts(grammars, data):
    name = data.draw(st.sampled_from(sorted(LANGUAGES)))
    alphabet = LANGUAGES[name][2]
    text = data.draw(st.text(alphabet=alphabet, max_size=14))
    grammar, pattern = grammars[name]
    state = read(grammar, text)
    prefix, whole = reference(pattern, text)
    assert bool(state) == prefix, (name, text)
    assert (bool(state) and state.accepting) == whole, (name, text)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_texts_grown_by_allowed_bytes_stay_in_the_language(grammars, data):
    """A random walk through the masks never leaves the language, and ends only in it."""
    name = data.draw(st.sampled_from(sorted(LANGUAGES)))
    grammar, pattern = grammars[name]
    out, state = b"", grammar.START
    for _ in range(data.draw(st.integers(1, 25))):
        allowed = grammar.allowed(state).nonzero().flatten().tolist()
        token = data.draw(st.sampled_from(allowed))
        if token == EOS:
            assert reference(pattern, out.decode())[1], (name, out)
            return
        out += bytes([token])
        state = grammar.advance(state, token)
        assert state and reference(pattern, whole_characters(out))[0], (name, out)


def whole_characters(data: bytes) -> str:
    """The text of `data` up to a character its last bytes have only begun."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        assert e.start >= len(data) - 3, "only the end may be cut short"
        return data[: e.start].decode()


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_mask_allows_exactly_the_tokens_that_keep_a_prefix(data):
    """Multi-byte tokens that cross returns and calls (`],[`, `":{`) against the reference
    walked over every token."""
    name = data.draw(st.sampled_from(sorted(LANGUAGES)))
    gbnf, pattern, alphabet = LANGUAGES[name]
    words = data.draw(st.lists(st.text(alphabet=alphabet, min_size=2, max_size=5), min_size=1, max_size=60))
    vocab = byte_vocab(sorted({w.encode() for w in words}), top=128)  # whole characters only
    pda = compile_grammar(gbnf)
    assert isinstance(pda, Pushdown)
    grammar = PushdownGrammar(pda, vocab, torch.device("cpu"))
    text, state = "", grammar.START
    for _ in range(6):
        allowed = grammar.allowed(state)
        for t in range(1, vocab.size):
            piece = (vocab.tokens[t] or b"").decode("utf-8", "surrogateescape")
            assert bool(allowed[t]) == (bool(vocab.tokens[t]) and reference(pattern, text + piece)[0]), \
                (name, text, piece)
        assert bool(allowed[EOS]) == reference(pattern, text)[1]
        choices = [t for t in allowed.nonzero().flatten().tolist() if t != EOS]
        if not choices:
            return
        token = data.draw(st.sampled_from(choices))
        text += (vocab.tokens[token] or b"").decode()
        state = grammar.advance(state, token)


def test_right_recursion_keeps_one_frame(grammars):
    grammar, _ = grammars["right recursion"]
    state = read(grammar, "<" + "xy" * 500)
    assert state and max(_depth(st) for st in state.tops) <= 2


def _depth(stack) -> int:
    n = 0
    while stack is not None:
        n, stack = n + 1, stack[2]
    return n


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_rule_a_frame_accepts_the_same_language(data):
    """What `compile_rules` falls back to when inlining makes a DFA too large: every rule its own
    frame. The same texts and prefixes as the reference."""
    name = data.draw(st.sampled_from(sorted(LANGUAGES)))
    gbnf, pattern, alphabet = LANGUAGES[name]
    rules = without_left_recursion(parse_grammar(gbnf))
    pda = _compile_rules(rules, "root", set(rules))
    assert isinstance(pda, Pushdown) and len(pda.names) == len(_reachable(rules))
    grammar = PushdownGrammar(pda, byte_vocab([]), torch.device("cpu"))
    text = data.draw(st.text(alphabet=alphabet, max_size=14))
    state = read(grammar, text)
    prefix, whole = reference(pattern, text)
    assert bool(state) == prefix and (bool(state) and state.accepting) == whole, (name, text)


def test_a_grammar_too_large_to_inline_compiles_with_its_rules_as_frames():
    """Thirty strict tools, each a schema with a bounded string: one DFA would pass the state
    limit, so each schema stays a frame; the calls still hold to their schemas."""
    from conveyor.server.tool_parsers import make_tool_parser
    from conveyor.server.tools import Tools

    tools = [{"type": "function", "function": {"name": f"f{i}", "strict": True, "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 40}, "n": {"type": "integer"}},
        "required": [f"p{i}"], "additionalProperties": False}}} for i in range(30)]
    spec = Tools.parse(tools, "auto", True, make_tool_parser("hermes")).constraint()
    pda = compile_automaton(spec)
    assert isinstance(pda, Pushdown) and len(pda.names) > 30
    assert pda.matches('Sure. <tool_call>\n{"name": "f7", "arguments": {"p7": "x", "n": 2}}\n</tool_call> ok')
    assert not pda.matches('<tool_call>{"name": "f7", "arguments": {"p8": "x"}}</tool_call>')
    assert not pda.matches('<tool_call>{"name": "f7", "arguments": {"p7": "' + "x" * 41 + '"}}</tool_call>')


def test_left_recursion_is_rewritten_as_repetition():
    direct = compile_grammar('root ::= root "a" | root "b" | "c"')
    assert isinstance(direct, ByteDFA), "c (a | b)*: nothing recursive is left"
    assert [direct.matches(t) for t in ("c", "cabba", "a", "ca c", "")] == [True, True, False, False, False]
    sums = compile_grammar('root ::= sum\nsum ::= sum "+" num | num\nnum ::= [0-9]+')
    assert isinstance(sums, ByteDFA) and sums.matches("1+22+3") and not sums.matches("1++2")
    indirect = compile_grammar('root ::= a\na ::= b "x" | "y"\nb ::= a "z" | "w"')
    assert [indirect.matches(t) for t in ("y", "wx", "yzxzx", "yz", "w")] == [True, True, True, False, False]


def test_a_grammar_without_recursion_compiles_to_a_dfa():
    dfa = compile_grammar('root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= [A-Z] [a-z]+')
    assert isinstance(dfa, ByteDFA)
    assert dfa.matches("hello Bob") and not dfa.matches("hey Bob") and not dfa.matches("hi bob")


def test_syntax():
    rules = parse_grammar(
        'root ::= "a\\n\\x41\\u00e9" [^a-c\\]] . x{2} x{1,} x{0,3} (x | "y")+ # comment\n'
        'x ::=\n  "x"\n  | "z"\n'
    )
    assert set(rules) == {"root", "x"}
    dfa = compile_grammar('root ::= "a\\n\\x41\\u00e9" [^a-c\\]] . x{2} x{1,} x{0,3} (x | "y")+\nx ::= "x" | "z"')
    assert isinstance(dfa, ByteDFA)
    assert dfa.matches("a\nAéd\nxzxy") and not dfa.matches("a\nAé]\nxzxy") and not dfa.matches("a\nAéd\nxzx")


@pytest.mark.parametrize(("gbnf", "says"), [
    ('root ::= "a', "line 1, column 12: unterminated string"),
    ('root ::= ("a"', "missing ')'"),
    ('root ::= "a")', "unbalanced ')'"),
    ('root ::= [a-', "unterminated character class"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "\\xZ1"', "bad escape \\xZ1"),
    ('root ::= "a"{3,1}', "bad repetition"),
    ('root ::= "a"\nroot ::= "b"', "defined twice"),
    ('main ::= "a"', "no 'root' rule"),
    ('root ::= item', "refers to 'item', which is not defined"),
    ('root ::= ::=', "line 1, column 10"),
    ("", "no rules"),
])
def test_bad_grammars_say_what_and_where(gbnf, says):
    with pytest.raises(GrammarError, match=regex.escape(says)):
        parse_grammar(gbnf)
    with pytest.raises(InvalidRequestError, match=regex.escape(says)) as e:
        StructuredOutputParams(grammar=gbnf)
    assert e.value.param == "structured_outputs.grammar"


@pytest.mark.parametrize(("gbnf", "says"), [
    ('root ::= x\nx ::= y? "a" | y x "b"\ny ::= "c"?', "'x' is left-recursive behind something that can match nothing"),
    ('root ::= "a"? root "b" | "c"', "'root' is left-recursive"),
    ('root ::= x\nx ::= "a" x', "'x' can never finish"),
    ('root ::= "a" root', "'root' can never finish"),
])
def test_grammars_that_cannot_run_are_refused_at_compile(gbnf, says):
    with pytest.raises(GrammarError, match=regex.escape(says)):
        compile_automaton(StructuredOutputParams(grammar=gbnf))
