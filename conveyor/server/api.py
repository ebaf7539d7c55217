"""The OpenAI-compatible HTTP API over an `EngineFront` (one engine, or replicas behind a router): `build_app` and its routes.

`build_app` returns a self-contained FastAPI app: its state hangs off closures and
`app.state.conveyor`, its metrics live in their own registry, nothing is module-global. The
request handling itself is in `serving.py`, the error shapes in `errors.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from conveyor import __version__
from conveyor.config import ConfigError
from conveyor.server.async_engine import EngineFront, EngineShuttingDownError
from conveyor.server.config import ServerConfig, default_model_name
from conveyor.server.errors import APIError, install_error_handlers
from conveyor.server.metrics import CONTENT_TYPE, ServerMetrics
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.server.serving import ChatCompletionHandler, CompletionHandler, ServerState


def served_model_names(config: ServerConfig, engine: EngineFront) -> tuple[str, ...]:
    if config.served_model_name:
        return config.served_model_name
    return (default_model_name(engine.model_path or "model"),)


def build_app(async_engine: EngineFront, server_config: ServerConfig) -> FastAPI:
    """A FastAPI app serving `async_engine`; its lifespan starts and stops the engine thread."""
    names = served_model_names(server_config, async_engine)
    if async_engine.metrics is None:
        async_engine.metrics = ServerMetrics(names[0])
    state = ServerState(async_engine, server_config, names, async_engine.metrics)
    # The --model value as typed is accepted too, as vLLM does when no name is given.
    model_arg = async_engine.model_arg
    accepted = set(names) | ({model_arg} if model_arg and not server_config.served_model_name else set())
    clash = accepted & set(state.loras)
    if clash:
        raise ConfigError(f"lora_modules: {sorted(clash)[0]!r} is the base model's name; name the adapter otherwise")
    accepted |= set(state.loras)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not async_engine.is_running:
            async_engine.start()
        try:
            yield
        finally:
            state.begin_shutdown()
            await async_engine.stop()

    app = FastAPI(title="conveyor", version=__version__, lifespan=lifespan)
    app.state.conveyor = state
    install_error_handlers(app)

    def check_accepting() -> None:
        if state.shutting_down:
            raise EngineShuttingDownError("the server is shutting down; no new requests")

    def check_model(model: str | None) -> None:
        if model is not None and model not in accepted:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{state.model_name}`"
                + (f" and the adapters {', '.join(f'`{n}`' for n in state.loras)}." if state.loras else "."),
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health() -> Response:
        if async_engine.dead is not None:
            raise APIError(503, "the engine has failed", "service_unavailable_error", code="engine_dead")
        if state.shutting_down or not async_engine.is_running:
            raise EngineShuttingDownError("the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "conveyor",
                    "root": async_engine.model_path,
                    "max_model_len": async_engine.max_model_len,
                }
                for name in names
            ] + [
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "conveyor",
                    "root": lora.lora_path,
                    "parent": state.model_name,
                    "max_model_len": async_engine.max_model_len,
                }
                for name, lora in state.loras.items()
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_accepting()
        check_model(body.model)
        return await CompletionHandler(state, body).run(raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_accepting()
        check_model(body.model)
        return await ChatCompletionHandler(state, body).run(raw)

    return app
