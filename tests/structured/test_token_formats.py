"""Structural tags' token-level formats (`token`, `token_triggered_tags`, `any_tokens`,
`token_dispatch`): a special token is read as bytes no text spells, admitted only where a
format names it; a token that the tokenizer holds as text is its text.

Against a matcher written from the definition (a regular expression over texts in which each
special token is one private-use character), over texts sampled from the format and damaged;
the masks of SmolLM2's vocabulary; and SmolLM2 run under a tag that its special tokens open and
close."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.sampling_params import InvalidRequestError, StructuredOutputParams
from conveyor.structured import compile_automaton
from conveyor.structured.regex import special_token
from tests.conftest import smollm2_path

NAMES = ["<|sec|>", "<|call|>", "<|end|>", "<|/sec|>", "<|x|>", "<|other|>"]
PUA = {name: chr(0xE000 + i) for i, name in enumerate(NAMES)}  # a special token, in a test's text
ENUM = {"type": "json_schema", "json_schema": {"enum": ["a", "b"]}}


def token(name: str) -> dict:
    return {"type": "token", "token": name}


def spelled(text: str) -> bytes:
    """What a grammar reads for a text whose private-use characters are special tokens."""
    back = {c: n for n, c in PUA.items()}
    return b"".join(special_token(back[c]) if c in back else c.encode("utf-8") for c in text)


def automaton(fmt: dict, specials: frozenset[str] | None):
    return compile_automaton(StructuredOutputParams(structural_tag={"type": "structural_tag", "format": fmt}), specials)


def test_a_token_is_its_special_token_where_the_tokenizer_has_one_else_its_text():
    fmt = {"type": "sequence", "elements": [token("<|sec|>"), {"type": "const_string", "value": "x"}]}
    special, text = spelled(PUA["<|sec|>"] + "x"), b"<|sec|>x"
    assert [automaton(fmt, s).reads(d) for s in (frozenset({"<|sec|>"}), frozenset(), None)
            for d in (special, text)] == [True, False, False, True, True, True]
    assert not automaton(fmt, frozenset(NAMES)).reads(spelled(PUA["<|call|>"] + "x"))  # another token


@pytest.mark.parametrize("content", ["any_tokens", "any_text"])
def test_a_tag_of_tokens_around_free_text(content):
    """Free content inside a tag closed by a token: any text, no special token (`any_tokens`:
    any special token but its excluded ones), none of its excluded tokens as text, nor the
    end's text in ordinary tokens (which a parser of the text would read as the token); it
    stops at the first end."""
    fmt = {"type": "tag", "begin": token("<|sec|>"), "end": token("<|end|>"),
           "content": {"type": content, "exclude_tokens": ["<|x|>", "<|call|>"]} if content == "any_tokens"
           else {"type": content, "excludes": ["<|x|>"]}}
    specials = frozenset(NAMES) - {"<|x|>"}  # <|x|> is text here, <|call|> a special token
    a = automaton(fmt, specials)
    s, e, o, c = PUA["<|sec|>"], PUA["<|end|>"], PUA["<|other|>"], PUA["<|call|>"]
    assert a.reads(spelled(f"{s}any text <|sec|> as text{e}"))  # (the begin is no marker here)
    assert not a.reads(spelled(f"{s}any text <|end|> as text{e}"))
    assert a.reads(spelled(f"{s}{e}"))
    assert a.reads(spelled(f"{s}a{o}b{o}{e}")) == (content == "any_tokens")  # other special tokens
    assert not a.reads(spelled(f"{s}a{c}b{e}"))  # an excluded special token (or any, in any_text)
    assert not a.reads(spelled(f"{s}a <|x|> b{e}"))  # the excluded token, as the text it is here
    assert not a.reads(spelled(f"{s}a{e}b{e}"))  # the first end ends it
    alone = automaton({"type": "any_tokens"}, specials)  # (no end, no exclusion: anything)
    assert alone.reads(spelled(f"a{o}{c}b")) and alone.reads(b"")


def section(parallel: bool) -> dict:
    """A Kimi-K2-like section: a trigger token opens it, calls of a token begin and end inside."""
    call = {"type": "tag", "begin": token("<|call|>"), "content": ENUM, "end": token("<|end|>")}
    calls = {"type": "tags_with_separator", "separator": "", "tags": [call], "at_least_one": True,
             "stop_after_first": not parallel}
    return {"type": "tag", "begin": token("<|sec|>"), "content": calls, "end": token("<|/sec|>")}


def oracle(specials: frozenset[str], parallel: bool, first: bool, once: bool) -> re.Pattern[str]:
    """The language of `token_triggered_tags` over `section` with <|x|> excluded, as a regular
    expression over texts with special tokens as private-use characters."""
    def t(name: str) -> str:
        return PUA[name] if name in specials else re.escape(name)

    # The trigger's and the excluded token's text: markers where the tokenizer holds them as
    # text, never written in ordinary tokens where it holds them as special tokens.
    text_markers = [re.escape(n) for n in ("<|sec|>", "<|x|>")]
    ordinary = "[^\ue000-\ue0ff]"  # free text holds no special token
    free = f"(?:(?!{'|'.join(text_markers)}){ordinary})*"
    one = f'{t("<|call|>")}"[ab]"{t("<|end|>")}'
    tag = f'{t("<|sec|>")}(?:{one}){"+" if parallel else ""}{t("<|/sec|>")}'
    if first and once:
        return re.compile(tag)
    rest = f"(?:{free}{tag})*{free}" if not once else f"(?:{free}{tag}|{free})"
    return re.compile(f"{tag}{rest}" if first else rest)


def sample(rnd: random.Random, parallel: bool, specials: frozenset[str]) -> str:
    def t(name: str) -> str:
        return PUA[name] if name in specials and rnd.random() < 0.9 else name

    def free() -> str:
        return "".join(rnd.choice(["a", " ", "<|", "|>", "x", "<|sec", "<|x|>"]) for _ in range(rnd.randint(0, 3)))

    def tag() -> str:
        calls = "".join(f'{t("<|call|>")}"{rnd.choice("ab")}"{t("<|end|>")}'
                        for _ in range(rnd.randint(1, 2) if parallel else 1))
        return t("<|sec|>") + calls + t("<|/sec|>")

    return "".join(free() + tag() for _ in range(rnd.randint(0, 2))) + free()


def damaged(text: str, rnd: random.Random) -> str:
    if not text or rnd.random() < 0.4:
        return text
    i = rnd.randrange(len(text))
    junk = rnd.choice([*PUA.values(), "<|sec|>", "<|end|>", '"', "a"])
    return rnd.choice([text[:i] + text[i + 1:], text[:i] + junk + text[i:], text[:i]])


@settings(max_examples=300, deadline=None)
@given(st.booleans(), st.booleans(), st.booleans(),
       st.sampled_from([frozenset(NAMES), frozenset(NAMES) - {"<|sec|>", "<|x|>"}, frozenset({"<|sec|>"})]),
       st.randoms(use_true_random=False))
def test_token_triggered_tags_read_as_the_definition(parallel, first, once, specials, rnd):
    """Free text (no special token, none of the excluded, nor the text of a special trigger; a
    trigger written as text where the tokenizer holds it as text), the section a trigger token
    opens, again or once; the automaton and the matcher agree on sampled texts, damaged or not."""
    fmt = {"type": "token_triggered_tags", "trigger_tokens": ["<|sec|>"], "tags": [section(parallel)],
           "exclude_tokens": ["<|x|>"], "at_least_one": first, "stop_after_first": once}
    a, want = automaton(fmt, specials), oracle(specials, parallel, first, once)
    for _ in range(8):
        text = damaged(sample(rnd, parallel, specials), rnd)
        assert a.reads(spelled(text)) == bool(want.fullmatch(text)), (text, specials)


def test_token_dispatch_starts_each_rule_at_its_token():
    fmt = {"type": "token_dispatch", "rules": [["<|call|>", ENUM], ["<|sec|>", {"type": "const_string", "value": "!"}]],
           "exclude_tokens": ["<|x|>"]}
    a = automaton(fmt, frozenset(NAMES))
    c, s, x = PUA["<|call|>"], PUA["<|sec|>"], PUA["<|x|>"]
    assert a.reads(spelled(f'text {c}"a" more {s}! end')) and a.reads(spelled("plain"))
    assert not a.reads(spelled(f'{c}"z"')) and not a.reads(spelled(f"{s}?")) and not a.reads(spelled(f"a{x}b"))


def test_exclude_token_and_ids_outside_the_vocabulary_are_refused_by_name():
    with pytest.raises(InvalidRequestError, match="'exclude_token'"):
        StructuredOutputParams(structural_tag={"type": "structural_tag", "format": {
            "type": "exclude_token", "exclude_tokens": ["<|x|>"]}})
    by_id = StructuredOutputParams(structural_tag={"type": "structural_tag", "format": {"type": "token", "token": 7}})
    with pytest.raises(Exception, match="token id 7 is not in the tokenizer's vocabulary"):
        compile_automaton(by_id, frozenset())  # (an engine gives an id its text first)


def smollm2_tokenizer():
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 is not installed")
    from pathlib import Path

    from conveyor.tokenizer import Tokenizer

    return Tokenizer.load(Path(path), gguf=True)


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
FILE_TAG = {"type": "structural_tag", "format": {"type": "token_triggered_tags", "trigger_tokens": ["<filename>"],
            "tags": [{"type": "tag", "begin": token("<filename>"), "content": {"type": "json_schema", "json_schema": CITY},
                      "end": token("<gh_stars>")}], "at_least_one": True, "stop_after_first": True}}


@pytest.mark.parametrize("by_id", [False, True], ids=["by text", "by id"])
def test_smollm2s_masks_take_a_special_token_only_where_it_is_named(by_id):
    """SmolLM2's special tokens (`<filename>` is id 6, `<gh_stars>` 7) under a tag they open and
    close, named by their text or their id: the opening token first and nothing else, then the
    JSON's tokens and no special one, the closing token where the JSON is complete, then the end."""
    from conveyor.structured.grammar import GrammarCache

    tok = smollm2_tokenizer()
    size = len(tok.hf)
    cache = GrammarCache(tok.hf, tok.eos_token_ids, size, torch.device("cpu"))
    assert {"<filename>", "<gh_stars>", "<|im_start|>"} <= cache.specials
    tag = json.loads(json.dumps(FILE_TAG).replace('"<filename>"', "6").replace('"<gh_stars>"', "7")) if by_id else FILE_TAG
    grammar = cache.get(StructuredOutputParams(structural_tag=tag))
    with pytest.raises(Exception, match="token id 99999 is not in the tokenizer's vocabulary"):
        cache.get(StructuredOutputParams(structural_tag={"type": "structural_tag", "format": token(99999)}))
    first = grammar.allowed(grammar.START)
    assert first.nonzero().flatten().tolist() == [6]
    state = grammar.advance(grammar.START, 6)
    ids = tok.encode('{"city": "Oslo"}', add_special_tokens=False)
    for t in ids:
        allowed = grammar.allowed(state)
        assert allowed[t] and not allowed[:17].any()  # (ids 0-16 are SmolLM2's special tokens)
        state = grammar.advance(state, t)
    done = grammar.allowed(state)
    ends = sorted(tok.eos_token_ids)
    assert done[7] and not done[ends].any()
    state = grammar.advance(state, 7)
    assert grammar.is_accepting(state) and grammar.allowed(state).nonzero().flatten().tolist() == ends


