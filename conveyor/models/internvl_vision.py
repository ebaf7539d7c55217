"""InternVL's vision side (transformers' `InternVLForConditionalGeneration`: InternVL 2.5 / 3 / 3.5
in HF's format): InternViT over 448-pixel tiles, a pixel shuffle, and an MLP projector.

InternVL (Chen et al. 2024, "How Far Are We to GPT-4V? Closing the Gap to Commercial Multimodal
Models with Open-Source Suites") cuts an image into up to `max_patches` 448-pixel tiles in the
grid whose aspect is nearest the picture's (`multimodal.ImageProcessor`'s `_internvl_tiles`,
HF's `crop_to_patches`), with a thumbnail of the whole picture after them when there is more than
one. Each tile runs through InternViT (a class token and learned positions, attention with
optional RMS-normed queries and keys, LayerNorm or RMS norm, layer scales on both residual
branches); its patches without the class token, 32x32 for a 448-pixel tile in 14-pixel patches,
are pixel-shuffled to 16x16 of four times the width (`downsample_ratio` 0.5) and projected (a
LayerNorm, linear, GELU, linear): 256 tokens a tile. A prompt's `<IMG_CONTEXT>` becomes `<img>`,
the image's tiles' tokens, and `</img>`, as HF's processor writes it. Parameter names are HF's
(`vision_tower.*`, `multi_modal_projector.*`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.vision import ACTIVATIONS, Tower, VisionMLP, VisionRMSNorm

if TYPE_CHECKING:
    from conveyor.models.vision import VisionArch


def _norm(v: VisionArch) -> nn.Module:
    if v.norm_type == "rms_norm":
        return VisionRMSNorm(v.hidden_size, v.layer_norm_eps)
    return nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)


class _Attention(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        d = v.hidden_size
        self.heads = v.num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=v.attention_bias) for _ in range(3))
        self.projection_layer = nn.Linear(d, d)
        if v.qk_norm:  # (InternViT-6B's: over the whole width, before the heads split)
            self.q_norm = VisionRMSNorm(d, 1e-6)
            self.k_norm = VisionRMSNorm(d, 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (a.view(n, t, self.heads, -1).transpose(1, 2) for a in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.projection_layer(out.transpose(1, 2).reshape(n, t, d))


class _Layer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.attention = _Attention(v)
        self.mlp = VisionMLP(v)
        self.layernorm_before = _norm(v)
        self.layernorm_after = _norm(v)
        self.lambda_1 = nn.Parameter(torch.empty(v.hidden_size))
        self.lambda_2 = nn.Parameter(torch.empty(v.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class _PatchEmbeddings(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.projection = nn.Conv2d(v.num_channels, v.hidden_size, v.patch_size, v.patch_size)


class _Embeddings(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.empty(1, 1, v.hidden_size))
        self.patch_embeddings = _PatchEmbeddings(v)
        self.position_embeddings = nn.Parameter(torch.empty(1, v.num_patches + 1, v.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        return x + self.position_embeddings


class _Encoder(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(v) for _ in range(max(v.feature_layers)))


class _VisionModel(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.embeddings = _Embeddings(v)
        self.encoder = _Encoder(v)
        if not v.mean_pooling and max(v.feature_layers) == v.num_layers:  # (the last layer's output, normed)
            self.layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)


class _Projector(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        width = v.hidden_size * 4
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, v.text_hidden_size)
        self.linear_2 = nn.Linear(v.text_hidden_size, v.text_hidden_size)
        self.act = ACTIVATIONS[v.projector_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def pixel_shuffle(x: torch.Tensor) -> torch.Tensor:
    """HF's InternVL pixel shuffle at 0.5: `[n, side, side, C]` to `[n, side/2, side/2, 4C]`, in
    its order of views and swaps."""
    n, w, h, c = x.shape
    x = x.view(n, w, h // 2, c * 2).permute(0, 2, 1, 3).contiguous()
    return x.view(n, h // 2, w // 2, c * 4).permute(0, 2, 1, 3).contiguous()


class InternVLVision(nn.Module):
    """Each image's tiles `[tiles, channels, 448, 448]` to its embeddings `[tiles * 256, text hidden]`
    (the tiles in order, the thumbnail last)."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.config = v
        self.vision_tower = Tower(_VisionModel(v))
        self.multi_modal_projector = _Projector(v)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        v = self.config
        model = self.vision_tower.vision_model
        tiles = torch.cat(images)
        x = model.embeddings(tiles.to(model.embeddings.cls_token.dtype))
        for layer in model.encoder.layer:
            x = layer(x)
        if hasattr(model, "layernorm"):
            x = model.layernorm(x)
        x = x[:, 1:]  # (the class token dropped)
        side = v.image_size // v.patch_size
        x = pixel_shuffle(x.reshape(x.shape[0], side, side, -1))
        out = self.multi_modal_projector(x.reshape(x.shape[0], -1, x.shape[-1]))
        return list(torch.split(out.flatten(0, 1), [image.shape[0] * out.shape[1] for image in images]))
