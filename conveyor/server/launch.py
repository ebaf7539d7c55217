"""`conveyor serve`: load the engine, serve the API with uvicorn, shut down gracefully.

Shutdown on SIGTERM or SIGINT, in order:
1. stop accepting: completions answer 503 and /health turns 503 (load balancers stop routing);
   the socket stays open, so clients get an answer rather than a refused connection;
2. in-flight requests get `shutdown_timeout` seconds to finish; what is left is aborted (a
   stream ends with finish_reason "abort", a non-streamed request gets 503);
3. uvicorn closes the connections, the engine (its process, or its thread with
   --no-engine-process) stops, the process exits with status 0.
A second signal skips the wait: everything is aborted at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from conveyor.config import ConfigError, EngineConfig
from conveyor.core.routing import RouterConfig
from conveyor.lora import lora_resolver
from conveyor.server.api import build_app
from conveyor.server.async_engine import AsyncEngine, EngineFront
from conveyor.server.config import ServerConfig
from conveyor.server.engine_process import EngineStartError, ProcessAsyncEngine
from conveyor.server.serving import ServerState

logger = logging.getLogger("conveyor.server")

# After the drain, uvicorn only has finished responses left to flush.
_FLUSH_TIMEOUT_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server with conveyor's drain in front of its own shutdown.

    uvicorn routes SIGINT/SIGTERM to `handle_exit` (from a signal handler, on the loop's own
    thread); we hand them to the loop instead of exiting at once, and we do not record them,
    so uvicorn does not re-raise them at exit (which would end the process with a non-zero
    status).
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        name = signal.Signals(sig).name
        engine = self.state.engine
        if self._signals == 1:
            logger.info(
                "%s: draining %d request(s), at most %.0f s", name, engine.num_open_streams, self.timeout
            )
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        else:
            logger.warning("%s again: aborting everything now", name)
            engine.abort_all()
            self.should_exit = True

    async def _drain(self) -> None:
        engine = self.state.engine
        self.state.begin_shutdown()
        if not await engine.wait_idle(self.timeout):
            logger.warning("shutdown timeout: aborting %d request(s)", engine.num_open_streams)
            engine.abort_all()
            await engine.wait_idle(_FLUSH_TIMEOUT_S)
        self.should_exit = True


def _build_front(engine_kwargs: dict[str, Any], server_config: ServerConfig, router_config: RouterConfig) -> EngineFront:
    """The engine (in its process or a thread) or, with several replicas, the replica set or the
    prefill and decode pools; ready."""
    if router_config.disaggregated:
        from conveyor.server.disaggregated import build_disaggregated_set

        pd = build_disaggregated_set(engine_kwargs, router_config, server_config.engine_process,
                                     server_config.max_queued_requests, server_config.engine_max_replays)
        pd.launch()
        logger.info("%d prefill and %d decode replica(s); prefill routed by %s", router_config.prefill_replicas,
                    router_config.decode_replicas, router_config.router_policy)
        return pd
    if router_config.data_parallel_size > 1 or router_config.data_parallel_backend == "ray":
        from conveyor.server.replicas import build_replica_set

        replicas = build_replica_set(
            engine_kwargs, router_config, server_config.engine_process,
            server_config.max_queued_requests, server_config.engine_max_replays,
        )
        replicas.launch()
        logger.info("%d engine replica(s) on %s, routed by %s", len(replicas.replicas),
                    router_config.data_parallel_backend, router_config.router_policy)
        return replicas
    if server_config.engine_process:
        process = ProcessAsyncEngine(
            engine_kwargs,
            max_queued_requests=server_config.max_queued_requests,
            max_replays=server_config.engine_max_replays,
        )
        process.launch()
        return process
    from conveyor.engine import Engine

    engine = Engine.from_config(EngineConfig.from_kwargs(**engine_kwargs))
    return AsyncEngine(engine, max_queued_requests=server_config.max_queued_requests)


def check_lora_modules(server_config: ServerConfig, config: EngineConfig) -> None:
    """Refuse at start what would make every request of an adapter fail: LoRA off, or a
    folder without an adapter's config (its weights are read and checked by the engine, at
    the first request that names it)."""
    loras = server_config.lora_requests
    if loras and not config.model.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    if server_config.allow_runtime_lora_updating and not config.model.enable_lora:
        raise ConfigError("--allow-runtime-lora-updating needs --enable-lora")
    if (server_config.lora_resolver_dir or server_config.lora_resolver) and not config.model.enable_lora:
        raise ConfigError("--lora-resolver-dir and --lora-resolver need --enable-lora")
    if server_config.lora_resolver_dir and not Path(server_config.lora_resolver_dir).is_dir():
        raise ConfigError(f"--lora-resolver-dir: {server_config.lora_resolver_dir} is not a folder")
    for name in server_config.lora_resolver:
        try:
            lora_resolver(name)
        except KeyError as e:
            raise ConfigError(f"--lora-resolver: {e.args[0]}") from None
    for lora in loras.values():
        if not (Path(lora.lora_path) / "adapter_config.json").is_file():
            raise ConfigError(f"lora_modules: {lora.lora_name}: no adapter_config.json in {lora.lora_path}")


def _exit_cleanly(sig: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def run_server(engine_kwargs: dict[str, Any], server_config: ServerConfig, router_config: RouterConfig | None = None) -> int:
    """Load the model, serve until a signal, drain, return the exit status (0)."""
    router_config = router_config or RouterConfig()
    front: EngineFront
    if not server_config.api_key and os.environ.get("CONVEYOR_API_KEY"):
        server_config = dataclasses.replace(server_config, api_key=(os.environ["CONVEYOR_API_KEY"],))
    for path in (server_config.ssl_keyfile, server_config.ssl_certfile, server_config.ssl_ca_certs):
        if path is not None and not Path(path).is_file():
            print(f"error: {path}: no such file (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs)", file=sys.stderr)
            return 1
    config = EngineConfig.from_kwargs(**engine_kwargs)  # a bad flag fails here, in either mode
    try:
        check_lora_modules(server_config, config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # Nothing is in flight while the model loads: a SIGTERM then just ends the process, cleanly.
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        try:
            front = _build_front(engine_kwargs, server_config, router_config)
        except EngineStartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    app = build_app(front, server_config, config)
    state: ServerState = app.state.conveyor
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        access_log=server_config.access_log,
        timeout_graceful_shutdown=int(_FLUSH_TIMEOUT_S),
        lifespan="on",
        ssl_keyfile=server_config.ssl_keyfile,
        ssl_certfile=server_config.ssl_certfile,
        ssl_ca_certs=server_config.ssl_ca_certs,
        root_path=server_config.root_path,
    )
    server = _Server(uv_config, state, server_config.shutdown_timeout)
    logger.info(
        "serving %s (max_model_len %d) on %s://%s:%d%s",
        state.model_name, front.max_model_len, "https" if server_config.ssl_certfile else "http",
        server_config.host, server_config.port, ", API keys asked" if server_config.api_key else "",
    )
    asyncio.run(server.serve())
    return 0 if server.started else 1