def test_smollm2_writes_the_special_tokens_a_tag_names(smollm2: str):
    """SmolLM2 greedy under the tag: its output's first token is `<filename>`, its last before
    the end `<gh_stars>`, the JSON between holds to the schema; the text keeps the tokens only
    where special tokens are not skipped."""
    import jsonschema

    from conveyor import LLM, SamplingParams

    llm = LLM(smollm2, kv_cache_memory=64 << 20, max_model_len=512)
    conv = [[{"role": "user", "content": "Name a city, as JSON."}]]
    outs = {}
    for skip in (False, True):
        params = SamplingParams(max_tokens=40, temperature=0, skip_special_tokens=skip,
                                structured_outputs=StructuredOutputParams(structural_tag=FILE_TAG))
        outs[skip] = llm.chat(conv, params, use_tqdm=False)[0].outputs[0]
    kept, skipped = outs[False], outs[True]
    assert kept.finish_reason == "stop" and kept.token_ids[0] == 6 and kept.token_ids[-2:-1] == [7]
    assert kept.token_ids == skipped.token_ids
    assert kept.text.startswith("<filename>") and kept.text.endswith("<gh_stars>")
    jsonschema.validate(json.loads(skipped.text), CITY)
    assert kept.text == f"<filename>{skipped.text}<gh_stars>"


