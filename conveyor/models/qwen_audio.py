"""Qwen2-Audio's audio side: Whisper's encoder over a clip's log-mel features, then an average
pool, a norm and one projection to the text model's width (HF's `Qwen2AudioEncoder` and
`Qwen2AudioMultiModalProjector`).

The encoder reads 30 seconds of features (3000 frames) whatever the clip's length: two
convolutions (the second of stride 2) and GELU make 1500 positions, learned position embeddings
are added, and pre-norm layers (attention with no key bias, a GELU MLP) attend over the positions
the clip's own frames reach, the rest masked out as keys. Pairs of positions are averaged, and
the first `audio_tokens(frames)` averages are the clip's tokens. Since padding is masked out as
keys, a position's output depends only on the clip's positions and its own: this module computes
only the positions those tokens read (`conveyor.audio.kept_frames`), which for a clip of a few
seconds is a small part of the 1500 HF computes, with the same values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.audio import audio_positions, audio_tokens
from conveyor.models.vision import ACTIVATIONS, VisionArch


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(3))
        self.k_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (p(x).view(n, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class _Layer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        d = v.hidden_size
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=v.layer_norm_eps)
        self.self_attn = _Attention(d, v.num_heads)
        self.final_layer_norm = nn.LayerNorm(d, eps=v.layer_norm_eps)
        self.fc1 = nn.Linear(d, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, d)
        self.act = ACTIVATIONS[v.hidden_act]

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # (as HF's layer: float16 kept finite)
            big = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-big, big)
        return x


class _Encoder(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        d = v.hidden_size
        self.conv1 = nn.Conv1d(v.num_channels, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(v.image_size, d)  # (`max_source_positions`)
        self.layers = nn.ModuleList(_Layer(v) for _ in range(v.num_layers))
        self.layer_norm = nn.LayerNorm(d, eps=v.layer_norm_eps)


class _Projector(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.linear = nn.Linear(v.hidden_size, v.text_hidden_size)


class QwenAudio(nn.Module):
    """The audio tower and projector under HF's names (`audio_tower.*`, `multi_modal_projector.*`)."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.config = v
        self.audio_tower = _Encoder(v)
        self.multi_modal_projector = _Projector(v)

    def forward(self, clips: list[Any]) -> list[torch.Tensor]:
        """Clips (`Pixels` of `conveyor.audio.AudioFeatures`: `[mels, kept frames]` and `frames`,
        the clip's own) to their embeddings `[audio_tokens(frames), text hidden]`, in one batch."""
        enc = self.audio_tower
        weight = enc.conv1.weight
        frames = [clip.frames for clip in clips]
        keys = torch.tensor([(f - 1) // 2 + 1 for f in frames], device=weight.device)
        tokens = [audio_tokens(f) for f in frames]
        positions = max(audio_positions(f) for f in frames)
        width = max(clip.values.shape[-1] for clip in clips)
        x = torch.zeros(len(clips), clips[0].values.shape[0], width, device=weight.device, dtype=weight.dtype)
        for i, clip in enumerate(clips):
            x[i, :, : clip.values.shape[-1]] = clip.values.to(weight.device, weight.dtype)
        h = F.gelu(enc.conv2(F.gelu(enc.conv1(x))))[:, :, :positions].transpose(1, 2)
        h = h + enc.embed_positions.weight[:positions]
        mask = (torch.arange(positions, device=weight.device)[None, :] < keys[:, None])[:, None, None, :]
        for layer in enc.layers:
            h = layer(h, mask)
        out = []
        for i, n in enumerate(tokens):
            pooled = h[i, : 2 * n].view(n, 2, -1).mean(dim=1)
            out.append(self.multi_modal_projector.linear(enc.layer_norm(pooled)))
        return out

