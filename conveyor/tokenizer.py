"""Tokenizer access and incremental detokenization.

The tokenizer comes from the model: an HF folder's tokenizer files, or a GGUF file's metadata
(transformers builds a fast tokenizer from it). `IncrementalDetokenizer` turns a growing list
of token ids into text deltas that never split a UTF-8 character, and holds back text that
could still turn into a stop string.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: Seq[int] = ()) -> None:
        self.hf = hf_tokenizer
        ids = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.append(hf_tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(ids)
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def load(cls, path: Path, gguf: bool, eos_token_ids: Seq[int] = ()) -> Tokenizer:
        import transformers
        from transformers import AutoTokenizer

        transformers.logging.set_verbosity_error()
        if not gguf:
            return cls(AutoTokenizer.from_pretrained(str(path)), eos_token_ids)
        # Building a tokenizer from GGUF metadata takes seconds; keep the result on disk,
        # keyed by the file's identity, and load that (a tenth of a second) next time.
        cached = _gguf_tokenizer_cache_dir(path)
        if cached is not None and (cached / "tokenizer_config.json").is_file():
            try:
                return cls(AutoTokenizer.from_pretrained(str(cached)), eos_token_ids)
            except (OSError, ValueError):
                pass  # a damaged cache entry: rebuild below
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if cached is not None:
            with contextlib.suppress(OSError):  # a read-only cache is only slower
                hf.save_pretrained(str(cached))
        return cls(hf, eos_token_ids)

    def stream_decoder(self, context: Seq[int], skip_special_tokens: bool) -> Callable[[int], str | None] | None:
        """A token-at-a-time decoder through the fast tokenizer's own (tokenizers'
        `DecodeStream`, in Rust): `step(id)` returns the text the token completes, or None
        while a character is still cut. None where its text would not be `decode`'s: no
        fast backend, a `tokenizers` without it, or a tokenizer that cleans up spaces."""
        backend = getattr(self.hf, "_tokenizer", None)
        if backend is None or getattr(self.hf, "clean_up_tokenization_spaces", False):
            return None
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:
            return None
        try:
            stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        except TypeError:  # before `ids`: prime it by stepping through the context
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for t in context:
                stream.step(backend, t)

        def step(token_id: int) -> str | None:
            return stream.step(backend, token_id)

        return step

    def writes_as_text(self, text: str) -> bool:
        """Whether `text` encodes to ordinary tokens only (no special token, which a grammar
        admits only where a structural tag's `token` format names it: conveyor/structured/)."""
        special = self._special_ids
        return not any(t in special for t in self.hf.encode(text, add_special_tokens=False))

    def is_special(self, text: str) -> bool:
        """Whether `text` is one special token of this tokenizer (control, not text)."""
        return text in self._special_texts

    @functools.cached_property
    def _special_texts(self) -> frozenset[str]:
        return special_texts(self.hf)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return special_ids(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_pair(self, text: str, text_pair: str) -> list[int]:
        """Two texts as one input, joined by the tokenizer's pair template (a cross-encoder's
        query and document, as HF's `tokenizer(text, text_pair)` writes them)."""
        return list(self.hf.encode(text, text_pair, add_special_tokens=True))

    def word_token_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The token sequences that spell each of `words` (vLLM's bad_words): alone and after
        a space (a word inside a sentence is usually its own, different, token)."""
        out: set[tuple[int, ...]] = set()
        for word in words:
            for prefix in ("", " "):
                ids = tuple(self.encode(prefix + word.lstrip(), add_special_tokens=False))
                if ids:
                    out.add(ids)
        return tuple(sorted(out))

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Seq[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self.hf.chat_template = template

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """The messages rendered by the chat template (`chat_template=` in `kwargs`: this call's
        own) and encoded."""
        if not (kwargs.get("chat_template") or self.chat_template):
            raise ValueError("this model has no chat template; use generate() with a plain prompt, or give one "
                             "(chat_template)")
        text = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        return self.encode(text, add_special_tokens=False)


def load_chat_template(value: str) -> str:
    """A chat template given as its text or as the path of a file holding it (vLLM's
    `--chat-template`); ValueError for a path that names no file."""
    candidate = Path(value).expanduser()
    if "{" not in value and "\n" not in value:
        try:
            return candidate.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"chat_template={value!r}: no such file, and not a Jinja template ({e.strerror})") from None
    return value


def _gguf_tokenizer_cache_dir(path: Path) -> Path | None:
    import hashlib
    import os

    try:
        st = path.stat()
    except OSError:
        return None
    root = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return root / "tokenizers" / key


class IncrementalDetokenizer:
    """Text deltas for a growing token list.

    Emits only text that is complete: a token that ends inside a UTF-8 character adds nothing
    until the next token completes it. With `stop` strings, a tail of the text that is the
    start of a stop string is held back until it can no longer match.

    Two ways, the same text: the fast tokenizer's own incremental decoder
    (`Tokenizer.stream_decoder`, one call into Rust a token: about a fourteenth of the other
    way's time on SmolLM2's tokenizer, and a step streams one token for each of up to hundreds
    of requests); or, where there is none (`stream=False`, or a decoder that fails), two
    decodes of a short window (`prefix_offset .. end`) a token, and a trailing U+FFFD means
    the character is still cut.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Seq[int],
        skip_special_tokens: bool = True,
        stop: Seq[str] = (),
        include_stop_str_in_output: bool = False,
        stream: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])  # a little context so leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)  # the window way: ids up to here are in `text`
        self.text = ""  # all complete output text so far (stop string cut off once found)
        self.emitted = 0  # characters of `text` already handed out
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped_by: str | None = None
        self._step = None
        if stream:
            # The stream's context must not begin inside a character: it would hand the cut
            # bytes out with the first token's text. (The windows way never emits its context.)
            context = self.ids
            while context and "\ufffd" in tokenizer.decode(context, skip_special_tokens):
                context = context[1:]
            self._step = tokenizer.stream_decoder(context, skip_special_tokens)

    def add(self, token_id: int) -> None:
        """Append one token; `self.text` grows by whatever is now complete."""
        if self.stopped_by is not None:
            return
        self.ids.append(token_id)
        if self._step is not None:
            try:
                new = self._step(token_id)
            except Exception:  # tokenizers' "invalid prefix": go on the other way
                self._step = None
                self.prefix_offset = max(0, self.read_offset - 6)
            else:
                if new is not None:
                    self.read_offset = len(self.ids)
                    self._extend(new)
                return
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._extend(full[len(prefix) :])

    def _extend(self, new: str) -> None:
        start = max(0, len(self.text) - self.hold - 1)
        self.text += new
        if self.stop:
            self._check_stop(start)

    def _check_stop(self, search_from: int) -> None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stopped_by = s

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out; holds back a possible stop-string prefix unless `final`."""
        end = len(self.text)
        if not final and self.stopped_by is None and self.stop:
            end = max(self.emitted, end - self._partial_stop_len())
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


def special_ids(hf_tokenizer: Any) -> frozenset[int]:
    """The ids of an HF tokenizer's special tokens (control, not text)."""
    added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(hf_tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def special_texts(hf_tokenizer: Any) -> frozenset[str]:
    """The texts of an HF tokenizer's special tokens."""
    return frozenset(t for t in hf_tokenizer.convert_ids_to_tokens(sorted(special_ids(hf_tokenizer))) if t)
