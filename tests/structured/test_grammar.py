"""Token masks against walking each token's bytes one by one, and each vocabulary's bytes
against its tokenizer's own decoding."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.sampling_params import StructuredOutputParams
from conveyor.structured.grammar import Grammar, GrammarCache, TokenVocab, token_bytes
from conveyor.structured.regex import compile_dfa, parse
from tests.conftest import smollm2_path

EOS = 0
PATTERNS = [r"(cat|dog)s? [0-9]{1,3}", r"[^\"\\]{0,5}\"", r"é+|中文", r"\{\"a\": (true|false)\}", r"x*"]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(PATTERNS),
    st.lists(st.binary(min_size=1, max_size=5).filter(lambda b: b != b"\x00"), min_size=1, max_size=120),
    st.randoms(use_true_random=False),
)
def test_a_mask_allows_exactly_the_tokens_whose_bytes_stay_alive(pattern, tokens, rng):
    # Single bytes make every live state continuable, as in a byte-level vocabulary.
    vocab_bytes = [None, *tokens, *(bytes([b]) for b in b"catdogs 0123{}\":aefrulx\xa9\xc3\xe4\xb8\xad\xe6\x96\x87")]
    vocab = TokenVocab(vocab_bytes, [EOS], len(vocab_bytes) + 3)  # logits wider than the vocabulary
    dfa = compile_dfa(parse(pattern))
    grammar = Grammar(dfa, vocab, torch.device("cpu"))
    states = {1}
    for _ in range(20):  # states reached by random allowed tokens
        state = rng.choice(sorted(states))
        allowed = grammar.allowed(state)
        assert allowed.shape == (vocab.size,)
        for t in range(vocab.size):
            data = vocab_bytes[t] if t < len(vocab_bytes) else None
            want = bool(data) and dfa.walk(state, data) != 0
            if t == EOS:
                want = bool(dfa.accepting[state])
            assert bool(allowed[t]) == want, (pattern, state, t, data)
        ids = allowed.nonzero().flatten().tolist()
        nxt = grammar.advance(state, rng.choice(ids))
        assert nxt != 0
        states.add(nxt)
    assert grammar.advance(1, EOS) == 1, "an end the scheduler ignores leaves the text as it was"


def test_a_state_with_nothing_left_allows_only_the_end():
    vocab = TokenVocab([None, b"a", b"b"], [EOS], 3)
    grammar = Grammar(compile_dfa(parse("a")), vocab, torch.device("cpu"))
    assert grammar.allowed(1).tolist() == [False, True, False]
    done = grammar.advance(1, 1)
    assert grammar.allowed(done).tolist() == [True, False, False]
    assert grammar.advance(1, 2) == 0 and grammar.allowed(0).tolist() == [True, False, False]


def roundtrip(hf, texts):
    pieces = token_bytes(hf)
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False)
        assert b"".join(pieces[i] for i in ids) == text.encode("utf-8"), text
    from conveyor.structured.regex import special_token

    # a special token reads as bytes no text spells, and no other token holds those bytes
    special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert all(pieces[i] == special_token(hf.convert_ids_to_tokens(i)) for i in special)
    assert not any(b and (0xF8 in b or 0xF9 in b) for i, b in enumerate(pieces) if i not in special)
    return pieces


TEXTS = ["Hello, world!", '{"name": "Zoë", "n": [1, 2]}', "  spaces\tand\nnewlines  ", "中文 and émoji 😀", "x" * 40]


def test_a_byte_level_vocabulary_spells_its_texts(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    from tests.structured.tiny_tokenizer import with_tokenizer

    hf = AutoTokenizer.from_pretrained(str(with_tokenizer(tiny_models["llama"], tmp_path / "m")))
    roundtrip(hf, TEXTS)


def test_smollm2s_vocabulary_spells_its_texts_and_masks_follow_them():
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 is not installed")
    from conveyor.tokenizer import Tokenizer

    tok = Tokenizer.load(Path(path), gguf=True)
    pieces = roundtrip(tok.hf, TEXTS)
    cache = GrammarCache(tok.hf, tok.eos_token_ids, len(pieces), torch.device("cpu"))
    grammar = cache.get(StructuredOutputParams(regex=r"\{\"answer\": \"[^\"]{0,20}\"\}"))
    ids = tok.encode('{"answer": "forty two"}', add_special_tokens=False)
    state = grammar.START
    for t in ids:  # the tokenizer's own spelling of a match is allowed token by token
        assert grammar.allowed(state)[t]
        state = grammar.advance(state, t)
    assert grammar.is_accepting(state) and all(grammar.allowed(state)[e] for e in tok.eos_token_ids)
    assert cache.get(StructuredOutputParams(regex=r"\{\"answer\": \"[^\"]{0,20}\"\}")) is grammar
    rng = random.Random(0)
    assert not grammar.allowed(grammar.START)[rng.choice(tok.encode("hello", add_special_tokens=False))]
