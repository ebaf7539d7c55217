"""A grammar's automaton against a vocabulary: which tokens each state allows, and where each
leads.

Each token is the byte string it adds to the output (`token_bytes`); a token is allowed in a
state when walking its bytes does not reach the dead state, and an end-of-sequence token
when the state accepts. Masks are computed the first time a state is met, for the whole
vocabulary at once: the tokens, sorted by length, walk the DFA's table one byte column at a
time (numpy), so a state costs about the vocabulary's total bytes in gathers. Masks are kept
per grammar and state, grammars per engine (`GrammarCache`).

A context-free grammar (`PushdownGrammar`) stands in a set of stacks of (rule, DFA state)
frames. The tokens its top frames take without returning below themselves are the same
whatever lies beneath, so they are computed once per (rule, state) by the same vectorized
walk; only the few tokens that pass a return or a call mid-token (`"},` inside a nested
object) are walked exactly against the stacks, byte by byte.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from conveyor.structured import GrammarError, compile_automaton
from conveyor.structured.cfg import DEAD, Config, Pushdown
from conveyor.structured.compile_worker import DFACompiler
from conveyor.structured.regex import SPECIAL_CLOSE, SPECIAL_OPEN, ByteDFA, special_token
from conveyor.structured.structural_tag import token_ids_as_text
from conveyor.tokenizer import special_ids, special_texts


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_bytes(hf_tokenizer: Any) -> list[bytes | None]:
    """Each token id's bytes in decoded text; for a special token (control, not text) the
    bytes no text spells that a grammar naming it reads (`regex.special_token`); None for a
    token no grammar can take (one of raw bytes that are never UTF-8's, such as those).

    Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM2) spell bytes with stand-in
    characters; SentencePiece ones use '▁' for a space and '<0xHH>' for raw bytes."""
    import json

    size = len(hf_tokenizer)
    pieces = hf_tokenizer.convert_ids_to_tokens(list(range(size)))
    special = special_ids(hf_tokenizer)
    added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    byte_level = _is_byte_level(decoder)
    table = _byte_level_decoder()
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if piece is None:
            out.append(None)
        elif i in special:
            out.append(special_token(piece))
        elif i in added:
            out.append(piece.encode("utf-8"))
        elif byte_level:
            try:
                out.append(bytes(table[c] for c in piece))
            except KeyError:
                out.append(piece.encode("utf-8"))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("▁", " ").encode("utf-8"))
    return [None if i not in special and b and (SPECIAL_OPEN in b or SPECIAL_CLOSE in b) else b
            for i, b in enumerate(out)]


def _is_byte_level(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(d) for d in decoder.get("decoders", []) or [])


class TokenVocab:
    """The vocabulary as bytes, laid out for the vectorized walk; `size` is the model's
    vocabulary (its logits' width), which may exceed the tokenizer's."""

    def __init__(self, tokens: Sequence[bytes | None], eos_token_ids: Iterable[int], size: int) -> None:
        self.size = size
        self.eos_token_ids = sorted(t for t in eos_token_ids if 0 <= t < size)
        ends = set(self.eos_token_ids)  # (allowed where the grammar may end, not as bytes)
        self.tokens = [None if i in ends else b for i, b in enumerate(list(tokens)[:size])]
        ids = [i for i, b in enumerate(self.tokens) if b]
        ids.sort(key=lambda i: -len(self.tokens[i] or b""))
        self.ids = np.array(ids, dtype=np.int64)
        lengths = [len(self.tokens[i] or b"") for i in ids]
        width = lengths[0] if lengths else 0
        self.bytes = np.full((len(ids), width), 256, dtype=np.int64)  # 256: past a token's end
        for row, i in enumerate(ids):
            data = self.tokens[i] or b""
            self.bytes[row, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        # How many tokens (a prefix, longest first) are longer than j bytes, for each j.
        self.longer_than = np.searchsorted(-np.array(lengths), -np.arange(width), side="left")

    @staticmethod
    def walk_table(table: np.ndarray) -> np.ndarray:
        """A DFA's byte table for `walk`: a column 256 (past a token's end) that stays put."""
        return np.concatenate([table[:, :256], np.arange(table.shape[0], dtype=table.dtype)[:, None]], axis=1)

    def walk(self, table: np.ndarray, state: int, leaves: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every token's bytes walked from `state` at once (`table` from `walk_table`): the
        state each ends in, by row of `ids` (0: dead), and whether it passed, after its
        first byte and before its last, a state that `leaves` marks."""
        cur = np.full(len(self.ids), state, dtype=table.dtype)
        passed = np.zeros(len(self.ids), dtype=bool)
        for j, n in enumerate(self.longer_than.tolist()):
            if j and leaves is not None:
                passed[:n] |= leaves[cur[:n]]
            cur[:n] = table[cur[:n], self.bytes[:n, j]]
        return cur, passed


