"""OpenAI's audio APIs over Whisper: `/v1/audio/transcriptions` and `/v1/audio/translations`.

A request is a multipart form, as OpenAI's client sends it: `file` (the audio file: WAV read here,
other formats through soundfile), `model`, `language` (the clip's, ISO-639-1; a translation is
always into English; where it is not given, Whisper's own guess: the language token its decoder
finds most likely after `<|startoftranscript|>` on the first window), `prompt` (text the decoder
continues from, Whisper's `<|startofprev|>`), `response_format` ("json" or "text"), `temperature`
(0 to 1, default 0), `stream`. The clip is read at 16 kHz and cut into 30-second windows, each one
decoder request (`<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`, after the prompt's
tokens), all submitted at once so the engine batches them; their texts are joined in order. The
answer is `{"text": ..., "language": ..., "usage": {"type": "duration", "seconds": ...}}` (or the
text alone); streamed, OpenAI's `transcript.text.delta` events in the windows' order, then one
`transcript.text.done`.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from conveyor.audio import Audio, load_audio
from conveyor.multimodal import ImagePrompt, Pixels
from conveyor.sampling_params import InvalidRequestError, SamplingParams
from conveyor.server.async_engine import EngineRequest
from conveyor.server.serving import _abort_on_disconnect

FORMATS = ("json", "text")
NOT_BUILT_FORMATS = ("srt", "vtt", "verbose_json")  # (they need Whisper's timestamps)
WINDOW_S = 30
LANGUAGE = re.compile(r"<\|[a-z]{2,3}\|>")  # (Whisper's language tokens: <|en|>, <|haw|>, <|yue|>)


async def transcribe(state: Any, raw: Request, task: str, check_model: Callable[[str | None], Awaitable[None]]
                     ) -> Response:
    """One transcription (`task` "transcribe") or translation ("translate") request; the form's
    `model` is checked by `check_model` (the routes')."""
    engine = state.engine
    tokenizer, processor = engine.tokenizer, engine.image_processor
    sot = None if tokenizer is None else _token(tokenizer, "<|startoftranscript|>")
    if sot is None or processor is None or processor.audio_features is None:
        raise InvalidRequestError("this model does not transcribe audio (Whisper does)", param="model")
    try:
        form = await raw.form()
    except Exception as e:  # (a body that is not a multipart form)
        raise InvalidRequestError(f"the request is a multipart form with the audio as 'file': {e}",
                                  param="file") from None
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise InvalidRequestError("the audio file is missing: send it as the form's 'file'", param="file")
    data = await upload.read()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    await check_model(fields.get("model"))
    fmt = fields.get("response_format", "json")
    if fmt in NOT_BUILT_FORMATS:
        raise InvalidRequestError(f"response_format {fmt!r} needs timestamps, which conveyor does not decode yet: "
                                  "use json or text", param="response_format")
    if fmt not in FORMATS:
        raise InvalidRequestError(f"response_format must be one of {list(FORMATS)}, not {fmt!r}",
                                  param="response_format")
    streamed = fields.get("stream", "false").lower() == "true"
    try:
        temperature = float(fields.get("temperature", 0.0))
    except ValueError:
        raise InvalidRequestError("temperature is a number from 0 to 1", param="temperature") from None
    if not 0.0 <= temperature <= 1.0:
        raise InvalidRequestError(f"temperature is a number from 0 to 1, not {temperature}", param="temperature")
    language = fields.get("language") or None
    lang = None if language is None else _token(tokenizer, f"<|{language}|>")
    if language is not None and lang is None:
        raise InvalidRequestError(f"language {language!r} is not one this model knows (an ISO-639-1 code, e.g. 'en')",
                                  param="language")
    marks = [_token(tokenizer, f"<|{task}|>"), _token(tokenizer, "<|notimestamps|>")]
    task_ids = [t for t in marks if t is not None]
    if len(task_ids) < len(marks):
        raise InvalidRequestError(f"this model's tokenizer lacks Whisper's task tokens for {task!r}", param="model")
    prompt = fields.get("prompt")
    if prompt:
        prev = _token(tokenizer, "<|startofprev|>")
        if prev is None:
            raise InvalidRequestError("this model's tokenizer has no <|startofprev|> for a prompt", param="prompt")
        ids = tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
        room = engine.max_model_len // 2 - 1  # (Whisper's own rule: the previous text takes at most half)
        before = [prev, *ids[-room:]]
    else:
        before = []
    features = processor.audio_features

    def windows() -> tuple[list[Pixels], float]:
        samples = load_audio(Audio(data), features.sampling_rate, domains=processor.allowed_media_domains)
        step = WINDOW_S * features.sampling_rate
        out: list[Pixels] = []
        for start in range(0, max(1, len(samples)), step):
            part = samples[start : start + step]
            if len(part) > 2 * features.hop_length or not out:  # (a last sliver of under 20 ms adds nothing)
                values, frames = features(part, whole=True)
                out.append(Pixels(values, features.digest(values, frames), frames=frames))
        return out, len(samples) / features.sampling_rate

    parts, seconds = await asyncio.to_thread(windows)
    rid = f"trsc-{uuid.uuid4().hex}"
    if lang is None:  # (Whisper's own detection: its most likely language token after the start, first window)
        lang, language = await _detect(engine, tokenizer, sot, parts[0], f"{rid}-lang")
    head = [*before, sot, lang, *task_ids]
    room = engine.max_model_len - len(head)
    if room < 1:
        raise InvalidRequestError("the prompt leaves the decoder no room to write", param="prompt")
    params = SamplingParams(max_tokens=room, temperature=temperature, skip_special_tokens=True)
    stream = await engine.add([EngineRequest(f"{rid}-{k}", ImagePrompt(list(head), (clip,)), params)
                               for k, clip in enumerate(parts)])
    watcher = asyncio.create_task(_abort_on_disconnect(raw, stream))
    usage = {"type": "duration", "seconds": math.ceil(seconds)}
    if streamed:
        return StreamingResponse(_events(stream, len(parts), watcher, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    texts = [""] * len(parts)
    try:
        async for out in stream:
            texts[int(out.request_id.rsplit("-", 1)[1])] = out.outputs[0].text
    finally:
        watcher.cancel()
    text = " ".join(t.strip() for t in texts if t.strip())
    if fmt == "text":
        return PlainTextResponse(text)
    return JSONResponse({"text": text, "language": language, "usage": usage})


async def _detect(engine: Any, tokenizer: Any, sot: int, clip: Pixels, request_id: str) -> tuple[int, str]:
    """The clip's language: the language token Whisper's decoder finds most likely right after
    `<|startoftranscript|>` (one step, its choice kept to the tokenizer's language tokens)."""
    names = {i: t[2:-2] for t, i in tokenizer.hf.get_vocab().items() if LANGUAGE.fullmatch(t)}
    if not names:
        raise InvalidRequestError("this model's tokenizer has no language tokens: give the language", param="language")
    params = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=tuple(sorted(names)))
    found = None
    async for out in engine.generate(ImagePrompt([sot], (clip,)), params, request_id):
        found = out
    assert found is not None
    token = found.outputs[0].token_ids[0]
    return token, names[token]


async def _events(stream: Any, windows: int, watcher: asyncio.Task[None], usage: dict[str, Any]
                  ) -> AsyncIterator[str]:
    """OpenAI's transcription stream: `transcript.text.delta` events as the windows' texts grow,
    in the windows' order (a later window's text is held until those before it are done), then
    one `transcript.text.done` with the whole text and the usage."""
    texts = [""] * windows
    done = [False] * windows
    sent = [0] * windows
    current = 0
    try:
        async for out in stream:
            k = int(out.request_id.rsplit("-", 1)[1])
            texts[k], done[k] = out.outputs[0].text, out.finished
            while current < windows:
                piece = texts[current][sent[current]:]
                if not sent[current]:  # (a window's text starts after one space, the first's after none)
                    piece = piece.lstrip()
                    if piece and any(texts[j].strip() for j in range(current)):
                        piece = " " + piece
                if piece.strip() or sent[current]:
                    sent[current] = len(texts[current])
                    if piece:
                        yield f"data: {json.dumps({'type': 'transcript.text.delta', 'delta': piece})}\n\n"
                if not done[current]:
                    break
                current += 1
        text = " ".join(t.strip() for t in texts if t.strip())
        yield f"data: {json.dumps({'type': 'transcript.text.done', 'text': text, 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()


def _token(tokenizer: Any, text: str) -> int | None:
    """A special token's id; None where the tokenizer has no such token."""
    hf = tokenizer.hf
    i = hf.convert_tokens_to_ids(text)
    return None if i is None or i == hf.unk_token_id else int(i)
