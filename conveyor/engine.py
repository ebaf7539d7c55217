"""The synchronous engine: add requests, call `step()` until done, abort at any time.

One `step()` is one iteration: the scheduler picks the batch, the runner computes it once, the
scheduler appends the sampled tokens and frees whatever finished. Detokenization and stop
strings live here, between the scheduler and the caller. With `async_scheduling`, a `step()`
schedules and launches the next iteration before it completes the previous one, so the host's
work overlaps the device's (SGLang's overlap scheduler).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from conveyor.audio import Audio
from conveyor.config import CacheConfig, ConfigError, EngineConfig
from conveyor.core.block_manager import BlockManager, HybridLayout
from conveyor.core.kv_events import KVEvent
from conveyor.core.scheduler import Scheduler, SchedulerOutput
from conveyor.kv_transfer import KVHandoff, Migration
from conveyor.lora import LoRARequest
from conveyor.multimodal import (
    ImageProcessor,
    ImagePrompt,
    ImageSpan,
    ImageToken,
    Pixels,
    as_image_prompt,
    expand_image_tokens,
    load_image,
    processor_kwargs,
)
from conveyor.outputs import CompletionOutput, ParallelChoices, RequestOutput, TokenLogprob
from conveyor.runner.base import PromptLogprob, Runner, RunnerOutput
from conveyor.sampling_params import (
    InvalidRequestError,
    PoolingParams,
    SamplingParams,
    StructuredOutputParams,
)
from conveyor.scoring import ModelHead
from conveyor.sequence import FinishReason, RequestMetrics, Sequence, SequenceStatus
from conveyor.tokenizer import IncrementalDetokenizer, Tokenizer
from conveyor.video import Video

if TYPE_CHECKING:  # torch is imported where a model is built, not by the engine's import
    import torch

    from conveyor.models.lora import LoRAManager
    from conveyor.runner.drafter import Drafter

logger = logging.getLogger("conveyor")

CPU_DEFAULT_KV_BYTES = 2 << 30
# KV events kept for `Engine.take_kv_events` (publisher "null") beyond which the oldest are dropped.
MAX_KEPT_KV_EVENTS = 100_000
PAUSE_MODES = ("abort", "wait", "keep")
# Kept free of the KV cache on a GPU: CUDA context, cuBLAS workspaces, activations.
CUDA_RUNTIME_RESERVE = 1 << 30


@dataclass(slots=True)
class StepRecord:
    """What one step did; the engine keeps them in `step_trace` when tracing is on."""

    step_id: int
    start: float
    duration_s: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_waiting: int
    kv_blocks_used: int
    num_preempted: int
    num_running: int = 0
    num_swapped: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    seq_ids: tuple[int, ...] = ()  # the sequences this step computed (occupancy timelines)
    num_draft_tokens: int = 0  # speculative decoding: drafts verified (in num_decode_tokens) ...
    num_accepted_tokens: int = 0  # ... and those the model accepted
    blocks_stored: int = 0  # KV offloading: cached blocks copied to its tier ...
    blocks_loaded: int = 0  # ... and copied back for prefix hits
    disk_blocks_written: int = 0  # its disk tier: tier blocks written to files ...
    disk_blocks_read: int = 0  # ... and files read back for prefix hits (in blocks_loaded)


@dataclass(slots=True)
class RequestRecord:
    """A finished request, kept (bounded) for traces and occupancy timelines."""

    request_id: str
    seq_id: int
    prompt_len: int
    output_len: int
    finish_reason: str | None
    priority: int
    num_preemptions: int
    metrics: RequestMetrics


@dataclass(slots=True)
class Resume:
    """Where a request stood when the engine serving it died: a new engine goes on from there.

    The outputs are recomputed as a recompute-preempted sequence's are (prompt and outputs
    prefilled again); the text up to `emitted_text_len` characters went out already and is
    not emitted twice; the timestamps carry over, so TTFT and TPOT span the restart.
    """

    output_token_ids: list[int]
    emitted_text_len: int
    metrics: RequestMetrics
    num_preemptions: int = 0
    text: str = ""  # what was emitted, for a front end that must hold it (the engine needs only its length)


@dataclass(slots=True)
class _InFlight:
    """A step launched and not yet completed (async scheduling)."""

    scheduled: SchedulerOutput
    handle: Any  # the runner's step handle: `result() -> RunnerOutput`
    start: float


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    stream: bool
    logprobs: list[TokenLogprob] | None
    emitted_tokens: int = 0
    emitted_text: int = 0
    delta: bool = False  # output_kind "delta": each output holds only what is new
    emitted_logprobs: int = 0  # ... and these logprobs went out already
    # SamplingParams.prompt_logprobs: the prompt's so far (its first token has none)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    emitted_prompt_logprobs: bool = False  # (output_kind "delta": they go out once)
    done: bool = False
    prompt_token_ids: list[int] | None = None  # sliced once, shared by every output of a stream
    extra: dict[str, object] = field(default_factory=dict)
    export_kv: bool = False  # the prefill of a disaggregated request: its K/V go out at the end
    handoff: KVHandoff | None = None  # ... read when its last prompt token is computed
    embedding: list[float] | None = None  # SamplingParams.pooling: the pooled vector, once computed
    token_embeddings: list[list[float]] | None = None  # ... pooling_type "all": one a prompt token


class Engine:
    """Holds the scheduler, the runner and the tokenizer; knows nothing of HTTP."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        runner: Runner,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        vocab_size: int,
        clock: Callable[[], float] = time.perf_counter,
        trace: bool = True,
        max_trace_steps: int | None = 100_000,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.clock = clock
        self.trace = trace
        # A bounded window, so a long-running server does not grow without limit.
        self.step_trace: deque[StepRecord] = deque(maxlen=max_trace_steps)
        self.last_step: StepRecord | None = None
        self.finished_requests: deque[RequestRecord] = deque(maxlen=max_trace_steps)
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._parents: dict[str, ParallelChoices] = {}  # requests with n > 1, by id
        self._child_of: dict[str, tuple[ParallelChoices, int]] = {}  # their choices' ids
        self._next_seq_id = 0
        # Async scheduling needs a runner that launches a step without waiting for it (the
        # simulator's runner prices a step at once: it keeps the plain loop).
        self._async = config.scheduler.async_scheduling and hasattr(runner, "submit")
        self._stream_interval = config.scheduler.stream_interval
        self._in_flight: _InFlight | None = None
        # Requests handed over with their K/V (conveyor/kv_transfer.py), in arrival order, until
        # the scheduler has a seat and swap space for them.
        self._incoming: deque[tuple[_Request, KVHandoff]] = deque()
        self.num_kv_received = 0  # handed-over requests that came in with their K/V
        self.num_kv_recomputed = 0  # ... and those whose K/V could never fit, computed here again
        self.num_migrated_out = 0  # requests handed to another engine (`migrate_out`) ...
        # pause_generation: no step runs while paused; while draining ("wait"), the requests
        # added since wait in `_held` for resume_generation, and the rest finish.
        self._paused = False
        self._draining = False
        self._held: list[Sequence] = []
        self._sleeping = 0  # sleep's level: 0 awake
        self.num_migrated_in = 0  # ... and taken from one (`migrate_in`)
        self.drafter: Drafter | None = None  # speculative_method='draft_model' (runner/drafter.py)
        # A classifier's class names (its model's `score` rows), whether it classifies every
        # token, and how a cross-encoder's pair reads (conveyor/scoring.py); empty for a causal LM.
        self.head = ModelHead()
        self.is_encoder = False  # a bidirectional encoder (BERT): it pools, and generates nothing
        self.image_processor: ImageProcessor | None = None  # an image-text model's (conveyor/multimodal.py)
        self.image_token: ImageToken | None = None  # ... and its image token ("<image>")
        self.text_only = False  # (an image-text model whose every kind limit_mm_per_prompt sets to 0)
        self.default_pooling = "last"  # what an embedding pools when its request does not say
        self._kv_publisher: Any = None  # KV events over ZeroMQ (conveyor/core/kv_events.py)
        self._kv_events_dropped = False
        self.model_path: str | None = None  # where the weights came from (`from_config`, `update_weights_from_disk`)
        # Tensors sent since (`update_weights_from_tensor`, `..._from_distributed`), on the host:
        # the model is built again from `model_path`'s checkpoint with these in place.
        self._weight_overlay: dict[str, torch.Tensor] = {}
        self._weight_groups: dict[str, Any] = {}  # name -> WeightUpdateGroup (conveyor/weight_sync.py)
        self.weight_version = "default"  # (SGLang's: named by whoever sends new weights)
        self._calibration: list[int] | None = None  # int8's calibration prompt (a model built again uses it)
        if config.cache.enable_kv_cache_events:
            self._start_kv_events(config.cache)

    @property
    def labels(self) -> tuple[str, ...]:
        return self.head.labels

    @property
    def token_classifier(self) -> bool:
        return self.head.token_classifier

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        import torch

        from conveyor.models.attention import TorchPagedAttention
        from conveyor.models.loader import (
            bge_m3_heads,
            build_model,
            gguf_has_tokenizer,
            is_gguf,
            open_model,
            resolve_model_path,
            sentence_transformers_dense,
        )

        mc = config.model
        _refuse_pipeline(config)
        device = _resolve_device(mc.device)
        dtype = _resolve_dtype(mc.dtype, device)
        tp = mc.tensor_parallel_size
        if tp > 1 and device.type != "cpu":
            raise ConfigError(
                f"tensor_parallel_size={tp} runs on CPU ranks; across GPUs (NCCL) it is not built yet"
            )
        threads = mc.num_threads if tp == 1 else mc.num_threads or max(1, (os.cpu_count() or 1) // tp)
        if threads is not None and device.type == "cpu":
            torch.set_num_threads(threads)
        path = resolve_model_path(mc.model)
        gguf = is_gguf(path)
        arch, tensors, reader = open_model(path)
        text_only = arch.vision is not None and _limited_to_text(arch.vision, path, mc.limit_mm_per_prompt)
        if text_only:  # (vLLM's text-only mode: the tower's weights are not read)
            arch = dataclasses.replace(arch, vision=None)
        dense = [] if gguf else sentence_transformers_dense(path)  # (before the weights load: a bad one fails fast)
        token_heads = bge_m3_heads(path, arch.hidden_size) if arch.is_encoder and path.is_dir() else None
        full_arch = arch
        if arch.is_encoder:
            _check_encoder_config(config)
        if arch.encoder is not None:
            _check_whisper_config(config)
        if tp > 1:  # this process is rank 0: its shard, and a KV cache over its heads
            from conveyor.models.tensor_parallel import shard_arch, shard_tensors

            arch, tensors = shard_arch(arch, tp), shard_tensors(tensors, 0, tp, arch)
        tok_path = Path(mc.tokenizer) if mc.tokenizer else path
        tokenizer: Tokenizer | None = None
        has_tokenizer = gguf_has_tokenizer(reader) if gguf else _has_tokenizer_files(path)
        if mc.tokenizer or has_tokenizer:
            tokenizer = Tokenizer.load(tok_path, gguf and not mc.tokenizer, full_arch.eos_token_ids)
            if mc.chat_template is not None:
                from conveyor.tokenizer import load_chat_template

                try:
                    tokenizer.chat_template = load_chat_template(mc.chat_template)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        else:
            logger.warning("%s has no tokenizer: prompts must be token ids", path)
            if mc.chat_template is not None:
                raise ConfigError(f"chat_template: {path} has no tokenizer to render chats with")

        mtp: dict[str, Any] | None = None
        if config.scheduler.speculative_method == "mtp":
            if arch.family not in ("deepseek_v3", "glm4_moe") or tp > 1:
                raise ConfigError("speculative_method='mtp' drafts with the multi-token-prediction layer of DeepSeek-V3 "
                                  f"or GLM-4.5: such a checkpoint on one rank (this is {arch.family}"
                                  f"{f', tensor_parallel_size={tp}' if tp > 1 else ''})")
            from conveyor.models.mtp import mtp_tensors

            mtp = {}
            tensors = mtp_tensors(tensors, arch, mtp)
        eagle: tuple[Any, dict[str, Any]] | None = None
        method = config.scheduler.speculative_method
        if method in ("eagle", "eagle3"):
            if mc.speculative_model is None:
                raise ConfigError(f"speculative_method={method!r} needs a speculative_model (the head's folder)")
            if tp > 1 or arch.is_encoder or arch.labels or arch.num_experts or arch.is_mla:
                raise ConfigError(f"speculative_method={method!r}: an EAGLE head drafts for a dense decoder on one "
                                  f"rank (this is {arch.family}{f', tensor_parallel_size={tp}' if tp > 1 else ''})")
            from conveyor.models.eagle import read_eagle

            eagle = read_eagle(resolve_model_path(mc.speculative_model), method, arch)
        medusa: tuple[Any, dict[str, Any]] | None = None
        if method == "medusa":
            if mc.speculative_model is None:
                raise ConfigError("speculative_method='medusa' needs a speculative_model (the heads' folder)")
            if tp > 1 or arch.is_encoder or arch.labels:
                raise ConfigError("speculative_method='medusa': Medusa heads draft for a decoder on one rank (this is "
                                  f"{arch.family}{f', tensor_parallel_size={tp}' if tp > 1 else ''})")
            from conveyor.models.medusa import read_medusa

            medusa = read_medusa(resolve_model_path(mc.speculative_model), arch)
            heads = medusa[0].num_heads
            if config.scheduler.speculative_token_tree is not None:
                from conveyor.core.speculative import TokenTree

                depth = TokenTree.parse(config.scheduler.speculative_token_tree).depth
                if depth > heads:
                    raise ConfigError(f"speculative_token_tree reaches depth {depth}: the Medusa checkpoint has "
                                      f"{heads} heads, one a depth; give paths of at most {heads} ranks")
            elif config.scheduler.num_speculative_tokens > heads:
                raise ConfigError(f"num_speculative_tokens={config.scheduler.num_speculative_tokens}: the Medusa "
                                  f"checkpoint has {heads} heads, one a guess; ask for at most {heads}")
        branching = config.scheduler.speculative_token_tree is not None or config.scheduler.speculative_eagle_topk
        if branching and (arch.sliding_window or any(arch.layer_windows)):
            name = "speculative_token_tree" if config.scheduler.speculative_token_tree else "speculative_eagle_topk"
            raise ConfigError(f"{name}: a token tree's rows attend under a mask of their own, "
                              "not built for sliding-window layers (this model has them); leave it unset")
        draft_arch = draft_tensors = None
        if config.scheduler.speculative_method == "draft_model":
            if mc.speculative_model is None:
                raise ConfigError("speculative_method='draft_model' needs a speculative_model (its path)")
            draft_arch, draft_tensors, _ = open_model(resolve_model_path(mc.speculative_model))
            _check_draft(arch, draft_arch)

        itemsize = torch.empty((), dtype=dtype).element_size()
        # The MTP layer counts as a draft: a sparse layer, its embeddings and head, and its
        # projection's weights; one layer's latent a token in the cache plan.
        planned = (dataclasses.replace(arch, num_layers=1, first_k_dense_replace=0) if mtp is not None
                   else eagle[0].arch if eagle is not None else draft_arch)
        extra = 2 * arch.hidden_size**2 if mtp is not None else 0
        if eagle is not None:  # its own tensors, whatever it shares with the model
            extra = sum(t.numel() for t in eagle[1].values()) - eagle[0].arch.num_params
        if medusa is not None:  # no cache: only its weights
            extra = sum(t.numel() for n, t in medusa[1].items() if n != "token_map")
        weight_bytes = (arch.num_params + (planned.num_params if planned else 0) + extra) * itemsize
        kv_dtype = _resolve_kv_dtype(config, dtype, device)
        num_blocks, num_swap_blocks, max_len, num_offload_blocks = _plan_cache(
            config, arch, kv_dtype, device, weight_bytes, draft_arch=planned
        )
        for name in ("quantization", "speculative_quantization"):
            if getattr(mc, name) is not None and (device.type != "cpu" or dtype != torch.float32):
                raise ConfigError(
                    f"{name}={getattr(mc, name)!r} is a CPU float32 path; this engine is "
                    f"{device.type} {str(dtype).removeprefix('torch.')}"
                )
        calibration = None
        if mc.quantization is not None or mc.speculative_quantization is not None:
            from conveyor.models.quantize import calibration_ids

            calibration = calibration_ids(
                None if tokenizer is None else tokenizer.encode, arch.vocab_size, min(256, max_len)
            )
        peers = None
        if tp > 1:  # the workers load their shards while this process loads its own
            from conveyor.runner.tensor_parallel import Recipe, TensorParallelGroup

            name = str(dtype).removeprefix("torch.")
            peers = TensorParallelGroup(tp, Recipe(
                str(path), name, str(kv_dtype).removeprefix("torch."), max_len, num_blocks,
                config.cache.block_size, num_swap_blocks + num_offload_blocks, threads or 1, mc.quantization, calibration,
                lora=(mc.max_lora_rank, mc.max_cpu_loras or config.scheduler.max_loras) if mc.enable_lora else None,
                layout=hybrid_layout(config, arch),
            ), arch=full_arch)
        model: Any
        try:
            if arch.is_encoder:
                from conveyor.models.bert import build_encoder

                model = build_encoder(arch, tensors, dtype, device)
            elif arch.encoder is not None:
                from conveyor.models.whisper import build_whisper

                model = build_whisper(arch, tensors, TorchPagedAttention(), dtype, device)
            else:
                model = build_model(
                    arch, tensors, TorchPagedAttention(), max_len, dtype, device, mc.quantization, calibration,
                    all_reduce=None if peers is None else peers.all_reduce,
                )
                model.text_only = text_only  # (its tower left out: `_limited_to_text`)
            if peers is not None:
                peers.wait_ready()
        except BaseException:
            if peers is not None:
                peers.close()
            raise
        draft_model = None
        if draft_arch is not None:
            assert draft_tensors is not None
            draft_model = build_model(
                draft_arch, draft_tensors, TorchPagedAttention(), max_len, dtype, device,
                mc.speculative_quantization, calibration,
            )
        if mc.classifier_from_tokens is not None:
            _classifier_from_tokens(model, tokenizer, mc.classifier_from_tokens, config)
        engine = cls._assemble(
            config, model, tokenizer, dtype, device, num_blocks, num_swap_blocks, max_len, kv_dtype, draft_model,
            peers, num_offload_blocks,
        )
        if mtp is not None:  # the drafter: the MTP layer over the target's hidden states
            from conveyor.models.mtp import build_mtp
            from conveyor.runner.mtp import HiddenStore, MTPDrafter, MTPRunner

            store = HiddenStore()
            engine.runner.hidden_store = store  # type: ignore[attr-defined]
            layer = build_mtp(arch, mtp, max_len, dtype, device)
            engine.drafter = MTPDrafter(MTPRunner(layer, num_blocks, config.cache.block_size, dtype, device,
                                                  kv_dtype), store)
        if eagle is not None:  # the drafter: an EAGLE head over the target's hidden states
            from conveyor.models.eagle import build_eagle
            from conveyor.runner.mtp import HiddenStore, MTPDrafter, MTPRunner

            spec, head_tensors = eagle
            head = build_eagle(spec, head_tensors, model, max_len, dtype, device)
            model.aux_layers = spec.aux_layers
            store = HiddenStore()
            engine.runner.hidden_store = store  # type: ignore[attr-defined]
            engine.drafter = MTPDrafter(MTPRunner(head, num_blocks, config.cache.block_size, dtype, device,
                                                  kv_dtype), store)
            if (topk := config.scheduler.speculative_eagle_topk) is not None:
                if topk > spec.draft_vocab:
                    raise ConfigError(f"speculative_eagle_topk={topk}: the head's vocabulary has {spec.draft_vocab} "
                                      "tokens; rank at most that many")
                engine.drafter.topk = topk
        if medusa is not None:  # the drafter: Medusa heads over the model's last hidden states
            from conveyor.models.medusa import build_medusa
            from conveyor.runner.medusa import MedusaDrafter
            from conveyor.runner.mtp import HiddenStore

            store = HiddenStore()
            engine.runner.hidden_store = store  # type: ignore[attr-defined]
            engine.drafter = MedusaDrafter(build_medusa(*medusa, dtype, device), store, device,  # type: ignore[assignment]
                                           dtype)
        if engine.drafter is not None and hasattr(engine.drafter, "draw"):  # (an MTP layer's, an EAGLE head's)
            engine.drafter.draw = config.scheduler.speculative_draw_guesses
        if token_heads is not None:  # BGE-M3's lexical weights and ColBERT vectors, a token each
            engine.runner.token_heads = token_heads  # type: ignore[attr-defined]
            engine.head = dataclasses.replace(engine.head, lexical=token_heads.sparse is not None)
        if dense:  # a sentence-transformers model's Dense modules, after its pooling
            runner = engine.runner
            runner.pool_dense = list(dense)  # type: ignore[attr-defined]
            runner.hidden_size = int(dense[-1].weight.shape[0])  # type: ignore[attr-defined]
        engine.model_path = str(path)
        engine._calibration = calibration
        return engine

    @classmethod
    def from_model(
        cls,
        config: EngineConfig,
        model: Any,
        tokenizer: Tokenizer | None,
        model_path: str | None = None,
        draft_model: Any = None,
    ) -> Engine:
        """A new engine (its own KV cache, scheduler and traces) over an already-built model,
        whose weights it shares: building many engines costs one load (tests, benchmarks).
        `draft_model` is the draft of `speculative_method='draft_model'` (an already-built
        model too, perhaps `model` itself); `speculative_model` is not looked at.

        `model` is another engine's `runner.model`. Its dtype and device are used; the model
        section of `config` (path, dtype, device, tokenizer) is not looked at, except
        `max_model_len` and `seed`. The cache and scheduler sections apply as in `from_config`,
        and `max_model_len` is further capped by the positions the model was built for.
        """
        _refuse_pipeline(config)
        if config.model.classifier_from_tokens is not None:
            raise ConfigError("classifier_from_tokens changes the model's head: use from_config")
        if config.model.tensor_parallel_size > 1 or model.tensor_parallel:
            raise ConfigError("tensor_parallel_size > 1 builds its ranks from the model's path: use from_config")
        weight = model.embed_tokens.weight
        positions = model.arch.max_position_embeddings if model.arch.is_encoder else model.rotary.max_positions
        # The weights already occupy device memory: do not count them twice in a CUDA budget.
        kv_dtype = _resolve_kv_dtype(config, weight.dtype, weight.device)
        method = config.scheduler.speculative_method
        if method in ("mtp", "eagle", "eagle3", "medusa"):  # (their drafters read the checkpoint's files)
            raise ConfigError(f"speculative_method={method!r} builds its drafter from the model's and "
                              "speculative_model's files: use from_config")
        drafting = method == "draft_model"
        if drafting != (draft_model is not None):
            raise ConfigError("a draft_model goes with speculative_method='draft_model', and only with it")
        if config.cache.kv_disk_path is not None:  # (its files are keyed by the model's path)
            if model_path is None:
                raise ConfigError("the KV disk tier keys its files by the model's path: give from_model its model_path")
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=str(model_path)))
        draft_arch = None
        if draft_model is not None:
            draft_arch = draft_model.arch
            _check_draft(model.arch, draft_arch)
            positions = min(positions, draft_model.rotary.max_positions)
        num_blocks, num_swap_blocks, max_len, num_offload_blocks = _plan_cache(
            config, model.arch, kv_dtype, weight.device, 0, max_positions=positions, draft_arch=draft_arch
        )
        engine = cls._assemble(
            config, model, tokenizer, weight.dtype, weight.device, num_blocks, num_swap_blocks, max_len, kv_dtype,
            draft_model, num_offload_blocks=num_offload_blocks,
        )
        engine.model_path = model_path
        return engine

    @classmethod
    def _assemble(
        cls,
        config: EngineConfig,
        model: Any,
        tokenizer: Tokenizer | None,
        dtype: Any,
        device: Any,
        num_blocks: int,
        num_swap_blocks: int,
        max_len: int,
        kv_dtype: Any = None,
        draft_model: Any = None,
        peers: Any = None,
        num_offload_blocks: int = 0,
    ) -> Engine:
        from conveyor.models.loader import ModelLoadError
        from conveyor.runner.model_runner import ModelRunner

        arch = model.arch
        eos_ids = tokenizer.eos_token_ids if tokenizer else frozenset(arch.eos_token_ids)
        if arch.encoder is not None:
            config = _whisper_engine_config(config)
        if arch.is_encoder:
            config = _encoder_config(config, max_len)
            if model.sep_token_id is None and tokenizer is not None:
                model.sep_token_id = getattr(tokenizer.hf, "sep_token_id", None)
        # The scheduler first: an unknown policy name fails before the KV cache is allocated.
        layout = hybrid_layout(config, arch)
        scheduler = Scheduler(
            config.scheduler,
            BlockManager(num_blocks, config.cache.block_size, num_swap_blocks, config.cache.enable_prefix_caching,
                         layout, cross_tokens=_cross_tokens(arch), num_offload_blocks=num_offload_blocks,
                         offloading_policy=config.cache.kv_offloading_policy,
                         eviction_policy=config.cache.eviction_policy),
            max_len,
            eos_ids,
        )
        mc = config.model

        def graphs(arch: Any) -> int:
            # A mixture of experts sizes each expert's rows on the host (one sync a layer), which
            # a CUDA graph cannot capture: its steps run eagerly; so does latent attention (its
            # torch path has not been captured on a GPU yet).
            # Capped scores (Gemma 2) and sinks take graphs where the Triton kernels attend (they
            # cap and sink in the launch); the torch backend builds masks a graph would not refresh.
            # (A hybrid cache's sliding groups read tables of their own: the graphs take them too.)
            torch_attention = (arch.attn_logit_softcapping > 0 or arch.attention_sinks) and not _triton_attends(dtype)
            eager = (mc.enforce_eager or arch.num_experts > 0 or arch.is_encoder or arch.is_mla
                     or torch_attention or arch.encoder is not None)
            return 0 if eager else min(mc.cuda_graph_max_batch, config.scheduler.max_num_seqs)

        runner = ModelRunner(
            model, num_blocks, config.cache.block_size, dtype, device,
            seed=mc.seed, num_swap_blocks=num_swap_blocks + num_offload_blocks, kv_dtype=kv_dtype, max_model_len=max_len,
            cuda_graph_max_batch=graphs(arch), layout=layout,
        )
        runner.eos_token_ids = tuple(sorted(eos_ids))  # what min_tokens holds back
        runner.logprobs_mode = mc.logprobs_mode
        if mc.logits_processors:
            from conveyor.logits_process import load_processors

            runner.logits_processors = load_processors(mc.logits_processors, config, device)
        if config.cache.kv_disk_path is not None and num_offload_blocks:
            runner.disk = scheduler.block_manager.disk = _disk_tier(config, runner, dtype, kv_dtype, peers)
        runner.encoder_cache_tokens = config.cache.encoder_cache_tokens
        if config.cache.encoder_cache_tokens and config.scheduler.max_num_encoder_input_tokens is not None:
            scheduler.encoder_cached = runner.holds_encoded  # (an item there costs the encoder nothing)
        runner.peers = peers  # tensor parallelism's other ranks (runner/tensor_parallel.py)
        if mc.enable_lora:
            from conveyor.models.lora import LoRAManager

            shard = (0, peers.size) if peers is not None else (0, 1)  # (checked against the whole model)
            runner.lora = LoRAManager(model, mc.max_lora_rank, mc.max_cpu_loras or config.scheduler.max_loras,
                                      arch=None if peers is None else peers.arch, shard=shard)
        if tokenizer is not None:
            from conveyor.structured.grammar import GrammarCache

            runner.grammars = GrammarCache(tokenizer.hf, eos_ids, arch.vocab_size, device)
            runner.word_token_ids = functools.lru_cache(maxsize=256)(tokenizer.word_token_ids)
        engine = cls(config, scheduler, runner, tokenizer, max_len, arch.vocab_size)
        engine.arch = arch  # type: ignore[attr-defined]
        engine.head = ModelHead(arch.labels, arch.token_classifier, mc.score_template, arch.score_activation)
        engine.is_encoder = arch.is_encoder
        engine.default_pooling = arch.default_pooling
        text_only = bool(getattr(model, "text_only", False))
        engine.text_only = text_only
        for option in ("mm_processor_kwargs", "limit_mm_per_prompt", "allowed_media_domains"):
            if option == "allowed_media_domains" and arch.encoder is not None:
                continue
            if getattr(mc, option) is not None and getattr(model, "vision", None) is None and not text_only:
                raise ConfigError(f"{option}: this model reads no images")
        if arch.encoder is not None:  # (Whisper: its clip's features, whole)
            folder = Path(mc.model) if mc.model is not None else None
            engine.image_processor = ImageProcessor.from_folder(folder if folder and folder.is_dir() else None,
                                                                arch.encoder)
            from conveyor.transcribe import Decoding

            engine.image_processor = dataclasses.replace(engine.image_processor, whisper=Decoding.read(
                folder if folder and folder.is_dir() else None, arch.vocab_size, tokenizer, arch.num_layers,
                arch.num_heads))
            features = engine.image_processor.audio_features
            assert features is not None
            if features.feature_size != arch.encoder.num_channels:
                raise ModelLoadError(f"preprocessor_config.json's feature_size={features.feature_size}: this "
                                     f"Whisper's encoder reads {arch.encoder.num_channels} mel bins")
        if getattr(model, "vision", None) is not None:
            folder = Path(mc.model) if mc.model is not None else None
            engine.image_processor = ImageProcessor.from_folder(folder if folder and folder.is_dir() else None,
                                                                arch.vision)
            try:
                engine.image_processor = (engine.image_processor.overridden(processor_kwargs(mc.mm_processor_kwargs))
                                          .limited(mc.limit_mm_per_prompt))
            except InvalidRequestError as e:
                raise ConfigError(str(e)) from None
            if tokenizer is not None:
                v = arch.vision
                frame = sum(map(len, engine._image_frame))
                engine.image_token = ImageToken(tokenizer.hf.convert_ids_to_tokens(v.placeholder_id), v.placeholder_id,
                                                v.tokens_per_image + frame, v.patch_size * v.merge_size if v.own_size else 0,
                                                v.style == "pixtral", v.pooled_tokens if v.style == "internvl" else 0,
                                                max(1, v.temporal_patch_size),
                                                tokenizer.hf.convert_ids_to_tokens(v.video_token_id) if v.reads_videos
                                                else None, v.pooled_side**2 if v.style == "llava_onevision" else 0,
                                                engine._audio_mark(v) if v.reads_audio else None)
                if v.style == "pixtral":  # (the span's break and end tokens are Mistral's ids)
                    named = tokenizer.hf.convert_tokens_to_ids(["[IMG_BREAK]", "[IMG_END]"])
                    unk = tokenizer.hf.unk_token_id
                    if any(i is not None and i != unk and i != want
                           for i, want in zip(named, (v.break_token_id, v.end_token_id), strict=True)):
                        raise ModelLoadError(f"this tokenizer's [IMG_BREAK] and [IMG_END] are {named}, not Pixtral's "
                                             f"{[v.break_token_id, v.end_token_id]}")
        if engine.image_processor is not None and mc.allowed_media_domains is not None:
            engine.image_processor = dataclasses.replace(
                engine.image_processor, allowed_media_domains=frozenset(d.lower() for d in mc.allowed_media_domains))
        if draft_model is not None:
            from conveyor.runner.drafter import Drafter

            # The draft's own KV cache, over the same block ids as the target's.
            draft_runner = ModelRunner(
                draft_model, num_blocks, config.cache.block_size, dtype, device,
                kv_dtype=kv_dtype, max_model_len=max_len, cuda_graph_max_batch=graphs(draft_model.arch),
            )
            # A round's first draft step catches up on the tokens the last round accepted (at
            # most every guess and the model's own token): as decodes side by side, in one call.
            draft_runner.chain_max_span = config.scheduler.num_speculative_tokens + 1
            engine.drafter = Drafter(draft_runner)
            engine.drafter.draw = config.scheduler.speculative_draw_guesses
        return engine

    # -- requests --------------------------------------------------------------------------
    def tokenize_prompt(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids, or a prompt cut short) and token ids, cut to
        their last `params.truncate_prompt_tokens`."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer; pass token ids", param="prompt")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        k = None if params is None else params.truncate_prompt_tokens
        if k is not None:
            if k == -1:
                k = self.max_model_len - (0 if params is not None and params.pooling is not None else 1)
            if len(ids) > k:
                text, ids = None, ids[-k:]
        return text, ids

    def prepare_prompt(self, prompt: Any, params: SamplingParams | None = None, images: tuple[ImageSpan, ...] = ()
                       ) -> tuple[str | None, list[int], tuple[ImageSpan, ...]]:
        """`tokenize_prompt`, and for a prompt with images (`ImagePrompt`, or vLLM's dict form)
        the images read and made pixels, each image token of the prompt repeated as many times
        as the image has embeddings, and where each image's tokens are. Token ids whose images
        are placed already (`images`) are taken as they are."""
        if images:
            assert isinstance(prompt, list), "images are placed in token ids"
            return None, prompt, images
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            return self._embeds_prompt(prompt, params)
        prompt = as_image_prompt(prompt)
        if getattr(getattr(self, "arch", None), "encoder", None) is not None:
            return self._whisper_prompt(prompt)
        if not isinstance(prompt, ImagePrompt):
            text, ids = self.tokenize_prompt(prompt, params)
            return text, ids, ()
        processor = self.image_processor
        vision = getattr(getattr(self, "arch", None), "vision", None)
        if self.text_only:
            raise InvalidRequestError("this engine reads text only: limit_mm_per_prompt sets each kind the model "
                                      "reads to 0, so its tower is not loaded", param="multi_modal_data")
        if processor is None or vision is None:
            if any(isinstance(p, Audio) for p in prompt.images):
                raise InvalidRequestError("this model reads no audio (Qwen2-Audio does)", param="audio")
            raise InvalidRequestError("this model reads no images", param="image")
        if params is not None and params.truncate_prompt_tokens is not None:
            raise InvalidRequestError("truncate_prompt_tokens would cut a prompt with images", param="truncate_prompt_tokens")
        if self.drafter is not None:
            raise InvalidRequestError("images with a draft model's speculation are not built", param="image")
        local = self.config.model.allowed_local_media_path
        processor = processor.overridden(prompt.processor_kwargs)
        videos = [p for p in prompt.images if isinstance(p, Video) or (isinstance(p, Pixels) and p.fps)]
        clips = [p for p in prompt.images if isinstance(p, Audio) or (isinstance(p, Pixels) and p.frames)]
        processor.check_counts(len(prompt.images) - len(videos) - len(clips), len(videos), len(clips))
        if clips and not vision.reads_audio:
            raise InvalidRequestError("this model reads no audio (Qwen2-Audio does)", param="audio")
        if vision.reads_audio:
            if len(clips) < len(prompt.images):
                raise InvalidRequestError("this model reads audio, not images or videos", param="image")
            return self._place_audio(prompt.prompt, [c if isinstance(c, Pixels) else processor.audio(c, local)
                                                     for c in clips])
        if videos and not vision.reads_videos:
            raise InvalidRequestError("this model reads no videos (the Qwen-VLs and LLaVA-OneVision do)", param="video")
        loaded = [p if isinstance(p, Pixels) else load_image(p, local, processor.allowed_media_domains)
                  for p in prompt.images if not isinstance(p, Video) and not (isinstance(p, Pixels) and p.fps)]
        pixels = [p if isinstance(p, Pixels) else processor(p) for p in loaded]
        crops = [[] if isinstance(p, Pixels) else [processor(c) for c in processor.crops(p)] for p in loaded]
        if vision.style == "llava_onevision" and len(pixels) > 1:  # (HF's processor: no tiles among several)
            pixels = [p.whole_only() for p in pixels]
        text, ids = self.tokenize_prompt(prompt.prompt)
        if any(crops):
            ids, pixels = self._pan_and_scan(ids, pixels, crops)
        layouts = [vision.image_layout(p) for p in pixels]
        if videos:  # (the images and videos as their placeholders come, each video's span of video tokens)
            ids, pixels, layouts = self._place_videos(ids, pixels, [v if isinstance(v, Pixels) else processor.video(v, local)
                                                                    for v in videos])
        before, after = self._image_frame
        ids, spans = expand_image_tokens(ids, vision.placeholder_id, pixels, [vision.image_tokens(p) for p in pixels],
                                         vision.image_token_id, before, after, vision.bidirectional, layouts)
        sc = self.scheduler.config
        if spans and vision.bidirectional and sc.prefill_mode == "chunked" and sc.max_num_batched_tokens < spans[0].length:
            raise InvalidRequestError(
                f"an image is {spans[0].length} tokens that a step computes together, more than "
                f"max_num_batched_tokens={sc.max_num_batched_tokens}", param="image")
        return text, ids, spans

    def _whisper_prompt(self, prompt: Any) -> tuple[str | None, list[int], tuple[ImageSpan, ...]]:
        """Whisper's request: the decoder's prompt (its special tokens written out, as vLLM takes
        it: "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>") and one clip, the
        encoder's input, carried as a span of no tokens (the runner encodes it at the
        sequence's first step)."""
        clips = prompt.images if isinstance(prompt, ImagePrompt) else ()
        if len(clips) != 1 or not all(isinstance(c, Audio) or (isinstance(c, Pixels) and c.frames) for c in clips):
            raise InvalidRequestError(
                "Whisper transcribes one audio clip a request: {'prompt': '<|startoftranscript|><|en|><|transcribe|>"
                "<|notimestamps|>', 'multi_modal_data': {'audio': clip}}", param="audio")
        assert isinstance(prompt, ImagePrompt) and self.image_processor is not None
        clip = clips[0]
        if not isinstance(clip, Pixels):
            clip = self.image_processor.audio(clip, self.config.model.allowed_local_media_path, whole=True)
        if isinstance(prompt.prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer; pass token ids", param="prompt")
            text, ids = prompt.prompt, self.tokenizer.encode(prompt.prompt, add_special_tokens=False)
        else:
            text, ids = None, list(prompt.prompt)
        if not ids:
            raise InvalidRequestError("Whisper's decoder prompt is empty: start it with <|startoftranscript|>",
                                      param="prompt")
        return text, ids, (ImageSpan(0, 0, clip),)

    def _place_audio(self, prompt: str | list[int], clips: list[Pixels]
                     ) -> tuple[str | None, list[int], tuple[ImageSpan, ...]]:
        """Qwen2-Audio's prompt: each audio token (`<|AUDIO|>`) repeated as many times as its
        clip has tokens, in the clips' order."""
        vision = self.arch.vision  # type: ignore[attr-defined]
        text, ids = self.tokenize_prompt(prompt)
        marks = ids.count(vision.placeholder_id)
        if marks != len(clips):
            token = "the audio token" if self.image_token is None else self.image_token.text
            raise InvalidRequestError(
                f"the prompt has {marks} audio tokens for {len(clips)} clips: put one {token} (between "
                "<|audio_bos|> and <|audio_eos|>) where each clip goes, or send the clips as a chat's content parts",
                param="audio")
        ids, spans = expand_image_tokens(ids, vision.placeholder_id, clips, [vision.image_tokens(c) for c in clips])
        return text, ids, spans

    def _audio_mark(self, vision: Any) -> str:
        """What a chat message holds where a clip goes, where its template does not place clips
        itself: the audio token between `<|audio_bos|>` and `<|audio_eos|>` (Qwen2-Audio's
        processor's form; the token alone where the tokenizer lacks them)."""
        hf = self.tokenizer.hf  # type: ignore[union-attr]
        token = hf.convert_ids_to_tokens(vision.placeholder_id)
        ids = hf.convert_tokens_to_ids(["<|audio_bos|>", "<|audio_eos|>"])
        if any(i is None or i == hf.unk_token_id for i in ids):
            return token
        return f"<|audio_bos|>{token}<|audio_eos|>"

    def _pan_and_scan(self, ids: list[int], images: list[Pixels], crops: list[list[Pixels]]
                      ) -> tuple[list[int], list[Pixels]]:
        """Gemma 3's pan and scan: each image with crops read as HF's processor writes it, "Here
        is the original image <start_of_image> and here are some crops to help you see better"
        and a `<start_of_image>` a crop (each then framed as any image), in place of its
        placeholder; the images and crops in the order of their placeholders."""
        vision = self.arch.vision  # type: ignore[attr-defined]
        boi = vision.placeholder_id
        if len(images) != ids.count(boi):  # (`expand_image_tokens` says how they do not pair up)
            return ids, images
        if self.tokenizer is None:
            raise InvalidRequestError("Gemma 3's pan and scan needs the tokenizer: its crops are introduced in text",
                                      param="image")
        mark = self.tokenizer.hf.convert_ids_to_tokens(boi)
        out: list[int] = []
        placed: list[Pixels] = []
        pending = iter(zip(images, crops, strict=True))
        for t in ids:
            if t != boi:
                out.append(t)
                continue
            image, its = next(pending)
            placed += [image, *its]
            if not its:
                out.append(t)
                continue
            text = (f"Here is the original image {mark} and here are some crops to help you see better "
                    + " ".join([mark] * len(its)))
            written = self.tokenizer.encode(text, add_special_tokens=False)
            if written.count(boi) != 1 + len(its):
                raise InvalidRequestError(f"this tokenizer does not keep {mark} whole: pan and scan cannot place "
                                          "the crops", param="image")
            out += written
        return out, placed

    def _place_videos(self, ids: list[int], images: list[Pixels], videos: list[Pixels]
                      ) -> tuple[list[int], list[Pixels], list[list[int] | None]]:
        """A prompt's images and videos in the order of their placeholders, each video token
        made an image placeholder whose span is the video's tokens (`expand_image_tokens`'s
        layouts): Qwen3-VL's, one a frame group, each after its time in text ("<1.5 seconds>")
        between a vision start and end (in place of the template's own start, pad and end, as
        vLLM reads them); InvalidRequestError where the video tokens and the videos do not pair up."""
        vision = self.arch.vision  # type: ignore[attr-defined]
        marks = [t for t in ids if t == vision.video_token_id]
        if len(marks) != len(videos):
            raise InvalidRequestError(
                f"the prompt has {len(marks)} video tokens for {len(videos)} videos: put one video token "
                f"(the model's, id {vision.video_token_id}) where each video goes, or send the videos as a chat's "
                "content parts",
                param="video")
        if len(images) != ids.count(vision.placeholder_id):  # (`expand_image_tokens` says how they do not pair up)
            return ids, [*images, *videos], [None] * (len(images) + len(videos))
        start, end = vision.vision_start_token_id, vision.vision_end_token_id
        out: list[int] = []
        placed: list[Pixels] = []
        pending = {vision.placeholder_id: iter(images), vision.video_token_id: iter(videos)}
        i = 0
        while i < len(ids):
            t = ids[i]
            i += 1
            if t not in pending:
                out.append(t)
                continue
            item = next(pending[t])
            if not (item.fps and vision.timestamps):
                placed.append(item)
                out.append(vision.placeholder_id)
                continue
            if self.tokenizer is None:
                raise InvalidRequestError("Qwen3-VL's videos need the tokenizer: their frames' times are text",
                                          param="video")
            if out and out[-1] == start and i < len(ids) and ids[i] == end:
                out.pop()
                i += 1
            for k, second in enumerate(item.times):
                out += [*self.tokenizer.encode(f"<{second:.1f} seconds>", add_special_tokens=False), start,
                        vision.placeholder_id, end]
                placed.append(item.frame_group(k, vision.temporal_patch_size))
        layouts = [[vision.video_token_id] * vision.image_tokens(p) if p.fps else None for p in placed]
        return out, placed, layouts

    @functools.cached_property
    def _image_frame(self) -> tuple[list[int], list[int]]:
        """What stands before and after an image's tokens in place of its placeholder: Gemma 3's
        "\n\n" and begin-of-image token, then its end-of-image token and "\n\n" (HF's
        processor's `full_image_sequence`); nothing for LLaVA."""
        vision = self.arch.vision  # type: ignore[attr-defined]
        if vision.style == "internvl":  # (its processor's `<img>` ... `</img>`)
            if self.tokenizer is None:
                return [], []
            ids = self.tokenizer.hf.convert_tokens_to_ids(["<img>", "</img>"])
            if any(i is None or i == self.tokenizer.hf.unk_token_id for i in ids):
                from conveyor.models.loader import ModelLoadError

                raise ModelLoadError("this tokenizer has no <img> and </img> to frame InternVL's images")
            return [ids[0]], [ids[1]]
        if vision.boi_token_id is None:
            return [], []
        gap = [] if self.tokenizer is None else self.tokenizer.encode("\n\n", add_special_tokens=False)
        return [*gap, vision.boi_token_id], [vision.eoi_token_id, *gap]

    def _embeds_prompt(self, prompt: dict[str, Any], params: SamplingParams | None
                       ) -> tuple[str | None, list[int], tuple[ImageSpan, ...]]:
        """vLLM's `{"prompt_embeds": tensor}`: `[tokens, hidden]` rows that go into the model where
        the embedding table's would (scaled as the model scales its own: Gemma's, Granite's), as
        placeholder token ids (0) with one span over them, keyed in the prefix cache by a digest
        of their values."""
        import hashlib

        import torch

        if not self.config.model.enable_prompt_embeds:
            raise InvalidRequestError("prompt_embeds needs enable_prompt_embeds=True (--enable-prompt-embeds)",
                                      param="prompt_embeds")
        if set(prompt) - {"prompt_embeds"}:
            raise InvalidRequestError(f"a prompt of embeddings has no field {sorted(set(prompt) - {'prompt_embeds'})[0]!r}",
                                      param="prompt")
        model: Any = getattr(self.runner, "model", None)
        arch = getattr(model, "arch", None)
        if (arch is None or self.is_encoder or getattr(model, "encoder_decoder", False) or arch.vision is not None
                or arch.mrope_section or arch.multimodal):
            raise InvalidRequestError("prompt_embeds are taken by text decoders (not encoders, Whisper or image-text "
                                      "models)", param="prompt_embeds")
        values = prompt["prompt_embeds"]
        if (not isinstance(values, torch.Tensor) or values.dim() != 2 or values.shape[0] == 0
                or values.shape[1] != arch.hidden_size or not values.is_floating_point()):
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise InvalidRequestError(f"prompt_embeds must be a float tensor [tokens, {arch.hidden_size}], not {shape}",
                                      param="prompt_embeds")
        if not bool(torch.isfinite(values).all()):
            raise InvalidRequestError("prompt_embeds hold a value that is not finite", param="prompt_embeds")
        if params is not None and (params.repetition_penalty != 1.0 or params.truncate_prompt_tokens is not None):
            raise InvalidRequestError("repetition_penalty and truncate_prompt_tokens read the prompt's tokens: a "
                                      "prompt of embeddings has none", param="prompt_embeds")
        if self.drafter is not None:
            raise InvalidRequestError("a draft model reads tokens: not with prompt_embeds", param="prompt_embeds")
        values = values.detach().to("cpu", torch.float32).contiguous()
        digest = hashlib.sha256(b"prompt_embeds" + values.numpy().tobytes()).digest()
        n = int(values.shape[0])
        return None, [0] * n, (ImageSpan(0, n, Pixels(values, digest, embeds=True)),)

    def _check_encoder_budget(self, images: tuple[ImageSpan, ...]) -> None:
        """InvalidRequestError where a prompt's media could never be encoded within a step's
        `max_num_encoder_input_tokens`: an item larger than it, or (prompts computed whole) all
        of them together."""
        sc = self.scheduler.config
        cap = sc.max_num_encoder_input_tokens
        images = tuple(span for span in images if not span.pixels.embeds)  # (embeddings: no encoder)
        if cap is None or not images:
            return
        largest = max(span.length for span in images)
        if largest > cap:
            raise InvalidRequestError(f"a media item of {largest} tokens is more than max_num_encoder_input_tokens="
                                      f"{cap}: no step could encode it", param="multi_modal_data")
        total = sum(span.length for span in images)
        if sc.prefill_mode != "chunked" and total > cap:
            raise InvalidRequestError(f"the prompt's media are {total} tokens, more than max_num_encoder_input_tokens="
                                      f"{cap}, and prefill_mode={sc.prefill_mode!r} computes a prompt whole",
                                      param="multi_modal_data")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if this request can never be served."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})",
                param="prompt",
            )
        if params.pooling is None and self.labels:
            raise InvalidRequestError(
                f"this model is a classifier ({len(self.labels)} classes): it generates no text; "
                "classify, score or embed with it", param="model",
            )
        if params.pooling is None and self.is_encoder:
            raise InvalidRequestError("this model is an encoder: it generates no text; embed or score with it",
                                      param="model")
        if params.pooling is not None:  # an embedding generates nothing: its prompt may fill the context
            self._check_pooling(params.pooling)
            if len(token_ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"the prompt has {len(token_ids)} tokens, but this engine embeds at most "
                    f"{self.max_model_len}; shorten the prompt", param="prompt",
                )
        elif len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but this engine serves at most "
                f"{self.max_model_len} tokens per sequence (prompt + at least 1 generated); "
                "shorten the prompt",
                param="prompt",
            )
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise InvalidRequestError(
                    f"{name}: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})", param=name
                )
        if params.bad_words and getattr(self.runner, "word_token_ids", None) is None:
            raise InvalidRequestError(
                "bad_words need the engine's tokenizer (this engine has none, or its runner samples no tokens)",
                param="bad_words",
            )
        if params.structured_outputs is not None:
            self._check_grammar(params.structured_outputs)
        sc = self.scheduler.config
        if sc.prefill_mode != "chunked" and len(token_ids) > sc.max_num_batched_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens="
                f"{sc.max_num_batched_tokens}, and prefill_mode={sc.prefill_mode!r} runs prompts "
                "whole; use prefill_mode='chunked' or a larger max_num_batched_tokens",
                param="prompt",
            )

    def uncompiled_grammars(self, params: Iterable[SamplingParams]) -> list[StructuredOutputParams]:
        """The grammars of these requests that adding them would compile (not cached yet):
        an engine process compiles them in a worker first (`compile_grammars`), so that its
        loop goes on stepping the running requests meanwhile."""
        grammars = getattr(self.runner, "grammars", None)
        if grammars is None:
            return []
        specs = {p.structured_outputs for p in params if p.structured_outputs is not None}
        return [s for s in specs if not grammars.cached(s)]

    def compile_grammars(self, specs: Iterable[StructuredOutputParams]) -> None:
        """Compile grammars into the engine's cache; raises InvalidRequestError as adding a
        request with one would. Safe from another thread than the one stepping the engine.

        The DFAs are compiled in a worker process (started on the first call), so that the
        compile does not share the GIL with the thread stepping the engine."""
        grammars = getattr(self.runner, "grammars", None)
        if grammars is not None:
            grammars.compile_in_worker()
        for spec in specs:
            self._check_grammar(spec)

    def _check_grammar(self, spec: StructuredOutputParams) -> None:
        """Compile a request's grammar against the vocabulary now (the engine caches it), so
        one that cannot work fails here, not in a step."""
        from conveyor.structured import GrammarError

        grammars = getattr(self.runner, "grammars", None)
        if grammars is None:
            raise InvalidRequestError(
                "structured outputs need the engine's tokenizer (this engine has none, or its "
                "runner samples no tokens)", param="structured_outputs",
            )
        try:
            grammars.get(spec)
        except GrammarError as e:
            raise InvalidRequestError(f"structured outputs: {e}", param="structured_outputs") from None

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | ImagePrompt | dict[str, Any],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        stream: bool = False,
        prompt_text: str | None = None,
        resume: Resume | None = None,
        lora_request: LoRARequest | None = None,
        export_kv: bool = False,
        kv_handoff: KVHandoff | None = None,
        images: tuple[ImageSpan, ...] = (),
    ) -> None:
        """Queue a request. Raises InvalidRequestError (and queues nothing) if it can never run.

        `prompt` is text, token ids, or either with images (`ImagePrompt`, or vLLM's dict
        `{"prompt": ..., "multi_modal_data": {"image": ...}}`: conveyor/multimodal.py); `images`
        places the images of token ids whose image tokens are expanded already.

        `prompt_text` names the text of already-tokenized `prompt` ids, for the output.
        `resume` continues a request another engine had started (an engine process replaced
        after a crash, or the prefill engine of a disaggregated request); its outputs are not
        emitted again. `lora_request` names the adapter it runs with (`enable_lora`); the
        adapter is loaded now, so a bad one fails here. `export_kv` makes this the prefill of a
        disaggregated request (`max_tokens=1`): its final output carries the K/V of its prompt
        (`RequestOutput.kv_handoff`). `kv_handoff` brings such K/V in: they must be of a prefix
        of the request's tokens (prompt, then resumed outputs) and leave one to compute; the
        request then computes only the rest (conveyor/kv_transfer.py).
        """
        if request_id in self._requests or request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if self._sleeping:
            raise InvalidRequestError("the engine is asleep (sleep mode): wake_up first", param="sleep")
        params = params or SamplingParams()
        for proc in getattr(self.runner, "logits_processors", ()):  # (vLLM's validate_params)
            try:
                proc.validate_params(params)
            except (ValueError, TypeError) as e:
                raise InvalidRequestError(f"{type(proc).__name__}: {e}", param="extra_args") from None
        if params.pooling is not None and params.pooling.pooling_type is None:  # the model's own pooling
            tokens = (self.token_classifier or self.head.lexical) and params.pooling.task == "classify"
            params = dataclasses.replace(params, pooling=dataclasses.replace(
                params.pooling, pooling_type="all" if tokens else self.default_pooling))
        if (export_kv or kv_handoff is not None) and params.n > 1:
            raise InvalidRequestError("K/V are handed over for one choice (n=1)", param="kv_transfer")
        if export_kv and params.max_tokens != 1:
            raise InvalidRequestError(
                "export_kv runs the prefill of a disaggregated request: max_tokens must be 1", param="kv_transfer"
            )
        if params.pooling is not None and (export_kv or kv_handoff is not None):
            raise InvalidRequestError("an embedding request has no K/V to hand over", param="kv_transfer")
        if params.n > 1:
            self._add_parent(request_id, prompt, params, arrival_time, stream, prompt_text, resume, lora_request,
                             images)
            return
        text, token_ids, images = self.prepare_prompt(prompt, params, images)
        if images:
            self._check_encoder_budget(images)
        if images and (export_kv or kv_handoff is not None):
            what = "given as embeddings" if images[0].pixels.embeds else "with images"
            raise InvalidRequestError(f"K/V of a prompt {what} are not handed over", param="kv_transfer")
        self.validate(token_ids, params)
        if lora_request is not None:
            self.check_lora(lora_request)
        seq = Sequence(
            self._next_seq_id,
            request_id,
            token_ids,
            params,
            self.clock() if arrival_time is None else arrival_time,
            lora_request,
            images,
        )
        self._next_seq_id += 1
        detok = None
        if self.tokenizer is not None and (stream or params.stop):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
        kind = params.output_kind
        req = _Request(
            request_id, text if text is not None else prompt_text, seq, detok, stream and kind != "final_only",
            [] if params.logprobs is not None else None, delta=kind == "delta",
        )
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        if resume is not None:
            self._resume(req, resume)
        if kv_handoff is not None:
            self._check_handoff(seq, kv_handoff)
        req.export_kv = export_kv
        self._requests[request_id] = req
        self._by_seq[seq.seq_id] = req
        bm = self.scheduler.block_manager
        if kv_handoff is None:
            self._queue(seq)
        elif bm.pages_to_receive(kv_handoff.num_tokens) > bm.num_swap_blocks:
            logger.warning("request %s: its %d handed-over tokens exceed the swap space (kv_receive_space); "
                           "computing them again", request_id, kv_handoff.num_tokens)
            self.num_kv_recomputed += 1
            self._queue(seq)
        else:
            self._incoming.append((req, kv_handoff))
            self._admit_incoming()

    def _check_pooling(self, pooling: PoolingParams) -> None:
        size = getattr(self.runner, "hidden_size", None)
        if size is None:
            raise InvalidRequestError("this engine's runner computes no hidden states to embed", param="pooling")
        if pooling.task == "classify" and self.head.lexical and not self.labels:
            if pooling.pooling_type not in (None, "all"):
                raise InvalidRequestError(
                    f"this model's lexical weights are a token each: pooling_type 'all', not {pooling.pooling_type!r}",
                    param="pooling_type",
                )
        elif pooling.task == "classify" and not self.labels:
            raise InvalidRequestError(
                "this model has no classification head: classify with a *ForSequenceClassification model, "
                "or embed with this one", param="task",
            )
        if pooling.task == "classify" and self.token_classifier and pooling.pooling_type not in (None, "all"):
            raise InvalidRequestError(
                f"this model classifies each token: its head reads pooling_type 'all', not {pooling.pooling_type!r}",
                param="pooling_type",
            )
        if pooling.dimensions is not None and pooling.dimensions > size:
            raise InvalidRequestError(
                f"dimensions={pooling.dimensions}: this model's embeddings have {size} values", param="dimensions"
            )

    def _check_handoff(self, seq: Sequence, handoff: KVHandoff) -> None:
        n = handoff.num_tokens
        if not 0 < n < seq.num_tokens or handoff.token_ids != seq.token_ids[:n]:
            raise InvalidRequestError(
                f"the handed-over K/V are of {n} tokens that are not a proper prefix of the request's "
                f"{seq.num_tokens}", param="kv_transfer",
            )
        lora = None if seq.lora_request is None else seq.lora_request.key
        if handoff.lora_key != lora:
            raise InvalidRequestError(
                f"the handed-over K/V were computed with adapter {handoff.lora_key!r}, the request runs {lora!r}",
                param="kv_transfer",
            )
        why = None if handoff.data is None else self.runner.kv_mismatch(handoff.data)
        if why is not None:
            raise InvalidRequestError(f"the handed-over {why}", param="kv_transfer")

    def _admit_incoming(self) -> None:
        """Queue handed-over requests, in arrival order, while the scheduler has a seat and swap
        space: their K/V go into swap blocks, and they come in as swapped-out sequences do."""
        while self._incoming:
            req, handoff = self._incoming[0]
            if not self.scheduler.can_receive(req.seq, handoff.num_tokens):
                return
            self._incoming.popleft()
            self.scheduler.receive(req.seq, handoff.num_tokens)
            seq = req.seq  # (a hybrid cache's sliding tables too: `BlockManager.receive`)
            self.runner.receive_kv(seq.block_table, handoff.data, seq.window_tables, seq.window_start)
            self.num_kv_received += 1

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Load (and so check) an adapter; InvalidRequestError if it cannot serve."""
        self._lora_manager(lora_request.lora_name).get(lora_request)

    def _lora_manager(self, name: object) -> LoRAManager:
        lora: LoRAManager | None = getattr(self.runner, "lora", None)
        if lora is None:
            raise InvalidRequestError(
                f"LoRA adapter {name!r}: this engine serves none (start it with enable_lora=True)",
                param="lora_request",
            )
        return lora

    # -- Whisper's word timestamps ---------------------------------------------------------------
    def cross_weights(self, features: list[Any], tokens: list[list[int]], heads: list[tuple[int, int]],
                      digests: list[bytes] | None = None) -> list[Any]:
        """Whisper's cross-attention probabilities of those (layer, head)s at each of a clip's
        decoder tokens (`Whisper.cross_weights`: a pass of its own, between steps), a
        `[heads, tokens, 1500]` tensor a clip: what `conveyor.transcribe` aligns words by. The
        encoder's outputs of the clips of those `digests` come from the encoder cache where it
        still holds them (their requests just ran), the others are encoded again."""
        model: Any = getattr(self.runner, "model", None)
        if not getattr(model, "encoder_decoder", False):
            raise InvalidRequestError("this model has no cross-attention to align words by (Whisper has)",
                                      param="timestamp_granularities")
        layers, heads_per_layer = model.arch.num_layers, model.arch.num_heads
        if any(not (0 <= layer < layers and 0 <= head < heads_per_layer) for layer, head in heads):
            raise InvalidRequestError(f"alignment heads {heads} are not all in this model's {layers} layers of "
                                      f"{heads_per_layer} heads", param="timestamp_granularities")
        if any(len(t) > self.max_model_len for t in tokens):
            raise InvalidRequestError("tokens past the decoder's positions", param="timestamp_granularities")
        cached = getattr(self.runner, "encoded", None)  # (ModelRunner's encoder cache)
        encoded = None if digests is None or cached is None else [cached(d) for d in digests]
        return model.cross_weights(features, tokens, [tuple(h) for h in heads], encoded)

    # -- adapters (vLLM's LLMEngine.add_lora, remove_lora, list_loras, pin_lora) --------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now, before a request names it (InvalidRequestError if it cannot
        serve); True. It is kept as any loaded adapter is: dropped when `max_cpu_loras` more
        recently used ones are loaded, unless pinned."""
        self.check_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop the loaded adapter of that id (and its pin); whether one was loaded. Requests
        still running with it load it again at their next step."""
        lora = self._lora_manager(lora_int_id)
        return any([lora.remove(key) for key in lora.loaded_keys if key[1] == lora_int_id])

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded now."""
        return {key[1] for key in self._lora_manager("?").loaded_keys}

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep the loaded adapter of that id loaded however many others are used, until
        `remove_lora`; True. InvalidRequestError if none is loaded (`add_lora` it first) or
        `max_cpu_loras` adapters are pinned already. A pinned adapter is kept beside the
        `max_cpu_loras` unpinned ones (vLLM counts it in their places; here pins cannot leave
        a step's `max_loras` adapters too few)."""
        lora = self._lora_manager(lora_int_id)
        key = next((k for k in lora.loaded_keys if k[1] == lora_int_id), None)
        if key is None:
            raise InvalidRequestError(f"no LoRA adapter of id {lora_int_id} is loaded; add_lora it first",
                                      param="lora_int_id")
        lora.pin(LoRARequest(key[0], key[1], lora.path_of(key)))
        return True

    def _add_parent(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None,
        stream: bool, prompt_text: str | None, resume: Resume | None, lora_request: LoRARequest | None,
        images: tuple[ImageSpan, ...] = (),
    ) -> None:
        """n choices as n requests over the same prompt: the first computes the prompt's
        logprobs if asked, choice i of a seeded request uses seed + i (vLLM's parallel sampling)."""
        if resume is not None:
            raise InvalidRequestError("a resumed request has one choice (n=1)", param="resume")
        text, token_ids, images = self.prepare_prompt(prompt, params, images)
        self.validate(token_ids, params)
        parent = ParallelChoices.of(request_id, params.n, params.output_kind, stream)
        if any(c in self._requests or c in self._parents for c in parent.child_ids):
            raise InvalidRequestError(f"request id {request_id!r}'s choices' ids are in use", param="request_id")
        arrival = self.clock() if arrival_time is None else arrival_time
        for i, (child, one) in enumerate(zip(parent.child_ids, params.choices(), strict=True)):
            self.add_request(child, token_ids, one, arrival, stream, text if text is not None else prompt_text,
                             lora_request=lora_request, images=images)
            self._child_of[child] = (parent, i)
        self._parents[request_id] = parent

    def _merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs of requests with n > 1 as their parents' (`ParallelChoices.merge`)."""
        merged: list[RequestOutput] = []
        for out in outputs:
            found = self._child_of.get(out.request_id)
            if found is None:
                merged.append(out)
                continue
            parent, index = found
            if out.finished:
                del self._child_of[out.request_id]
            one = parent.merge(index, out)
            if parent.done:
                del self._parents[parent.request_id]
            if one is not None:
                merged.append(one)
        return merged

    # -- live migration (Llumnix's) -----------------------------------------------------------
    def migrate_out(self, request_id: str) -> Migration | None:
        """Take a request out of this engine, to go on in another (`migrate_in`): its outputs so
        far, and the K/V of the tokens it has computed, read from the cache (a waiting or
        preempted or swapped-out request takes none). No output is emitted for it here, its blocks are freed.
        None (and nothing changes) for a request this engine cannot hand over: unknown or
        finished, one of `n` choices, a disaggregated prefill, an embedding, one with images,
        one with tokens still owed by a step in flight (async scheduling), or one that has
        generated nothing yet (it is as cheap to send again)."""
        req = self._requests.get(request_id)
        if req is None or req.done or req.export_kv or request_id in self._child_of:
            return None
        seq = req.seq
        params = seq.sampling_params
        if (params.pooling is not None or seq.images or seq.num_pending or not seq.num_output_tokens
                or self._in_flight is not None or any(waiting is req for waiting, _ in self._incoming)):
            return None
        computed = seq.num_computed_tokens if seq.status is SequenceStatus.RUNNING and seq.block_table else 0
        handoff = None
        if computed:
            lora = seq.lora_request
            handoff = KVHandoff(seq.token_ids[:computed], self.runner.read_kv(seq.block_table, computed, seq.window_tables),
                                self.runner.kv_bytes(computed), None if lora is None else lora.key)
        metrics = dataclasses.replace(seq.metrics, token_times=list(seq.metrics.token_times))
        resume = Resume(seq.output_token_ids, req.emitted_text, metrics, seq.num_preemptions)
        out = Migration(request_id, seq.token_ids[: seq.prompt_len], req.prompt, params, resume, handoff,
                        seq.lora_request, req.stream)
        self.scheduler.abort(seq.seq_id, self.clock())  # (its blocks freed; the runner drops its state next step)
        req.done = True
        self._requests.pop(request_id, None)
        self._by_seq.pop(seq.seq_id, None)
        self.num_migrated_out += 1
        return out

    def migrate_in(self, m: Migration, arrival_time: float | None = None) -> None:
        """Go on with a request another engine's `migrate_out` gave: its K/V land in the swap
        space and come in as a swapped-out sequence does (computed again where they cannot
        fit), its outputs are not emitted again, its timestamps carry over."""
        self.add_request(m.request_id, m.prompt_token_ids, m.params,
                         arrival_time=m.resume.metrics.arrival_time if arrival_time is None else arrival_time,
                         stream=m.stream, prompt_text=m.prompt_text, resume=m.resume,
                         lora_request=m.lora_request, kv_handoff=m.handoff)
        self.num_migrated_in += 1

    def _resume(self, req: _Request, resume: Resume) -> None:
        seq = req.seq
        outputs = resume.output_token_ids
        if len(outputs) >= seq.sampling_params.max_tokens or seq.prompt_len + len(outputs) >= self.max_model_len:
            raise InvalidRequestError("a resumed request has no tokens left to generate", param="resume")
        seq.token_ids += outputs
        seq.metrics = dataclasses.replace(resume.metrics, token_times=list(resume.metrics.token_times))
        seq.num_preemptions = resume.num_preemptions
        req.emitted_tokens = len(outputs)
        if req.detokenizer is not None:
            for t in outputs:  # the same text as before: nothing in it ended the request
                req.detokenizer.add(t)
            req.detokenizer.emitted = resume.emitted_text_len
        req.emitted_text = resume.emitted_text_len

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks are free when this returns."""
        parent = self._parents.get(request_id)
        if parent is not None:  # every choice still running; the last gives the parent's output
            outs = [out for c in parent.child_ids if c in self._child_of and (out := self._abort_one(c))]
            merged = self._merge(outs)
            return merged[-1] if merged else None
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        if req is None or req.done:
            return None
        for i, (waiting, _) in enumerate(self._incoming):
            if waiting is req:  # handed over, not yet in the scheduler: nothing to free
                del self._incoming[i]
                seq = req.seq
                seq.status, seq.finish_reason, seq.metrics.finished_time = (
                    SequenceStatus.FINISHED, FinishReason.ABORT, self.clock())
                return self._finish_output(req)
        self.scheduler.abort(req.seq.seq_id, self.clock())
        return self._finish_output(req)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or copies to make: a write-through of the blocks the last step
        computed (KV offloading's `write_through` policies) takes one more step. False while
        paused (`pause_generation`): there is nothing to step until `resume_generation`."""
        if self._paused:
            return False
        busy = (self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._incoming)
                or self.scheduler.block_manager.has_pending_copies)
        if self._draining and not busy:  # ("wait": the last request in flight at the pause is done)
            self._paused, self._draining = True, False
        return busy

    # -- pause and resume (vLLM's, for an RL trainer's weight updates) ---------------------------
    def pause_generation(self, mode: str = "keep", clear_cache: bool = False) -> list[RequestOutput]:
        """Stop generating until `resume_generation` (vLLM's `pause_generation`): "keep" freezes
        every request where it stands (no step runs; requests added meanwhile queue); "wait"
        lets the requests already here finish, then pauses (`is_paused` says when), holding the
        ones added meanwhile; "abort" aborts every request (their final outputs are returned)
        and pauses. `clear_cache` forgets the prefix cache (no request after the pause reuses K/V
        computed before it; the requests kept keep their own blocks)."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode={mode!r} is not one of {', '.join(PAUSE_MODES)}", param="mode")
        aborted: list[RequestOutput] = []
        if mode == "abort":
            for rid in [*self._parents, *(r for r in self._requests if r not in self._child_of)]:
                if (out := self.abort_request(rid)) is not None:
                    aborted.append(out)
        if mode == "wait":
            self._draining = not self._paused
        else:
            self._paused, self._draining = True, False
        if clear_cache:
            self.reset_prefix_cache()
        return aborted

    def resume_generation(self) -> bool:
        """Go on after `pause_generation`: the frozen requests step again, the held ones queue."""
        self._paused = self._draining = False
        held, self._held = self._held, []
        for seq in held:
            self.scheduler.add(seq)
        return True

    def is_paused(self) -> bool:
        """Paused: "keep" and "abort" at once, "wait" once its requests are done."""
        if self._draining:
            self.has_unfinished_requests()
        return self._paused

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> bool:
        """Load new weights of the same architecture (SGLang's `update_weights_from_disk`: an RL
        trainer's checkpoint), checked against the running model's shapes; the prefix cache is
        forgotten (its K/V were computed with the old weights). A checkpoint of the same
        configuration is copied into the running model where it `fits_in_place` (CPU); otherwise a
        new model is built from `model_path` as this engine built its own (dtype, device,
        kernels, int8 calibrated again) and put in its place (CUDA graphs captured again), both
        models in memory while it loads. Idle or paused only (`pause_generation`): a request
        frozen by "keep" goes on with the new weights over the K/V it computed with the old ones.
        Not built for encoders, Whisper or image towers; nor, where the model is built again,
        for tensor parallelism, speculative decoding (but n-gram's) or LoRA: InvalidRequestError."""
        from conveyor.models.loader import (
            ModelLoadError,
            open_model,
            resolve_model_path,
        )

        self._check_weight_update("model_path")
        runner: Any = self.runner
        old = runner.model
        try:
            path = resolve_model_path(model_path)
            arch, tensors, _ = open_model(path)
        except (FileNotFoundError, ValueError) as e:
            raise InvalidRequestError(f"model_path={model_path!r}: {e}", param="model_path") from None
        peers = getattr(runner, "peers", None)
        same = arch == getattr(old, "arch", None) or (peers is not None and arch == peers.arch)
        if same and self._weights_blocker(in_place=True) is None:
            try:
                if self._update_in_place(dict(tensors), whole=True):
                    self._put_model(old, flush_cache=True, weight_version=weight_version)
                    self.model_path, self._weight_overlay = str(path), {}
                    return True
            except ModelLoadError as e:
                raise InvalidRequestError(f"model_path={model_path!r}: {e}", param="model_path") from None
        self._check_rebuildable("updating the weights", "model_path")
        path, new = self._build_model_like(model_path, old, param="model_path")
        self._put_model(new, flush_cache=True, weight_version=weight_version)
        self.model_path, self._weight_overlay = str(path), {}
        return True

    def update_weights_from_tensor(self, named_tensors: Any, flush_cache: bool = True,
                                   weight_version: str | None = None) -> bool:
        """New values of some or all of the model's tensors, by their HF names (SGLang's
        `update_weights_from_tensor`; what TRL and verl hand vLLM's `load_weights` in the trainer's
        process): a `{name: tensor}` mapping or `(name, tensor)` pairs, q/k/v and gate/up apart or
        fused, on any device and dtype. Where the model `fits_in_place` (CPU) they are copied into
        its own parameters (each tensor-parallel rank its slice; adapters, drafters and the
        fused decode keep reading them); elsewhere (CUDA, whose kernels and graphs are captured
        on the model as built; int8, quantized again) the model is built again, as
        `update_weights_from_disk` builds it, from the checkpoint at `model_path` with every
        tensor sent so far in place. A copy of each tensor sent is kept on the host, for that and
        for `wake_up` after sleep level 2. A name no parameter has or a shape that does not fit
        is an InvalidRequestError and changes nothing. Idle or paused engines only;
        `flush_cache=False` keeps the prefix cache (K/V of the old weights)."""
        from conveyor.models.loader import ModelLoadError
        from conveyor.weight_sync import named_items

        self._check_weight_update("named_tensors")
        if self.model_path is None:
            raise InvalidRequestError("this engine was not built from a checkpoint's path: the rest of the weights "
                                      "are read from there", param="named_tensors")
        runner: Any = self.runner
        sent = {n: t.detach().to(device="cpu", dtype=runner.dtype if t.is_floating_point() else t.dtype, copy=True)
                for n, t in named_items(named_tensors)}
        overlay = {**self._weight_overlay, **sent}
        if self._weights_blocker(in_place=True) is None:
            try:
                in_place = self._update_in_place(sent)
            except ModelLoadError as e:
                raise InvalidRequestError(f"named_tensors: {e}", param="named_tensors") from None
        else:
            in_place = False
        if not in_place:
            self._check_rebuildable("updating the weights", "named_tensors")
            _, runner.model = self._build_model_like(self.model_path, runner.model, overlay, param="named_tensors")
        self._put_model(runner.model, flush_cache=flush_cache, weight_version=weight_version)
        self._weight_overlay = overlay
        return True

    def _update_in_place(self, tensors: dict[str, Any], whole: bool = False) -> bool:
        """`update_weights_in_place` on this process's model, and on each tensor-parallel rank its
        slice (checked here first, on rank 0's: every rank's slice has its shapes)."""
        from conveyor.models.loader import fits_in_place, update_weights_in_place

        runner: Any = self.runner
        peers = getattr(runner, "peers", None)
        if peers is None:
            return update_weights_in_place(runner.model, tensors, whole)
        from conveyor.models.tensor_parallel import shard_tensors

        if not fits_in_place(runner.model):
            return False
        mine = dict(shard_tensors(iter(tensors.items()), 0, peers.size, peers.arch))
        update_weights_in_place(runner.model, mine, whole)
        peers.update_weights(tensors)
        return True

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None,
                                  timeout_s: float = 600.0) -> bool:
        """Join a trainer's weight-update group as rank `rank_offset` (SGLang's call: the trainer
        is rank 0, `conveyor.weight_sync.WeightBroadcaster`); blocks until every rank has joined.
        `backend`: "gloo" (CPU) or "nccl" (CUDA); by default the one of this engine's device."""
        from conveyor.weight_sync import WeightUpdateGroup

        if group_name in self._weight_groups:
            raise InvalidRequestError(f"group_name={group_name!r}: this engine is in that group already",
                                      param="group_name")
        if not isinstance(rank_offset, int) or rank_offset < 1:
            raise InvalidRequestError(f"rank_offset={rank_offset!r}: an engine's rank is 1 or more (the trainer "
                                      "is 0)", param="rank_offset")
        runner: Any = self.runner
        if backend is None:
            backend = "nccl" if getattr(getattr(runner, "device", None), "type", "cpu") == "cuda" else "gloo"
        self._weight_groups[group_name] = WeightUpdateGroup(master_address, master_port, rank_offset, world_size,
                                                            group_name, backend, timeout_s)
        return True

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, bucket_bytes: int = 0) -> bool:
        """Receive tensors the trainer broadcasts over the group (`init_weights_update_group`),
        one of each name, dtype and shape in that order (`bucket_bytes` > 0: packed in the
        buckets `conveyor.weight_sync.bucket_plan` makes, as the trainer's `send` was told), and
        load them as `update_weights_from_tensor` does. Every tensor is received before anything
        is checked against the model (the trainer's broadcast must not hang); a bad list is
        refused before."""
        from conveyor.weight_sync import check_update_metadata

        group = self._weight_groups.get(group_name)
        if group is None:
            raise InvalidRequestError(f"group_name={group_name!r}: no such weight-update group "
                                      "(init_weights_update_group first)", param="group_name")
        check_update_metadata(names, dtypes, shapes)
        self._check_weight_update("names")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 0:
            raise InvalidRequestError(f"bucket_bytes={bucket_bytes!r}: a size in bytes, 0 for none", param="bucket_bytes")
        tensors = group.receive(names, dtypes, shapes, bucket_bytes)
        return self.update_weights_from_tensor(tensors, flush_cache, weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> bool:
        group = self._weight_groups.pop(group_name, None)
        if group is None:
            raise InvalidRequestError(f"group_name={group_name!r}: no such weight-update group", param="group_name")
        group.close()
        return True

    def get_weight_version(self) -> str:
        return self.weight_version

    def _check_weight_update(self, param: str) -> None:
        if self._sleeping:
            raise InvalidRequestError("the engine is asleep: wake_up first", param=param)
        if not self._paused and self.has_unfinished_requests():
            raise InvalidRequestError("update the weights of an idle or paused engine (pause_generation first)",
                                      param=param)
        why = self._weights_blocker(in_place=True)
        if why is not None:
            raise InvalidRequestError(f"updating the weights is not built with {why}", param=param)

    def _put_model(self, new: Any, flush_cache: bool, weight_version: str | None) -> None:
        runner: Any = self.runner
        runner.model = new
        if runner.graphs is not None:  # (they replay the old model's kernels on its weights)
            runner.graphs = runner.capture_graphs()
        if flush_cache:
            self.reset_prefix_cache()
        if weight_version is not None:
            self.weight_version = str(weight_version)

    def _weights_blocker(self, in_place: bool) -> str | None:
        """What keeps this engine's weights from being replaced (None: nothing): copied in place
        (`in_place`), only a model of another kind (encoders, Whisper, image towers); built again,
        also tensor parallelism, a drafter that reads the target (but n-gram's) and adapters."""
        runner: Any = self.runner
        old: Any = getattr(runner, "model", None)
        if (old is None or self.is_encoder or getattr(old, "encoder_decoder", False)
                or getattr(old, "vision", None) is not None):
            return "this model"
        if in_place:
            return None
        method = self.config.scheduler.speculative_method
        return ("tensor parallelism" if getattr(runner, "peers", None) is not None
                else "speculative decoding" if self.drafter is not None or (method and method != "ngram")
                else "LoRA adapters" if self.config.model.enable_lora else None)

    def _check_rebuildable(self, what: str, param: str) -> None:
        """InvalidRequestError unless this engine's model can be built again from a path (a plain
        decoder on one rank, no drafter but n-gram's, no adapters, tower or encoder)."""
        why = self._weights_blocker(in_place=False)
        if why is not None:
            raise InvalidRequestError(f"{what} is not built with {why}", param=param)

    def _build_model_like(self, model_path: str, old: Any, overlay: dict[str, torch.Tensor] | None = None,
                          param: str = "model_path") -> tuple[Path, Any]:
        """A model from `model_path` (its tensors `overlay` names in their place) built as this
        engine built its own, checked against `old`'s shapes (`old` None: not checked)."""
        from conveyor.models.attention import TorchPagedAttention
        from conveyor.models.loader import (
            ModelLoadError,
            build_model,
            open_model,
            resolve_model_path,
        )
        from conveyor.weight_sync import overlaid

        try:
            path = resolve_model_path(model_path)
            arch, tensors, _ = open_model(path)
        except (FileNotFoundError, ValueError) as e:
            raise InvalidRequestError(f"model_path={model_path!r}: {e}", param="model_path") from None
        shape = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
        if old is not None and any(getattr(arch, f) != getattr(old.arch, f) for f in shape):
            theirs = {f: getattr(arch, f) for f in shape if getattr(arch, f) != getattr(old.arch, f)}
            raise InvalidRequestError(f"model_path={model_path!r} is another architecture ({theirs})", param="model_path")
        runner: Any = self.runner
        if overlay:
            tensors = overlaid(tensors, overlay)
        try:
            return path, build_model(arch, tensors, TorchPagedAttention(), self.max_model_len, runner.dtype,
                                     runner.device, self.config.model.quantization, self._calibration)
        except ModelLoadError as e:
            raise InvalidRequestError(f"{param}: {e}", param=param) from None

    # -- sleep mode (vLLM's) ---------------------------------------------------------------------
    def sleep(self, level: int = 1) -> bool:
        """Give memory back while the engine idles (vLLM's sleep mode: an RL trainer's turn on the
        device). Level 1 frees the KV cache (its swap and offloading space too) and forgets the
        prefix cache; level 2 also drops the weights, which `wake_up` builds again from the
        model's path (vLLM's level 1 also moves the weights to host memory: not built; here they
        stay). A drafter's KV cache (a draft model's, an MTP or EAGLE head's) and every
        tensor-parallel rank's go too; level 2 with those only where the model is built again
        (not with tensor parallelism or a drafter other than n-gram's). Idle engines only;
        requests are refused while asleep."""
        if level not in (1, 2):
            raise InvalidRequestError(f"level={level!r}: sleep takes level 1 or 2", param="level")
        if self._sleeping:
            return True
        if self.has_unfinished_requests() or self._held or self.scheduler.has_unfinished():
            raise InvalidRequestError("sleep needs an idle engine: requests are in flight", param="level")
        runner: Any = self.runner
        draft = getattr(self.drafter, "runner", None)
        if not hasattr(runner, "release_kv") or (draft is not None and not hasattr(draft, "release_kv")):
            raise InvalidRequestError("this engine's runner has no memory to give back", param="level")
        if level == 2:
            self._check_rebuildable("sleep level 2", "level")
            if self.model_path is None:
                raise InvalidRequestError("sleep level 2 builds the weights again from the model's path: this "
                                          "engine has none", param="level")
        self.reset_prefix_cache()
        runner.release_kv()
        if draft is not None:
            draft.release_kv()
        if getattr(runner, "peers", None) is not None:
            from conveyor.runner.tensor_parallel import Step

            runner.peers.send(Step(kv="release"))
        if level == 2:
            import gc

            runner.model, runner.graphs = None, None
            gc.collect()
        self._sleeping = level
        return True

    def wake_up(self) -> bool:
        """Take the memory `sleep` gave back (the weights built again after level 2)."""
        if not self._sleeping:
            return True
        runner: Any = self.runner
        if self._sleeping == 2:
            assert self.model_path is not None
            runner.model = self._build_model_like(self.model_path, None, self._weight_overlay)[1]
        runner.restore_kv()
        draft = getattr(self.drafter, "runner", None)
        if draft is not None:
            draft.restore_kv()
        if getattr(runner, "peers", None) is not None:
            from conveyor.runner.tensor_parallel import Step

            runner.peers.send(Step(kv="restore"))
        self._sleeping = 0
        return True

    def is_sleeping(self) -> bool:
        return bool(self._sleeping)

    def _queue(self, seq: Sequence) -> None:
        if self._draining or (self._paused and self._held):
            self._held.append(seq)  # (after a "wait" pause: not before resume_generation)
        else:
            self.scheduler.add(seq)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (a benchmark's cold start, or after changing weights).
        Requests in flight keep their blocks; they only stop being found by new requests."""
        self.scheduler.block_manager.reset_prefix_cache()
        self._publish_kv_events()  # (an idle engine takes no step to send AllBlocksCleared)
        return True

    # -- KV events -------------------------------------------------------------------------
    def _start_kv_events(self, cc: CacheConfig) -> None:
        self.enable_kv_events()
        if cc.kv_events_publisher == "zmq":
            import weakref

            from conveyor.core.kv_events import KVEventPublisher, KVEventsConfig

            self._kv_publisher = KVEventPublisher(KVEventsConfig(
                "zmq", cc.kv_events_endpoint, cc.kv_events_replay_endpoint, cc.kv_events_topic,
                cc.kv_events_buffer_steps, cc.data_parallel_rank))
            weakref.finalize(self, self._kv_publisher.close)

    def enable_kv_events(self) -> None:
        """Record KV events from now on (as `enable_kv_cache_events=True` does from the start):
        the simulator's replicas turn them on for a router that reads them."""
        if self.scheduler.block_manager.kv_events is None:
            self.scheduler.block_manager.kv_events = []

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's events since the last call (BlockStored, BlockRemoved,
        AllBlocksCleared; conveyor/core/kv_events.py), oldest first; with kv_events_publisher
        zmq they are published at each step instead, and this is empty."""
        return self.scheduler.block_manager.take_events()

    def _publish_kv_events(self) -> None:
        if self._kv_publisher is not None:
            self._kv_publisher.publish(self.scheduler.block_manager.take_events())

    def reset_mm_cache(self) -> bool:
        """Forget every media item's encoder output the encoder cache keeps (vLLM's
        `reset_mm_cache`): the next requests that show one encode it again. Sequences in flight
        keep what their steps already read."""
        reset = getattr(self.runner, "reset_encoder_cache", None)
        if reset is not None:
            reset()
        return True

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished + len(self._incoming)

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of requests that finished or (if streamed) moved.

        With async scheduling (and a runner that can launch a step without waiting for it),
        a call schedules and launches the next step, then completes the one launched before:
        the outputs are that earlier step's."""
        if self._paused:
            return []
        if self._incoming:
            self._admit_incoming()
        outputs = self._step_async() if self._async else self._step_sync()
        if self._kv_publisher is not None:
            self._publish_kv_events()
        elif (kept := self.scheduler.block_manager.kv_events) is not None and len(kept) > MAX_KEPT_KV_EVENTS:
            # Kept for `take_kv_events`, and no one takes them: the oldest go (once said).
            del kept[: len(kept) - MAX_KEPT_KV_EVENTS]
            if not self._kv_events_dropped:
                self._kv_events_dropped = True
                logger.warning("KV events: more than %d kept and not taken (Engine.take_kv_events); the oldest "
                               "are dropped (publish them with kv_events_publisher='zmq')", MAX_KEPT_KV_EVENTS)
        return self._merge(outputs) if self._child_of else outputs

    def _step_sync(self) -> list[RequestOutput]:
        start = self.clock()
        sched_out = self.scheduler.schedule(start)
        if self.drafter is not None:  # the draft model's guesses, into the step's placeholders
            self.drafter.fill(sched_out)
        if sched_out.is_empty:
            self._nothing_to_run(sched_out, start)
            return []
        run_out = self.runner.execute(sched_out)
        now = self._after_run(start, run_out)
        return self._complete(sched_out, run_out, start, now)

    def _step_async(self) -> list[RequestOutput]:
        while True:
            start = self.clock()
            sched_out = self.scheduler.schedule(start)
            launched = None
            if not sched_out.is_empty:
                launched = _InFlight(sched_out, self.runner.submit(sched_out), start)  # type: ignore[attr-defined]
            elif self._in_flight is not None:
                self._nothing_to_run(sched_out, start, idle=False)
            previous, self._in_flight = self._in_flight, launched
            if previous is not None:
                run_out = previous.handle.result()
                return self._complete(previous.scheduled, run_out, previous.start, self.clock())
            if launched is None:
                self._nothing_to_run(sched_out, start)
                return []
            # The first step after a pause: launch its successor too before completing it,
            # so that every call with work completes one step.

    def _nothing_to_run(self, sched_out: SchedulerOutput, start: float, idle: bool = True) -> None:
        if sched_out.finished_seq_ids:
            self.runner.execute(sched_out)  # computes nothing; the runner drops their state
        if sched_out.preempted_seq_ids:
            # Nothing to compute, but the step preempted (a displacement): keep it in the
            # trace, and go on at once.
            self._record(sched_out, start, self.clock() - start)
        elif idle and self.scheduler.has_unfinished():
            self._idle(self.scheduler.next_wakeup())

    def _complete(
        self, sched_out: SchedulerOutput, run_out: RunnerOutput, start: float, now: float
    ) -> list[RequestOutput]:
        accepted_before = self.scheduler.num_accepted_tokens
        for item in sched_out.scheduled:  # the K/V a disaggregated prefill hands over, before its blocks go
            if item.sample and (req := self._by_seq.get(item.seq_id)) is not None and req.export_kv:
                self._export(req, item.block_table, item.context_len, item.window_tables)
        updates = self.scheduler.update(sched_out, run_out.sampled, now, run_out.logprobs, run_out.accepted)
        self._record(sched_out, start, now - start, self.scheduler.num_accepted_tokens - accepted_before)

        outputs: list[RequestOutput] = []
        by_seq = self._by_seq
        if run_out.prompt_logprobs:
            self._take_prompt_logprobs(run_out.prompt_logprobs)
        if run_out.pooled:
            self._take_pooled(run_out.pooled)
        for upd in updates:
            req = by_seq.get(upd.seq.seq_id)
            if req is None or upd.new_token_id is None:
                continue
            stopped = False  # by a stop string at this token
            if req.detokenizer is not None or req.logprobs is not None:  # else a token has nothing to add
                stopped = self._on_token(req, upd.new_token_id, upd.logprob, upd.top_logprobs, now, upd.last)
            if not upd.last:  # more of this step's tokens follow (speculative decoding)
                if stopped:  # they come after the stop: not outputs
                    seq = req.seq
                    del seq.token_ids[upd.index + 1 :]
                    del seq.metrics.token_times[seq.num_output_tokens :]
                    outputs.append(self._finish_output(req))
            elif req.seq.status is SequenceStatus.FINISHED:
                outputs.append(self._finish_output(req))
            elif req.stream and (  # (not with output_kind "final_only"); the first token at once
                self._stream_interval == 1 or not req.emitted_tokens
                or len(req.seq.token_ids) - req.seq.num_pending - req.seq.prompt_len - req.emitted_tokens
                >= self._stream_interval
            ):
                outputs.append(self._output(req))
        return outputs

    def _export(self, req: _Request, block_table: list[int], num_tokens: int, window_tables: list[list[int]]) -> None:
        lora = req.seq.lora_request
        req.handoff = KVHandoff(
            req.seq.token_ids[:num_tokens], self.runner.read_kv(block_table, num_tokens, window_tables),
            self.runner.kv_bytes(num_tokens), None if lora is None else lora.key,
        )

    def _take_prompt_logprobs(self, got: dict[int, tuple[int, list[PromptLogprob]]]) -> None:
        """Append the prompt logprobs a step computed to their requests' lists; those a
        request has already (its prompt computed again after a preemption) are not taken twice."""
        for seq_id, (first, entries) in got.items():
            req = self._by_seq.get(seq_id)
            if req is None or req.prompt_logprobs is None:
                continue
            have, ids = req.prompt_logprobs, req.seq.token_ids
            for i, (logprob, rank, top) in enumerate(entries, start=first):
                if i == len(have):
                    have.append(TokenLogprob(ids[i], logprob, top, rank))

    def _take_pooled(self, got: dict[int, Any]) -> None:
        """The embedding requests' pooled vectors: cut to their `dimensions`, normalized; a
        classification's logits as probabilities (softmax; a sigmoid for one class)."""
        import torch

        for seq_id, vector in got.items():
            req = self._by_seq.get(seq_id)
            pooling = None if req is None else req.seq.sampling_params.pooling
            if req is None or pooling is None:
                continue
            v = vector.cpu()  # a vector, or (pooling_type "all") a row a prompt token
            if pooling.task == "classify":
                if pooling.activation and not (self.head.lexical and not self.labels):  # (ReLU'd by its head)
                    v = torch.sigmoid(v) if v.shape[-1] == 1 else torch.softmax(v, dim=-1)
            else:
                if pooling.dimensions is not None:
                    v = v[..., : pooling.dimensions]
                if pooling.normalize:
                    v = torch.nn.functional.normalize(v, dim=-1)
            if v.dim() == 2:
                req.token_embeddings = v.tolist()
            else:
                req.embedding = v.tolist()

    def _idle(self, wake_at: float | None) -> None:
        """Nothing is schedulable yet (a dynamic batch's window is open): wait a little."""
        now = self.clock()
        self.wait_until(min(now + 0.01, wake_at if wake_at is not None else now + 0.001))

    def wait_until(self, t: float) -> None:
        """Let time pass until `t` on the engine's clock (a simulator advances a virtual one)."""
        delay = t - self.clock()
        if delay > 0:
            time.sleep(delay)

    def _after_run(self, start: float, run_out: RunnerOutput) -> float:
        """The time the step ended (a virtual clock advances by the simulated duration)."""
        return self.clock()

    def _on_token(
        self,
        req: _Request,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        now: float,
        last: bool = True,
    ) -> bool:
        """Take one new token of `req`; True if it completes a stop string, which ends `req`.

        `last`: no token of this step follows (the sequence's state is this token's)."""
        seq = req.seq
        if req.logprobs is not None and logprob is not None:
            req.logprobs.append(TokenLogprob(token, logprob, top))
        # An EOS or stop token that ended the sequence is not text.
        ended_by_token = last and seq.status is SequenceStatus.FINISHED and seq.finish_reason is FinishReason.STOP
        if req.detokenizer is not None and not ended_by_token:
            req.detokenizer.add(token)
            if req.detokenizer.stopped_by is not None and not (last and seq.is_finished):
                seq.stop_reason = req.detokenizer.stopped_by
                if seq.is_finished:  # by a later token of the step: the stop string came first
                    seq.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(seq, FinishReason.STOP, now)
                return True
        return False

    def _text(self, req: _Request, final: bool) -> tuple[str, str]:
        """(full text, delta since the last output)."""
        seq = req.seq
        if req.detokenizer is not None:
            delta = req.detokenizer.delta(final=final)
            return req.detokenizer.text[: req.detokenizer.emitted], delta
        if self.tokenizer is None:
            return "", ""
        ids = seq.output_token_ids
        if seq.finish_reason is FinishReason.STOP and not isinstance(seq.stop_reason, str):
            ids = ids[:-1]  # the EOS / stop token is not part of the text
        text = self.tokenizer.decode(ids, seq.sampling_params.skip_special_tokens)
        delta = text[req.emitted_text :]
        req.emitted_text = len(text)
        return text, delta

    def _delta_text(self, req: _Request, final: bool) -> str:
        """The text new since the last output (`_text`'s delta, without the full text)."""
        if req.detokenizer is not None:
            return req.detokenizer.delta(final=final)
        return self._text(req, final)[1]  # no stream decoder: decoded whole, as `_text` does

    def _output(self, req: _Request, final: bool = False) -> RequestOutput:
        seq = req.seq
        tokens, start = seq.token_ids, seq.prompt_len
        end = len(tokens) - seq.num_pending  # the outputs so far (never a placeholder)
        delta_ids = tokens[start + req.emitted_tokens : end]
        logprobs = req.logprobs
        if req.delta:  # only what is new: no copy of the whole output a token
            delta = text = self._delta_text(req, final)
            out_ids = delta_ids
            if logprobs is not None:
                logprobs = logprobs[req.emitted_logprobs :]
                req.emitted_logprobs += len(logprobs)
        else:
            text, delta = self._text(req, final)
            out_ids = tokens[start:end]
            logprobs = list(logprobs) if logprobs is not None else None
        req.emitted_tokens = end - start
        reason = seq.finish_reason.value if seq.finish_reason else None
        if seq.sampling_params.pooling is not None:  # an embedding: the token its step sampled is no output
            text = delta = ""
            out_ids, delta_ids = [], []
            reason = "stop" if reason == "length" else reason
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=out_ids,
            finish_reason=reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            delta_text=delta,
            delta_token_ids=delta_ids,
        )
        if req.prompt_token_ids is None:
            req.prompt_token_ids = seq.prompt_token_ids
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is not None and req.delta:
            prompt_logprobs = None if req.emitted_prompt_logprobs else prompt_logprobs
            req.emitted_prompt_logprobs = True
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=seq.status is SequenceStatus.FINISHED,
            metrics=seq.metrics,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.metrics.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def _finish_output(self, req: _Request) -> RequestOutput:
        req.done = True
        out = self._output(req, final=True)
        out.kv_handoff = req.handoff
        out.embedding = req.embedding
        out.token_embeddings = req.token_embeddings
        seq = req.seq
        if self.trace:
            self.finished_requests.append(
                RequestRecord(
                    req.request_id, seq.seq_id, seq.prompt_len, seq.num_output_tokens,
                    out.outputs[0].finish_reason, seq.sampling_params.priority,
                    seq.num_preemptions, seq.metrics,
                )
            )
        self._requests.pop(req.request_id, None)
        self._by_seq.pop(req.seq.seq_id, None)
        return out

    def _record(self, sched_out: SchedulerOutput, start: float, duration: float, accepted: int = 0) -> None:
        bm = self.scheduler.block_manager
        self.last_step = StepRecord(
                step_id=sched_out.step_id,
                start=start,
                duration_s=duration,
                num_seqs=len(sched_out.scheduled),
                num_prefill_tokens=sched_out.num_prefill_tokens,
                num_decode_tokens=sched_out.num_decode_tokens,
                num_waiting=len(self.scheduler.waiting),
                kv_blocks_used=bm.num_used_blocks,
                num_preempted=len(sched_out.preempted_seq_ids),
                num_running=len(self.scheduler.running),
                num_swapped=len(self.scheduler.swapped),
                blocks_swapped_out=len(sched_out.blocks_to_swap_out),
                blocks_swapped_in=len(sched_out.blocks_to_swap_in),
                seq_ids=tuple(s.seq_id for s in sched_out.scheduled),
                num_draft_tokens=sched_out.num_draft_tokens,
                num_accepted_tokens=accepted,
                blocks_stored=len(sched_out.blocks_to_store),
                blocks_loaded=len(sched_out.blocks_to_load),
                disk_blocks_written=len(sched_out.disk_writes),
                disk_blocks_read=len(sched_out.disk_reads),
        )
        if self.trace:
            self.step_trace.append(self.last_step)


