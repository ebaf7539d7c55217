"""The shape of a Llama-family transformer, read from an HF config.json or GGUF metadata.

The mixture-of-experts members (Mixtral, Qwen2-MoE, Qwen3-MoE) are Llama-family attention with
a routed MLP: `num_experts > 0`, and `is_sparse_layer` says which layers route. DeepSeek-V2/V3
are such a body with multi-head latent attention (`is_mla`) and grouped routers."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from conveyor.models.vision import VisionArch, VisionConfigError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "Phi3ForCausalLM": "phi3",  # Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini
    "GraniteForCausalLM": "granite",  # IBM Granite 3.x: a Llama with four multipliers
}
# The same bodies with a classification head (`score`) over the last token instead of an LM
# head: sequence classifiers, and cross-encoders (rerankers) where there is one label.
CLASSIFIER_ARCHITECTURES = {
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "Gemma2ForSequenceClassification": "gemma2",  # (reward models: Skywork-Reward-Gemma-2)
    "Gemma3TextForSequenceClassification": "gemma3",
}
# ... with the head over every token instead (a token classifier: NER, tagging).
TOKEN_CLASSIFIER_ARCHITECTURES = {
    "LlamaForTokenClassification": "llama",
    "MistralForTokenClassification": "mistral",
    "Qwen2ForTokenClassification": "qwen2",
    "Qwen3ForTokenClassification": "qwen3",
    "Gemma2ForTokenClassification": "gemma2",
}
# Bidirectional encoders (conveyor/models/bert.py): they embed, classify and score pairs, and
# generate nothing. RoBERTa's positions start after its padding id; XLM-RoBERTa is RoBERTa's.
ENCODER_ARCHITECTURES = {
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
    "RobertaModel": "roberta",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaModel": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
    "BertForTokenClassification": "bert",
    "RobertaForTokenClassification": "roberta",
    "XLMRobertaForTokenClassification": "roberta",
    "ModernBertModel": "modernbert",
    "ModernBertForSequenceClassification": "modernbert",
    "ModernBertForTokenClassification": "modernbert",
    # Gemma 3 with bidirectional attention (EmbeddingGemma): a Gemma 3 body as an encoder.
    "Gemma3TextModel": "gemma3_encoder",
}
ENCODER_FAMILIES = ("bert", "roberta", "modernbert", "gemma3_encoder")
# The attention each family shares with a dense one (q/k/v bias, q/k norms, sliding window).
_BASE_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
# Multi-head latent attention (MLA) and DeepSeek's routing: conveyor/models/mla.py, moe.py.
DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")
# DeepSeek's mixture (grouped routers, ungated shared experts, dense first layers, an MTP layer
# after the last) under grouped-query attention with partial RoPE: GLM-4.5 / 4.6.
DEEPSEEK_STYLE_MOE = (*DEEPSEEK_FAMILIES, "glm4_moe")
# Gemma 2 and 3: sliding-window and global layers in a pattern (each kind its own RoPE base in
# Gemma 3), norms before and after each sublayer that scale by (1 + w), a scaled embedding,
# GELU-gated MLPs, and (Gemma 2) tanh soft-capped attention scores and logits.
GEMMA_FAMILIES = ("gemma2", "gemma3", "gemma3_encoder")
# Image-text checkpoints read through their text model's family: Gemma 3's 4B, 12B and 27B ship
# only in this form (its images: `VisionArch.from_gemma3`, where the config has a vision_config).
MULTIMODAL_TEXT_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "gemma3"}
# Image-text checkpoints of LLaVA's form whose images conveyor reads (conveyor/models/vision.py):
# a ViT, a projector, and any text model conveyor runs, as `text_config` names it.
LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                       "LlavaOnevisionForConditionalGeneration")
# Qwen's image-text checkpoints (conveyor/models/qwen_vision.py): a Qwen2 text model with M-RoPE.
QWEN_VL_ARCHITECTURES = {"Qwen2VLForConditionalGeneration": "qwen2_vl",
                         "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                         "Qwen3VLForConditionalGeneration": "qwen3_vl",
                         "Qwen3VLMoeForConditionalGeneration": "qwen3_vl"}
# What transformers' LlamaConfig assumes where a LLaVA checkpoint's `text_config` is silent
# (LLaVA-1.5's configs list only what differs from these).
LLAMA_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "bos_token_id": 1, "eos_token_id": 2,
}
# ... and transformers' MistralConfig (LLaVA-NeXT over Mistral-7B lists what differs from it).
MISTRAL_TEXT_DEFAULTS: dict[str, Any] = {
    **LLAMA_TEXT_DEFAULTS, "model_type": "mistral", "intermediate_size": 14336, "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
}
# What transformers' Gemma3TextConfig assumes where a checkpoint's `text_config` is silent
# (the Hub's multimodal Gemma 3 configs list only what differs from these).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}


class UnsupportedModelError(ValueError):
    """The model file is readable but describes something conveyor does not run."""


@dataclass(frozen=True)
class ArchConfig:
    family: str  # llama | mistral | qwen2 | qwen3 | gemma2 | gemma3 | mixtral | qwen2_moe | qwen3_moe | bert | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mixture of experts (0 experts: a dense MLP in every layer). A sparse layer's router picks
    # `num_experts_per_tok` of `num_experts` gated MLPs of `moe_intermediate_size` per token,
    # weighted by their softmax probabilities (renormalized over the chosen with
    # `norm_topk_prob`); Qwen2-MoE adds a shared expert behind a sigmoid gate to every token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1  # every n-th layer routes (Qwen-MoE)...
    mlp_only_layers: tuple[int, ...] = ()  # ...except these, which keep a dense MLP
    # A sequence classifier (`*ForSequenceClassification`): the names of its classes, one
    # each row of its `score` head; empty for a causal LM.
    labels: tuple[str, ...] = ()
    token_classifier: bool = False  # its head classifies every token (`*ForTokenClassification`)
    # How the model pools an embedding when a request does not say ("last", "mean", "cls"):
    # sentence-transformers' 1_Pooling/config.json where the folder has one, else "cls" for an
    # encoder and "last" for a decoder (vLLM's defaults).
    pooling: str | None = None
    # A one-class classifier's score activation by sentence-transformers' config (a CrossEncoder's
    # `activation_fn`, a torch module's qualified name); None: a sigmoid.
    score_activation: str | None = None
    # Encoders (BERT, RoBERTa): `rms_norm_eps` is their LayerNorm's eps. Segment embeddings
    # (`type_vocab_size`; a pair's second text, after the first `sep_token_id`, is segment 1),
    # the MLP's activation, and where positions start (RoBERTa: after its padding id).
    type_vocab_size: int = 0
    hidden_act: str = "silu"
    position_offset: int = 0
    sep_token_id: int | None = None
    # ModernBERT: every n-th layer attends globally at `rope_theta`, the others within
    # `sliding_window` tokens either side at `local_rope_theta`; its classifier's head.
    global_attn_every: int = 0
    local_rope_theta: float = 0.0
    classifier_act: str = "gelu"
    classifier_bias: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3; `kv_lora_rank > 0`): each token caches one
    # latent `[kv_lora_rank]` and one rotary key `[qk_rope_head_dim]` shared by all heads;
    # queries come through a low-rank `q_lora_rank` (0: one projection). `head_dim` is then the
    # rotary part (what the rotary tables span).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint's rotary dims come in (even, odd) pairs
    # DeepSeek's routers: a softmax (V2) or sigmoid (V3) score, the experts picked within the
    # `topk_group` best of `n_group` groups ("group_limited_greedy" by each group's best score,
    # "noaux_tc" by its best two plus a learned bias), weights scaled by `routed_scaling_factor`;
    # the shared experts join every token ungated. Dense layers before `first_k_dense_replace`.
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True
    first_k_dense_replace: int = 0
    rotary_dim: int = 0  # the leading dims of each head that RoPE turns (0: all; GLM-4.5: half)
    # Gemma: each layer's window (0: it attends globally), its sliding layers' RoPE base
    # (`local_rope_theta`, unscaled; 0: the global one), the softmax scale's
    # `query_pre_attn_scalar` ** -0.5 (0: head_dim's), and tanh soft caps (0: none) on the
    # attention scores and the final logits, `cap * tanh(x / cap)`.
    layer_windows: tuple[int, ...] = ()
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    multimodal: bool = False  # the text model of an image-text checkpoint (Gemma 3's, LLaVA's)
    vision: VisionArch | None = None  # ... and its vision side, where conveyor reads its images
    # An encoder-decoder's encoder (Whisper's: conveyor/models/whisper.py); the fields above are
    # then its decoder's (`num_layers`, heads, `max_position_embeddings` its learned positions).
    encoder: VisionArch | None = None
    # Multimodal RoPE (Qwen2-VL): the head's frequencies in parts turned by time, row and column
    # positions in turn (an image's tokens' 3D positions: conveyor/models/qwen_vision.py); text
    # has the three alike, so plain RoPE.
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # (Qwen3-VL) the parts interleaved, frequency by frequency
    # Granite: the embeddings times `embedding_multiplier`, each sublayer's output times
    # `residual_multiplier` before its residual add, the softmax scale `attention_multiplier`
    # (0: the head's), the logits divided by `logits_scaling`.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 0.0
    logits_scaling: float = 1.0
    # gpt-oss: a learned logit a head that joins each softmax's denominator ("attention sinks"),
    # a bias on o_proj too, routers with a bias whose top k logits are softmaxed, experts with
    # biases and a clamped SwiGLU: `(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`, g the
    # gate clamped above at `limit`.
    attention_sinks: bool = False
    o_proj_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0  # > 0: the clamped SwiGLU of gpt-oss
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )
        if self.num_experts and (self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1):
            raise UnsupportedModelError("a mixture of experts needs moe_intermediate_size and decoder_sparse_step >= 1")
        if self.num_experts and (self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group):
            raise UnsupportedModelError(
                f"n_group={self.n_group} must divide the {self.num_experts} experts, and topk_group={self.topk_group} "
                "be in [1, n_group]"
            )
        if self.num_experts and self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise UnsupportedModelError(f"topk_method={self.topk_method!r} is not supported "
                                        "(greedy, group_limited_greedy, noaux_tc are)")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise UnsupportedModelError(f"scoring_func={self.scoring_func!r} is not supported (softmax, sigmoid are)")
        if self.is_mla and (self.qk_rope_head_dim % 2 or self.qk_nope_head_dim < 1 or self.v_head_dim < 1):
            raise UnsupportedModelError("multi-head latent attention needs an even qk_rope_head_dim and "
                                        "qk_nope_head_dim, v_head_dim >= 1")

    @property
    def is_gemma(self) -> bool:
        return self.family in GEMMA_FAMILIES

    def window_of(self, index: int) -> int:
        """Layer `index`'s attention window in tokens, its own included (0: the whole context)."""
        if self.layer_windows:
            return self.layer_windows[index]
        return self.sliding_window or 0

    @property
    def local_rope(self) -> ArchConfig:
        """The shape whose RoPE the sliding layers take where they have a base of their own
        (`local_rope_theta`): that base, unscaled."""
        return dataclasses.replace(self, rope_theta=self.local_rope_theta, rope_scaling=None)

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier or (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def llama_arithmetic(self) -> bool:
        """A Llama's layer and ends exactly (what the fused native decode and the fused CUDA
        kernels compute): no Gemma norms, no Granite multipliers."""
        return not self.is_gemma and self.family != "granite"

    @property
    def rope_dim(self) -> int:
        """The dims of each head RoPE turns (what the rotary tables span)."""
        return self.rotary_dim or self.head_dim

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): a latent and a rotary key cached a token."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_shape(self) -> tuple[int, int]:
        """(heads, dim) of each of a layer's two cache planes `[2, slots, heads, dim]`. MLA's one
        latent + rotary key a token, `kv_lora_rank + qk_rope_head_dim` values, is cut in two
        halves, one a plane (conveyor/models/mla.py): no byte kept twice, and every copy, swap
        and hand-over of the cache stays what it is for K and V."""
        if self.is_mla:
            return 1, -(-(self.kv_lora_rank + self.qk_rope_head_dim) // 2)
        return self.num_kv_heads, self.head_dim

    @property
    def num_labels(self) -> int:
        """A classifier's classes (0: a causal LM, which generates)."""
        return len(self.labels)

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder: every token sees the whole prompt, so a prompt is computed
        in one step (never in chunks, never from a cached prefix) and nothing is generated."""
        return self.family in ENCODER_FAMILIES

    @property
    def default_pooling(self) -> str:
        """An embedding's (a token classifier's classification reads "all")."""
        return self.pooling or ("cls" if self.is_encoder else "last")

    @property
    def attention_family(self) -> str:
        """The dense family whose attention this one has (itself for a dense model)."""
        return _BASE_FAMILY.get(self.family, self.family)

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer `index` routes its tokens to experts (HF's rule for Qwen-MoE; DeepSeek's
        first `first_k_dense_replace` layers are dense)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers and index >= self.first_k_dense_replace
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse_layer(i) for i in range(self.num_layers))

    @property
    def expert_params(self) -> int:
        """One routed expert's weights (gate, up and down; gpt-oss's biases too)."""
        bias = 2 * self.moe_intermediate_size + self.hidden_size if self.expert_bias else 0
        return 3 * self.hidden_size * self.moe_intermediate_size + bias

    @property
    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        if self.is_encoder:  # biases everywhere, two LayerNorms a layer; a classifier's pooler or dense + head
            layer = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
            positions = self.max_position_embeddings + self.position_offset
            embed = (self.vocab_size + positions + self.type_vocab_size) * h + 2 * h
            pooler = 0 if self.token_classifier else h * h + h
            head = (pooler + self.num_labels * (h + 1)) if self.labels else 0
            return L * layer + embed + head
        if self.is_mla:
            attention = self.mla_params + 2 * h
        else:
            q = self.num_heads * self.head_dim
            kv = self.num_kv_heads * self.head_dim
            attention = h * (q + 2 * kv) + q * h + 2 * h  # projections and the two norms
            attention += (q + 2 * kv if self.attention_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
            attention += 2 * h if self.is_gemma else 0  # the norms before and after the MLP
            attention += (h if self.o_proj_bias else 0) + (self.num_heads if self.attention_sinks else 0)
        sparse = self.num_sparse_layers
        moe = self.num_experts * (self.expert_params + h) + 3 * h * self.shared_expert_intermediate_size
        gated = self.shared_expert_intermediate_size and self.shared_expert_gated
        moe += h if gated else 0  # the shared expert's gate
        moe += self.num_experts if self.topk_method == "noaux_tc" or self.expert_bias else 0  # the router's bias
        mlp = (L - sparse) * 3 * h * i + sparse * moe
        embed = self.vocab_size * h
        head = (self.num_labels * (h + self.token_classifier) if self.labels
                else 0 if self.tie_word_embeddings else self.vocab_size * h)
        return L * attention + mlp + embed + head + h

    @property
    def mla_params(self) -> int:
        """One layer's latent attention: the query's (low-rank) projections, the latent's down and
        up projections with their norms, the output projection."""
        h, n, r = self.hidden_size, self.num_heads, self.kv_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = h * n * qk if not self.q_lora_rank else h * self.q_lora_rank + self.q_lora_rank * (n * qk + 1)
        kv = h * (r + self.qk_rope_head_dim) + r + r * n * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h

    @property
    def num_active_params(self) -> int:
        """The weights one token computes with: the routed experts it is sent to, not all."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_params - self.num_sparse_layers * idle * self.expert_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        if self.is_encoder:  # a prompt's K/V live only within its one step
            return 0
        heads, dim = self.kv_cache_shape
        return 2 * self.num_layers * heads * dim * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ArchConfig:
        archs = cfg.get("architectures") or []
        for a in archs:
            if a in MULTIMODAL_TEXT_ARCHITECTURES:
                text = {**GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
                for key in ("bos_token_id", "eos_token_id"):  # (the top level's, where the text's has none)
                    if text.get(key) is None and cfg.get(key) is not None:
                        text[key] = cfg[key]
                arch = _gemma_from_hf(text, MULTIMODAL_TEXT_ARCHITECTURES[a], False, False)
                vision = None
                if cfg.get("vision_config"):  # (its images: conveyor/models/vision.py)
                    try:
                        vision = VisionArch.from_gemma3(cfg, arch.hidden_size)
                    except VisionConfigError as e:
                        raise UnsupportedModelError(str(e)) from None
                    if max(vision.image_token_id, vision.placeholder_id, vision.eoi_token_id or 0) >= arch.vocab_size:
                        raise UnsupportedModelError("Gemma 3's image tokens are outside the vocabulary")
                return dataclasses.replace(arch, multimodal=True, vision=vision)
            if a in LLAVA_ARCHITECTURES:
                return _llava_from_hf(cfg, a == "LlavaNextForConditionalGeneration",
                                      onevision=a == "LlavaOnevisionForConditionalGeneration")
            if a in QWEN_VL_ARCHITECTURES:
                return _qwen_vl_from_hf(cfg, QWEN_VL_ARCHITECTURES[a])
            if a == "Qwen2AudioForConditionalGeneration":
                return _qwen2_audio_from_hf(cfg)
            if a == "WhisperForConditionalGeneration":
                return _whisper_from_hf(cfg)
            if a == "Mistral3ForConditionalGeneration":
                return _llava_from_hf(cfg, mistral3=True)
            if a == "InternVLForConditionalGeneration":
                return _llava_from_hf(cfg, internvl=True)
            if a in ENCODER_ARCHITECTURES:
                return _encoder_from_hf(cfg, ENCODER_ARCHITECTURES[a], a.endswith("Classification"),
                                        a.endswith("ForTokenClassification"))
        family = None
        classifier = tokens = False
        for a in archs:
            family = (SUPPORTED_ARCHITECTURES.get(a) or CLASSIFIER_ARCHITECTURES.get(a)
                      or TOKEN_CLASSIFIER_ARCHITECTURES.get(a))
            if family:
                classifier = a not in SUPPORTED_ARCHITECTURES
                tokens = a in TOKEN_CLASSIFIER_ARCHITECTURES
                break
        if family is None:
            family = {v: v for v in SUPPORTED_ARCHITECTURES.values()}.get(cfg.get("model_type", ""))
        if family is None:
            raise UnsupportedModelError(
                f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"conveyor runs {sorted(SUPPORTED_ARCHITECTURES | CLASSIFIER_ARCHITECTURES | TOKEN_CLASSIFIER_ARCHITECTURES | ENCODER_ARCHITECTURES)}"
            )
        if family in DEEPSEEK_STYLE_MOE:
            return _deepseek_from_hf(cfg, family)
        if family in GEMMA_FAMILIES:
            return _gemma_from_hf(cfg, family, classifier, tokens)
        if family == "gpt_oss":
            return _gpt_oss_from_hf(cfg)
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta, rope_scaling = _rope(cfg)
        eos_ids = _eos_ids(cfg)
        base = _BASE_FAMILY.get(family, family)
        use_sw = cfg.get("use_sliding_window", base in ("mistral", "phi3"))
        if family == "phi3":
            rope_scaling = _longrope(cfg, rope_scaling)
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if family in _BASE_FAMILY else 0
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", base == "qwen2"))),
            qk_norm=base == "qwen3",
            rope_scaling=rope_scaling,
            sliding_window=cfg.get("sliding_window") if use_sw else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            # Mixtral's experts are `intermediate_size` wide; Qwen's have a size of their own.
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            norm_topk_prob=family == "mixtral" or bool(cfg.get("norm_topk_prob", False)),  # Mixtral always does
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0,
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            labels=_labels(cfg) if classifier else (),
            token_classifier=tokens,
            rotary_dim=_rotary_dim(cfg) if family == "phi3" else 0,
            embedding_multiplier=float(cfg.get("embedding_multiplier") or 1.0),
            residual_multiplier=float(cfg.get("residual_multiplier") or 1.0),
            attention_multiplier=float(cfg.get("attention_multiplier") or 0.0) if family == "granite" else 0.0,
            logits_scaling=float(cfg.get("logits_scaling") or 1.0),
        )


