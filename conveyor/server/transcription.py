"""OpenAI's audio APIs over Whisper: `/v1/audio/transcriptions` and `/v1/audio/translations`.

A request is a multipart form, as OpenAI's client sends it: `file` (the audio file: WAV read here,
other formats through soundfile), `model`, `language` (the clip's, ISO-639-1; a translation is
always into English; where it is not given, Whisper's own guess: the language token its decoder
finds most likely after `<|startoftranscript|>` on the first window), `prompt` (text the decoder
continues from, Whisper's `<|startofprev|>`), `response_format`, `timestamp_granularities[]`
("segment", "word": `conveyor.alignment`, a pass of the engine's between steps), `temperature`
(0 to 1, default 0: OpenAI's fallback), `seed`, vLLM's `top_p`, `top_k`, `min_p`,
`repetition_penalty`, `frequency_penalty`, `presence_penalty` and `max_completion_tokens` (each
window's), `stream`. The clip's windows, decoder prompts and segments are `conveyor.transcribe`'s,
all requests submitted at once so the engine batches them. The answer, by `response_format`: "json", `{"text": ..., "language": ...,
"usage": {"type": "duration", "seconds": ...}}`; "text", the text alone; "verbose_json", OpenAI's
(the task, the language's name, the clip's seconds, the text and its segments with their times
and scores, decoded with Whisper's timestamps); "srt" and "vtt", the segments as subtitles.
Streamed (json and text only), OpenAI's `transcript.text.delta` events in the windows' order, then
one `transcript.text.done`.
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
from conveyor.sampling_params import InvalidRequestError, SamplingParams
from conveyor.server.async_engine import EngineRequest
from conveyor.server.serving import _abort_on_disconnect
from conveyor.transcribe import Transcriber, join, srt, verbose_json, vtt

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# vLLM's sampling fields of a transcription request: (SamplingParams' name, the form's, its kind)
SAMPLED = (("top_p", "top_p", float), ("top_k", "top_k", int), ("min_p", "min_p", float),
           ("repetition_penalty", "repetition_penalty", float), ("frequency_penalty", "frequency_penalty", float),
           ("presence_penalty", "presence_penalty", float), ("max_tokens", "max_completion_tokens", int))


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
    if fmt not in FORMATS:
        raise InvalidRequestError(f"response_format must be one of {list(FORMATS)}, not {fmt!r}",
                                  param="response_format")
    granularities = {v for k, v in form.multi_items() if k in ("timestamp_granularities[]", "timestamp_granularities")
                     and isinstance(v, str)}
    for g in granularities - {"segment", "word"}:
        raise InvalidRequestError(f"timestamp_granularities holds 'segment' and 'word', not {g!r}",
                                  param="timestamp_granularities")
    if granularities and fmt != "verbose_json":
        raise InvalidRequestError("timestamp_granularities needs response_format 'verbose_json'",
                                  param="timestamp_granularities")
    words = "word" in granularities
    segmented = fmt in ("srt", "vtt") or (fmt == "verbose_json" and (not granularities or "segment" in granularities))
    streamed = fields.get("stream", "false").lower() == "true"
    if streamed and fmt not in ("json", "text"):
        raise InvalidRequestError(f"a stream holds the text's deltas: response_format {fmt!r} is not streamed "
                                  "(use json or text)", param="stream")
    temperature = _number(fields, "temperature", float, 0.0)
    seed = _number(fields, "seed", int)
    sampling = {name: _number(fields, field_name, kind) for name, field_name, kind in SAMPLED
                if fields.get(field_name) not in (None, "")}
    language = fields.get("language") or None
    lang = None if language is None else whisper.language_id(language)
    before = whisper.before(fields.get("prompt"))
    temperatures = whisper.check(before, task, temperature, segmented, words, sampling)
    if streamed:  # (text once sent stays sent: no fallback)
        temperatures = temperatures[:1]
    job = whisper.job([await asyncio.to_thread(whisper.windows, data)], lang, before, task, temperatures,
                      segmented, seed, words, sampling)
    rid = f"trsc-{uuid.uuid4().hex}"
    usage = {"type": "duration", "seconds": math.ceil(job.clips[0][1])}
    detect = job.detect()
    if detect:
        outs = await _gather(engine, raw, f"{rid}-lang", detect)
        if outs is None:
            return Response(status_code=499)  # (the client went: nobody reads an answer)
        job.detected(outs)
    if streamed:
        requests = job.requests()
        stream = await engine.add([EngineRequest(f"{rid}-{k}", prompt, params)
                                   for k, (prompt, params) in enumerate(requests)])
        watcher = asyncio.create_task(_abort_on_disconnect(raw, stream))
        return StreamingResponse(_events(stream, len(requests), watcher, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    tries = 0
    while requests := job.requests():
        outs = await _gather(engine, raw, f"{rid}-{tries}", requests)
        if outs is None:
            return Response(status_code=499)
        job.took(outs)
        tries += 1
    if words:
        job.aligned(await engine.call_engine("cross_weights", *job.alignment()))
    result = job.results()[0]
    if fmt == "text":
        return PlainTextResponse(result.text)
    if fmt == "srt":
        return PlainTextResponse(srt(result.segments))
    if fmt == "vtt":
        return PlainTextResponse(vtt(result.segments), media_type="text/vtt")
    if fmt == "verbose_json":
        return JSONResponse(verbose_json(result, task, segmented, words) | {"usage": usage})
    return JSONResponse({"text": result.text, "language": result.language, "usage": usage})


async def _gather(engine: Any, raw: Request, rid: str, requests: list[tuple[ImagePrompt, SamplingParams]]
                  ) -> list[Any] | None:
    """The requests' final outputs, in their order; None where the client went (they are
    aborted)."""
    outs: list[Any] = [None] * len(requests)
    stream = await engine.add([EngineRequest(f"{rid}-{k}", prompt, params) for k, (prompt, params) in enumerate(requests)])
    watcher = asyncio.create_task(_abort_on_disconnect(raw, stream))
    try:
        async for out in stream:
            outs[int(out.request_id.rsplit("-", 1)[1])] = out
    finally:
        gone = watcher.done()
        watcher.cancel()
    return None if gone or any(o is None or o.outputs[0].finish_reason == "abort" for o in outs) else outs


def _number(fields: dict[str, str], name: str, kind: type, default: Any = None) -> Any:
    """A form field's number (`default` where it is not given); InvalidRequestError naming it."""
    value = fields.get(name)
    if value in (None, ""):
        return default
    try:
        return kind(value)
    except ValueError:
        raise InvalidRequestError(f"{name} is a number, not {value!r}", param=name) from None


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

