"""conveyor: continuous batching over a paged KV cache, with every scheduling policy named."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.config import ConfigError, EngineConfig
from conveyor.logits_process import LogitsProcessor, LogitsRow
from conveyor.lora import LoRARequest
from conveyor.multimodal import ImagePrompt
from conveyor.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from conveyor.sampling_params import (
    InvalidRequestError,
    PoolingParams,
    SamplingParams,
    StructuredOutputParams,
)
from conveyor.video import Video

__version__ = "0.1.0"

if TYPE_CHECKING:
    from conveyor.async_llm import AsyncLLM
    from conveyor.engine import Engine
    from conveyor.llm import LLM

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "ConfigError",
    "EmbeddingRequestOutput",
    "Engine",
    "EngineConfig",
    "ImagePrompt",
    "InvalidRequestError",
    "LoRARequest",
    "LogitsProcessor",
    "LogitsRow",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputParams",
    "Video",
]


def __getattr__(name: str) -> Any:
    # torch-heavy parts load on first use, so `import conveyor.core.scheduler` stays light.
    if name == "LLM":
        from conveyor.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from conveyor.async_llm import AsyncLLM

        return AsyncLLM
    if name == "Engine":
        from conveyor.engine import Engine

        return Engine
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