def _whisper_from_hf(cfg: dict[str, Any]) -> ArchConfig:
    """A Whisper checkpoint: its decoder as the model (learned positions, biases, GELU, tied
    embeddings) and its encoder (`encoder`: Qwen2-Audio's tower's fields, `VisionArch`)."""
    d = int(cfg.get("d_model", 1280))
    heads = int(cfg.get("decoder_attention_heads", 20))
    if cfg.get("scale_embedding"):
        raise UnsupportedModelError("a Whisper with scaled embeddings is not supported")
    if d % heads:
        raise UnsupportedModelError("the decoder's width is not a multiple of its heads")
    try:
        encoder = VisionArch.from_qwen2_audio({"audio_config": {
            "num_mel_bins": cfg.get("num_mel_bins", 80), "encoder_layers": cfg.get("encoder_layers", 32),
            "encoder_attention_heads": cfg.get("encoder_attention_heads", 20),
            "encoder_ffn_dim": cfg.get("encoder_ffn_dim", 5120), "d_model": d,
            "activation_function": cfg.get("activation_function", "gelu"),
            "max_source_positions": cfg.get("max_source_positions", 1500)}}, d)
    except VisionConfigError as e:
        raise UnsupportedModelError(str(e)) from None
    eos = cfg.get("eos_token_id", 50257)
    return ArchConfig(
        family="whisper", vocab_size=int(cfg["vocab_size"]), hidden_size=d,
        intermediate_size=int(cfg.get("decoder_ffn_dim", 5120)), num_layers=int(cfg.get("decoder_layers", 32)),
        num_heads=heads, num_kv_heads=heads, head_dim=d // heads, rms_norm_eps=1e-5, rope_theta=0.0,
        max_position_embeddings=int(cfg.get("max_target_positions", 448)), tie_word_embeddings=True,
        attention_bias=True, bos_token_id=cfg.get("decoder_start_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        hidden_act=cfg.get("activation_function", "gelu"), encoder=dataclasses.replace(encoder, style="whisper"),
    )


def _qwen2_audio_from_hf(cfg: dict[str, Any]) -> ArchConfig:
    """A Qwen2-Audio checkpoint: its Qwen2 text model (`text_config`) with its audio side
    (`VisionArch.from_qwen2_audio`: Whisper's encoder, conveyor/models/qwen_audio.py)."""
    arch = _text_model({"model_type": "qwen2", **dict(cfg.get("text_config") or {})}, {}, cfg, "Qwen2-Audio")
    try:
        audio = VisionArch.from_qwen2_audio(cfg, arch.hidden_size)
    except VisionConfigError as e:
        raise UnsupportedModelError(str(e)) from None
    if not 0 <= audio.image_token_id < arch.vocab_size:
        raise UnsupportedModelError(f"audio_token_index={audio.image_token_id} is outside the vocabulary")
    return dataclasses.replace(arch, multimodal=True, vision=audio)


def _text_model(given: dict[str, Any], defaults: dict[str, Any], cfg: dict[str, Any], what: str) -> ArchConfig:
    """A multimodal checkpoint's text model from its `text_config` (`given`, over `defaults`;
    the top level's BOS and EOS where it names none): a plain decoder, else UnsupportedModelError."""
    text = {**defaults, **given}
    for key in ("bos_token_id", "eos_token_id"):
        if given.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    arch = ArchConfig.from_hf(text)
    if arch.multimodal or arch.is_encoder or arch.labels:
        raise UnsupportedModelError(f"{what} over a {arch.family} text model is not supported")
    return arch


def _llava_from_hf(cfg: dict[str, Any], tiles: bool = False, mistral3: bool = False, internvl: bool = False,
                   onevision: bool = False) -> ArchConfig:
    """A LLaVA checkpoint (LLaVA-NeXT's with `tiles`; Mistral 3's, a Pixtral tower whose patches
    merge 2x2, with `mistral3`; InternVL's, InternViT over tiles, with `internvl`): its text
    model (any family conveyor runs, by `text_config`'s `model_type` or `architectures`) with its
    vision side (`VisionArch`)."""
    given = dict(cfg.get("text_config") or {})
    if internvl and "tie_word_embeddings" in cfg:  # (the top level's governs, as transformers reads it)
        given["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    kind = given.get("model_type", "mistral" if mistral3 else "qwen2" if internvl or onevision else "llama")
    defaults = {"llama": LLAMA_TEXT_DEFAULTS, "mistral": MISTRAL_TEXT_DEFAULTS}.get(kind, {})
    arch = _text_model(given, defaults, cfg, "a LLaVA")
    try:
        if mistral3:
            vision = VisionArch.from_mistral3(cfg, arch.hidden_size, arch.rms_norm_eps)
        elif internvl:
            vision = VisionArch.from_internvl(cfg, arch.hidden_size)
        elif onevision:
            vision = VisionArch.from_llava_onevision(cfg, arch.hidden_size)
        else:
            vision = (VisionArch.from_llava_next if tiles else VisionArch.from_llava)(cfg, arch.hidden_size)
    except VisionConfigError as e:
        raise UnsupportedModelError(str(e)) from None
    if not 0 <= vision.image_token_id < arch.vocab_size:
        raise UnsupportedModelError(f"image_token_index={vision.image_token_id} is outside the vocabulary")
    return dataclasses.replace(arch, multimodal=True, vision=vision)


def _qwen_vl_from_hf(cfg: dict[str, Any], style: str) -> ArchConfig:
    """A Qwen2-VL or Qwen2.5-VL checkpoint (its Qwen2 text model: the config's top level in
    transformers 4's form, `text_config` in 5's) or a Qwen3-VL one (a Qwen3 text model, M-RoPE's
    parts interleaved), with M-RoPE, and its vision side."""
    qwen3 = style == "qwen3_vl"
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "architectures", "model_type")}
    text = {**top, **(cfg.get("text_config") or {})}
    if "tie_word_embeddings" in cfg:  # (the top level's governs: Qwen3-VL-MoE's text config says True)
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    moe = qwen3 and bool(text.get("num_experts") or text.get("num_local_experts"))
    family = "qwen3_moe" if moe else "qwen3" if qwen3 else "qwen2"
    architecture = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    # (Qwen3-VL's mixture always renormalizes its top-k weights)
    text |= {"architectures": [architecture[family]], "model_type": family, **({"norm_topk_prob": True} if moe else {})}
    scaling, params = dict(text.get("rope_scaling") or {}), dict(text.get("rope_parameters") or {})
    section = (scaling.get("mrope_section") or params.get("mrope_section")
               or ((24, 20, 20) if qwen3 else (16, 24, 24)))
    if scaling.get("rope_type", scaling.get("type")) in ("mrope", "default"):
        text["rope_scaling"] = None  # (M-RoPE is this model's plain RoPE: its sections are below)
    if params.get("rope_type", params.get("type")) == "mrope":
        text["rope_parameters"] = {**params, "rope_type": "default"}
    arch = ArchConfig.from_hf(text)
    if 2 * sum(section) != arch.rope_dim:
        raise UnsupportedModelError(f"mrope_section {list(section)} does not split a head of {arch.rope_dim} dims in half")
    try:
        vision = VisionArch.from_qwen_vl(cfg, arch.hidden_size, style)
    except VisionConfigError as e:
        raise UnsupportedModelError(str(e)) from None
    if not 0 <= vision.image_token_id < arch.vocab_size:
        raise UnsupportedModelError(f"image_token_id={vision.image_token_id} is outside the vocabulary")
    return dataclasses.replace(arch, multimodal=True, vision=vision, mrope_section=tuple(int(s) for s in section),
                               mrope_interleaved=qwen3)