def test_ids_are_given_their_tokens_text_everywhere_a_token_may_be():
    from conveyor.structured.structural_tag import token_ids_as_text

    names = {1: "<|sec|>", 2: "<|call|>", 3: "<|end|>", 4: "<|x|>"}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token_triggered_tags", "trigger_tokens": [1], "exclude_tokens": [4, 99],
         "tags": [{"type": "tag", "begin": token(1), "content": {"type": "any_tokens", "exclude_tokens": [4]},
                   "end": {"type": "token", "token": 3}}]},
        {"type": "token_dispatch", "rules": [[2, {"type": "const_string", "value": "x"}]]},
        {"type": "const_string", "value": "5"}]}}
    out = json.loads(token_ids_as_text(json.dumps(tag), names.get))
    first, dispatch, const = out["format"]["elements"]
    assert first["trigger_tokens"] == ["<|sec|>"] and first["exclude_tokens"] == ["<|x|>", 99]  # (99: refused later)
    assert first["tags"][0]["begin"]["token"] == "<|sec|>" and first["tags"][0]["end"]["token"] == "<|end|>"
    assert first["tags"][0]["content"]["exclude_tokens"] == ["<|x|>"]
    assert dispatch["rules"][0][0] == "<|call|>" and const["value"] == "5"
    assert token_ids_as_text('{"format": {"type": "any_text"}}', names.get) == '{"format": {"type": "any_text"}}'