def _has_tokenizer_files(folder: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return folder.is_dir() and any((folder / n).is_file() for n in names)


def _disk_tier(config: EngineConfig, runner: Any, dtype: Any, kv_dtype: Any, peers: Any) -> Any:
    """KV offloading's disk tier (`kv_disk_path`), in a subdirectory of this cache layout."""
    from conveyor.core.disk_tier import DiskTier, fingerprint

    cc, mc = config.cache, config.model
    if peers is not None:
        raise ConfigError("the KV disk tier under tensor parallelism is not built (each rank would write its "
                          "shard); leave kv_disk_path unset")
    if mc.enable_lora:
        raise ConfigError("the KV disk tier with LoRA adapters is not built (a block's hash names an adapter by "
                          "its name and id, which another run may give other weights); leave kv_disk_path unset")
    from conveyor.models.loader import resolve_model_path

    model = str(resolve_model_path(mc.model))
    stat = os.stat(model)
    pages = runner.swap_pages
    bs = cc.block_size
    block_bytes = sum(p[:, :bs].numel() * p.element_size() for p in pages)
    num_blocks = cc.kv_disk_size // block_bytes
    if not num_blocks:
        raise ConfigError(f"kv_disk_size={cc.kv_disk_size} bytes holds no KV block of {block_bytes} bytes")
    layout = fingerprint(os.path.realpath(model), stat.st_size, stat.st_mtime_ns, mc.quantization, str(dtype),
                         str(kv_dtype), bs, len(pages), tuple(pages[0].shape[2:]))
    assert cc.kv_disk_path is not None
    try:
        return DiskTier(cc.kv_disk_path, layout, num_blocks, block_bytes)
    except OSError as e:
        raise ConfigError(f"kv_disk_path={cc.kv_disk_path!r} cannot hold the KV disk tier: {e}") from None


class CachePlan(NamedTuple):
    """What `plan_cache` sizes: device KV blocks, CPU swap blocks, the longest sequence, and
    KV offloading's host blocks (numbered after the swap blocks in the runner's host pool)."""

    num_blocks: int
    num_swap_blocks: int
    max_model_len: int
    num_offload_blocks: int


def plan_cache(
    config: EngineConfig,
    kv_bytes_per_token: int,
    model_max_len: int,
    default_budget: Callable[[], int],
    max_positions: int | None = None,
    layout: HybridLayout | None = None,
    cross_tokens: int = 0,
) -> CachePlan:
    """The `CachePlan` for `config`; no torch, so the
    simulator sizes its cache by this same rule. `default_budget()` gives the KV bytes when
    the config names neither num_kv_blocks nor kv_cache_memory. With a hybrid `layout`,
    `kv_bytes_per_token` is a page's (its `page_layers` layers'), and a sequence's capacity
    counts its sliding groups' blocks too (`HybridLayout.capacity`). An encoder-decoder's
    sequence holds blocks for the encoder's `cross_tokens` positions beside its own."""
    mc, cc = config.model, config.cache
    block_bytes = kv_bytes_per_token * cc.block_size
    if cc.num_kv_blocks is not None:
        num_blocks = cc.num_kv_blocks
    elif not block_bytes:  # an encoder keeps no K/V: its blocks only count seats' tokens
        longest = min(mc.max_model_len or model_max_len, max_positions or model_max_len)
        num_blocks = config.scheduler.max_num_seqs * -(-(longest + 1) // cc.block_size)
    else:
        budget = cc.kv_cache_memory if cc.kv_cache_memory is not None else default_budget()
        num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"the KV cache budget holds no block of {cc.block_size} tokens "
            f"({block_bytes} bytes each); raise kv_cache_memory or num_kv_blocks"
        )
    capacity = num_blocks * cc.block_size
    if cross_tokens:
        cross_pages = -(-cross_tokens // cc.block_size)
        capacity = (num_blocks - cross_pages) * cc.block_size
        if capacity < 1:
            raise ConfigError(
                f"the KV cache's {num_blocks} blocks hold no request: one takes {cross_pages} blocks for the "
                f"cross-attention keys and values of the encoder's {cross_tokens} positions and one of its own; "
                "raise kv_cache_memory or num_kv_blocks"
            )
    if layout is not None:
        capacity = layout.capacity(num_blocks, cc.block_size, config.scheduler.kv_chunk)
        if capacity < 1:
            need = layout.pages_for(1, cc.block_size, config.scheduler.kv_chunk)
            raise ConfigError(
                f"the hybrid KV cache's {num_blocks} blocks hold no sequence: one takes a block of each of "
                f"its {need} tables; raise kv_cache_memory or num_kv_blocks"
            )
    max_len = mc.max_model_len or model_max_len
    if max_positions is not None and max_len > max_positions:
        if mc.max_model_len is not None:
            raise ConfigError(
                f"max_model_len={max_len} exceeds the {max_positions} positions this model was "
                "built for; load it again with the larger max_model_len"
            )
        max_len = max_positions
    if max_len > capacity:
        if mc.max_model_len is not None:
            raise ConfigError(
                f"max_model_len={max_len} exceeds the KV cache capacity of {capacity} tokens "
                f"({num_blocks} blocks x {cc.block_size}{', hybrid' if layout else ''}); raise the cache or "
                "lower max_model_len"
            )
        logger.info("max_model_len capped at the KV cache capacity: %d tokens", capacity)
        max_len = capacity

    # One CPU pool: blocks swapped out by preemption, and K/V handed over by a prefill engine.
    swaps = config.scheduler.preemption_mode != "recompute"
    num_swap_blocks = 0
    if cc.num_swap_blocks is not None and (swaps or cc.kv_receive_space):
        num_swap_blocks = cc.num_swap_blocks
    elif cc.num_swap_blocks is None and block_bytes:
        num_swap_blocks = ((cc.swap_space if swaps else 0) + cc.kv_receive_space) // block_bytes
    # KV offloading's tier: host blocks of its own (numbered after the swap blocks).
    num_offload_blocks = cc.num_offload_blocks if cc.num_offload_blocks is not None else (
        cc.kv_offloading_size // block_bytes if block_bytes else 0)
    if cc.kv_offloading_size and block_bytes and not num_offload_blocks:
        raise ConfigError(
            f"kv_offloading_size={cc.kv_offloading_size} bytes holds no KV block of {block_bytes} bytes "
            f"(it is in bytes, where vLLM's --kv-offloading-size is in GiB: {cc.kv_offloading_size} GiB is "
            f"{cc.kv_offloading_size << 30})"
        )
    if num_offload_blocks and (layout is not None or cross_tokens or not block_bytes):
        raise ConfigError("KV offloading is built for a decoder's whole KV cache (not a hybrid one, an "
                          "encoder-decoder's or an encoder's); leave kv_offloading_size at 0")
    return CachePlan(num_blocks, num_swap_blocks, max_len, num_offload_blocks)


def _classifier_from_tokens(model: Any, tokenizer: Tokenizer | None, tokens: tuple[str, ...],
                            config: EngineConfig) -> None:
    """Give a causal LM a classification head read from its LM head's rows for `tokens` (vLLM's
    classifier_from_token): with two, the difference of their rows (the second's class, a
    cross-encoder's relevance: sigmoid(l2 - l1) is the second's share of the two's softmax);
    with more, one row a class. The LM head stays; the model now only classifies."""
    import dataclasses

    import torch

    arch = model.arch
    why = ("it is an encoder" if arch.is_encoder else "it is a classifier already" if arch.labels
           else "int8 quantizes the LM head" if config.model.quantization is not None
           else "each tensor-parallel rank holds a slice of the LM head" if config.model.tensor_parallel_size > 1
           else "it has no tokenizer to find the tokens" if tokenizer is None else None)
    if why is not None:
        raise ConfigError(f"classifier_from_tokens: not for this model: {why}")
    assert tokenizer is not None
    ids = []
    for token in tokens:
        found = tokenizer.encode(token, add_special_tokens=False)
        if len(found) != 1:
            raise ConfigError(f"classifier_from_tokens: {token!r} is {len(found)} tokens of this vocabulary, not one")
        ids.append(found[0])
    with torch.no_grad():
        rows = model.head_weight[ids].clone()
        weight = (rows[1] - rows[0])[None] if len(ids) == 2 else rows
        score = torch.nn.Linear(arch.hidden_size, weight.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        score.weight.copy_(weight)
    score.requires_grad_(False)
    model.score = score
    model.arch = dataclasses.replace(arch, labels=(tokens[1],) if len(ids) == 2 else tokens)


def _limited_to_text(vision: Any, path: Path, limits: Any) -> bool:
    """Whether `limit_mm_per_prompt` sets every kind of media the model reads to 0 (then its
    tower need not load, as in vLLM); a bad limit is a ConfigError."""
    if limits is None:
        return False
    try:
        processor = ImageProcessor.from_folder(path if path.is_dir() else None, vision).limited(limits)
    except InvalidRequestError as e:
        raise ConfigError(str(e)) from None
    if vision.reads_audio:
        return processor.max_audios == 0
    return processor.max_images == 0 and (processor.max_videos == 0 or not vision.reads_videos)


def _refuse_pipeline(config: EngineConfig) -> None:
    if config.model.quantization in ("fp8", "mxfp4"):
        q = config.model.quantization
        raise ConfigError(f"quantization={q!r} is priced by the simulator (conveyor simulate); the engine has no "
                          f"{q.upper()} kernels: it loads {q.upper()} checkpoints decoded to its dtype, with no "
                          "quantization set")
    if config.model.enable_dp_attention:
        raise ConfigError("enable_dp_attention: the engine does not build data-parallel attention and "
                          "expert parallelism (the simulator prices them: conveyor simulate)")
    if config.model.pipeline_parallel_size > 1:
        raise ConfigError(
            f"pipeline_parallel_size={config.model.pipeline_parallel_size}: the engine does not build pipeline "
            "parallelism (the simulator prices it: conveyor simulate); use tensor_parallel_size"
        )


def _check_encoder_config(config: EngineConfig) -> None:
    mc, sc = config.model, config.scheduler
    refused = [name for name, on in (
        ("tensor_parallel_size > 1", mc.tensor_parallel_size > 1),
        ("quantization", mc.quantization is not None),
        ("enable_lora", mc.enable_lora),
        ("speculative_method='draft_model'", sc.speculative_method == "draft_model"),
    ) if on]
    if refused:
        raise ConfigError(f"an encoder model (BERT, RoBERTa) runs without {', '.join(refused)}: not built for encoders")


def _check_whisper_config(config: EngineConfig) -> None:
    """What a Whisper engine does not run: ConfigError naming it."""
    mc, sc = config.model, config.scheduler
    for name, value, why in (
        ("tensor_parallel_size", mc.tensor_parallel_size > 1, "one rank"),
        ("speculative_method", sc.speculative_method is not None, "no drafts"),
        ("enable_lora", mc.enable_lora, "no adapters"),
        ("quantization", mc.quantization is not None, "its weights as they are"),
    ):
        if value:
            raise ConfigError(f"{name}: Whisper (an encoder-decoder) runs with {why} here")


def _whisper_engine_config(config: EngineConfig) -> EngineConfig:
    """Whisper's decoder K/V depend on its clip, which no block hash sees: no prefix cache (vLLM
    turns it off for encoder-decoder models too)."""
    if not config.cache.enable_prefix_caching:
        return config
    logger.info("Whisper: no prefix cache (its decoder's K/V depend on the clip)")
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False))


def _encoder_config(config: EngineConfig, max_len: int) -> EngineConfig:
    """An encoder's prompt is computed whole, in one step (its every token sees every other):
    no chunks (whole prompts join the step, as prefill_mode='mixed' runs them, with a budget
    that fits the longest) and no prefix cache (a cached prefix's K/V would not have seen the
    rest of the prompt). vLLM turns both off for encoder-only models the same way."""
    import dataclasses

    sc, cc = config.scheduler, config.cache
    if sc.prefill_mode == "chunked" or sc.max_num_batched_tokens < max_len or cc.enable_prefix_caching:
        logger.info("an encoder computes each prompt whole: prompts unchunked, no prefix cache")
    return dataclasses.replace(
        config,
        scheduler=dataclasses.replace(
            sc, prefill_mode="mixed" if sc.prefill_mode == "chunked" else sc.prefill_mode,
            max_num_batched_tokens=max(sc.max_num_batched_tokens, max_len), long_prefill_token_threshold=0,
        ),
        cache=dataclasses.replace(cc, enable_prefix_caching=False),
    )


def _check_draft(arch: Any, draft: Any) -> None:
    if draft.vocab_size != arch.vocab_size:
        raise ConfigError(
            f"the speculative model's vocabulary ({draft.vocab_size} tokens) is not the model's "
            f"({arch.vocab_size}): its guesses must be the model's tokens"
        )


def _plan_cache(
    config: EngineConfig,
    arch: Any,
    dtype: Any,
    device: Any,
    weight_bytes: int,
    max_positions: int | None = None,
    draft_arch: Any = None,
) -> CachePlan:
    """`plan_cache` for a model (and its draft, whose K/V take a share of every block)."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_per_token = arch.kv_bytes_per_token(itemsize)
    layout = hybrid_layout(config, arch)
    if layout is not None:  # a page: its layers' share (every layer's K/V are alike in size)
        kv_per_token = kv_per_token * layout.page_layers // arch.num_layers
    max_model_len = arch.max_position_embeddings
    if arch.is_encoder:  # learned positions: none past the table (a decoder's rotary ones extend)
        max_positions = arch.max_position_embeddings if max_positions is None else min(max_positions, max_model_len)
    if draft_arch is not None:
        kv_per_token += draft_arch.kv_bytes_per_token(itemsize)
        max_model_len = min(max_model_len, draft_arch.max_position_embeddings)

    def default_budget() -> int:
        if device.type == "cuda":
            return _cuda_kv_budget(device, weight_bytes, config.cache.gpu_memory_utilization)
        return CPU_DEFAULT_KV_BYTES

    return plan_cache(config, kv_per_token, max_model_len, default_budget, max_positions, layout,
                      cross_tokens=_cross_tokens(arch))


def _cross_tokens(arch: Any) -> int:
    """The positions an encoder-decoder's (Whisper's) decoder attends to in its encoder's output,
    whose keys and values each sequence holds in cache blocks (0 for any other model)."""
    return arch.encoder.image_size if arch.encoder is not None else 0


def _triton_attends(dtype: torch.dtype) -> bool:
    """Whether a CUDA model's attention runs in the Triton kernels (`_use_triton_attention`):
    triton there, not switched off with `CONVEYOR_TRITON=0`, and a dtype the kernels take."""
    import torch

    from conveyor.kernels.triton_attention import triton_available

    return (dtype in (torch.float32, torch.float16, torch.bfloat16) and triton_available()
            and os.environ.get("CONVEYOR_TRITON", "1") != "0")


def hybrid_layout(config: EngineConfig, arch: Any) -> HybridLayout | None:
    """The hybrid KV cache's layout (`hybrid_kv_cache`), or None; a ConfigError for a model or
    an engine it is not built for."""
    if not config.cache.hybrid_kv_cache:
        return None
    if arch.is_encoder:
        raise ConfigError("hybrid_kv_cache: an encoder keeps no K/V")
    return hybrid_layout_of(config, [arch.window_of(i) for i in range(arch.num_layers)])


def hybrid_layout_of(config: EngineConfig, windows: list[int], name: str = "") -> HybridLayout:
    """The layout for layers attending within `windows` under `config`, or a ConfigError: the
    engine's rules, which the simulator keeps too (`name`: the model's, for its message)."""
    try:
        layout = HybridLayout.of(windows)
    except ValueError as e:
        raise ConfigError(f"hybrid_kv_cache: {name}{e}") from None
    if layout.all_sliding and config.scheduler.speculative_method in ("draft_model", "eagle", "eagle3"):
        raise ConfigError("hybrid_kv_cache: every layer of this model slides, so its one table releases blocks "
                          "a draft model's (or EAGLE head's) global layers would read; not built with a draft")
    return layout


def _resolve_kv_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's torch dtype: the compute dtype unless `kv_cache_dtype` names another,
    which only the CPU backends read (the Triton kernels take the compute dtype)."""
    import torch

    name = config.cache.kv_cache_dtype
    kv = dtype if name == "auto" else getattr(torch, name)
    if kv != dtype and device.type != "cpu":
        raise ConfigError(
            f"kv_cache_dtype={name!r} differs from the compute dtype "
            f"{str(dtype).removeprefix('torch.')}; on {device.type} use kv_cache_dtype='auto'"
        )
    return kv


def _resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available here; use device='cpu'")
    return torch.device(name)


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _cuda_kv_budget(device: torch.device, weight_bytes: int, utilization: float) -> int:
    import torch

    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - weight_bytes - (total - free) - CUDA_RUNTIME_RESERVE
    return max(budget, 0)