def _longrope(cfg: dict[str, Any], scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Phi-3's LongRoPE scaling with what its tables need beside the factors: the pretraining
    length (`original_max_position_embeddings`, where Phi-3's configs keep it at the top) and
    the ratio of the lengths where the config gives no `factor`."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return scaling
    original = int(scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096))
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original, "factor": factor}


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """The rotary base and scaling (None: plain RoPE) of a config of either generation."""
    rope_scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters")  # transformers >= 5 folds theta and scaling here
    if isinstance(params, dict):
        rope_theta = params.get("rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default" and rope_scaling is None:
            rope_scaling = params
    return float(rope_theta if rope_theta is not None else 10000.0), rope_scaling


def _eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def _deepseek_from_hf(cfg: dict[str, Any], family: str) -> ArchConfig:
    """DeepSeek-V2 (and -Lite) and DeepSeek-V3 / R1: latent attention, and a mixture of
    `n_routed_experts` after `first_k_dense_replace` dense layers with `n_shared_experts`.
    GLM-4.5 / 4.6: the same mixture (V3's router) under grouped-query attention with q/k/v
    biases, optional q/k norms and RoPE over the first `partial_rotary_factor` of each head."""
    rope_theta, rope_scaling = _rope(cfg)
    heads = cfg["num_attention_heads"]
    experts = int(cfg.get("n_routed_experts") or 0)
    moe_width = int(cfg.get("moe_intermediate_size") or 0)
    glm = family == "glm4_moe"
    v3 = family == "deepseek_v3" or glm
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if int(cfg.get("moe_layer_freq") or 1) != 1:  # (every released checkpoint routes every layer)
        raise UnsupportedModelError(f"moe_layer_freq={cfg['moe_layer_freq']} is not supported (1 is)")
    return ArchConfig(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads) if glm else heads,
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads) if glm else int(cfg.get("qk_rope_head_dim", 64)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=glm and bool(cfg.get("use_qk_norm", False)),
        rotary_dim=_rotary_dim(cfg) if glm else 0,
        rope_scaling=rope_scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate_size=moe_width if experts else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=moe_width * int(cfg.get("n_shared_experts") or 0) if experts else 0,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=0 if glm else int(cfg.get("kv_lora_rank", 512)),
        qk_nope_head_dim=0 if glm else int(cfg.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=0 if glm else int(cfg.get("qk_rope_head_dim", 64)),
        v_head_dim=0 if glm else int(cfg.get("v_head_dim", 128)),
        # V2's rotary multiplies (even, odd) pairs as complex numbers; V3's says so in its config.
        rope_interleave=False if glm else bool(cfg.get("rope_interleave", True)) if v3 else True,
        scoring_func=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
        topk_method=method,
        n_group=int(cfg.get("n_group") or 1) if method != "greedy" else 1,
        topk_group=int(cfg.get("topk_group") or 1) if method != "greedy" else 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        shared_expert_gated=False,
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
    )


def _layer_windows(types: list[str], layers: int, window: int) -> tuple[int, ...]:
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {types}: one sliding_attention or full_attention a layer")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _gpt_oss_from_hf(cfg: dict[str, Any]) -> ArchConfig:
    """gpt-oss (20B, 120B): grouped-query attention with biases and sinks, sliding (128 tokens)
    and global layers by turns, YaRN RoPE, and a mixture of experts in every layer."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    rope_theta, rope_scaling = _rope(cfg)
    if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is None:  # (the config's default)
        rope_scaling = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096}
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    experts = int(cfg.get("num_local_experts") or 0)
    width = int(cfg["intermediate_size"])
    return ArchConfig(
        family="gpt_oss",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta if cfg.get("rope_theta") or cfg.get("rope_parameters") else 150000.0,
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", True)),
        rope_scaling=rope_scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 4),
        moe_intermediate_size=width,
        layer_windows=_layer_windows(types, layers, int(cfg.get("sliding_window") or 128)),
        attention_sinks=True,
        o_proj_bias=bool(cfg.get("attention_bias", True)),
        expert_bias=True,
        swiglu_limit=float(cfg.get("swiglu_limit") or 7.0),
        swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702),
    )


def _gemma_from_hf(cfg: dict[str, Any], family: str, classifier: bool, tokens: bool) -> ArchConfig:
    """Gemma 2 (every other layer sliding, from the first) and Gemma 3 (five sliding layers to
    one global: `sliding_window_pattern`), or the `layer_types` a config lists; Gemma 3's
    sliding layers turn at `rope_local_base_freq` (transformers 5: `rope_parameters` by layer
    type), its global ones at `rope_theta` with the config's scaling."""
    gemma3 = family == "gemma3"
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma with bidirectional attention (EmbeddingGemma) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):  # (the same tanh approximation)
        raise UnsupportedModelError(f"hidden_activation={act!r}: conveyor's Gemma runs gelu_pytorch_tanh")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:
        pattern = int(cfg.get("sliding_window_pattern") or 6) if gemma3 else 2
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    window = int(cfg.get("sliding_window") or 4096)
    rope = cfg.get("rope_parameters") or {}
    by_type = isinstance(rope.get("full_attention"), dict)
    full = rope["full_attention"] if by_type else rope
    theta = float(full.get("rope_theta") or cfg.get("rope_theta") or (1_000_000.0 if gemma3 else 10_000.0))
    scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    local = (rope.get("sliding_attention") or {}) if by_type else {}
    local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0) if gemma3 else 0.0
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError("scaled RoPE on Gemma's sliding layers is not supported")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    return ArchConfig(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=gemma3,
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
        labels=_labels(cfg) if classifier else (),
        token_classifier=tokens,
        hidden_act="gelu_pytorch_tanh",
        local_rope_theta=local_theta if local_theta != theta or scaling else 0.0,
        layer_windows=_layer_windows(types, layers, window),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 0.0),
        attn_logit_softcapping=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
    )


