"""Transcription with Whisper: a clip's windows of at most 30 seconds, Whisper's decoder prompts
and decoding rules, its own guess of the language, its timestamps as segments; shared by
`LLM.transcribe`, `conveyor transcribe` and the HTTP audio APIs (conveyor/server/transcription.py).

A clip is read at 16 kHz and cut into windows of at most 30 seconds; where more than 30 seconds
are left, the cut falls in the middle of the quietest tenth of a second of the window's last
second (the least energy; a word is seldom cut, where a cut every 30 s would). Each window
is one decoder request: `<|startofprev|>` and the prompt's tokens (at most half the decoder's
positions, Whisper's rule) where a prompt is given, then `<|startoftranscript|>`, the language
token, the task's (`<|transcribe|>` or `<|translate|>`) and `<|notimestamps|>` where no
timestamps are asked. Every request carries the checkpoint's decoding rules (`WhisperRules`,
from generation_config.json: its suppressed tokens, those not drawn first; with timestamps,
OpenAI's timestamp rules). All windows go to the engine at once, so it batches them; their texts
are joined in order. Where no language is given, it is Whisper's own guess: the language token
the decoder finds most likely right after `<|startoftranscript|>` on the first window (one step,
its choice kept to the language tokens).

With timestamps, a window's output is segments between timestamp tokens (20 ms apart, counted
from the window's start): a segment's start is the timestamp before its text, its end the one
after; text left open at the window's end ends with the window. Each window's segments carry
OpenAI's scores of the window: `avg_logprob` (its tokens' logprobs after the rules, the end's
included, over the tokens before the end plus one, as OpenAI's whisper does),
`compression_ratio` (its text's bytes over their zlib-compressed bytes) and `no_speech_prob` (the
probability of `<|nospeech|>` right after `<|startoftranscript|>`, from a one-step request beside
the window's).

A temperature of 0 is OpenAI's fallback: each window is decoded greedily, and one whose text
compresses more than 2.4 times (a loop) or whose average logprob is under -1 (unsure) is decoded
again at 0.2, then 0.4 ... 1.0 until one passes, unless its no-speech probability is over 0.6
(silence, where no text is right); the last is kept whatever its scores (`Job`). Only the windows
that fail go round again, together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.audio import Audio, as_audio, load_audio
from conveyor.multimodal import ImagePrompt, Pixels
from conveyor.sampling_params import InvalidRequestError, SamplingParams, WhisperRules

WINDOW_S = 30
SEARCH_S = 1.0  # where a cut may fall: the window's last second ...
QUIET_S = 0.1  # ... at the middle of its quietest tenth
STEP_S = 0.02  # (a timestamp token's step: <|0.00|>, <|0.02|> ...)
TIMESTAMPS = 1501  # (<|0.00|> .. <|30.00|>)
LANGUAGE = re.compile(r"<\|[a-z]{2,3}\|>")  # (Whisper's language tokens: <|en|>, <|haw|>, <|yue|>)
TASKS = ("transcribe", "translate")
# OpenAI's fallback: a window decoded again at the next temperature where its text compresses
# more than COMPRESSION_MAX times or its average logprob is under LOGPROB_MIN, unless its
# no-speech probability is over NO_SPEECH_MAX
FALLBACK = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
# The sampling parameters a transcription takes besides its temperature and seed (vLLM's
# transcription request's): each window's request carries them
SAMPLING = ("top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "max_tokens")
COMPRESSION_MAX, LOGPROB_MIN, NO_SPEECH_MAX = 2.4, -1.0, 0.6
NO_SPEECH = ("<|nospeech|>", "<|nocaptions|>")  # (large-v3's name, then the earlier models')
# Whisper's languages by code, as OpenAI's verbose_json names them
_NAMES = (
    "en:english zh:chinese de:german es:spanish ru:russian ko:korean fr:french ja:japanese pt:portuguese "
    "tr:turkish pl:polish ca:catalan nl:dutch ar:arabic sv:swedish it:italian id:indonesian hi:hindi "
    "fi:finnish vi:vietnamese he:hebrew uk:ukrainian el:greek ms:malay cs:czech ro:romanian da:danish "
    "hu:hungarian ta:tamil no:norwegian th:thai ur:urdu hr:croatian bg:bulgarian lt:lithuanian la:latin "
    "mi:maori ml:malayalam cy:welsh sk:slovak te:telugu fa:persian lv:latvian bn:bengali sr:serbian "
    "az:azerbaijani sl:slovenian kn:kannada et:estonian mk:macedonian br:breton eu:basque is:icelandic "
    "hy:armenian ne:nepali mn:mongolian bs:bosnian kk:kazakh sq:albanian sw:swahili gl:galician mr:marathi "
    "pa:punjabi si:sinhala km:khmer sn:shona yo:yoruba so:somali af:afrikaans oc:occitan ka:georgian "
    "be:belarusian tg:tajik sd:sindhi gu:gujarati am:amharic yi:yiddish lo:lao uz:uzbek fo:faroese "
    "ht:haitian_creole ps:pashto tk:turkmen nn:nynorsk mt:maltese sa:sanskrit lb:luxembourgish my:myanmar "
    "bo:tibetan tl:tagalog mg:malagasy as:assamese tt:tatar haw:hawaiian ln:lingala ha:hausa ba:bashkir "
    "jw:javanese su:sundanese yue:cantonese")
LANGUAGE_NAMES = dict(pair.split(":") for pair in _NAMES.split())


@dataclass(frozen=True)
class Segment:
    """A stretch of a clip's speech between two timestamps (OpenAI's verbose_json segment);
    `seek` is its window's start in 10-ms feature frames; the scores are its window's."""

    id: int
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    seek: int
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


@dataclass(frozen=True)
class TimedWord:
    """A word and where it is said (seconds into the clip; OpenAI's verbose_json word)."""

    word: str
    start: float
    end: float


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str
    seconds: float  # the clip's length
    segments: tuple[Segment, ...] = ()  # (with timestamps)
    words: tuple[TimedWord, ...] = ()  # (with word timestamps)


@dataclass(frozen=True)
class Window:
    start: float  # seconds into its clip
    end: float
    features: Pixels


@dataclass(frozen=True)
class Decoding:
    """A Whisper checkpoint's decoding rules (`WhisperRules`, without timestamps) and the id of
    its first timestamp token (None: it has none), its engine's `ImageProcessor.whisper`."""

    rules: WhisperRules
    timestamp_begin: int | None
    heads: tuple[tuple[int, int], ...] = ()  # (the alignment heads: (decoder layer, head))

    @classmethod
    def read(cls, folder: Path | None, vocab_size: int, tokenizer: Any, layers: int = 0, heads: int = 0
             ) -> Decoding:
        """From generation_config.json (nothing where there is none): its `suppress_tokens`,
        `begin_suppress_tokens`, `max_initial_timestamp_index` (OpenAI's 50, one second, where
        not given), end of text and `alignment_heads` (where not given, OpenAI's: every head of
        the decoder's second half of `layers`), ids past the vocabulary left out; the
        timestamps follow `<|notimestamps|>` where the vocabulary holds all 1501."""
        cfg: dict[str, Any] = {}
        if folder is not None and (folder / "generation_config.json").is_file():
            try:
                cfg = json.loads((folder / "generation_config.json").read_text())
            except (OSError, json.JSONDecodeError):
                cfg = {}

        def ids(key: str) -> tuple[int, ...]:
            return tuple(int(t) for t in cfg.get(key) or () if 0 <= int(t) < vocab_size)

        initial = cfg.get("max_initial_timestamp_index", 50)
        end = cfg.get("eos_token_id", None if tokenizer is None else tokenizer.hf.eos_token_id)
        end = end[0] if isinstance(end, list) else end
        none = None if tokenizer is None else token_id(tokenizer, "<|notimestamps|>")
        begin = none + 1 if none is not None and none + TIMESTAMPS < vocab_size else None
        rules = WhisperRules(suppress=ids("suppress_tokens"), begin_suppress=ids("begin_suppress_tokens"),
                             end=int(end or 0), max_initial_timestamp=None if initial is None else int(initial))
        given = cfg.get("alignment_heads")
        alignment = (tuple((int(a), int(b)) for a, b in given) if given else
                     tuple((layer, h) for layer in range(layers // 2, layers) for h in range(heads)))
        return cls(rules, begin, alignment)


@dataclass
class Transcriber:
    """What a Whisper engine's front needs to transcribe: its tokenizer's special tokens, its
    feature extractor and decoding rules (`ImageProcessor.audio_features`, `.whisper`) and the
    decoder's length."""

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

    def rules(self, timestamps: bool) -> WhisperRules:
        """The checkpoint's decoding rules; with timestamps, those of its timestamp tokens:
        InvalidRequestError where it has none."""
        decoding: Decoding | None = getattr(self.processor, "whisper", None)
        if decoding is None:
            decoding = Decoding(WhisperRules(), None)
        if not timestamps:
            return decoding.rules
        if decoding.timestamp_begin is None:
            raise InvalidRequestError("this model has no timestamp tokens", param="timestamp_granularities")
        return dataclasses.replace(decoding.rules, timestamp_begin=decoding.timestamp_begin)

    def head(self, before: list[int], language: int, task: str, timestamps: bool = False) -> list[int]:
        if task not in TASKS:
            raise InvalidRequestError(f"task is one of {list(TASKS)}, not {task!r}", param="task")
        marks = [token_id(self.tokenizer, f"<|{task}|>")]
        if not timestamps:
            marks.append(token_id(self.tokenizer, "<|notimestamps|>"))
        if None in marks:
            raise InvalidRequestError(f"this model's tokenizer lacks Whisper's task tokens for {task!r}", param="model")
        head = [*before, self.sot, language, *(m for m in marks if m is not None)]
        if len(head) >= self.max_model_len:
            raise InvalidRequestError("the prompt leaves the decoder no room to write", param="prompt")
        return head

    def check(self, before: list[int], task: str, temperature: float | tuple[float, ...], timestamps: bool = False,
              words: bool = False, sampling: dict[str, Any] | None = None) -> tuple[float, ...]:
        """The temperatures to decode at (`temperatures`); InvalidRequestError for a bad task, a
        prompt that leaves no room, a temperature out of range, sampling parameters that are not
        `SAMPLING`'s or out of range, or timestamps (or alignment heads, for words) the model
        has not: before the clip is read."""
        for name in sampling or {}:
            if name not in SAMPLING:
                raise InvalidRequestError(f"{name}: a transcription takes {', '.join(SAMPLING)} (and temperature, "
                                          "seed)", param=name)
        SamplingParams(**(sampling or {}))  # (their ranges: InvalidRequestError naming one)
        self.head(before, self.sot, task, timestamps)  # (the start token stands for the language)
        self.rules(timestamps)
        decoding: Decoding | None = getattr(self.processor, "whisper", None)
        if words and (decoding is None or not decoding.heads):
            raise InvalidRequestError("this model names no alignment heads for word timestamps",
                                      param="timestamp_granularities")
        return self.temperatures(temperature)

    def temperatures(self, temperature: float | tuple[float, ...]) -> tuple[float, ...]:
        """A temperature of 0 is OpenAI's fallback (`FALLBACK`); a tuple, those in turn; any
        other number, it alone."""
        out = tuple(temperature) if isinstance(temperature, tuple | list) else (
            FALLBACK if temperature == 0 else (temperature,))
        if not out:
            raise InvalidRequestError("temperature: give at least one", param="temperature")
        for t in out:
            if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 <= t <= 1.0:
                raise InvalidRequestError(f"temperature is a number from 0 to 1, not {t!r}", param="temperature")
        return tuple(float(t) for t in out)

    def windows(self, audio: Any) -> tuple[list[Window], float]:
        """The clip's windows of at most 30 seconds as Whisper's features (`split`), and the
        clip's seconds."""
        features = self.processor.audio_features
        rate = features.sampling_rate
        samples = load_audio(as_audio(audio), rate, domains=self.processor.allowed_media_domains)
        out = [Window(lo / rate, hi / rate, self.processor.audio(Audio(samples[lo:hi], rate), whole=True))
               for lo, hi in split(samples, rate)]
        return out, len(samples) / rate

    def detect_request(self, first: Window) -> tuple[ImagePrompt, SamplingParams]:
        """The one-step request whose token is Whisper's guess of the language."""
        names = self.languages()
        if not names:
            raise InvalidRequestError("this model's tokenizer has no language tokens: give the language",
                                      param="language")
        return (ImagePrompt([self.sot], (first.features,)),
                SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=tuple(sorted(names))))

    def params(self, head: list[int], temperature: float, rules: WhisperRules, logprobs: bool = False,
               seed: int | None = None, sampling: dict[str, Any] | None = None) -> SamplingParams:
        """A window's request: as many tokens as the decoder has room for (`max_tokens` caps
        them), the other `sampling` parameters as given."""
        given = dict(sampling or {})
        room = self.max_model_len - len(head)
        return SamplingParams(**given | {"max_tokens": min(given.get("max_tokens", room), room)},
                              temperature=temperature, skip_special_tokens=True, whisper=rules,
                              logprobs=0 if logprobs else None, seed=None if temperature == 0 else seed)

    def job(self, clips: list[tuple[list[Window], float]], language: int | None, before: list[int], task: str,
            temperatures: tuple[float, ...], timestamps: bool = False, seed: int | None = None, words: bool = False,
            sampling: dict[str, Any] | None = None) -> Job:
        return Job(self, clips, language, before, task, temperatures, timestamps, seed, words, dict(sampling or {}))

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the tokenizer's special tokens (its added ones marked special)."""
        return frozenset(i for i, t in self.tokenizer.hf.added_tokens_decoder.items() if t.special)

    @functools.cached_property
    def no_speech_id(self) -> int | None:
        """`<|nospeech|>` (large-v3's) or `<|nocaptions|>` (the earlier models'), if either."""
        return next((t for t in (token_id(self.tokenizer, n) for n in NO_SPEECH) if t is not None), None)


@dataclass
class Attempt:
    """A window's decode at one temperature, and its scores (OpenAI's)."""

    tokens: list[int]
    text: str
    temperature: float
    avg_logprob: float
    compression_ratio: float
    at: int  # (its temperature's index in the job's)


@dataclass
class Job:
    """One call's clips through the engine, the same steps whoever runs the requests (the
    server's async engine, `LLM`'s): `detect()`'s requests (the languages to guess; none where
    one is given) and their outputs to `detected`; then, while `requests()` gives any (each
    window still to decode, at its temperature; the first time, where the windows are scored,
    each followed by its no-speech request), their outputs to `took`; then `results()`.

    A window is scored (its tokens' logprobs, its no-speech probability) where timestamps or a
    fallback are asked. With more than one temperature, a window whose decode looks wrong is
    decoded again at the next (OpenAI's whisper's fallback): its text compresses more than 2.4
    times (a loop) or its average logprob is under -1, unless its no-speech probability is over
    0.6 (silence, where any text is as good). The last temperature's decode stays whatever its
    scores."""

    whisper: Transcriber
    clips: list[tuple[list[Window], float]]
    given: int | None  # (the language's token; None: each clip's guessed)
    before: list[int]
    task: str
    temperatures: tuple[float, ...]
    timestamps: bool
    seed: int | None = None
    words: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # (`SAMPLING`'s, for every window's request)
    langs: list[int] = field(default_factory=list)
    tries: list[int] = field(default_factory=list)  # (each window's temperature, an index)
    attempts: list[Attempt | None] = field(default_factory=list)
    no_speech: list[float] = field(default_factory=list)
    asked: list[tuple[int, bool]] = field(default_factory=list)  # (the last requests: window, and its no-speech one)
    timed: list[list[TimedWord]] = field(default_factory=list)  # (each window's words, once aligned)

    def __post_init__(self) -> None:
        if self.given is not None:
            self.langs = [self.given] * len(self.clips)
        n = len(self.windows)
        self.tries, self.attempts, self.no_speech = [0] * n, [None] * n, [0.0] * n

    @property
    def scored(self) -> bool:
        return self.timestamps or len(self.temperatures) > 1

    def detect(self) -> list[tuple[ImagePrompt, SamplingParams]]:
        if self.langs:
            return []
        return [self.whisper.detect_request(windows[0]) for windows, _ in self.clips]

    def detected(self, outs: list[Any]) -> None:
        self.langs = [o.outputs[0].token_ids[0] for o in outs]

    @property
    def windows(self) -> list[tuple[int, Window]]:
        """Every clip's windows in order, with their clip's index."""
        return [(k, w) for k, (windows, _) in enumerate(self.clips) for w in windows]

    def requests(self) -> list[tuple[ImagePrompt, SamplingParams]]:
        """The windows still to decode, each at its temperature; the first time, where scored,
        each followed by its no-speech request (the two in one step hear the clip through the
        encoder once). Nothing once every window is decoded."""
        whisper = self.whisper
        rules = whisper.rules(self.timestamps)
        quiet = whisper.no_speech_id
        out: list[tuple[ImagePrompt, SamplingParams]] = []
        self.asked = []
        for i, (k, w) in enumerate(self.windows):
            done = self.attempts[i]
            if done is not None and done.at == self.tries[i]:
                continue
            head = whisper.head(self.before, self.langs[k], self.task, self.timestamps)
            seed = None if self.seed is None else self.seed + i
            out.append((ImagePrompt(list(head), (w.features,)),
                        whisper.params(head, self.temperatures[self.tries[i]], rules, self.scored, seed,
                                       self.sampling)))
            first = self.attempts[i] is None and self.scored
            if first:
                out.append((ImagePrompt([*self.before, whisper.sot], (w.features,)),
                            SamplingParams(max_tokens=1, temperature=0.0, logprobs=0,
                                           allowed_token_ids=None if quiet is None else (quiet,))))
            self.asked.append((i, first))
        return out

    def took(self, outs: list[Any]) -> None:
        """`requests()`' outputs, in their order: each window's decode kept, and where it falls
        back, its next temperature asked."""
        quiet = self.whisper.no_speech_id
        rules = self.whisper.rules(self.timestamps)
        at = 0
        for i, first in self.asked:
            choice = outs[at].outputs[0]
            if first:
                q = outs[at + 1].outputs[0]
                self.no_speech[i] = math.exp(q.logprobs[0].logprob) if q.logprobs and q.token_ids[0] == quiet else 0.0
            at += 2 if first else 1
            attempt = self.attempt(choice, rules, self.tries[i])
            self.attempts[i] = attempt
            if self.tries[i] + 1 < len(self.temperatures) and self.no_speech[i] <= NO_SPEECH_MAX and (
                    attempt.compression_ratio > COMPRESSION_MAX or attempt.avg_logprob < LOGPROB_MIN):
                self.tries[i] += 1

    def attempt(self, choice: Any, rules: WhisperRules, at: int) -> Attempt:
        tokens = [t for t in choice.token_ids if t != rules.end]
        logprobs = [lp.logprob for lp in choice.logprobs or ()]  # (the end's too: OpenAI's sum)
        begin = rules.timestamp_begin
        text = choice.text if begin is None else self.whisper.tokenizer.decode(
            [t for t in tokens if t < begin], skip_special_tokens=True)
        return Attempt(tokens, text, self.temperatures[at], sum(logprobs) / (len(tokens) + 1),
                       compression_ratio(text), at)

    def language(self, k: int) -> str:
        return self.whisper.languages()[self.langs[k]]

    def text_tokens(self, attempt: Attempt) -> list[int]:
        """A decode's text tokens: neither special, nor timestamps, nor the end."""
        special = self.whisper.special_ids
        begin = self.whisper.rules(self.timestamps).timestamp_begin
        end = self.whisper.rules(False).end
        return [t for t in attempt.tokens if t not in special and t != end and (begin is None or t < begin)]

    def alignment(self) -> tuple[list[Any], list[list[int]], list[tuple[int, int]], list[bytes]]:
        """What the engine's `cross_weights` reads to align each window's words (after every
        window is decoded): its features, its decoder input (`<|startoftranscript|>`, the
        language, the task, `<|notimestamps|>`, the text, the end: OpenAI's), the heads, and
        the features' digests (the encoder cache's keys)."""
        whisper = self.whisper
        decoding: Decoding | None = getattr(whisper.processor, "whisper", None)
        heads = list(decoding.heads) if decoding is not None else []
        if not heads:
            raise InvalidRequestError("this model names no alignment heads for word timestamps",
                                      param="timestamp_granularities")
        end = whisper.rules(False).end
        features, tokens, digests = [], [], []
        for i, (k, w) in enumerate(self.windows):
            attempt = self.attempts[i]
            assert attempt is not None, "alignment() before every window is decoded"
            head = whisper.head([], self.langs[k], self.task)
            features.append(w.features.values)
            digests.append(w.features.digest)
            tokens.append([*head, *self.text_tokens(attempt)[: whisper.max_model_len - len(head) - 1], end])
        return features, tokens, heads, digests

    def aligned(self, weights: list[Any]) -> None:
        """The windows' words from the engine's `cross_weights` of `alignment()`."""
        from conveyor.alignment import align

        decode = self.whisper.tokenizer.decode
        self.timed = []
        for i, ((k, w), x) in enumerate(zip(self.windows, weights, strict=True)):
            attempt = self.attempts[i]
            assert attempt is not None
            words = align(x, w.features.frames // 2, self.text_tokens(attempt),
                          lambda ids: decode(ids, skip_special_tokens=True), self.language(k), w.start,
                          read=x.shape[1] - 5)  # (as `alignment()` read them: after 4 tokens, before the end)
            self.timed.append([TimedWord(v.word.strip(), v.start, v.end) for v in words])

    def results(self) -> list[Transcription]:
        """Each clip's transcription from its windows' last decodes."""
        texts: list[list[str]] = [[] for _ in self.clips]
        segments: list[list[Segment]] = [[] for _ in self.clips]
        words: list[list[TimedWord]] = [[] for _ in self.clips]
        for i, (k, w) in enumerate(self.windows):
            attempt = self.attempts[i]
            assert attempt is not None, "results() before every window is decoded"
            if self.words:
                assert self.timed, "results() before the words are aligned"
                words[k].extend(self.timed[i])
            if not self.timestamps:
                texts[k].append(attempt.text)
                continue
            found = self.segments(attempt, w, self.no_speech[i], len(segments[k]))
            segments[k].extend(found)
            texts[k].extend(s.text for s in found)
        return [Transcription(join(t), self.language(k), seconds, tuple(segments[k]), tuple(words[k]))
                for k, (t, (_, seconds)) in enumerate(zip(texts, self.clips, strict=True))]

    def segments(self, attempt: Attempt, window: Window, no_speech: float, first_id: int) -> list[Segment]:
        """A window's segments from its tokens: between timestamps, the last one's text left
        open ending with the window; the scores are the window's (OpenAI's)."""
        begin = self.whisper.rules(True).timestamp_begin
        assert begin is not None
        decode = self.whisper.tokenizer.decode
        spans: list[tuple[float, float, list[int]]] = []
        start, words, opened = window.start, [], 0
        for t in attempt.tokens:
            if t < begin:
                words.append(t)
                continue
            at = round(window.start + (t - begin) * STEP_S, 3)
            if words:
                spans.append((start, at, [opened, *words, t]))
                words = []
            start, opened = at, t
        if words:
            spans.append((start, round(window.end, 3), [opened, *words]))
        out: list[Segment] = []
        for lo, hi, ids in spans:
            said = decode([t for t in ids if t < begin], skip_special_tokens=True)
            if said.strip():
                out.append(Segment(first_id + len(out), lo, max(lo, hi), said, tuple(ids), round(window.start * 100),
                                   attempt.temperature, attempt.avg_logprob, attempt.compression_ratio, no_speech))
        return out


def split(samples: np.ndarray, rate: int) -> list[tuple[int, int]]:
    """Where a clip's windows lie (sample ranges): 30 seconds each while more is left, a cut
    at the middle of the quietest tenth of a second in the window's last second (so the last
    window holds at least 50 ms)."""
    n, size = len(samples), WINDOW_S * rate
    quiet, search = int(QUIET_S * rate), int(SEARCH_S * rate)
    out: list[tuple[int, int]] = []
    start = 0
    while n - start > size:
        region = samples[start + size - search : start + size].astype(np.float64)
        starts = range(0, search - quiet + 1, quiet // 2)
        power = np.cumsum(np.concatenate([[0.0], region**2]))
        energy = [power[s + quiet] - power[s] for s in starts]
        cut = start + size - search + starts[int(np.argmin(energy))] + quiet // 2
        out.append((start, cut))
        start = cut
    return [*out, (start, n)]


def compression_ratio(text: str) -> float:
    """The text's bytes over their zlib-compressed bytes (OpenAI's sign of a loop: above 2.4)."""
    raw = text.encode()
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def join(texts: list[str]) -> str:
    """The windows' texts as one."""
    return " ".join(t.strip() for t in texts if t.strip())


def token_id(tokenizer: Any, text: str) -> int | None:
    """A special token's id; None where the tokenizer has no such token."""
    hf = tokenizer.hf
    i = hf.convert_tokens_to_ids(text)
    return None if i is None or i == hf.unk_token_id else int(i)


# -- what the formats write --------------------------------------------------------------------
def verbose_json(result: Transcription, task: str, segments: bool = True, words: bool = False) -> dict[str, Any]:
    """OpenAI's verbose_json: the task, the language's name, the clip's seconds, the text, the
    segments (where asked), the words (where asked)."""
    out = {"task": task, "language": LANGUAGE_NAMES.get(result.language, result.language).replace("_", " "),
           "duration": round(result.seconds, 3), "text": result.text}
    if segments:
        out["segments"] = [dataclasses.asdict(s) | {"tokens": list(s.tokens)} for s in result.segments]
    if words:
        out["words"] = [dataclasses.asdict(w) for w in result.words]
    return out


def _clock(seconds: float, mark: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{mark}{ms % 1000:03d}"


def srt(segments: tuple[Segment, ...] | list[Segment]) -> str:
    """SubRip subtitles: a numbered cue a segment, `HH:MM:SS,mmm --> HH:MM:SS,mmm`."""
    return "".join(f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{_cue(s.text)}\n\n"
                   for i, s in enumerate(segments, 1))


def vtt(segments: tuple[Segment, ...] | list[Segment]) -> str:
    """WebVTT subtitles: `WEBVTT`, then a cue a segment, `HH:MM:SS.mmm --> HH:MM:SS.mmm`."""
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{_cue(s.text)}\n\n"
                                   for s in segments)


def _cue(text: str) -> str:
    return text.strip().replace("-->", "->")