class Grammar:
    """One compiled grammar. `allowed(state)` is a bool tensor over the vocabulary (on
    `device`); `advance(state, token)` is the state after a token (0 once it cannot match)."""

    START = 1

    def __init__(self, dfa: ByteDFA, vocab: TokenVocab, device: torch.device) -> None:
        self.dfa = dfa
        self.vocab = vocab
        self.device = device
        self._rows = dfa.table.tolist()  # a Python walk per sampled token: lists beat numpy scalars
        self._walk = vocab.walk_table(dfa.table)
        self._eos = frozenset(vocab.eos_token_ids)
        self._masks: dict[int, torch.Tensor] = {}
        self._ends: set[int] = set()  # states whose mask allows only the end

    def advance(self, state: int, token: int) -> int:
        if token in self._eos:
            return state  # an end the scheduler did not take (min_tokens): text is unchanged
        data = self.vocab.tokens[token] if 0 <= token < len(self.vocab.tokens) else None
        if not data or not state:
            return 0
        rows = self._rows
        for b in data:
            state = rows[state][b]
            if not state:
                return 0
        return state

    def is_accepting(self, state: int) -> bool:
        return bool(self.dfa.accepting[state])

    def allowed(self, state: int) -> torch.Tensor:
        mask = self._masks.get(state)
        if mask is None:
            mask = self._masks[state] = self._compute(state)
        return mask

    def ends_only(self, state: int) -> bool:
        """Whether the end is the one token `allowed(state)` allows (the output is complete):
        min_tokens then does not hold the end back, there being nothing else to draw."""
        self.allowed(state)
        return state in self._ends

    def _compute(self, state: int) -> torch.Tensor:
        vocab = self.vocab
        mask = np.zeros(vocab.size, dtype=bool)
        if state:
            cur, _ = vocab.walk(self._walk, state)
            mask[vocab.ids[cur != 0]] = True
            if self.dfa.accepting[state]:
                mask[vocab.eos_token_ids] = True
        if _finish(mask, vocab):
            self._ends.add(state)
        return torch.from_numpy(mask).to(self.device)


def _finish(mask: np.ndarray, vocab: TokenVocab) -> bool:
    """Allow the end where nothing can continue the text (a token outside the grammar came
    first); whether the end is all the mask allows."""
    if not mask.any():
        mask[vocab.eos_token_ids] = True
    return bool(mask.sum() == np.count_nonzero(mask[vocab.eos_token_ids]))


class PushdownGrammar:
    """A compiled context-free grammar, with `Grammar`'s interface over `Config` states."""

    mask_capacity = 256  # masks kept (LRU): a context-free grammar's states do not end
    step_capacity = 200_000  # (state, byte) steps kept, then forgotten all at once

    def __init__(self, pda: Pushdown, vocab: TokenVocab, device: torch.device) -> None:
        self.pda = pda
        self.vocab = vocab
        self.device = device
        # For the vectorized walk, as Grammar's; a frame may leave its rule (call or return)
        # in a state with calls or that accepts.
        self._walk = [vocab.walk_table(t) for t in pda.tables]
        self._leaves = [
            np.array([bool(c) for c in calls], dtype=bool) | acc for calls, acc in zip(pda.calls, pda.accepting, strict=True)
        ]
        self._eos = frozenset(vocab.eos_token_ids)
        self.START = pda.start()
        self._steps: dict[tuple[Config, int], Config] = {}
        self._tokens: dict[tuple[Config, int], Config] = {}
        self._masks: OrderedDict[Config, torch.Tensor] = OrderedDict()
        self._ends: set[Config] = set()
        self._nodes: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _step(self, state: Config, b: int) -> Config:
        key = (state, b)
        nxt = self._steps.get(key)
        if nxt is None:
            nxt = self.pda.step(state, b)
            if len(self._steps) >= self.step_capacity:
                self._steps.clear()
            self._steps[key] = nxt
        return nxt

    def _read(self, state: Config, data: bytes) -> Config:
        for b in data:
            state = self._step(state, b)
            if not state:
                break
        return state

    def advance(self, state: Config, token: int) -> Config:
        if token in self._eos:
            return state  # an end the scheduler did not take (min_tokens): text is unchanged
        key = (state, token)
        nxt = self._tokens.get(key)
        if nxt is None:
            data = self.vocab.tokens[token] if 0 <= token < len(self.vocab.tokens) else None
            nxt = self._read(state, data) if data and state else DEAD
            if len(self._tokens) >= self.step_capacity:
                self._tokens.clear()
            self._tokens[key] = nxt
        return nxt

    def is_accepting(self, state: Config) -> bool:
        return state.accepting

    def allowed(self, state: Config) -> torch.Tensor:
        mask = self._masks.get(state)
        if mask is None:
            mask = self._masks[state] = self._compute(state)
            if len(self._masks) > self.mask_capacity:
                self._ends.discard(self._masks.popitem(last=False)[0])
        else:
            self._masks.move_to_end(state)
        return mask

    def ends_only(self, state: Config) -> bool:
        self.allowed(state)
        return state in self._ends

    def _compute(self, state: Config) -> torch.Tensor:
        vocab = self.vocab
        mask = np.zeros(vocab.size, dtype=bool)
        unsure = []
        for r, s in {(r, s) for r, s, _ in state.tops}:
            takes, maybe = self._node(r, s)
            mask |= takes
            unsure.append(maybe)
        if unsure:
            candidates = np.unique(np.concatenate(unsure))
            for t in candidates[~mask[candidates]].tolist():
                data = vocab.tokens[t]
                if data and self._read(state, data):
                    mask[t] = True
        if state.accepting:
            mask[vocab.eos_token_ids] = True
        if _finish(mask, vocab):
            self._ends.add(state)
        return torch.from_numpy(mask).to(self.device)

    def _node(self, r: int, s: int) -> tuple[np.ndarray, np.ndarray]:
        """The tokens a frame of rule r in state s reads whole within its rule (allowed
        whatever is beneath), and those that die after passing a state where the frame could
        call or return (to walk exactly)."""
        node = self._nodes.get((r, s))
        if node is None:
            vocab = self.vocab
            cur, passed = vocab.walk(self._walk[r], s, self._leaves[r])
            takes = np.zeros(vocab.size, dtype=bool)
            takes[vocab.ids[cur != 0]] = True
            node = self._nodes[(r, s)] = (takes, vocab.ids[(cur == 0) & passed])
        return node


