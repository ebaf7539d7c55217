"""The OpenAI-compatible HTTP API over an `EngineFront` (one engine, or replicas behind a router): `build_app` and its routes.

`build_app` returns a self-contained FastAPI app: its state hangs off closures and
`app.state.conveyor`, its metrics live in their own registry, nothing is module-global. The
request handling itself is in `serving.py`, the error shapes in `errors.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from conveyor import __version__
from conveyor.config import ConfigError, EngineConfig
from conveyor.lora import LoRARequest
from conveyor.sampling_params import InvalidRequestError
from conveyor.server.async_engine import EngineFront, EngineShuttingDownError, pause_front
from conveyor.server.config import ServerConfig, default_model_name
from conveyor.server.embeddings import (
    ClassifyHandler,
    EmbeddingHandler,
    PoolingHandler,
    RerankHandler,
    ScoreHandler,
    detokenize,
    tokenize,
)
from conveyor.server.errors import APIError, install_error_handlers
from conveyor.server.metrics import CONTENT_TYPE, ServerMetrics
from conveyor.server.protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    PoolingRequest,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from conveyor.server.responses import ResponsesHandler, ResponseStore
from conveyor.server.security import install_security
from conveyor.server.serving import (
    ChatCompletionHandler,
    CompletionHandler,
    ServerState,
    verify_adapter,
)
from conveyor.server.transcription import transcribe


def served_model_names(config: ServerConfig, engine: EngineFront) -> tuple[str, ...]:
    if config.served_model_name:
        return config.served_model_name
    return (default_model_name(engine.model_path or "model"),)


async def json_object(raw: Request) -> dict[str, Any]:
    """A route's body read as a JSON object; a 400 if it is not JSON, or not an object."""
    try:
        body = await raw.json()
    except ValueError:
        raise APIError(400, "the body is not JSON", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body is not a JSON object", "invalid_request_error")
    return body


def build_app(
    async_engine: EngineFront, server_config: ServerConfig, engine_config: EngineConfig | None = None
) -> FastAPI:
    """A FastAPI app serving `async_engine`; its lifespan starts and stops the engine thread.
    `engine_config` (optional) tells what the engines accept (an adapter's highest rank)."""
    names = served_model_names(server_config, async_engine)
    if async_engine.metrics is None:
        async_engine.metrics = ServerMetrics(names[0])
    state = ServerState(async_engine, server_config, names, async_engine.metrics,
                        max_lora_rank=engine_config.model.max_lora_rank if engine_config else None)
    # The --model value as typed is accepted too, as vLLM does when no name is given.
    model_arg = async_engine.model_arg
    base_names = set(names) | ({model_arg} if model_arg and not server_config.served_model_name else set())
    clash = base_names & set(state.loras)
    if clash:
        raise ConfigError(f"lora_modules: {sorted(clash)[0]!r} is the base model's name; name the adapter otherwise")

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
    install_security(app, server_config)

    def check_accepting() -> None:
        if state.shutting_down:
            raise EngineShuttingDownError("the server is shutting down; no new requests")

    async def check_model(model: str | None) -> None:
        # The adapters are looked up at each request: the server may load and unload them,
        # and its resolvers find new ones.
        if model is None or model in base_names or model in state.loras:
            return
        if await state.resolve_lora(model) is None:
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

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """SageMaker's health check (vLLM's): /health's answer."""
        return await health()

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's: the server's load, its requests accepted and not yet finished (every replica's)."""
        return {"server_load": async_engine.num_in_flight}

    @app.post("/invocations")
    async def invocations(raw: Request) -> Response:
        """SageMaker's one route (vLLM's): a body with `messages` is a chat completion, one with
        `prompt` a completion, one with `input` an embedding; validated as that route's."""
        from fastapi.exceptions import RequestValidationError
        from pydantic import ValidationError

        data = await json_object(raw)
        kinds: list[tuple[str, Any]] = [("messages", (ChatCompletionRequest, chat_completions)),
                                        ("prompt", (CompletionRequest, completions)),
                                        ("input", (EmbeddingRequest, embeddings))]
        for key, (model, route) in kinds:
            if key in data:
                try:
                    body = model.model_validate(data)
                except ValidationError as e:
                    raise RequestValidationError(e.errors()) from None
                return await route(body, raw)
        raise APIError(400, "/invocations takes a chat completion (messages), a completion (prompt) or an "
                       "embedding (input) request", "invalid_request_error")

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

    if server_config.allow_runtime_lora_updating:
        _add_lora_routes(app, state, base_names)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_accepting()
        await check_model(body.model)
        return await CompletionHandler(state, body).run(raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_accepting()
        await check_model(body.model)
        return await ChatCompletionHandler(state, body).run(raw)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        check_accepting()
        await check_model(body.model)
        return await EmbeddingHandler(state, body).run(raw)

    stored = ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        check_accepting()
        await check_model(body.model)
        return await ResponsesHandler(state, body, stored).run(raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        found = stored.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id {response_id!r} not found.", "not_found_error",
                           param="response_id", code="response_not_found")
        return found[0]

    @app.post("/pooling")
    async def pooling(body: PoolingRequest, raw: Request) -> Response:
        check_accepting()
        await check_model(body.model)
        return await PoolingHandler(state, body).run(raw)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest, raw: Request) -> Response:
        check_accepting()
        await check_model(body.model)
        return await ClassifyHandler(state, body).run(raw)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, raw: Request) -> Response:
        check_accepting()
        await check_model(body.model)
        return await ScoreHandler(state, body).run(raw)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw: Request) -> Response:
        check_accepting()
        await check_model(body.model)
        return await RerankHandler(state, body).run(raw)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(raw: Request) -> Response:
        check_accepting()
        return await transcribe(state, raw, "transcribe", check_model)

    @app.post("/v1/audio/translations")
    async def translations(raw: Request) -> Response:
        check_accepting()
        return await transcribe(state, raw, "translate", check_model)

    async def reset(name: str) -> Response:
        check_accepting()
        try:
            await async_engine.call_engine(name)
        except NotImplementedError as e:
            raise APIError(501, str(e), "not_implemented_error") from None
        return Response(status_code=200)

    @app.post("/abort_request")
    async def abort_request(raw: Request) -> Response:
        """SGLang's: end a completions or chat request in flight by its id (`rid`: the request's
        own `request_id` or X-Request-Id, or the response's `id`); its choices end with
        finish_reason "abort", as a client's disconnect ends them. `abort_all`: every request of
        every engine (as /pause?mode=abort does, without pausing)."""
        body = await json_object(raw)
        if body.get("abort_all") is True:
            async_engine.abort_all()
            return Response(status_code=200)
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("rid: a request's id is needed (or abort_all: true)", param="rid")
        stream = state.inflight.get(rid)
        if stream is None:
            raise APIError(404, f"no request {rid!r} is in flight", "not_found_error", param="rid")
        stream.abort()
        return Response(status_code=200)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's: forget every cached prefix (the offloading tier's too) on every engine."""
        return await reset("reset_prefix_cache")

    if server_config.enable_rl_api:
        @app.post("/pause")
        async def pause(mode: str = "abort", clear_cache: bool = True) -> Response:
            """vLLM's: stop generating on every engine (abort, wait for or keep what is in flight)."""
            check_accepting()
            await pause_front(async_engine, mode, clear_cache)
            return Response(status_code=200)

        @app.post("/resume")
        async def resume() -> Response:
            """vLLM's: go on after /pause."""
            check_accepting()
            await async_engine.call_engine("resume_generation")
            return Response(status_code=200)

        @app.get("/is_paused")
        async def is_paused() -> dict[str, bool]:
            return {"is_paused": bool(await async_engine.call_engine("is_paused"))}

        @app.post("/sleep")
        async def sleep(level: int = 1) -> Response:
            """vLLM's sleep mode on every engine: level 1 frees the KV cache, 2 the weights too."""
            check_accepting()
            await async_engine.call_engine("sleep", level)
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up() -> Response:
            check_accepting()
            await async_engine.call_engine("wake_up")
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping() -> dict[str, bool]:
            return {"is_sleeping": bool(await async_engine.call_engine("is_sleeping"))}

        def version_of(body: dict[str, Any]) -> str | None:
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise InvalidRequestError("weight_version: a string is needed", param="weight_version")
            return version

        def flag(body: dict[str, Any], name: str, default: bool) -> bool:
            value = body.get(name, default)
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{name}: true or false", param=name)
            return value

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(raw: Request) -> dict[str, Any]:
            """SGLang's: every engine loads new weights of the same architecture from `model_path`
            (idle or paused engines only)."""
            check_accepting()
            body = await json_object(raw)
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise InvalidRequestError("model_path: a checkpoint's path is needed", param="model_path")
            await async_engine.call_engine("update_weights_from_disk", path, version_of(body))
            return {"success": True, "message": f"weights loaded from {path}"}

        @app.post("/update_weights_from_tensor")
        async def update_weights_from_tensor(raw: Request) -> dict[str, Any]:
            """SGLang's route, with the tensors as one safetensors file: the body itself
            (`application/octet-stream`, options in the query: `flush_cache`, `weight_version`),
            or in base64 in a JSON body's `safetensors` (`conveyor.weight_sync`'s
            `save_named_tensors` and `serialize_named_tensors`). SGLang's pickles are not read."""
            from conveyor.weight_sync import deserialize_named_tensors, load_named_tensors

            check_accepting()
            if raw.headers.get("content-type", "").startswith("application/octet-stream"):
                query = dict(raw.query_params)
                flush = query.get("flush_cache", "true").lower()
                if flush not in ("true", "false"):
                    raise InvalidRequestError("flush_cache: true or false", param="flush_cache")
                sent = load_named_tensors(await raw.body())
                await async_engine.call_engine("update_weights_from_tensor", list(sent.items()), flush == "true",
                                               query.get("weight_version"))
                return {"success": True, "message": f"{len(sent)} tensors loaded"}
            body = await json_object(raw)
            if "serialized_named_tensors" in body:
                raise InvalidRequestError("serialized_named_tensors (pickles) are not read here: send the tensors as a "
                                          "base64 safetensors file in `safetensors` "
                                          "(conveyor.weight_sync.serialize_named_tensors)",
                                          param="serialized_named_tensors")
            data = body.get("safetensors")
            if not isinstance(data, str) or not data:
                raise InvalidRequestError("safetensors: a base64 safetensors file is needed", param="safetensors")
            tensors = deserialize_named_tensors(data)
            await async_engine.call_engine("update_weights_from_tensor", list(tensors.items()),
                                           flag(body, "flush_cache", True), version_of(body))
            return {"success": True, "message": f"{len(tensors)} tensors loaded"}

        @app.post("/init_weights_update_group")
        async def init_weights_update_group(raw: Request) -> dict[str, Any]:
            """SGLang's: every engine joins the trainer's group (engine i as rank rank_offset + i)."""
            check_accepting()
            body = await json_object(raw)
            address, port = body.get("master_address"), body.get("master_port")
            offset, size = body.get("rank_offset", 1), body.get("world_size")
            if not isinstance(address, str) or not isinstance(port, int) or isinstance(port, bool):
                raise InvalidRequestError("master_address (a string) and master_port (a number) are needed",
                                          param="master_address")
            if not isinstance(offset, int) or not isinstance(size, int):
                raise InvalidRequestError("rank_offset and world_size: numbers are needed", param="world_size")
            group, backend = body.get("group_name", "weight_update_group"), body.get("backend")
            if not isinstance(group, str) or (backend is not None and not isinstance(backend, str)):
                raise InvalidRequestError("group_name and backend: strings", param="group_name")
            await async_engine.call_engine("init_weights_update_group", address, port, offset, size, group, backend)
            return {"success": True, "message": f"joined {group!r}"}

        @app.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(raw: Request) -> dict[str, Any]:
            """SGLang's: every engine receives the tensors the trainer broadcasts, then loads them
            (each engine checks the names, dtypes and shapes before it receives anything)."""
            check_accepting()
            body = await json_object(raw)
            names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
            group = body.get("group_name", "weight_update_group")
            if not isinstance(group, str):
                raise InvalidRequestError("group_name: a string", param="group_name")
            bucket = body.get("bucket_bytes", 0)
            if not isinstance(bucket, int) or isinstance(bucket, bool) or bucket < 0:
                raise InvalidRequestError("bucket_bytes: a size in bytes, 0 for none", param="bucket_bytes")
            await async_engine.call_engine("update_weights_from_distributed", names, dtypes, shapes, group,
                                           flag(body, "flush_cache", True), version_of(body), bucket)
            return {"success": True, "message": f"{len(names)} tensors loaded"}  # type: ignore[arg-type]

        @app.post("/destroy_weights_update_group")
        async def destroy_weights_update_group(raw: Request) -> dict[str, Any]:
            check_accepting()
            body = await json_object(raw)
            group = body.get("group_name", "weight_update_group")
            if not isinstance(group, str):
                raise InvalidRequestError("group_name: a string", param="group_name")
            await async_engine.call_engine("destroy_weights_update_group", group)
            return {"success": True, "message": f"left {group!r}"}

        @app.get("/get_weight_version")
        async def get_weight_version() -> dict[str, str]:
            """SGLang's: the `weight_version` the last update named ("default" before any)."""
            return {"weight_version": str(await async_engine.call_engine("get_weight_version"))}

    @app.post("/reset_mm_cache")
    async def reset_mm_cache() -> Response:
        """vLLM's: forget the encoder outputs every engine's encoder cache keeps."""
        return await reset("reset_mm_cache")

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        await check_model(body.model)
        return tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        await check_model(body.model)
        return detokenize(state, body)

    return app