def _rotary_dim(cfg: dict[str, Any]) -> int:
    params = cfg.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    factor = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    dim = int(head_dim * factor)
    if dim % 2 or not 0 < dim <= head_dim:
        raise UnsupportedModelError(f"partial_rotary_factor={factor} of head_dim={head_dim} gives no even rotary width")
    return 0 if dim == head_dim else dim


ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def _encoder_from_hf(cfg: dict[str, Any], family: str, classifier: bool, tokens: bool = False) -> ArchConfig:
    """A BERT or RoBERTa config: absolute position embeddings only (what their checkpoints
    use); RoBERTa numbers positions from its padding id + 1, so it has two positions fewer."""
    if family == "modernbert":
        return _modernbert_from_hf(cfg, classifier, tokens)
    if family == "gemma3_encoder":
        if not cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("Gemma3TextModel without use_bidirectional_attention is a decoder's body; "
                                        "conveyor runs it as Gemma3ForCausalLM")
        arch = _gemma_from_hf({**cfg, "use_bidirectional_attention": False}, "gemma3", False, False)
        # HF's bidirectional sliding layers see |i - j| < window // 2 + 1: window // 2 either side.
        sides = tuple(w // 2 for w in arch.layer_windows)
        return dataclasses.replace(arch, family="gemma3_encoder", layer_windows=sides, pooling="mean",
                                   tie_word_embeddings=False)
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise UnsupportedModelError(f"position_embedding_type={kind!r}: conveyor's encoders have absolute positions")
    act = cfg.get("hidden_act", "gelu")
    if act not in ENCODER_ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act={act!r}: conveyor's encoders run {', '.join(ENCODER_ACTIVATIONS)}")
    positions = cfg.get("max_position_embeddings", 512)
    offset = int(cfg.get("pad_token_id") or 0) + 1 if family == "roberta" else 0
    return ArchConfig(
        **_encoder_shape(cfg, family, classifier, tokens),
        rms_norm_eps=cfg.get("layer_norm_eps", 1e-12),
        rope_theta=10000.0,  # (no rotary positions)
        max_position_embeddings=positions - offset,
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        hidden_act=act,
        position_offset=offset,
        sep_token_id=cfg.get("sep_token_id"),
    )


def _encoder_shape(cfg: dict[str, Any], family: str, classifier: bool, tokens: bool) -> dict[str, Any]:
    """What every encoder's config says alike: its widths and depth, one KV head a query head,
    no LM head, and a classifier's classes."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    return dict(family=family, vocab_size=cfg["vocab_size"], hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
                num_kv_heads=heads, head_dim=hidden // heads, tie_word_embeddings=False,
                labels=_labels(cfg) if classifier else (), token_classifier=tokens)


def _modernbert_from_hf(cfg: dict[str, Any], classifier: bool, tokens: bool) -> ArchConfig:
    """ModernBERT's config, as transformers 4.48-4.x wrote it (global_attn_every_n_layers, the
    two rope thetas) or 5 writes it (layer_types, rope_parameters by layer type)."""
    for key, want in (("hidden_activation", ENCODER_ACTIVATIONS), ("classifier_activation", ENCODER_ACTIVATIONS)):
        if cfg.get(key, "gelu") not in want:
            raise UnsupportedModelError(f"{key}={cfg.get(key)!r}: conveyor's encoders run {', '.join(want)}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("norm_bias"):
        raise UnsupportedModelError("ModernBERT with attention, MLP or norm biases is not read here")
    every = int(cfg.get("global_attn_every_n_layers") or 3)
    types = cfg.get("layer_types")
    if types:
        globals_at = [i for i, t in enumerate(types) if t == "full_attention"]
        every = globals_at[1] - globals_at[0] if len(globals_at) > 1 else len(types)
        if globals_at[:1] != [0] or any(b - a != every for a, b in itertools.pairwise(globals_at)):
            raise UnsupportedModelError(f"layer_types {types}: conveyor reads a global layer every n from the first")
    rope = cfg.get("rope_parameters") or {}
    global_theta = (rope.get("full_attention") or {}).get("rope_theta", cfg.get("global_rope_theta", 160000.0))
    local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", cfg.get("local_rope_theta", 10000.0))
    return ArchConfig(
        **_encoder_shape(cfg, "modernbert", classifier, tokens),
        rms_norm_eps=cfg.get("norm_eps", 1e-5),
        rope_theta=float(global_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        sliding_window=int(cfg.get("local_attention", 128)) // 2,
        pooling=cfg.get("classifier_pooling") if classifier else None,
        hidden_act=cfg.get("hidden_activation", "gelu"),
        global_attn_every=every,
        local_rope_theta=float(local_theta),
        classifier_act=cfg.get("classifier_activation", "gelu"),
        classifier_bias=bool(cfg.get("classifier_bias", False)),
    )


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's class names, by index: HF's `id2label` (written for every classifier;
    `num_labels` alone names them LABEL_i, as transformers does)."""
    id2label = cfg.get("id2label") or {}
    n = int(cfg.get("num_labels") or len(id2label) or 2)
    if id2label and len(id2label) != n:
        raise UnsupportedModelError(f"num_labels={n} but id2label names {len(id2label)} classes")
    try:
        names = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError):
        raise UnsupportedModelError(f"id2label's keys must be class indices, got {sorted(id2label)!r}") from None
    if id2label and sorted(names) != list(range(n)):
        raise UnsupportedModelError(f"id2label's keys must be 0..{n - 1}, got {sorted(names)}")
    return tuple(names.get(i, f"LABEL_{i}") for i in range(n))