class GrammarCache:
    """An engine's grammars, compiled once per distinct request grammar (`params.key`), the
    `capacity` most recently used kept. Safe to use from two threads (the engine process
    compiles new grammars in a worker while its loop reads compiled ones); a grammar is
    compiled outside the lock."""

    capacity = 64

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], vocab_size: int, device: torch.device) -> None:
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._vocab_size = vocab_size
        self.device = device
        self._vocab: TokenVocab | None = None
        self._specials: frozenset[str] | None = None
        self._grammars: dict[tuple[str, object], Grammar | PushdownGrammar] = {}
        self._lock = threading.Lock()
        # Where DFAs are compiled: here (None), or a worker process (`compile_worker`).
        self.compiler: DFACompiler | None = None

    @property
    def vocab(self) -> TokenVocab:
        if self._vocab is None:
            self._vocab = TokenVocab(token_bytes(self._tokenizer), self._eos, self._vocab_size)
        return self._vocab

    def token_text(self, token_id: int) -> str | None:
        """A token's text (a special token's too), or None for an id outside the vocabulary."""
        if not 0 <= token_id < len(self._tokenizer):
            return None
        return str(self._tokenizer.decode([token_id], skip_special_tokens=False)) or None

    @property
    def specials(self) -> frozenset[str]:
        """The texts of the tokenizer's special tokens (a structural tag's `token` formats)."""
        if self._specials is None:
            self._specials = special_texts(self._tokenizer)
        return self._specials

    def compile_in_worker(self) -> None:
        """From now on, compile DFAs in a worker process (`compile_worker`), started on the
        first compile: a caller in another thread than the engine's loop then shares no GIL
        with it while a grammar compiles."""
        with self._lock:
            if self.compiler is None:
                self.compiler = DFACompiler()

    def cached(self, params: Any) -> bool:
        with self._lock:
            return params.key in self._grammars

    def get(self, params: Any) -> Grammar | PushdownGrammar:
        """The grammar of a `StructuredOutputParams`; raises GrammarError."""
        key = params.key
        with self._lock:
            known = self._grammars.pop(key, None)
            if known is not None:
                self._grammars[key] = known  # the most recently used now
                return known
        if not self.vocab.eos_token_ids:
            raise GrammarError("the model has no end-of-sequence token to end a structured output with")
        specials = self.specials
        if getattr(params, "structural_tag", None) is not None:  # tokens given by id: by their text
            text = token_ids_as_text(params.structural_tag, self.token_text)
            if text != params.structural_tag:
                params = dataclasses.replace(params, structural_tag=text)
        automaton = (self.compiler.compile(params, specials) if self.compiler is not None
                     else compile_automaton(params, specials))
        grammar: Grammar | PushdownGrammar
        if isinstance(automaton, Pushdown):
            grammar = PushdownGrammar(automaton, self.vocab, self.device)
        else:
            grammar = Grammar(automaton, self.vocab, self.device)
        with self._lock:
            if key not in self._grammars and len(self._grammars) >= self.capacity:
                self._grammars.pop(next(iter(self._grammars)))  # the least recently used (its requests hold it)
            self._grammars[key] = grammar
        return grammar