async def _unpin(state: ServerState, lora_int_id: int) -> None:
    """A pinned adapter's pin and weights dropped from every engine (requests still running with
    it load it again at their next step)."""
    state.pinned_loras.discard(lora_int_id)
    await state.engine.call_engine("remove_lora", lora_int_id)


def _add_lora_routes(app: FastAPI, state: ServerState, base_names: set[str]) -> None:
    """vLLM's runtime LoRA routes. An adapter loaded here is checked against the model's
    shapes before it is served; it takes a new id, so a name unloaded and loaded again is
    another adapter to the engines (`LoRARequest.key`). Unloading stops new requests naming
    it; those already running end with it."""
    import asyncio

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        name = body.lora_name
        if name in base_names:
            raise APIError(400, f"{name!r} is the base model's name; name the adapter otherwise", param="lora_name")
        if name in state.loras and not body.load_inplace:
            raise APIError(400, f"The LoRA adapter {name!r} is already loaded; unload it first "
                                "(or load it with load_inplace)", param="lora_name")
        try:
            request = LoRARequest(name, state.next_lora_id, body.lora_path)
            state.next_lora_id += 1  # (taken now: a concurrent load never takes the same id)
            await asyncio.to_thread(verify_adapter, request, state.engine.model_path, state.max_lora_rank)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="lora_path") from None
        if name in state.loras and not body.load_inplace:  # loaded by another call while this one checked
            raise APIError(400, f"The LoRA adapter {name!r} is already loaded; unload it first", param="lora_name")
        if body.pinned:  # (SGLang's: loaded on every engine now, its weights read: a bad file fails here)
            try:
                await state.engine.call_engine("add_lora", request)
                await state.engine.call_engine("pin_lora", request.lora_int_id)
            except InvalidRequestError as e:
                with suppress(Exception):
                    await state.engine.call_engine("remove_lora", request.lora_int_id)
                raise APIError(400, str(e), param="lora_path") from None
            state.pinned_loras.add(request.lora_int_id)
        # In place: a new id, so the name's new requests never meet the old adapter's weights or
        # cached K/V; those running end with the old one.
        replaced = name in state.loras
        old = state.loras.get(name)
        state.loras[name] = request
        if old is not None and old.lora_int_id in state.pinned_loras:
            await _unpin(state, old.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' {'replaced' if replaced else 'added'} successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        name = body.lora_name
        lora = state.loras.get(name)
        if lora is None or (body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id):
            raise APIError(404, f"The LoRA adapter {name!r} cannot be found", "not_found_error",
                           param="lora_name", code="lora_not_found")
        del state.loras[name]
        if lora.lora_int_id in state.pinned_loras:
            await _unpin(state, lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

