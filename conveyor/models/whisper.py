"""Whisper (`WhisperForConditionalGeneration`): an encoder over 30 seconds of log-mel features and a
decoder that writes the transcript, attending to its own tokens (paged K/V, as any decoder's) and
to the encoder's output (cross-attention).

The encoder is Qwen2-Audio's without the pool (conveyor/models/qwen_audio.py: two convolutions,
learned positions, pre-norm layers), read whole: Whisper was trained on clips padded with silence
to 30 seconds and attends over all 1500 positions, padding included, so nothing may be left out.
A request's encoder runs at its first step (its output kept in the runner's encoder cache, where a
later request of the same clip finds it); each decoder layer's cross-attention keys and values of
those 1500 positions are made then and written into the paged cache, in the blocks of
the sequence's cross table (`BlockManager.cross_pages`: taken with its first blocks, released with
them, so the cache's memory budget holds them and a preempted request's are made again), where
every later step reads them (`AttentionBackend.cross`; vLLM's cross-attention blocks). The decoder: token and learned position embeddings, pre-norm layers of causal
self-attention (through the attention backend, over the paged cache), cross-attention and a GELU
MLP, a final norm, and the token embeddings as the LM head. Its positions are the decoder's own
(at most `max_target_positions`, 448).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.arch import ArchConfig, UnsupportedModelError
from conveyor.models.attention import (
    AttentionBackend,
    AttentionMetadata,
    CpuPagedAttention,
    CrossMetadata,
    TorchPagedAttention,
)
from conveyor.models.qwen_audio import _Encoder
from conveyor.models.vision import ACTIVATIONS


@dataclass
class CrossStates:
    """One step's cross-attention: where each sequence's encoder keys and values lie in the
    cache (`meta`), and the clips encoded this step, `encoded[j]` the encoder's output
    `[1500, d]`, whose keys and values each layer writes to the cache slots `slots[j]` (the
    cross tables of the sequences that hear the clip, one after another)."""

    meta: CrossMetadata
    encoded: list[torch.Tensor]
    slots: list[torch.Tensor]


class _Projections(nn.Module):
    """Whisper's attention projections: q, v and out with biases, k without."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(3))
        self.k_proj = nn.Linear(d, d, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        d = arch.hidden_size
        self.heads, self.head_dim = arch.num_heads, arch.head_dim
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.self_attn = _Projections(d)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = _Projections(d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, arch.intermediate_size)
        self.fc2 = nn.Linear(arch.intermediate_size, d)
        self.act = ACTIVATIONS[arch.hidden_act]

    def cross_states(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's output `[positions, d]` as this layer's cross keys and values, `[positions,
        heads, head_dim]` each (the cache's layout)."""
        n = encoded.shape[0]
        a = self.encoder_attn
        return (a.k_proj(encoded).view(n, self.heads, self.head_dim),
                a.v_proj(encoded).view(n, self.heads, self.head_dim))

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend,
                cross: CrossStates) -> torch.Tensor:
        t = x.shape[0]
        for encoded, slots in zip(cross.encoded, cross.slots, strict=True):  # (a clip's first step)
            k, v = self.cross_states(encoded)
            copies = slots.shape[0] // k.shape[0]  # (the sequences that hear it)
            if copies > 1:
                k, v = k.repeat(copies, 1, 1), v.repeat(copies, 1, 1)
            backend.write(k, v, kv_cache[0], kv_cache[1], slots)
        h = self.self_attn_layer_norm(x)
        s = self.self_attn
        q, k, v = (p(h).view(t, self.heads, self.head_dim) for p in (s.q_proj, s.k_proj, s.v_proj))
        x = x + s.out_proj(backend.forward(q, k, v, kv_cache, meta, self.head_dim**-0.5).reshape(t, -1))
        q = self.encoder_attn.q_proj(self.encoder_attn_layer_norm(x)).view(t, self.heads, self.head_dim)
        out = backend.cross(q, kv_cache, cross.meta, self.head_dim**-0.5)  # (every row sees all 1500 positions)
        x = x + self.encoder_attn.out_proj(out.reshape(t, -1))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))

    def weighed(self, x: torch.Tensor, cross: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's tokens `[t, d]` through the layer without a cache (causal self-attention
        over them alone), and the cross-attention's probabilities `[heads, t, positions]`."""
        t = x.shape[0]
        h = self.self_attn_layer_norm(x)
        s = self.self_attn
        q, k, v = (p(h).view(t, self.heads, self.head_dim).transpose(0, 1) for p in (s.q_proj, s.k_proj, s.v_proj))
        x = x + s.out_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, -1))
        q = self.encoder_attn.q_proj(self.encoder_attn_layer_norm(x)).view(t, self.heads, self.head_dim).transpose(0, 1)
        ck, cv = (c.transpose(0, 1) for c in cross)  # [heads, positions, head_dim]
        weights = torch.softmax((q @ ck.transpose(1, 2)).float() * self.head_dim**-0.5, dim=-1)
        x = x + self.encoder_attn.out_proj((weights.to(cv.dtype) @ cv).transpose(0, 1).reshape(t, -1))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x)))), weights


