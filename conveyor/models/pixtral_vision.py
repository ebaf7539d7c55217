"""Pixtral's vision side: Mistral's ViT over an image at (about) its own size, as Pixtral-12B
(LLaVA's form, `vision_config.model_type == "pixtral"`) and Mistral Small 3.1 / 3.2
(`Mistral3ForConditionalGeneration`) read images.

Pixtral (Agrawal et al. 2024, "Pixtral 12B") scales an image down to fit `longest_edge` and
rounds each side up to whole tokens (`ImageProcessor`'s `pixtral_size`), cuts it into patches (a
convolution without bias), RMS-norms them, and runs a ViT of RMS norms, gated MLPs and a 2D RoPE
(each head's frequencies alternate between the patch's row and column: even ones turn by the row,
odd ones by the column), each image attending within itself. Pixtral-12B projects every patch
(LLaVA's two-layer projector); Mistral 3 RMS-norms the patches, merges each 2x2 block into one
(`patch_merger`: the four patches side by side, channel-major as `F.unfold` lays them, through one
linear layer), then projects.

An image's tokens in the prompt are rows of `[IMG]` tokens, each row ending with `[IMG_BREAK]` and
the last with `[IMG_END]`; the image's embeddings take the `[IMG]` places and the break and end
tokens keep their own (text) embeddings. The encoder gives the whole span at once: its rows with
the break and end tokens' embeddings (`frame`, taken from the text model's table) between them, so
a span stays one contiguous run of rows for the runner, the encoder cache and a prompt in chunks.
Parameter names are HF's (`vision_tower.*`, `multi_modal_projector.*`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.qwen_vision import segment_attention
from conveyor.models.vision import ACTIVATIONS, Tower, VisionRMSNorm

if TYPE_CHECKING:
    from conveyor.models.vision import VisionArch


class _Attention(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        d = v.hidden_size
        self.heads = v.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: list[tuple[int, int]]
                ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rope
        q, k = (torch.cat((-t[..., t.shape[-1] // 2 :], t[..., : t.shape[-1] // 2]), dim=-1) * sin + t * cos
                for t in (q, k))
        return self.o_proj(segment_attention(q, k, v, bounds).reshape(n, -1))


class _FeedForward(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(v.hidden_size, v.intermediate_size, bias=False)
        self.up_proj = nn.Linear(v.hidden_size, v.intermediate_size, bias=False)
        self.down_proj = nn.Linear(v.intermediate_size, v.hidden_size, bias=False)
        self.act = ACTIVATIONS[v.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.attention_norm = VisionRMSNorm(v.hidden_size, 1e-5)
        self.attention = _Attention(v)
        self.ffn_norm = VisionRMSNorm(v.hidden_size, 1e-5)
        self.feed_forward = _FeedForward(v)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: list[tuple[int, int]]
                ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, bounds)
        return x + self.feed_forward(self.ffn_norm(x))


class _Transformer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(v) for _ in range(max(v.feature_layers)))


class _VisionModel(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.patch_conv = nn.Conv2d(v.num_channels, v.hidden_size, v.patch_size, v.patch_size, bias=False)
        self.ln_pre = VisionRMSNorm(v.hidden_size, 1e-5)
        self.transformer = _Transformer(v)


class _PatchMerger(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.merge = v.merge_size
        self.merging_layer = nn.Linear(v.hidden_size * v.merge_size**2, v.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """An image's patches `[gh * gw, D]` (row-major) to one a merge x merge block, as HF's
        `F.unfold` lays them (channel-major, then the block's rows and columns)."""
        d = x.shape[1]
        grid = F.unfold(x.view(gh, gw, d).permute(2, 0, 1)[None], self.merge, stride=self.merge)
        return self.merging_layer(grid.view(d * self.merge**2, -1).t())


class _Projector(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        width = v.hidden_size * len(v.feature_layers)
        if v.merge_size > 1:  # Mistral 3
            self.norm = VisionRMSNorm(v.hidden_size, v.projector_eps)
            self.patch_merger = _PatchMerger(v)
        self.linear_1 = nn.Linear(width, v.text_hidden_size, bias=v.projector_bias)
        self.linear_2 = nn.Linear(v.text_hidden_size, v.text_hidden_size, bias=v.projector_bias)
        self.act = ACTIVATIONS[v.projector_act]


class PixtralVision(nn.Module):
    """Images `[channels, height, width]` (sides multiples of patch x merge pixels) to their
    spans' embeddings `[rows * (columns + 1), text hidden]`: each row of image embeddings, then
    the break token's embedding (the end token's after the last row)."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.config = v
        self.vision_tower = Tower(_VisionModel(v))
        self.multi_modal_projector = _Projector(v)
        # `[IMG_BREAK]`'s and `[IMG_END]`'s embeddings `[2, text hidden]` (`set_frame`).
        self.frame: torch.Tensor | None = None

    def set_frame(self, embeddings: torch.Tensor) -> None:
        self.frame = embeddings.detach().clone()

    def _rope(self, gh: int, gw: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's 2D RoPE for a `gh` x `gw` grid of patches (row-major): the head's even frequencies
        by the row, the odd ones by the column, halves alike; `[patches, 1, head_dim]` float32."""
        v = self.config
        dim = v.hidden_size // v.num_heads
        inv = 1.0 / (v.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        rows = torch.arange(gh, device=device, dtype=torch.float32).repeat_interleave(gw)
        cols = torch.arange(gw, device=device, dtype=torch.float32).repeat(gh)
        freqs = torch.cat((rows[:, None] * inv[0::2], cols[:, None] * inv[1::2]), dim=-1)
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None]
        return freqs.cos(), freqs.sin()

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        v = self.config
        model = self.vision_tower.vision_model
        proj = self.multi_modal_projector
        xs, grids, bounds, ropes = [], [], [], []
        at = 0
        for image in images:
            x = model.patch_conv(image[None].to(model.patch_conv.weight.dtype))[0]  # [D, gh, gw]
            _, gh, gw = x.shape
            xs.append(x.flatten(1).t())
            grids.append((gh, gw))
            bounds.append((at, at + gh * gw))
            ropes.append(self._rope(gh, gw, x.device))
            at += gh * gw
        x = model.ln_pre(torch.cat(xs))
        cos, sin = torch.cat([r[0] for r in ropes]), torch.cat([r[1] for r in ropes])
        rope = (cos.to(x.dtype), sin.to(x.dtype))  # (HF turns in the model's dtype)
        kept = {0: x} if 0 in v.feature_layers else {}
        for i, layer in enumerate(model.transformer.layers, start=1):
            x = layer(x, rope, bounds)
            if i in v.feature_layers:
                kept[i] = x
        features = torch.cat([kept[i] for i in v.feature_layers], dim=-1)
        assert self.frame is not None, "the break and end tokens' embeddings are set at load (set_frame)"
        out = []
        for (a, b), (gh, gw) in zip(bounds, grids, strict=True):
            f = features[a:b]
            if v.merge_size > 1:
                f = proj.patch_merger(proj.norm(f), gh, gw)
            rows, cols = gh // v.merge_size, gw // v.merge_size
            f = proj.linear_2(proj.act(proj.linear_1(f))).view(rows, cols, -1)
            frame = self.frame.to(f.dtype)
            breaks = frame[0].expand(rows, 1, -1).clone()
            breaks[-1, 0] = frame[1]
            out.append(torch.cat((f, breaks), dim=1).reshape(rows * (cols + 1), -1))
        return out
