"""Server options: frozen, validated, with help text from which `conveyor serve` makes its flags.

Engine options (model, cache, scheduler) stay in `conveyor.config`; these are the HTTP front
end's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.config import ConfigError
from conveyor.lora import LoRARequest
from conveyor.server.reasoning import PARSERS as REASONING_PARSERS


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=_help("Address to listen on."))
    port: int = field(default=8000, metadata=_help("TCP port to listen on."))
    served_model_name: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "Model name(s) clients may send; the first is reported. "
            "Default: the model file or folder name."
        ),
    )
    max_queued_requests: int | None = field(
        default=None,
        metadata=_help("Most requests waiting for a first step; beyond it, HTTP 429. Default: no limit."),
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata=_help("Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted."),
    )
    engine_process: bool = field(
        default=True,
        metadata=_help(
            "Run the engine in its own process: if it dies, it is started again and the "
            "requests in flight resume where they stood. --no-engine-process steps it in a "
            "thread of the server's process."
        ),
    )
    engine_max_replays: int = field(
        default=1,
        metadata=_help(
            "With --engine-process: how many engine deaths a request may live through; in "
            "flight through one more, it fails with HTTP 500 (it may be what kills the engine)."
        ),
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata=_help(
            "Return a thinking model's <think> block apart from its answer, as "
            "reasoning_content on the chat API: deepseek_r1 (the output starts inside the "
            "block), qwen3 or glm45 (it thinks only if it opens one), mistral (Magistral's "
            "[THINK] block, likewise), openai_gptoss (gpt-oss's harmony messages: the analysis "
            "channel is reasoning, calls go to --tool-call-parser openai); also seed_oss, step3, "
            "ernie45, hunyuan_a13b, minimax_m2, minimax_m2_append_think (the whole output as "
            "content, <think> in front) and granite (\"Here is my thought process:\" ... \"Here "
            "is my response:\"). Default: off."
        ),
    )
    tool_call_parser: str = field(
        default="hermes",
        metadata=_help(
            "How the model writes tool calls under tool_choice auto (vLLM's parsers of the same "
            "names): hermes (<tool_call> blocks), llama3_json ({\"name\", \"parameters\"} "
            "objects), mistral ([TOOL_CALLS] and a JSON list), pythonic ([f(a=1), g()]), "
            "qwen3_coder, glm45, deepseek_v3, kimi_k2, granite, jamba, hunyuan_a13b, minimax, internlm, "
            "seed_oss, xlam, phi4_mini_json, granite-20b-fc, gigachat3, deepseek_v32, apertus or openai (gpt-oss's harmony "
            "calls). A chat "
            "template without tools is asked for that format."
        ),
    )
    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "LoRA adapters served under their own model names, as name=path (a PEFT folder) "
            'or vLLM\'s JSON {"name": ..., "path": ...}; a request whose model is the name '
            "runs with the adapter. Needs --enable-lora."
        ),
    )
    enable_rl_api: bool = field(
        default=False,
        metadata=_help(
            "Serve POST /pause?mode=abort|wait|keep&clear_cache=true|false, POST /resume and GET /is_paused "
            "(vLLM's, behind its VLLM_SERVER_DEV_MODE), POST /update_weights_from_disk {model_path} "
            "(SGLang's), POST /update_weights_from_tensor {safetensors}, POST /init_weights_update_group, "
            "/update_weights_from_distributed and /destroy_weights_update_group, GET /get_weight_version "
            "(SGLang's weight updates from a trainer), POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping "
            "(vLLM's sleep mode): an RL trainer stops generation on every engine, frees its memory and loads "
            "new weights."
        ),
    )
    allow_runtime_lora_updating: bool = field(
        default=False,
        metadata=_help(
            "Serve POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter "
            "{lora_name} (vLLM's routes, behind its VLLM_ALLOW_RUNTIME_LORA_UPDATING): adapters "
            "added and removed while the server runs. Needs --enable-lora."
        ),
    )
    lora_resolver_dir: str | None = field(
        default=None,
        metadata=_help(
            "Serve an adapter no one loaded when a request names it: the model name NAME is the "
            "PEFT folder DIR/NAME (vLLM's filesystem resolver and its VLLM_LORA_RESOLVER_CACHE_DIR), "
            "checked and loaded at its first request, served from then on. Needs --enable-lora."
        ),
    )
    lora_resolver: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "LoRA resolvers asked, after --lora-resolver-dir's, for an adapter a request names: "
            "each registered with conveyor.lora.register_lora_resolver or a package's entry point "
            "in the group conveyor.lora_resolvers. Needs --enable-lora."
        ),
    )
    log_level: str = field(default="info", metadata=_help("trace, debug, info, warning or error."))
    access_log: bool = field(default=False, metadata=_help("Log every HTTP request."))
    return_tokens_as_token_ids: bool = field(
        default=False,
        metadata=_help("Logprobs name tokens as `token_id:N` rather than by their text, for tokens that are not "
                       "whole characters (vLLM's; a request's field of the same name overrides it)."),
    )
    enable_request_id_headers: bool = field(
        default=False,
        metadata=_help("Completions and chats answer with an X-Request-Id header: the response's id (vLLM's)."),
    )
    api_key: tuple[str, ...] = field(
        default=(),
        repr=False,  # (never in a log)
        metadata=_help(
            "Keys a request must present as `Authorization: Bearer KEY` (vLLM's --api-key; also read "
            "from CONVEYOR_API_KEY); any one of them will do. Every route but /health, /ping, "
            "/metrics and /version asks for one; a request without a right one gets HTTP 401. "
            "Default: none asked."
        ),
    )
    allowed_origins: tuple[str, ...] = field(
        default=("*",), metadata=_help("CORS: origins a browser may call the API from (vLLM's default, every one).")
    )
    allowed_methods: tuple[str, ...] = field(default=("*",), metadata=_help("CORS: methods allowed."))
    allowed_headers: tuple[str, ...] = field(default=("*",), metadata=_help("CORS: request headers allowed."))
    allow_credentials: bool = field(default=False, metadata=_help("CORS: allow cookies and authorization headers."))
    ssl_keyfile: str | None = field(default=None, metadata=_help("Serve HTTPS: the private key file (PEM)."))
    ssl_certfile: str | None = field(default=None, metadata=_help("Serve HTTPS: the certificate file (PEM)."))
    ssl_ca_certs: str | None = field(
        default=None, metadata=_help("HTTPS: CA certificates that client certificates are checked against.")
    )
    root_path: str = field(
        default="", metadata=_help("The path prefix a proxy serves the API under and strips (ASGI root_path).")
    )

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            object.__setattr__(self, "served_model_name", (self.served_model_name,))
        elif not isinstance(self.served_model_name, tuple):
            object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in [0, 65535]")
        if any(not n for n in self.served_model_name):
            raise ConfigError("served_model_name: names must be non-empty")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ConfigError(f"max_queued_requests={self.max_queued_requests} must be at least 1")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown_timeout={self.shutdown_timeout} must be >= 0 seconds")
        if self.engine_max_replays < 0:
            raise ConfigError(f"engine_max_replays={self.engine_max_replays} must be >= 0")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser={self.reasoning_parser!r}: use one of {', '.join(REASONING_PARSERS)}")
        from conveyor.server.tool_parsers import tool_parser_names

        if self.tool_call_parser not in tool_parser_names():
            raise ConfigError(f"tool_call_parser={self.tool_call_parser!r}: use {', '.join(tool_parser_names())}")
        if not isinstance(self.lora_modules, tuple):
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        names = list(self.lora_requests)
        if len(names) != len(self.lora_modules):
            raise ConfigError("lora_modules: each adapter needs a name of its own")
        if not isinstance(self.lora_resolver, tuple):
            object.__setattr__(self, "lora_resolver", tuple(self.lora_resolver))
        if self.log_level not in ("trace", "debug", "info", "warning", "error", "critical"):
            raise ConfigError(f"log_level={self.log_level!r}: use trace, debug, info, warning or error")
        for name in ("api_key", "allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if any(not k for k in self.api_key):
            raise ConfigError("api_key: keys must be non-empty")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("ssl_keyfile and ssl_certfile go together: HTTPS needs both")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ConfigError("ssl_ca_certs checks client certificates over HTTPS: it needs ssl_keyfile and ssl_certfile")

    @property
    def lora_requests(self) -> dict[str, LoRARequest]:
        """The adapters by the model name a request sends (ids 1, 2, ... in the given order)."""
        out: dict[str, LoRARequest] = {}
        for i, spec in enumerate(self.lora_modules):
            name, path = _lora_module(spec)
            out[name] = LoRARequest(name, i + 1, path)
        return out


def _lora_module(spec: str) -> tuple[str, str]:
    if spec.lstrip().startswith("{"):
        try:
            obj = json.loads(spec)
        except ValueError as e:
            raise ConfigError(f"lora_modules: {spec!r} is not valid JSON: {e}") from None
        name, path = obj.get("name"), obj.get("path")
    else:
        name, _, path = spec.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise ConfigError(f'lora_modules: {spec!r} must be name=path or {{"name": ..., "path": ...}}')
    return name, path


def default_model_name(model_path: str | Path) -> str:
    """`SmolLM2-135M-Instruct.Q4_1` for `.../SmolLM2-135M-Instruct.Q4_1.gguf`; a folder's name."""
    path = Path(model_path)
    return path.stem if path.suffix.lower() == ".gguf" else path.name
