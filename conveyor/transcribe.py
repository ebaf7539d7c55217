"""Transcription with Whisper: a clip's 30-second windows, Whisper's decoder prompts, its own guess
of the language, shared by `LLM.transcribe`, `conveyor transcribe` and the HTTP audio APIs
(conveyor/server/transcription.py).

A clip is read at 16 kHz and cut into 30-second windows (a last sliver under 20 ms dropped), each
one decoder request: `<|startofprev|>` and the prompt's tokens (at most half the decoder's
positions, Whisper's rule) where a prompt is given, then `<|startoftranscript|>`, the language
token, the task's (`<|transcribe|>` or `<|translate|>`) and `<|notimestamps|>`. All windows go to
the engine at once, so it batches them; their texts are joined in order. Where no language is
given, it is Whisper's own guess: the language token the decoder finds most likely right after
`<|startoftranscript|>` on the first window (one step, its choice kept to the language tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from conveyor.audio import Audio, as_audio, load_audio
from conveyor.multimodal import ImagePrompt, Pixels
from conveyor.sampling_params import InvalidRequestError, SamplingParams

WINDOW_S = 30
LANGUAGE = re.compile(r"<\|[a-z]{2,3}\|>")  # (Whisper's language tokens: <|en|>, <|haw|>, <|yue|>)
TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str
    seconds: float  # the clip's length


@dataclass
class Transcriber:
    """What a Whisper engine's front needs to transcribe: its tokenizer's special tokens, its
    feature extractor (`ImageProcessor.audio_features`) and the decoder's length."""

    tokenizer: Any
    processor: Any
    max_model_len: int
    sot: int

    @classmethod
    def of(cls, tokenizer: Any, processor: Any, max_model_len: int) -> Transcriber:
        """InvalidRequestError where the model is not Whisper (no `<|startoftranscript|>`)."""
        sot = None if tokenizer is None else token_id(tokenizer, "<|startoftranscript|>")
        if sot is None or processor is None or processor.audio_features is None:
            raise InvalidRequestError("this model does not transcribe audio (Whisper does)", param="model")
        return cls(tokenizer, processor, max_model_len, sot)

    def language_id(self, language: str) -> int:
        found = token_id(self.tokenizer, f"<|{language}|>")
        if found is None or not LANGUAGE.fullmatch(f"<|{language}|>"):
            raise InvalidRequestError(f"language {language!r} is not one this model knows (an ISO-639-1 code, "
                                      "e.g. 'en')", param="language")
        return found

    def languages(self) -> dict[int, str]:
        """The tokenizer's language tokens: id -> code."""
        return {i: t[2:-2] for t, i in self.tokenizer.hf.get_vocab().items() if LANGUAGE.fullmatch(t)}

    def before(self, prompt: str | None) -> list[int]:
        """`<|startofprev|>` and the prompt's tokens, at most half the decoder's positions."""
        if not prompt:
            return []
        prev = token_id(self.tokenizer, "<|startofprev|>")
        if prev is None:
            raise InvalidRequestError("this model's tokenizer has no <|startofprev|> for a prompt", param="prompt")
        ids = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
        return [prev, *ids[-(self.max_model_len // 2 - 1) :]]

    def head(self, before: list[int], language: int, task: str) -> list[int]:
        if task not in TASKS:
            raise InvalidRequestError(f"task is one of {list(TASKS)}, not {task!r}", param="task")
        marks = [token_id(self.tokenizer, f"<|{task}|>"), token_id(self.tokenizer, "<|notimestamps|>")]
        if None in marks:
            raise InvalidRequestError(f"this model's tokenizer lacks Whisper's task tokens for {task!r}", param="model")
        head = [*before, self.sot, language, *(m for m in marks if m is not None)]
        if len(head) >= self.max_model_len:
            raise InvalidRequestError("the prompt leaves the decoder no room to write", param="prompt")
        return head

    def check(self, before: list[int], task: str, temperature: float) -> None:
        """InvalidRequestError for a bad task, a prompt that leaves no room, or a temperature
        out of range: before the clip is read."""
        self.params(self.head(before, self.sot, task), temperature)  # (the start token stands for the language)

    def windows(self, audio: Any) -> tuple[list[Pixels], float]:
        """The clip's 30-second windows as Whisper's features, and the clip's seconds."""
        features = self.processor.audio_features
        rate = features.sampling_rate
        samples = load_audio(as_audio(audio), rate, domains=self.processor.allowed_media_domains)
        step = WINDOW_S * rate
        out: list[Pixels] = []
        for start in range(0, max(1, len(samples)), step):
            part = samples[start : start + step]
            if len(part) > 2 * features.hop_length or not out:  # (a last sliver of under 20 ms adds nothing)
                out.append(self.processor.audio(Audio(part, rate), whole=True))
        return out, len(samples) / rate

    def detect_request(self, first: Pixels) -> tuple[ImagePrompt, SamplingParams]:
        """The one-step request whose token is Whisper's guess of the language."""
        names = self.languages()
        if not names:
            raise InvalidRequestError("this model's tokenizer has no language tokens: give the language",
                                      param="language")
        return (ImagePrompt([self.sot], (first,)),
                SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=tuple(sorted(names))))

    def params(self, head: list[int], temperature: float) -> SamplingParams:
        if not 0.0 <= temperature <= 1.0:
            raise InvalidRequestError(f"temperature is a number from 0 to 1, not {temperature}", param="temperature")
        return SamplingParams(max_tokens=self.max_model_len - len(head), temperature=temperature,
                              skip_special_tokens=True)


def join(texts: list[str]) -> str:
    """The windows' texts as one."""
    return " ".join(t.strip() for t in texts if t.strip())


def token_id(tokenizer: Any, text: str) -> int | None:
    """A special token's id; None where the tokenizer has no such token."""
    hf = tokenizer.hf
    i = hf.convert_tokens_to_ids(text)
    return None if i is None or i == hf.unk_token_id else int(i)
