"""Model shapes for the simulator: what the cost model needs, read from any HF config.json.

No weights and no torch: a `ModelShape` is the handful of sizes that decide a step's FLOPs and
bytes. The catalog holds the published config.json values of the models the docs simulate.

A mixture of experts (`num_experts > 0`) splits the per-layer weights in two: those every token
reads (attention, dense MLPs, routers, shared experts: `dense_params`) and the routed experts
(`expert_params` each), of which a step reads only the ones its tokens chose (the cost model).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    gated_mlp: bool = True  # Llama-style gate/up/down (3 matrices); OPT's fc1/fc2 is 2
    max_position_embeddings: int = 4096
    learned_positions: int = 0  # OPT: a learned position table (rows), read like embeddings
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0: dense): `num_sparse_layers` layers route each token to
    # `experts_per_token` of `num_experts` gated MLPs `expert_intermediate_size` wide, beside
    # an always-on shared expert `shared_expert_intermediate_size` wide (Qwen2-MoE; 0: none).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_sparse_layers: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate; DeepSeek's shared experts have none
    # Multi-head latent attention (DeepSeek-V2/V3; `kv_lora_rank > 0`): a token caches a latent
    # and one rotary key for all heads; queries through a `q_lora_rank` bottleneck (0: none).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Sliding-window attention: `num_sliding_layers` of the layers attend within their last
    # `sliding_window` positions (Gemma 2/3, gpt-oss; every layer of Mistral-7B-v0.1), the rest
    # over the whole context. Their K/V are kept whole, as the engine keeps them.
    sliding_window: int = 0
    num_sliding_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.name}: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} heads do not divide into {self.num_kv_heads} KV heads")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts
                                     and self.expert_intermediate_size > 0
                                     and 0 < self.num_sparse_layers <= self.num_layers):
            raise ValueError(f"{self.name}: a mixture of experts needs 1 <= experts_per_token <= num_experts, "
                             "an expert_intermediate_size and 1 <= num_sparse_layers <= num_layers")
        if not 0 <= self.num_sliding_layers <= self.num_layers or (self.num_sliding_layers > 0) != (self.sliding_window > 0):
            raise ValueError(f"{self.name}: sliding layers need a window, and at most num_layers of them")

    @property
    def sliding_share(self) -> float:
        """The share of the layers that attend within a window."""
        return self.num_sliding_layers / self.num_layers

    # -- sizes -----------------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """Weights of the per-layer matrices (q, k, v, o and the MLP or the experts), all layers."""
        return self.dense_params + self.num_sparse_layers * self.num_experts * self.expert_params

    @property
    def dense_params(self) -> int:
        """The per-layer weights every token computes with: all of a dense model's; a mixture's
        attention, dense MLPs, routers and shared experts."""
        h = self.hidden_size
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        sparse = self.num_sparse_layers
        gate = self.shared_expert_intermediate_size and self.shared_expert_gated
        shared = 3 * h * self.shared_expert_intermediate_size + (h if gate else 0)
        moe = h * self.num_experts + shared  # the router and the shared expert (with its gate)
        return self.num_layers * self.attention_params + (self.num_layers - sparse) * mlp + sparse * moe

    @property
    def attention_params(self) -> int:
        """One layer's attention projections."""
        h, n = self.hidden_size, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * n * qk if not self.q_lora_rank else self.q_lora_rank * (h + n * qk)
            r = self.kv_lora_rank
            return q + h * (r + self.qk_rope_head_dim) + r * n * (self.qk_nope_head_dim + self.v_head_dim) \
                + n * self.v_head_dim * h
        q = n * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_dims(self) -> tuple[float, float]:
        """(prefill, decode) FLOPs a head spends on one (query, key) pair, over 4: `head_dim` for
        both with multi-head attention. MLA's prompts expand the latents into per-head keys
        (nope + rope) and values (v); its decodes absorb the up-projection and attend over the
        latents (rank + rope for the scores, rank for the values), as vLLM and SGLang run them."""
        if not self.is_mla:
            return float(self.head_dim), float(self.head_dim)
        prefill = (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) / 2
        return prefill, (2 * self.kv_lora_rank + self.qk_rope_head_dim) / 2

    @property
    def expert_params(self) -> int:
        """One routed expert's weights (gate, up and down)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def active_params(self) -> int:
        """The weights a token computes with, as model cards count them (a mixture: its chosen
        experts only, not the others)."""
        idle = self.num_experts - self.experts_per_token
        return self.num_params - self.num_sparse_layers * idle * self.expert_params

    @property
    def head_params(self) -> int:
        """The LM head (read even when tied: it is the embedding matrix, read whole)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All weights; norms and biases are left out (under 0.1% for every catalog model)."""
        embed = (self.vocab_size + self.learned_positions) * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.head_params
        return self.layer_params + embed + head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        if self.is_mla:  # one latent and one rotary key a layer
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def weight_bytes(self, dtype_bytes: int, layer_bytes: int | None = None, expert_bytes: float | None = None) -> int:
        """All weights at `dtype_bytes` each; with `layer_bytes` (FP8: 1), the layers' matrices
        (attention, MLPs, experts) at that and the embeddings and LM head at `dtype_bytes`, as
        vLLM quantizes them; with `expert_bytes` (MXFP4: 4.25 bits), the routed experts at that."""
        routed = self.num_sparse_layers * self.num_experts * self.expert_params
        layers: float = (self.layer_params - routed) * (layer_bytes or dtype_bytes)
        layers += routed * (expert_bytes if expert_bytes is not None else layer_bytes or dtype_bytes)
        return math.ceil(layers + (self.num_params - self.layer_params) * dtype_bytes)

    def check_tensor_parallel(self, size: int) -> None:
        """Whether `size` devices can split this model as vLLM does: the query heads and the
        MLP widths evenly, the KV heads evenly or each held by `size / num_kv_heads` devices."""
        kv = self.num_kv_heads
        widths = {"num_heads": self.num_heads, "intermediate_size": self.intermediate_size}
        if self.num_experts:
            widths["expert_intermediate_size"] = self.expert_intermediate_size
        bad = [f"{k}={v}" for k, v in widths.items() if v % size]
        if kv % size and size % kv and not self.is_mla:
            bad.append(f"num_kv_heads={kv}")
        if bad:
            raise ValueError(f"{self.name}: tensor_parallel_size={size} does not split {', '.join(bad)}")

    def kv_share(self, tensor_parallel: int) -> float:
        """The share of a token's K/V one of `tensor_parallel` devices holds (KV heads fewer than
        the devices are copied: each holds one). MLA's latent serves every head: each device
        holds all of it (vLLM's tensor-parallel MLA)."""
        if self.is_mla:
            return 1.0
        return max(self.num_kv_heads // tensor_parallel, 1) / self.num_kv_heads

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def from_arch(cls, arch: Any, name: str = "model") -> ModelShape:
        """From a loaded model's `ArchConfig` (what `conveyor calibrate` measured)."""
        return cls(
            name=name, hidden_size=arch.hidden_size, num_layers=arch.num_layers, num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, intermediate_size=arch.intermediate_size,
            vocab_size=arch.vocab_size, tie_word_embeddings=arch.tie_word_embeddings,
            max_position_embeddings=arch.max_position_embeddings, eos_token_ids=tuple(arch.eos_token_ids),
            num_experts=arch.num_experts, experts_per_token=arch.num_experts_per_tok,
            expert_intermediate_size=arch.moe_intermediate_size,
            shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
            num_sparse_layers=arch.num_sparse_layers, shared_expert_gated=arch.shared_expert_gated,
            kv_lora_rank=arch.kv_lora_rank, q_lora_rank=arch.q_lora_rank, qk_nope_head_dim=arch.qk_nope_head_dim,
            qk_rope_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim,
            **_windows_of(arch.layer_windows or (arch.sliding_window or 0,) * arch.num_layers),
        )

    @classmethod
    def _deepseek(cls, cfg: dict[str, Any], name: str, eos_ids: tuple[int, ...]) -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        return cls(
            name=name, hidden_size=int(cfg["hidden_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=heads, head_dim=int(cfg.get("qk_rope_head_dim", 64)),
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), eos_token_ids=eos_ids,
            **_deepseek_keys(cfg),
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> ModelShape:
        """Llama-family keys (Llama, Mistral, Qwen2/3, SmolLM, Gemma 2/3, and the mixtures
        Mixtral, Qwen2/3-MoE, gpt-oss...) or OPT's; an image-text checkpoint's text model."""
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):  # Gemma 3's 4B-27B
            from conveyor.models.arch import GEMMA3_TEXT_DEFAULTS

            cfg = {**GEMMA3_TEXT_DEFAULTS, "model_type": "gemma3_text", "eos_token_id": cfg.get("eos_token_id"),
                   **cfg["text_config"]}
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ValueError(f"{name}: config.json has no {e.args[0]!r}; is it a decoder-only transformer?") from None
        opt = cfg.get("model_type") == "opt" or "ffn_dim" in cfg
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        if opt:
            if cfg.get("word_embed_proj_dim", hidden) != hidden:
                raise ValueError(f"{name}: OPT with word_embed_proj_dim != hidden_size (OPT-350M) is not modelled")
            return cls(
                name=name, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                head_dim=hidden // heads, intermediate_size=int(cfg["ffn_dim"]), vocab_size=vocab,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), gated_mlp=False,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                learned_positions=int(cfg.get("max_position_embeddings", 2048)) + 2,
                eos_token_ids=eos_ids,
            )
        if "intermediate_size" not in cfg:
            raise ValueError(f"{name}: config.json has no 'intermediate_size'")
        if cfg.get("kv_lora_rank"):
            return cls._deepseek(cfg, name, eos_ids)
        if cfg.get("n_routed_experts"):  # GLM-4.5: DeepSeek's mixture under grouped-query attention
            return cls(
                name=name, hidden_size=hidden, num_layers=layers, num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=vocab, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), eos_token_ids=eos_ids,
                **_deepseek_moe(cfg),
            )
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        moe: dict[str, Any] = {}
        if experts:
            step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
            moe = dict(
                num_experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
                expert_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                num_sparse_layers=sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0),
            )
        gemma = str(cfg.get("model_type", "")).startswith("gemma")
        return cls(
            name=name, hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=vocab,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
            **moe,
            **_windows_of(_layer_windows(cfg, layers)),
        )


def _layer_windows(cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Each layer's window (0: global), as the engine reads them (conveyor/models/arch.py):
    `layer_types`, else Gemma 2's and gpt-oss's every other layer, Gemma 3's
    `sliding_window_pattern`, or every layer where Mistral's (or Qwen's `use_sliding_window`) say."""
    kind = str(cfg.get("model_type", ""))
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if not types:
        if kind in ("gemma2", "gpt_oss"):
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif kind.startswith("gemma3"):
            pattern = int(cfg.get("sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif window and cfg.get("use_sliding_window", kind == "mistral"):
            types = ["sliding_attention"] * layers
        else:
            return (0,) * layers
    window = window or (4096 if kind.startswith("gemma") else 128)
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _windows_of(windows: tuple[int, ...]) -> dict[str, Any]:
    sliding = [w for w in windows if w]
    if len(set(sliding)) > 1:
        raise ValueError(f"sliding windows of several widths {sorted(set(sliding))} are not modelled")
    return dict(sliding_window=sliding[0] if sliding else 0, num_sliding_layers=len(sliding))


def _deepseek_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's mixture (also GLM-4.5's): `n_routed_experts` after `first_k_dense_replace`
    dense layers, `n_shared_experts` ungated."""
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("n_routed_experts") or 0)
    width = int(cfg.get("moe_intermediate_size") or 0)
    if not experts:
        return {}
    return dict(num_experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
                expert_intermediate_size=width, shared_expert_intermediate_size=width * int(cfg.get("n_shared_experts") or 0),
                num_sparse_layers=layers - int(cfg.get("first_k_dense_replace") or 0), shared_expert_gated=False)


