"""OpenAI's audio APIs over Whisper: `/v1/audio/transcriptions` and `/v1/audio/translations`.

A request is a multipart form, as OpenAI's client sends it: `file` (the audio file: WAV read here,
other formats through soundfile), `model`, `language` (the clip's, ISO-639-1; a translation is
always into English; where it is not given, Whisper's own guess: the language token its decoder
finds most likely after `<|startoftranscript|>` on the first window), `prompt` (text the decoder
continues from, Whisper's `<|startofprev|>`), `response_format` ("json" or "text"), `temperature`
(0 to 1, default 0), `stream`. The clip's windows and decoder prompts are `conveyor.transcribe`'s,
all submitted at once so the engine batches them; their texts are joined in order. The answer is
`{"text": ..., "language": ..., "usage": {"type": "duration", "seconds": ...}}` (or the text
alone); streamed, OpenAI's `transcript.text.delta` events in the windows' order, then one
`transcript.text.done`.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from conveyor.multimodal import ImagePrompt
from conveyor.sampling_params import InvalidRequestError
from conveyor.server.async_engine import EngineRequest
from conveyor.server.serving import _abort_on_disconnect
from conveyor.transcribe import Transcriber, join

FORMATS = ("json", "text")
NOT_BUILT_FORMATS = ("srt", "vtt", "verbose_json")  # (they need Whisper's timestamps)


async def transcribe(state: Any, raw: Request, task: str, check_model: Callable[[str | None], Awaitable[None]]
                     ) -> Response:
    """One transcription (`task` "transcribe") or translation ("translate") request; the form's
    `model` is checked by `check_model` (the routes')."""
    engine = state.engine
    whisper = Transcriber.of(engine.tokenizer, engine.image_processor, engine.max_model_len)
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
    language = fields.get("language") or None
    lang = None if language is None else whisper.language_id(language)
    before = whisper.before(fields.get("prompt"))
    whisper.check(before, task, temperature)
    parts, seconds = await asyncio.to_thread(whisper.windows, data)
    rid = f"trsc-{uuid.uuid4().hex}"
    if lang is None:
        prompt, params = whisper.detect_request(parts[0])
        found = None
        async for out in engine.generate(prompt, params, f"{rid}-lang"):
            found = out
        assert found is not None
        lang = found.outputs[0].token_ids[0]
        language = whisper.languages()[lang]
    head = whisper.head(before, lang, task)
    params = whisper.params(head, temperature)
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
    text = join(texts)
    if fmt == "text":
        return PlainTextResponse(text)
    return JSONResponse({"text": text, "language": language, "usage": usage})


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
        text = join(texts)
        yield f"data: {json.dumps({'type': 'transcript.text.done', 'text': text, 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()

