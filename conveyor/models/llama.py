"""The Llama family (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE: conveyor/models/moe.py) over a flat token batch; DeepSeek-V2/V3 are
this body with latent attention (conveyor/models/mla.py) and DeepSeek's routers.

Selective batching: embeddings, norms, projections and the MLP run once over all of a step's
tokens `[T, hidden]`; only attention looks at sequences, through the paged KV cache. Q/K/V and
gate/up projections are fused into one matrix each. The LM head runs only on sampling rows.
"""

from __future__ import annotations

import functools
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import (
    FUSED_DECODE_ROWS,
    LAYER_FIELDS,
    Q8_MAX_ROWS,
    SKINNY_MAX_ROWS,
    decode_layers,
    paged_decode_attention,
    rms_norm,
    rope,
    silu_mul,
    skinny_linear,
    skinny_linear_q8,
    to_huge_pages,
    write_kv,
)
from conveyor.models.arch import ArchConfig, UnsupportedModelError
from conveyor.models.attention import (
    NATIVE_KV_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    CpuEagerAttention,
    CpuPagedAttention,
    EagerAttention,
    build_metadata,
)
from conveyor.models.mla import LatentAttention
from conveyor.models.moe import Experts, SparseMoE
from conveyor.models.quantize import (
    ActivationRecorder,
    Int8Linear,
    choose_smoothing,
    int8_supported,
    quantize_linears,
)

if TYPE_CHECKING:
    from conveyor.models.lora import LoRAContext
    from conveyor.models.vision import ImageEncoder