class _Decoder(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.embed_positions = nn.Embedding(arch.max_position_embeddings, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.layer_norm = nn.LayerNorm(arch.hidden_size)


class Whisper(nn.Module):
    """The whole model under HF's names with `model.` dropped (`encoder.*`, `decoder.*`); the
    runner calls it as any decoder, with `meta.cross` (`CrossStates`) for the cross-attention."""

    encoder_decoder = True
    lm_head = None
    fused_decode = None
    gemv = None
    vision = None
    text_only = False

    def __init__(self, arch: ArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        assert arch.encoder is not None
        self.arch = arch
        self.backend = backend
        self.encoder = _Encoder(arch.encoder)
        self.decoder = _Decoder(arch)

    @property
    def tensor_parallel(self) -> bool:
        return False

    @torch.inference_mode()
    def encode(self, features: list[torch.Tensor]) -> torch.Tensor:
        """Clips' features `[mels, 3000]` to the encoder's output `[clips, 1500, d]` (all in one
        batch); each decoder layer makes its cross keys and values of it (`cross_states`)."""
        enc = self.encoder
        w = enc.conv1.weight
        x = torch.stack(features).to(w.device, w.dtype)
        h = F.gelu(enc.conv2(F.gelu(enc.conv1(x)))).transpose(1, 2)
        h = h + enc.embed_positions.weight[: h.shape[1]]
        for layer in enc.layers:
            h = layer(h, None)  # (every position sees every one: no mask)
        return enc.layer_norm(h)

    @torch.inference_mode()
    def cross_weights(self, features: list[torch.Tensor], tokens: list[list[int]], heads: list[tuple[int, int]],
                      encoded: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Each clip's decoder tokens read whole (no cache), and the cross-attention probabilities
        of those (layer, head)s at each token over the encoder's positions: `[heads, tokens,
        1500]` float32 on the host a clip (word timestamps' alignment, `conveyor.transcribe`).
        `encoded`: the encoder's outputs already at hand (the encoder cache's), None where a
        clip's features go through the encoder again."""
        outputs = list(encoded) if encoded is not None else [None] * len(features)
        todo = [i for i, e in enumerate(outputs) if e is None]
        if todo:
            for i, e in zip(todo, self.encode([features[i] for i in todo]), strict=True):
                outputs[i] = e
        dec = self.decoder
        out = []
        for encoded_clip, ids in zip(outputs, tokens, strict=True):
            assert encoded_clip is not None
            x = dec.embed_tokens(torch.tensor(ids, device=dec.embed_tokens.weight.device))
            x = x + dec.embed_positions.weight[: len(ids)]
            kept: dict[tuple[int, int], torch.Tensor] = {}
            layers: list[DecoderLayer] = list(dec.layers)  # type: ignore[arg-type]
            for i, layer in enumerate(layers):
                x, weights = layer.weighed(x, layer.cross_states(encoded_clip))
                kept |= {(i, h): weights[h] for layer_index, h in heads if layer_index == i}
            out.append(torch.stack([kept[head] for head in heads]).float().cpu())
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        cross: CrossStates | None = getattr(meta, "cross", None)
        if cross is None:
            raise UnsupportedModelError("a Whisper step needs its sequences' encoder states (meta.cross)")
        dec = self.decoder
        x = dec.embed_tokens(input_ids) + dec.embed_positions(positions)
        for i, layer in enumerate(dec.layers):
            x = layer(x, kv_caches[i], meta, self.backend, cross)
        return dec.layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = hidden @ self.decoder.embed_tokens.weight.T
        if out is not None:
            out.copy_(logits)
            return out
        return logits

    def prepare_for_inference(self, quantization: str | None = None, calibration_ids: Any = None) -> None:
        """CPU float32: the native paged attention (self-attention's decodes and every row's
        cross-attention read the cache in place; the torch reference gathers blocks); CUDA: the
        Triton kernels (unless `CONVEYOR_TRITON=0`), the cross-attention in the decode kernel."""
        if quantization is not None:
            raise UnsupportedModelError(f"quantization={quantization!r} is not built for Whisper")
        w = self.decoder.embed_tokens.weight
        if type(self.backend) is not TorchPagedAttention:
            return  # (a backend chosen by the caller)
        if w.device.type == "cpu" and w.dtype == torch.float32:
            from conveyor.kernels import paged_decode_attention, write_kv

            kernel = paged_decode_attention()
            if kernel is not None:
                self.backend = CpuPagedAttention(kernel, None, write_kv())
        elif w.device.type == "cuda" and w.dtype in (torch.float32, torch.float16, torch.bfloat16):
            from conveyor.kernels.triton_attention import TritonPagedAttention, triton_available

            if os.environ.get("CONVEYOR_TRITON", "1") != "0" and triton_available():
                self.backend = TritonPagedAttention()


def build_whisper(arch: ArchConfig, tensors: Any, backend: AttentionBackend, dtype: torch.dtype,
                  device: torch.device) -> Whisper:
    """The model from HF-named tensors (`model.encoder.*`, `model.decoder.*`; `proj_out` is the
    token embeddings, tied)."""
    with torch.device("meta"):
        model = Whisper(arch, backend)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, t in tensors:
            name = name.removeprefix("model.")
            if name == "proj_out.weight":
                continue  # (tied to the token embeddings)
            if name not in params:
                raise UnsupportedModelError(f"a Whisper checkpoint's tensor {name!r} has no place here")
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise UnsupportedModelError(f"{name}: tensor of shape {tuple(t.shape)} does not fit {tuple(p.shape)}")
            p.copy_(t.to(dtype))
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise UnsupportedModelError(f"the checkpoint lacks {len(missing)} Whisper tensors, e.g. {missing[:3]}")
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return model