def _deepseek_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields a DeepSeek-V2/V3 config.json adds to a Llama's (MLA and DeepSeek's mixture)."""
    return dict(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)), qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
                v_head_dim=int(cfg.get("v_head_dim", 128)), **_deepseek_moe(cfg))


def _llama(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, max_pos: int,
           tied: bool = False, head_dim: int | None = None) -> dict[str, Any]:
    cfg = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
           "vocab_size": vocab, "max_position_embeddings": max_pos, "tie_word_embeddings": tied}
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    return cfg


# The config.json values of each model on the Hugging Face Hub (the repository named beside it).
MODEL_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", _llama(4096, 32, 32, 8, 14336, 128256, 131072)),
    # Llama-3.1-8B's vocabulary: the draft model of speculative decoding's usual pairing.
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", _llama(2048, 16, 32, 8, 8192, 128256, 131072, tied=True, head_dim=64)),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", _llama(8192, 80, 64, 8, 28672, 128256, 131072)),
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B", _llama(16384, 126, 128, 8, 53248, 128256, 131072)),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", _llama(4096, 32, 32, 32, 11008, 32000, 4096)),
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", _llama(5120, 40, 40, 40, 13824, 32000, 4096)),
    "llama-13b": ("huggyllama/llama-13b (LLaMA-1)", _llama(5120, 40, 40, 40, 13824, 32000, 2048)),
    "opt-13b": ("facebook/opt-13b", {"model_type": "opt", "hidden_size": 5120, "num_hidden_layers": 40,
                                     "num_attention_heads": 40, "ffn_dim": 20480, "vocab_size": 50272,
                                     "max_position_embeddings": 2048, "word_embed_proj_dim": 5120}),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1", {**_llama(4096, 32, 32, 8, 14336, 32000, 32768),
                                                 "model_type": "mistral", "sliding_window": 4096}),
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", _llama(1024, 28, 16, 8, 3072, 151936, 40960, tied=True, head_dim=128)),
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", _llama(576, 30, 9, 3, 1536, 49152, 8192, tied=True)),
    # Mixtures of experts: 46.7B weights, 12.9B active a token; 30.5B, 3.3B.
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", {**_llama(4096, 32, 32, 8, 14336, 32000, 32768),
                                                     "model_type": "mixtral", "num_local_experts": 8,
                                                     "num_experts_per_tok": 2}),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", {**_llama(2048, 48, 32, 4, 6144, 151936, 40960, head_dim=128),
                                             "model_type": "qwen3_moe", "num_experts": 128,
                                             "num_experts_per_tok": 8, "moe_intermediate_size": 768}),
}


def _deepseek(hidden: int, layers: int, heads: int, inter: int, vocab: int, q_lora: int | None, experts: int,
              per_token: int, moe: int, shared: int, dense: int) -> dict[str, Any]:
    return {**_llama(hidden, layers, heads, heads, inter, vocab, 163840), "model_type": "deepseek_v2",
            "kv_lora_rank": 512, "q_lora_rank": q_lora, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": experts, "num_experts_per_tok": per_token,
            "moe_intermediate_size": moe, "n_shared_experts": shared, "first_k_dense_replace": dense}


# Latent attention: 15.7B weights, 2.4B active; 671B (the multi-token-prediction layer left out), 37B.
MODEL_CONFIGS["deepseek-v2-lite"] = ("deepseek-ai/DeepSeek-V2-Lite",
                                     _deepseek(2048, 27, 16, 10944, 102400, None, 64, 6, 1408, 2, 1))
MODEL_CONFIGS["deepseek-v3"] = ("deepseek-ai/DeepSeek-V3",
                                {**_deepseek(7168, 61, 128, 18432, 129280, 1536, 256, 8, 2048, 1, 3),
                                 "model_type": "deepseek_v3"})


# DeepSeek's mixture under grouped-query attention: 106 B weights, 12 B active (13.4 with the
# embeddings and head).
MODEL_CONFIGS["glm-4.5-air"] = ("zai-org/GLM-4.5-Air", {
    **_llama(4096, 46, 96, 8, 10944, 151552, 131072, head_dim=128), "model_type": "glm4_moe",
    "moe_intermediate_size": 1408, "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "first_k_dense_replace": 1})


# Sliding and global layers: Gemma 3's five to one over 1,024 tokens (27.0 B text weights), and
# gpt-oss's by turns over 128 (20.9 B weights, 3.6 B active; 116.8 B, 5.1 B; the card's counts).
MODEL_CONFIGS["gemma-3-27b"] = ("google/gemma-3-27b-it (its text_config)", {
    **_llama(5376, 62, 32, 16, 21504, 262208, 131072, tied=True, head_dim=128), "model_type": "gemma3_text",
    "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 168})
for _name, _layers, _experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
    MODEL_CONFIGS[_name] = (f"openai/{_name}", {
        **_llama(2880, _layers, 64, 8, 2880, 201088, 131072, head_dim=64), "model_type": "gpt_oss",
        "num_local_experts": _experts, "num_experts_per_tok": 4, "sliding_window": 128})


def model_names() -> list[str]:
    return sorted(MODEL_CONFIGS)


def get_model(name_or_path: str) -> ModelShape:
    """A catalog name, a config.json, or a folder holding one."""
    key = name_or_path.lower()
    if key in MODEL_CONFIGS:
        return ModelShape.from_hf_config(MODEL_CONFIGS[key][1], key)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
        return ModelShape.from_hf_config(cfg, path.parent.name or str(path))
    raise ValueError(f"unknown model {name_or_path!r}: use one of {', '.join(model_names())} or a config.json path")