# Fused-decode pointer tables kept: one per KV cache of the engines sharing a model.
MAX_CACHE_TABLES = 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    native: Callable[..., torch.Tensor] | None = None  # set by prepare_for_inference (CPU float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Half precision normalises in float32 (as the reference does); float32/float64 keep
        # their own precision. F.rms_norm is one fused kernel, bit-equal to the formula here.
        if self.native is not None and x.dim() == 2:
            return self.native(x, self.weight, self.eps)
        shape = (x.shape[-1],)
        if x.dtype in (torch.float16, torch.bfloat16):
            normed = F.rms_norm(x.float(), shape, None, self.eps)
            return self.weight * normed.to(x.dtype)
        return F.rms_norm(x, shape, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), in float32 whatever the model's dtype, then
    rounds once (as HF's Gemma2/3RMSNorm; the checkpoint stores the weight centred on 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(arch: ArchConfig, dim: int) -> RMSNorm | GemmaRMSNorm:
    return GemmaRMSNorm(dim, arch.rms_norm_eps) if arch.is_gemma else RMSNorm(dim, arch.rms_norm_eps)


def rope_inv_freq(arch: ArchConfig) -> torch.Tensor:
    """Inverse frequencies, computed in float32 as the reference implementation does."""
    dim = arch.rope_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor (llama3-style scaling, precomputed)
        return inv / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "longrope":  # Phi-3's LongRoPE: a factor a dimension (the short ones; `Rotary` adds the long)
        return longrope_inv_freq(arch, "short_factor")
    if kind == "yarn":  # YaRN (Peng et al., 2023): long wavelengths interpolated, short ones kept
        factor = float(scaling["factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

        def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(arch.rope_theta))

        low, high = dim_of(fast), dim_of(slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1 where a dimension keeps its frequency (extrapolates)
        wavelengths = arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        return 1.0 / (factor * wavelengths) * (1 - keep) + inv * keep  # (HF's roundings)
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn, longrope are)")


def longrope_inv_freq(arch: ArchConfig, which: str) -> torch.Tensor:
    """LongRoPE's inverse frequencies with its `short_factor` or `long_factor` (HF's roundings)."""
    dim = arch.rope_dim
    factors = torch.tensor((arch.rope_scaling or {})[which], dtype=torch.float32)
    return 1.0 / (factors * arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(arch: ArchConfig) -> float:
    """What YaRN and LongRoPE multiply the cos/sin tables by (1 for every other kind of RoPE)."""
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def softmax_scale_factor(arch: ArchConfig) -> float:
    """DeepSeek's correction of the softmax scale under scaled RoPE: `mscale_all_dim`'s YaRN
    factor, squared (1 where the config has none)."""
    scaling = arch.rope_scaling or {}
    mscale_all_dim = scaling.get("mscale_all_dim")
    if scaling.get("rope_type", scaling.get("type", "default")) == "default" or not mscale_all_dim:
        return 1.0
    return _yarn_mscale(float(scaling["factor"]), float(mscale_all_dim)) ** 2


class Rotary(nn.Module):
    """cos/sin tables for every position up to `max_positions`, in the model dtype."""

    cos: torch.Tensor  # buffers [positions, head_dim/2], float32
    sin: torch.Tensor

    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        inv = rope_inv_freq(arch)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]  # [positions, head_dim / 2]
        scaling = arch.rope_scaling or {}
        # LongRoPE: a second table, with the long factors, at rows max_positions.. (`long_from`:
        # the rows of a step whose sequence reaches past the pretraining length read it).
        self.long_from = 0
        if scaling.get("rope_type") == "longrope":
            freqs = torch.cat((freqs, pos[:, None] * longrope_inv_freq(arch, "long_factor")[None, :]))
            self.long_from = int(scaling["original_max_position_embeddings"])
        self.max_positions = max_positions
        factor = rope_attention_factor(arch)
        self.register_buffer("cos", freqs.cos() * factor if factor != 1 else freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin() * factor if factor != 1 else freqs.sin(), persistent=False)
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._mrope_parts: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin rows `[T, 1, head_dim/2]` for this step, computed once, shared by all layers.
        In another dtype than float32 they are views of one gather from a table of both, kept
        in that dtype: one kernel a step where a gather and a cast of each took four (the
        same values: rounding commutes with the gather)."""
        if dtype == self.cos.dtype:  # the native CPU kernels take contiguous rows
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        key = (dtype, self.cos.device)
        table = self._tables.get(key)
        if table is None:  # [positions, 2, head_dim/2]; built by the eager run before a graph capture
            table = self._tables[key] = torch.stack((self.cos, self.sin), dim=1).to(dtype)
        rows = table[positions]
        return rows[:, :1], rows[:, 1:]

    def mrope(self, positions: torch.Tensor, sections: tuple[int, ...], interleaved: bool, dtype: torch.dtype
              ) -> RopeTables:
        """M-RoPE's rows `[T, 1, head_dim/2]` for positions `[T, 3]` (time, row, column): each
        frequency at the position of its part (HF's `mrope_section`: the parts in turn, or with
        `interleaved`, Qwen3-VL's, frequency j at the row's if j % 3 == 1 and the column's if
        j % 3 == 2, within their parts' thrice lengths; both halves of a head alike)."""
        key = (sections, interleaved, positions.device)
        parts = self._mrope_parts.get(key)
        if parts is None:
            if interleaved:
                part = torch.zeros(sum(sections), dtype=torch.int64)
                for k in (1, 2):
                    part[k : 3 * sections[k] : 3] = k
            else:
                part = torch.repeat_interleave(torch.arange(len(sections)) % 3, torch.tensor(sections))
            parts = self._mrope_parts[key] = (part.to(positions.device),
                                              torch.arange(sum(sections), device=positions.device))
        part, columns = parts
        rows = positions[:, part]  # [T, head_dim/2]: each frequency's position
        return self.cos[rows, columns].unsqueeze(1).to(dtype), self.sin[rows, columns].unsqueeze(1).to(dtype)


RopeTables = tuple[torch.Tensor, torch.Tensor]
# (delta, residual, weight, eps) -> (rms_norm(residual + delta) * weight, residual + delta)
AddNorm = Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
# (x, weight, *, norm=, eps=, silu_mul=, residual=) -> x @ weight.T with those folded in
Gemv = Callable[..., torch.Tensor]


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate the two halves of each head (the HF / NeoX layout); same rounding as the
    reference's `x * cos + rotate_half(x) * sin`."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TransposedLinear(nn.Module):
    """`nn.Linear` with its weight stored `[in, out]`: on CPU, MKL streams this layout from
    memory faster for the small row counts of decode steps (measured in BENCHMARKS.md)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


class SkinnyLinear(nn.Module):
    """`nn.Linear` (weight `[out, in]`) for float32 on CPU: steps of up to SKINNY_MAX_ROWS
    rows (decodes) go through the native kernel that streams the weight at memory speed;
    larger ones (prompts) through MKL's GEMM."""

    def __init__(self, linear: nn.Linear, kernel: Callable[..., torch.Tensor], max_rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(to_huge_pages(linear.weight.detach().contiguous()), requires_grad=False)
        self.bias = linear.bias
        self.kernel = kernel
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            y = self.kernel(x, self.weight)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, backend: AttentionBackend, index: int = 0) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_proj_bias)
        self.q_norm = make_norm(arch, arch.head_dim) if arch.qk_norm else None
        self.k_norm = make_norm(arch, arch.head_dim) if arch.qk_norm else None
        self.scale = arch.attention_scale
        self.softcap = arch.attn_logit_softcapping
        self.sinks = nn.Parameter(torch.empty(arch.num_heads)) if arch.attention_sinks else None  # gpt-oss
        # Capped scores and sinks take explicit products (no kernel computes them).
        self.eager = bool(self.softcap) or self.sinks is not None
        self.backend = EagerAttention(self.softcap) if self.eager else backend
        self.rotary_dim = arch.rotary_dim  # 0: RoPE turns every dim of a head
        # A window of its own (Gemma; None: the step's): masks of that window, and a backend
        # built with it (`prepare_for_inference`).
        self.window: int | None = arch.layer_windows[index] if arch.layer_windows else None
        self.layer_index = index  # (a hybrid KV cache's metadata: `AttentionMetadata.layer_metas`)

    native_rope: Callable[..., None] | None = None  # set by prepare_for_inference (CPU float32)
    # RoPE, the K/V write and the attention from the fused projection's output, one launch for
    # a step of decodes only (CUDA, Triton backend, fused kernels on: `_use_triton_fused`).
    rope_attend: Callable[..., torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), rope, kv_cache, meta))

    def attend(
        self, qkv: torch.Tensor, rope: RopeTables, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """What lies between the two projections: the q/k norms, RoPE and paged attention of
        the fused projection's output `qkv` `[T, q + 2 kv]`; returns `[T, q_size]`."""
        T = qkv.shape[0]
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = qkv.view(T, h + 2 * kvh, self.head_dim)
        if self.sinks is not None:  # (the backend, eager or Triton, may serve several layers)
            self.backend.sinks = self.sinks
        if meta.layer_metas is not None:  # a hybrid KV cache: this layer's group's tables and slots
            meta = meta.layer_metas[self.layer_index]
        rope_attend = self.rope_attend
        if rope_attend is not None and self.q_norm is None and not self.rotary_dim:
            return rope_attend(qkv, rope[0], rope[1], h, kv_cache, meta, self.scale).reshape(T, self.q_size)
        if self.window is not None:
            meta = meta.windowed(self.window)
        qk, v = qkv[:, : h + kvh], qkv[:, h + kvh :]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        r = self.rotary_dim
        if r:  # partial RoPE (GLM-4.5): the leading dims turn, the rest pass
            qk = torch.cat((apply_rope(qk[..., :r], rope), qk[..., r:]), dim=-1)
        elif self.native_rope is not None:
            self.native_rope(qk, rope[0], rope[1], h + kvh)  # in place, one pass
        else:
            qk = apply_rope(qk, rope)  # q and k heads in one pass
        q, k = qk[:, :h], qk[:, h:]
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return o.reshape(T, self.q_size)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        self.intermediate = intermediate_size
        self.gelu = act != "silu"  # Gemma: GELU (tanh approximation) of the gate
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    native_silu_mul: Callable[..., torch.Tensor] | None = None  # set by prepare_for_inference (CPU float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native_silu_mul is not None:
            return self.down_proj(self.native_silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        if self.gelu:
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, backend: AttentionBackend, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = make_norm(arch, arch.hidden_size)
        self.self_attn: Attention | LatentAttention = (LatentAttention(arch) if arch.is_mla
                                                       else Attention(arch, backend, index))
        # Llama: the norm before the MLP. Gemma: the norm of the attention's output, with two
        # more around the MLP (before it and of its output), each before the residual add.
        self.post_attention_layernorm = make_norm(arch, arch.hidden_size)
        self.pre_feedforward_layernorm = make_norm(arch, arch.hidden_size) if arch.is_gemma else None
        self.post_feedforward_layernorm = make_norm(arch, arch.hidden_size) if arch.is_gemma else None
        # Gemma 3's sliding layers turn at a RoPE base of their own (the model's `local_rotary`).
        self.local_rope = arch.local_rope_theta > 0 and arch.window_of(index) > 0
        self.residual_multiplier = arch.residual_multiplier
        self.mlp: MLP | SparseMoE
        if arch.is_sparse_layer(index):
            shared = arch.shared_expert_intermediate_size
            self.mlp = SparseMoE(arch, MLP(arch.hidden_size, shared) if shared else None)
        else:
            self.mlp = MLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)

    # Tensor parallelism (conveyor/models/tensor_parallel.py): sums the ranks' partial outputs
    # of the attention and of the MLP, in place, before each joins the residual stream.
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        reduce = self.reduce
        if self.residual_multiplier != 1.0:  # Granite: each sublayer's output scaled before its add
            m = self.residual_multiplier
            attn = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
            h = x + (attn if reduce is None else reduce(attn)) * m
            out = self.mlp(self.post_attention_layernorm(h))
            return h + (out if reduce is None else reduce(out)) * m
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            attn = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
            h = x + self.post_attention_layernorm(attn if reduce is None else reduce(attn))
            out = self.mlp(self.pre_feedforward_layernorm(h))
            return h + self.post_feedforward_layernorm(out if reduce is None else reduce(out))
        if reduce is not None:
            h = x + reduce(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
            return h + reduce(self.mlp(self.post_attention_layernorm(h)))
        h = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        add_norm: AddNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with each residual add fused into the norm after it: takes and returns the
        last sublayer's output not yet added (`delta`, None before the first layer) and the
        running residual. The same sums, in the same order, as `forward`."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        normed, residual = add_norm(delta, residual, ln1.weight, ln1.eps)
        attn = self.self_attn(normed, rope, kv_cache, meta)
        if self.reduce is not None:
            attn = self.reduce(attn)
        normed, residual = add_norm(attn, residual, ln2.weight, ln2.eps)
        out = self.mlp(normed)
        return (out if self.reduce is None else self.reduce(out)), residual

    def forward_gemv(
        self, x: torch.Tensor, rope: RopeTables, kv_cache: torch.Tensor, meta: AttentionMetadata, gemv: Gemv
    ) -> torch.Tensor:
        """`forward` for the few rows of a decode step with each projection one GEMV that folds
        in its neighbours (conveyor/kernels/triton_gemv.py): the norm before `qkv_proj` and
        `gate_up_proj`, SiLU × up before `down_proj`, the residual add after `o_proj` and
        `down_proj`. Four GEMVs, RoPE and attention; the same roundings as `forward`."""
        attn, mlp = self.self_attn, self.mlp
        assert isinstance(mlp, MLP) and isinstance(attn, Attention), "a mixture of experts or MLA takes the modules' path"
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv = gemv(x, attn.qkv_proj.weight, norm=ln1.weight, eps=ln1.eps)
        h = gemv(attn.attend(qkv, rope, kv_cache, meta), attn.o_proj.weight, residual=x)
        gate_up = gemv(h, mlp.gate_up_proj.weight, norm=ln2.weight, eps=ln2.eps)
        return gemv(gate_up, mlp.down_proj.weight, silu_mul=True, residual=h)


class FusedDecode:
    """Decode-only steps of up to `max_rows` rows on CPU in float32 (FUSED_DECODE_ROWS; Q8_MAX_ROWS
    with int8 weights): every decoder layer
    in one native call (`decode_layers` in conveyor/kernels/cpu_kernels.cpp), the same stages
    as the modules but with no Python and no thread start-up between the weight streams. At
    batch 1 that per-layer overhead is about an eighth of a step (BENCHMARKS.md).

    With `quantization="int8"` the projections stream their int8 weights here and multiply
    float32 activations (weight-only int8); larger steps keep fbgemm's int8 x int8 GEMMs."""

    def __init__(self, model: LlamaForCausalLM, kernel: Callable[..., None]) -> None:
        arch = model.arch
        self.kernel = kernel
        # The modules the step's two ends use (not the model itself: no reference cycle).
        self.rotary: Rotary = model.rotary
        self.embed: nn.Embedding = model.embed_tokens
        assert isinstance(model.norm, RMSNorm)  # (no Gemma: its layers run as modules)
        self.norm: RMSNorm = model.norm
        self.fold_ends = True  # embedding and final norm in the native call (False: in torch, as before)
        assert self.rotary.cos.is_contiguous() and self.rotary.cos.dtype == torch.float32
        assert self.embed.weight.is_contiguous() and self.embed.weight.dtype == torch.float32
        self.dims = (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size,
                     arch.rms_norm_eps)
        self.scale = arch.head_dim**-0.5
        self.window = arch.sliding_window or 0

        def ptr(t: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> int:
            assert t is None or (t.is_contiguous() and t.dtype == dtype)
            return 0 if t is None else t.data_ptr()

        def weight(proj: nn.Module) -> int:
            if isinstance(proj, Int8Linear):
                return ptr(proj.qweight, torch.int8)
            w = proj.weight
            assert isinstance(w, torch.Tensor)
            return ptr(w)

        def int8(proj: nn.Module) -> list[int]:  # (row scales, smoothing divisors) or zeros
            if isinstance(proj, Int8Linear):
                return [ptr(proj.wscale), ptr(proj.inv_smooth)]
            return [0, 0]

        rows, int8_rows = [], []
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(mlp, MLP) and isinstance(attn, Attention), "the fused decode runs dense models only"
            rows.append([
                ptr(layer.input_layernorm.weight), weight(attn.qkv_proj), ptr(attn.qkv_proj.bias),
                ptr(attn.q_norm.weight if attn.q_norm is not None else None),
                ptr(attn.k_norm.weight if attn.k_norm is not None else None),
                weight(attn.o_proj), ptr(layer.post_attention_layernorm.weight),
                weight(mlp.gate_up_proj), weight(mlp.down_proj),
            ])
            int8_rows.append([v for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                              for v in int8(proj)])
        # The model keeps every tensor alive; the table holds only their addresses.
        self.weights = torch.tensor(rows, dtype=torch.int64)
        self.int8 = torch.tensor(int8_rows, dtype=torch.int64)
        # int8 projections pass over their weights once per 8 rows; float32 ones once per step.
        self.max_rows = Q8_MAX_ROWS if bool(self.int8.any()) else FUSED_DECODE_ROWS
        assert self.weights.shape[1] + 2 + self.int8.shape[1] == len(LAYER_FIELDS)
        # One table per KV cache (engines that share the model each have their own cache, and
        # may step at once from their threads): built once, looked up by the caches' addresses.
        self._tables: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    def table(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The weight pointers with each layer's K and V cache pointers appended (built once
        per cache; safe to call from several threads)."""
        key = tuple(c.data_ptr() for c in kv_caches)
        table = self._tables.get(key)
        if table is None:
            assert all(c.is_contiguous() and c.dtype in NATIVE_KV_DTYPES for c in kv_caches)
            caches = torch.tensor([[c[0].data_ptr(), c[1].data_ptr()] for c in kv_caches], dtype=torch.int64)
            table = torch.cat((self.weights, caches, self.int8), dim=1).contiguous()
            self._tables[key] = table
            while len(self._tables) > MAX_CACHE_TABLES:
                self._tables.popitem(last=False)
        return table

    def applies(self, num_tokens: int, meta: AttentionMetadata | None, kv_dtype: torch.dtype) -> bool:
        """Whether a step of `num_tokens` rows runs here: decodes only (`meta`; None: the rows
        will be), few enough, over a cache whose dtype the call reads."""
        if meta is not None and (meta.num_decodes != num_tokens or meta.prefills):
            return False
        return num_tokens <= self.max_rows and kv_dtype in NATIVE_KV_DTYPES

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The step's hidden states after the final norm. The embedding lookup and the final norm
        run inside the native call too (`fold_ends`), so that nothing but this call sits between
        the previous step's sampling and the weight stream: the host work after a stream runs on
        cold caches, about 100 µs a torch op at batch 1 here (BENCHMARKS.md).

        `meta.chained` (a speculative step's guessed rows, each a one-token decode) has the call
        write every row's K/V before any row attends. `keep` (int64 layer indices): the residual
        streams entering those layers, side by side, in `kept` `[T, len(keep) * hidden]`."""
        assert meta.decode_blocks is not None and meta.decode_context_lens is not None
        kv_half = kv_caches[0].dtype == torch.float16
        tables, ctx = meta.decode_blocks.contiguous(), meta.decode_context_lens.contiguous()
        ends: tuple[torch.Tensor | None, ...]
        if self.fold_ends:
            x = torch.empty((input_ids.shape[0], self.dims[0]), dtype=torch.float32)
            ends = (input_ids.contiguous(), self.embed.weight, self.norm.weight)
        else:
            x, ends = self.embed(input_ids).contiguous(), (None, None, None)
        aux = None if keep is None else torch.empty((x.shape[0], keep.numel() * x.shape[1]), dtype=torch.float32)
        self.kernel(x, self.table(kv_caches), self.dims, self.rotary.cos, self.rotary.sin, positions.contiguous(),
                    meta.slot_mapping.contiguous(), tables, ctx, meta.block_size, self.scale, self.window, kv_half,
                    *ends, chained=meta.chained, aux_layers=keep, aux=aux, paths=meta.decode_paths,
                    path_lens=meta.decode_path_lens)
        self.kept = aux
        return x if self.fold_ends else self.norm(x)

    kept: torch.Tensor | None = None  # the last call's `keep` streams


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF's, except the fused `qkv_proj` and `gate_up_proj`."""

    embed_tokens: nn.Embedding
    norm: RMSNorm | GemmaRMSNorm
    rotary: Rotary

    def __init__(self, arch: ArchConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(arch, backend, i) for i in range(arch.num_layers)])
        self.norm = make_norm(arch, arch.hidden_size)
        # A classifier (`arch.labels`) has a `score` head over the pooled hidden state and no LM head.
        self.lm_head = (None if arch.tie_word_embeddings or arch.labels
                        else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False))
        self.score = nn.Linear(arch.hidden_size, arch.num_labels, bias=arch.token_classifier) if arch.labels else None
        self.rotary = Rotary(arch, max_positions)
        self.local_rotary = Rotary(arch.local_rope, max_positions) if arch.local_rope_theta else None
        # Gemma scales its embeddings by sqrt(hidden), rounded to the model's dtype; Granite by
        # its `embedding_multiplier`.
        self.embed_scale = arch.hidden_size**0.5 if arch.is_gemma else None
        self.embed_multiplier = arch.embedding_multiplier
        self.fused_decode: FusedDecode | None = None  # set by prepare_for_inference (CPU float32)
        self.add_norm: AddNorm | None = None  # set by prepare_for_inference (CUDA, half precision)
        self.gemv: Gemv | None = None  # set by prepare_for_inference (CUDA, half precision, opt-in)
        self.gemv_head: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # ... with the argmax
        self.gemv_max_rows = 0
        self.lora: LoRAContext | None = None  # set by attach_lora (enable_lora)
        # The layers whose incoming residual streams a step keeps, side by side in `aux_hidden`
        # `[T, len(aux_layers) * hidden]` (an EAGLE-3 head's input: conveyor/models/eagle.py).
        self.aux_layers = ()
        self.aux_hidden: torch.Tensor | None = None
        # A LLaVA's vision side (conveyor/models/vision.py; Qwen2-Audio's audio side,
        # conveyor/models/qwen_audio.py), set by the loader: what a step's image (audio) tokens
        # take their embeddings from (`AttentionMetadata.embeds`). `text_only`: an image-text
        # model loaded without it (`limit_mm_per_prompt` 0 for every kind it reads).
        self.vision: ImageEncoder | None = None
        self.text_only = False

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self._aux_layers

    @aux_layers.setter
    def aux_layers(self, layers: tuple[int, ...]) -> None:
        self._aux_layers = tuple(layers)
        self._aux_ids = torch.tensor(self._aux_layers, dtype=torch.int64)  # (for the native call)

    @property
    def tensor_parallel(self) -> bool:
        """One rank's shard (conveyor/models/tensor_parallel.py): its layers all-reduce."""
        return any(isinstance(layer, DecoderLayer) and layer.reduce is not None for layer in self.layers)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight `[vocab, hidden]`: the embedding table's where they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm."""
        # A step with adapters runs the modules, where `LoRALinear` adds their deltas; the
        # fused paths read the base weights directly. So does a step that keeps the streams
        # entering some layers (an EAGLE-3 head reads them: `aux_layers`).
        aux = self.aux_layers
        # (a step with image tokens takes their embeddings from `meta.embeds`, and M-RoPE's
        # positions from `meta.mrope`: the modules too)
        bare = (self.lora is None or self.lora.current() is None) and meta.embeds is None and meta.mrope is None
        fused = self.fused_decode
        # (the native whole-model decode reads one table for every layer: not a hybrid cache's;
        # it keeps the streams an EAGLE-3 head reads itself)
        if bare and fused is not None and meta.layer_metas is None and fused.applies(input_ids.shape[0], meta, kv_caches[0].dtype):
            if not aux:
                return fused(input_ids, positions, kv_caches, meta)
            hidden = fused(input_ids, positions, kv_caches, meta, self._aux_ids)
            self.aux_hidden = fused.kept
            return hidden
        plain = bare and not aux
        if plain and self.gemv is not None and input_ids.shape[0] <= self.gemv_max_rows:
            return self.norm(self._forward_gemv(input_ids, positions, kv_caches, meta))
        x = self.embed(input_ids)
        deep: torch.Tensor | None = None  # (Qwen3-VL's DeepStack: what the first layers' outputs add)
        if meta.embeds is not None:  # image tokens: the vision side's embeddings in their rows
            rows, values = meta.embeds
            width = x.shape[1]
            x = x.index_copy(0, rows, values[:, :width].to(x.dtype))
            if values.shape[1] > width:
                deep = values[:, width:].to(x.dtype).view(len(rows), -1, width)
        if meta.mrope is not None:
            rope = self.rotary.mrope(meta.mrope, self.arch.mrope_section, self.arch.mrope_interleaved, x.dtype)
        else:
            rope = self.rotary(self.rope_positions(positions, meta), x.dtype)
        add_norm = self.add_norm
        kept: dict[int, torch.Tensor] = {}
        if add_norm is not None:
            delta: torch.Tensor | None = None
            for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                assert isinstance(layer, DecoderLayer)
                if i in aux:
                    kept[i] = x if delta is None else x + delta
                delta, x = layer.forward_fused(delta, x, rope, cache, meta, add_norm)
                if deep is not None and i < deep.shape[1]:  # (into the residual: the sum is the same)
                    assert meta.embeds is not None
                    x = x.index_add(0, meta.embeds[0], deep[:, i])
            if aux:
                self.aux_hidden = torch.cat([kept[i] for i in aux], dim=-1)
            return add_norm(delta, x, self.norm.weight, self.norm.eps)[0]
        local = self.local_rotary(positions, x.dtype) if self.local_rotary is not None else rope
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i in aux:
                kept[i] = x
            x = layer(x, local if layer.local_rope else rope, cache, meta)
            if deep is not None and i < deep.shape[1]:
                assert meta.embeds is not None
                x = x.index_add(0, meta.embeds[0], deep[:, i])
        if aux:
            self.aux_hidden = torch.cat([kept[i] for i in aux], dim=-1)
        return self.norm(x)

    def rope_positions(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The rotary table's rows for this step: the positions, and under LongRoPE the long
        factors' rows for every row of a sequence that reaches past the pretraining length in
        this step (HF's rule for one sequence's forward pass: a prompt longer than it turns all
        of its positions with the long factors; K/V already cached keep theirs)."""
        k = self.rotary.long_from
        if not k:
            return positions
        long = positions >= k  # a decode at position p: the sequence is p + 1 long
        for span in meta.prefills:
            long[span.token_start : span.token_end] = span.start_pos + span.token_end - span.token_start > k
        return positions + long.long() * self.rotary.max_positions

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.scale_embeds(self.embed_tokens(input_ids))

    def scale_embeds(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding table's rows `x` as the layers take them (Granite's multiplier,
        Gemma's square root of the width; a prompt given as embeddings too, as HF's
        `inputs_embeds`)."""
        if self.embed_multiplier != 1.0:
            return x * self.embed_multiplier
        if self.embed_scale is None:
            return x
        return x * _rounded(self.embed_scale, x.dtype)

    def make_rotary(self, max_positions: int, device: torch.device | str) -> None:
        """The rotary tables in float32, on `device` (made again after the model moves to its
        dtype, which would round them)."""
        self.rotary = Rotary(self.arch, max_positions).to(device)
        if self.local_rotary is not None:
            self.local_rotary = Rotary(self.arch.local_rope, max_positions).to(device)

    def _forward_gemv(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The decoder layers as fused GEMVs (`_use_triton_gemv`): the residual stream before
        the final norm, which the LM head's GEMV can fold in."""
        gemv = self.gemv
        assert gemv is not None
        x = self.embed(input_ids)
        rope = self.rotary(self.rope_positions(positions, meta), x.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            x = layer.forward_gemv(x, rope, cache, meta, gemv)
        return x

    def forward_greedy(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        greedy: Callable[..., torch.Tensor],
        logits: torch.Tensor,
        tokens: torch.Tensor,
    ) -> None:
        """A step through its logits (into `logits`, `[T, vocab]`) and their greedy tokens (into
        `tokens`, by `greedy(logits, out=tokens)`): what a CUDA graph of a decode step
        captures, so a greedy step's only launch is the graph. With the fused GEMVs
        (`_use_triton_gemv`) the final norm, the LM head and the argmax are one launch."""
        head = self.gemv_head
        if head is not None and input_ids.shape[0] <= self.gemv_max_rows:
            x = self._forward_gemv(input_ids, positions, kv_caches, meta)
            head(x, self.head_weight, norm=self.norm.weight, eps=self.norm.eps, out=logits, tokens=tokens)
            return
        self.compute_logits(self(input_ids, positions, kv_caches, meta), out=logits)
        greedy(logits, out=tokens)

    @torch.inference_mode()
    def forward_sequence(self, token_ids: list[int]) -> torch.Tensor:
        """Hidden states `[len(token_ids), hidden]` of one sequence read in a single prefill,
        over a scratch KV cache of its own (calibration, precision checks): no engine needed."""
        weight = self.embed_tokens.weight
        block_size = 16
        num_blocks = -(-len(token_ids) // block_size)
        meta = build_metadata([list(range(num_blocks))], [0], [len(token_ids)], block_size, weight.device,
                              self.arch.sliding_window, weight.dtype)
        caches = [
            torch.zeros(2, num_blocks * block_size, *self.arch.kv_cache_shape, dtype=weight.dtype, device=weight.device)
            for _ in self.layers
        ]
        return self(torch.tensor(token_ids, device=weight.device), meta.positions, caches, meta)

    def prepare_for_inference(
        self, quantization: str | None = None, calibration_ids: list[int] | None = None
    ) -> None:
        """Called once after the weights are loaded.

        On CPU in float32, the native skinny kernel (conveyor/kernels) takes the few rows of
        decode steps in every projection and in the LM head, whose weights move to huge pages;
        decode-only steps run all decoder layers in one native call (`FusedDecode`, off with
        `CONVEYOR_FUSED_DECODE=0`). Without the kernels, the weights are kept
        transposed (`[in, out]`, contiguous): for small row counts MKL streams that layout
        about twice as fast as `x @ W.T`. With `quantization="int8"` every projection and the
        LM head become `Int8Linear`s (conveyor/models/quantize.py), smoothed with activations
        recorded on `calibration_ids`; the embedding table stays float32 for lookups.
        A mixture of experts, or latent attention, runs its layers as modules (no fused decode):
        each expert streams its stacked slice through the same skinny kernel, or with int8 its
        own int8 weights (`Experts.quantize_int8`; the routers stay float32).
        """
        weight = self.head_weight
        moe = self.arch.num_experts > 0
        self._head_t: torch.Tensor | None = None
        self._head_kernel: Callable[..., torch.Tensor] | None = None
        self._head_int8: Int8Linear | None = None
        if quantization is not None:
            if quantization != "int8":
                raise ValueError(f"unknown quantization {quantization!r}")
            if weight.device.type != "cpu" or weight.dtype != torch.float32 or not int8_supported():
                raise UnsupportedModelError(
                    "quantization='int8' needs float32 on an x86 CPU with torch's fbgemm int8 kernels"
                )
            self._quantize_int8(weight, calibration_ids or [0])
        if weight.device.type == "cuda":
            self._use_triton_attention(weight.dtype)
            self._use_triton_fused(weight.dtype)
            self._use_triton_gemv(weight.dtype)
        if weight.device.type != "cpu":
            return
        kernel = skinny_linear() if weight.dtype == torch.float32 else None
        if kernel is None:
            self._head_t = weight.detach().t().contiguous() if quantization is None else None
        else:
            self._head_kernel = kernel
            if quantization is None:  # the float32 head streams at every decode step
                owner = self.embed_tokens if self.lm_head is None else self.lm_head
                owner.weight = nn.Parameter(to_huge_pages(owner.weight.detach().contiguous()), requires_grad=False)
        use_cpu_kernels(self, kernel, self.arch.sliding_window, keep=self.lm_head)
        # The native call has no router, no latent attention, no Gemma layer, and no
        # all-reduce between a tensor-parallel rank's layers.
        plain = (not moe and not self.arch.is_mla and self.arch.llama_arithmetic and not self.tensor_parallel
                 and not self.arch.rotary_dim and not self.rotary.long_from)  # (whole-head RoPE, one table)
        fused = decode_layers() if kernel is not None and plain else None
        self._head_q8 = skinny_linear_q8() if kernel is not None and quantization is not None else None
        if fused is not None and os.environ.get("CONVEYOR_FUSED_DECODE", "1") != "0":
            self.fused_decode = FusedDecode(self, fused)

    def _use_triton_attention(self, dtype: torch.dtype) -> None:
        """On CUDA, paged attention runs in the Triton kernels (conveyor/kernels/triton_attention.py)
        when triton is installed and the dtype is one they take (fp32/fp16/bf16), unless
        `CONVEYOR_TRITON=0`; else in the torch reference (float64 tests run there)."""
        from conveyor.kernels.triton_attention import TritonPagedAttention, triton_available

        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return
        if os.environ.get("CONVEYOR_TRITON", "1") == "0" or not triton_available():
            return
        # One a window (and cap): its per-step plan is shared; a layer with sinks sets its own
        # before each call.
        backends: dict[tuple[int, float], TritonPagedAttention] = {}
        for module in self.modules():
            if isinstance(module, Attention):
                window = (self.arch.sliding_window if module.window is None else module.window) or 0
                key = (window, module.softcap)
                if key not in backends:
                    backends[key] = TritonPagedAttention(window or None, softcap=module.softcap)
                module.backend = backends[key]

    def _use_triton_fused(self, dtype: torch.dtype) -> None:
        """On CUDA in half precision, with `CONVEYOR_TRITON_FUSED=1` (`triton_fused.enabled`), the
        residual adds, norms, RoPE and SiLU-and-multiply run in the fused Triton kernels
        (conveyor/kernels/triton_fused.py); with the Triton attention backend, RoPE, the K/V
        cache write and a decode step's attention are one kernel (`rope_attend`), whose
        splits merge themselves (`merge_splits`), unless `CONVEYOR_TRITON_ONE_LAUNCH_DECODE=0`
        (then three: RoPE and write, attention, reduce; for measuring one against the other).
        float32 on CUDA keeps the torch ops: the reference's exact arithmetic."""
        from conveyor.kernels import triton_fused
        from conveyor.kernels.triton_attention import TritonPagedAttention

        if dtype not in (torch.float16, torch.bfloat16) or not triton_fused.enabled() or not self.arch.llama_arithmetic:
            return  # (Gemma's norms and GELU, Granite's multipliers: no fused kernels)

        def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return triton_fused.add_rms_norm(None, x, weight, eps)[0]

        self.add_norm = triton_fused.add_rms_norm
        one_launch = os.environ.get("CONVEYOR_TRITON_ONE_LAUNCH_DECODE", "1") != "0"
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.native = norm  # q/k norms (3-D) stay on the torch path
            elif isinstance(module, Attention):
                module.native_rope = triton_fused.rope_
                if isinstance(module.backend, TritonPagedAttention):
                    module.backend.merge_splits = one_launch
                    module.rope_attend = functools.partial(triton_fused.rope_attend, module.backend,
                                                           one_launch=one_launch)
            elif isinstance(module, (MLP, Experts)):
                module.native_silu_mul = triton_fused.silu_mul

    def _use_triton_gemv(self, dtype: torch.dtype) -> None:
        """On CUDA in half precision, with `CONVEYOR_TRITON_GEMV=1` (`triton_gemv.enabled`), steps
        of up to `triton_gemv.model_max_rows()` rows (1 unless `CONVEYOR_GEMV_MAX_ROWS` says up
        to 8: more lost to cuBLAS on an H100) run each decoder layer as four Triton GEMVs with
        the norms, SiLU × up and residual adds folded in (`DecoderLayer.forward_gemv`), and
        their LM head as a GEMV, launched with programmatic dependent launch where
        `CONVEYOR_TRITON_PDL=1` on Hopper or later (`triton_gemv.pdl_enabled`). Models with
        projection biases, and mixtures of experts, keep the other path."""
        from conveyor.kernels import triton_gemv

        if dtype not in (torch.float16, torch.bfloat16) or not triton_gemv.enabled():
            return
        if self.arch.num_experts or self.arch.is_mla or not self.arch.llama_arithmetic:
            return
        if any(isinstance(m, (nn.Linear, TransposedLinear)) and m.bias is not None for m in self.modules()):
            return
        for module in list(self.modules()):  # a CPU model (the interpreter's tests): [out, in] again
            for name, child in list(module.named_children()):
                if isinstance(child, TransposedLinear):
                    fan_in, fan_out = child.weight_t.shape
                    linear = nn.Linear(fan_in, fan_out, bias=False, device=child.weight_t.device, dtype=dtype)
                    linear.weight = nn.Parameter(child.weight_t.detach().t().contiguous(), requires_grad=False)
                    setattr(module, name, linear)
        self.gemv = functools.partial(triton_gemv.linear, pdl=triton_gemv.pdl_enabled())
        self.gemv_head = functools.partial(triton_gemv.linear_argmax, pdl=triton_gemv.pdl_enabled())
        self.gemv_max_rows = triton_gemv.model_max_rows()

    @torch.inference_mode()
    def _quantize_int8(self, head_weight: torch.Tensor, calibration_ids: list[int]) -> None:
        """Run the float32 model once over `calibration_ids` recording every linear layer's
        inputs, then replace the layers (and the LM head) by smoothed `Int8Linear`s."""
        from conveyor.kernels import Q8_MAX_ROWS, skinny_linear_q8
        from conveyor.models.moe import SparseMoE

        # A mixture's routers stay float32 (an expert's choice is not rounded), its experts int8.
        routers = [r for m in self.modules() if isinstance(m, SparseMoE)
                   for r in (m.gate, m.shared_expert_gate) if isinstance(r, nn.Linear)]
        # Latent attention's up-projection stays float32: its weight is read as the per-head
        # W_UK and W_UV that the absorbed decode multiplies with (conveyor/models/mla.py).
        up = [m.kv_b_proj for m in self.modules() if isinstance(m, LatentAttention)]
        skip = [m for m in (self.lm_head, self.score, *routers, *up) if m is not None]
        linears: dict[str, nn.Module] = {
            n: m for n, m in self.named_modules() if isinstance(m, nn.Linear) and not any(m is s for s in skip)
        }
        recorder = ActivationRecorder(linears)
        try:
            hidden = self.forward_sequence(calibration_ids)
        finally:
            recorder.remove()
        n = len(calibration_ids)
        inputs = {name: (recorder.absmax[name], recorder.rows[name]) for name in recorder.absmax}
        quantize_linears(self, inputs, skip=skip)
        q8 = skinny_linear_q8()
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.experts.quantize_int8(q8, Q8_MAX_ROWS)
        head_rows = hidden[:: max(1, n // 256)]
        self._head_int8 = Int8Linear(
            head_weight, None, choose_smoothing(head_rows, head_weight, hidden.abs().amax(dim=0))
        )
        self.lm_head = None  # the int8 copy serves; a tied embedding keeps its float32 table

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A classifier's logits `[rows, num_labels]` (float32 at least) over pooled hidden states."""
        if self.score is None:
            raise UnsupportedModelError("this model has no classification head")
        logits = self.score(pooled.to(self.embed_tokens.weight.dtype))
        return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head over `hidden` (after the final norm); into `out` if given (a CUDA graph's
        fixed buffer), with no copy on the CUDA paths; soft-capped where the model caps them."""
        return self.cap_logits(self._head(hidden, out))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's `cap * tanh(logits / cap)` and Granite's `logits / logits_scaling`, in place
        (the logits as they are elsewhere)."""
        if self.arch.logits_scaling != 1.0:
            logits.div_(self.arch.logits_scaling)
        cap = self.arch.final_logit_softcapping
        return logits.div_(cap).tanh_().mul_(cap) if cap else logits

    def _head(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        head_int8 = getattr(self, "_head_int8", None)
        if head_int8 is not None:
            q8 = getattr(self, "_head_q8", None)
            if q8 is not None and hidden.shape[0] <= Q8_MAX_ROWS:
                return _into(out, q8(hidden, head_int8.qweight, head_int8.wscale, head_int8.inv_smooth))
            return _into(out, head_int8(hidden))
        head_t = getattr(self, "_head_t", None)
        if head_t is not None:
            return _into(out, hidden @ head_t)
        weight = self.head_weight
        if self.gemv is not None and hidden.shape[0] <= self.gemv_max_rows:
            return self.gemv(hidden, weight, out=out)
        kernel = getattr(self, "_head_kernel", None)
        if kernel is not None and hidden.shape[0] <= SKINNY_MAX_ROWS:
            return _into(out, kernel(hidden, weight))
        if out is not None:
            return torch.matmul(hidden, weight.t(), out=out)  # the product F.linear computes
        return F.linear(hidden, weight)


def use_cpu_kernels(root: nn.Module, kernel: Callable[..., torch.Tensor] | None, sliding_window: int | None,
                    keep: nn.Module | None = None) -> None:
    """CPU float32: the native kernels (`kernel`: the skinny GEMV; None where they are not built)
    in `root`'s norms, RoPE, paged attention, SiLU-and-multiply and experts, and every
    `nn.Linear` but `keep` a `SkinnyLinear` (a `TransposedLinear` without the kernels)."""
    if kernel is not None:
        norm, attention, rotate, act, writer = rms_norm(), paged_decode_attention(), rope(), silu_mul(), write_kv()
        for module in root.modules():
            if isinstance(module, RMSNorm):
                module.native = norm
            elif isinstance(module, Attention):
                module.native_rope = rotate
                if attention is not None:  # (the native decode caps scores and takes sinks too)
                    window = sliding_window if module.window is None else module.window
                    module.backend = (CpuEagerAttention(attention, window, writer, module.softcap) if module.eager
                                      else CpuPagedAttention(attention, window, writer))
            elif isinstance(module, (MLP, Experts)) and not getattr(module, "gelu", False):
                module.native_silu_mul = act
            if isinstance(module, Experts):  # stacked weights: the GEMV takes one expert's slice
                module.skinny, module.skinny_max_rows = kernel, SKINNY_MAX_ROWS
                module.grouped_mm = getattr(F, "grouped_mm", None)  # torch >= 2.9
                if module.int8 is None:  # (int8 experts hold their own weights)
                    module.gate_up_proj = nn.Parameter(to_huge_pages(module.gate_up_proj.detach()), requires_grad=False)
                    module.down_proj = nn.Parameter(to_huge_pages(module.down_proj.detach()), requires_grad=False)
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child is not keep:
                replacement = (
                    SkinnyLinear(child, kernel, SKINNY_MAX_ROWS) if kernel is not None else TransposedLinear(child)
                )
                setattr(module, name, replacement)


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if out is None else out.copy_(value)
