"""OpenAI's audio APIs over Whisper: `/v1/audio/transcriptions` and `/v1/audio/translations`.

A request is a multipart form, as OpenAI's client sends it: `file` (the audio file: WAV read here,
other formats through soundfile), `model`, `language` (ISO-639-1, default "en": the clip's
language; a translation is always into English), `prompt` (text the decoder continues from, Whisper's
`<|startofprev|>`), `response_format` ("json" or "text"), `temperature` (0 to 1, default 0). The
clip is read at 16 kHz and cut into 30-second windows, each one decoder request
(`<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`, after the prompt's tokens), all
submitted at once so the engine batches them; their texts are joined in order. The answer is
`{"text": ..., "usage": {"type": "duration", "seconds": ...}}` (or the text alone).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from conveyor.audio import Audio, load_audio
from conveyor.multimodal import ImagePrompt, Pixels
from conveyor.sampling_params import InvalidRequestError, SamplingParams

FORMATS = ("json", "text")
NOT_BUILT_FORMATS = ("srt", "vtt", "verbose_json")  # (they need Whisper's timestamps)
WINDOW_S = 30


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
    if fields.get("stream", "false").lower() == "true":
        raise InvalidRequestError("streamed transcriptions are not built: leave stream false", param="stream")
    try:
        temperature = float(fields.get("temperature", 0.0))
    except ValueError:
        raise InvalidRequestError("temperature is a number from 0 to 1", param="temperature") from None
    if not 0.0 <= temperature <= 1.0:
        raise InvalidRequestError(f"temperature is a number from 0 to 1, not {temperature}", param="temperature")
    language = fields.get("language") or "en"
    lang = _token(tokenizer, f"<|{language}|>")
    if lang is None:
        raise InvalidRequestError(f"language {language!r} is not one this model knows (an ISO-639-1 code, e.g. 'en')",
                                  param="language")
    marks = [sot, lang, _token(tokenizer, f"<|{task}|>"), _token(tokenizer, "<|notimestamps|>")]
    head = [t for t in marks if t is not None]
    if len(head) < len(marks):
        raise InvalidRequestError(f"this model's tokenizer lacks Whisper's task tokens for {task!r}", param="model")
    prompt = fields.get("prompt")
    if prompt:
        prev = _token(tokenizer, "<|startofprev|>")
        if prev is None:
            raise InvalidRequestError("this model's tokenizer has no <|startofprev|> for a prompt", param="prompt")
        ids = tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
        room = engine.max_model_len // 2 - 1  # (Whisper's own rule: the previous text takes at most half)
        head = [prev, *ids[-room:], *head]
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
    room = engine.max_model_len - len(head)
    if room < 1:
        raise InvalidRequestError("the prompt leaves the decoder no room to write", param="prompt")
    params = SamplingParams(max_tokens=room, temperature=temperature, skip_special_tokens=True)
    rid = f"trsc-{uuid.uuid4().hex}"

    async def one(k: int, clip: Pixels) -> str:
        text = ""
        async for out in engine.generate(ImagePrompt(list(head), (clip,)), params, f"{rid}-{k}"):
            text = out.outputs[0].text
        return text.strip()

    texts = await asyncio.gather(*(one(k, clip) for k, clip in enumerate(parts)))
    text = " ".join(t for t in texts if t)
    if fmt == "text":
        return PlainTextResponse(text)
    return JSONResponse({"text": text, "usage": {"type": "duration", "seconds": math.ceil(seconds)}})


def _token(tokenizer: Any, text: str) -> int | None:
    """A special token's id; None where the tokenizer has no such token."""
    hf = tokenizer.hf
    i = hf.convert_tokens_to_ids(text)
    return None if i is None or i == hf.unk_token_id else int(i)
