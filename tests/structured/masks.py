"""A random walk through a DFA grammar's states, each state's token mask checked against walking
every token's bytes: the end where the state accepts, a token where its bytes stay alive."""

from __future__ import annotations

import random

import torch

from conveyor.structured.grammar import Grammar, TokenVocab
from conveyor.structured.regex import ByteDFA

EOS = 0


def walk_checking_masks(automaton: ByteDFA, vocab_bytes: list[bytes | None], rng: random.Random, steps: int = 30) -> None:
    """`vocab_bytes[0]` is the end token (None); the walk takes random allowed tokens, never the
    end, until only the end is left."""
    assert isinstance(automaton, ByteDFA)
    grammar = Grammar(automaton, TokenVocab(vocab_bytes, [EOS], len(vocab_bytes)), torch.device("cpu"))
    state = 1
    for _ in range(steps):
        allowed = grammar.allowed(state)
        for t, data in enumerate(vocab_bytes):
            want = bool(automaton.accepting[state]) if t == EOS else bool(data) and automaton.walk(state, data) != 0
            assert bool(allowed[t]) == want, (state, t, data)
        ids = [i for i in allowed.nonzero().flatten().tolist() if i != EOS]
        if not ids:
            return
        state = grammar.advance(state, rng.choice(ids))
        assert state != 0
