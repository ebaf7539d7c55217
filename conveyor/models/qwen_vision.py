"""Qwen2-VL's and Qwen2.5-VL's vision side: a ViT over an image at (about) its own size, and
a merger of each 2x2 block of patches into one embedding of the text model.

Qwen2-VL (Wang et al. 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the
World at Any Resolution") resizes an image so that both sides are multiples of 28 pixels and its
area lies between a least and a most (`multimodal.ImageProcessor`'s `smart_resize`), cuts it into
14-pixel patches (a 3D convolution over two frames: an image is its own frame twice, which is
the 2D convolution of the two frames' weights summed), and runs a ViT whose attention turns
each head's halves by the patch's row and column (2D RoPE) and sees the whole image. The merger
(a norm, then an MLP over the four patches of each 2x2 block side by side) gives one embedding
every four patches: an image of 448x448 pixels is 32x32 patches and 256 image tokens.

In the text model an image's tokens take 3D rotary positions (M-RoPE, `mrope_positions`): the
image's first position for time, and that plus the token's row, and plus its column, each
turning its own part of the head's frequencies (`mrope_section`); the text after an image goes
on from its first position plus the larger of its rows and columns, so an image of h x w tokens
takes max(h, w) positions, not h * w.

Qwen2.5-VL (Bai et al. 2025, "Qwen2.5-VL Technical Report") has RMS norms, a gated SiLU MLP,
and attention within windows of `window_size` pixels (8x8 patches for 112) in all blocks but
`fullatt_block_indexes`; the patches are put in window order for the blocks and back in the
image's order after the merger. Qwen3-VL (Qwen Team 2025) has 16-pixel patches (a biased
convolution), adds a learned square grid of position embeddings resampled to the image's patches
(bilinear, corners aligned), interleaves M-RoPE's parts frequency by frequency in the text model,
and feeds the text model more of the image (DeepStack, Meng et al. 2024): the outputs of some
blocks (`deepstack_visual_indexes`), each through a merger of its own, are added to the first
text layers' outputs at the image's tokens; they ride beside the image's embeddings in one row
(`[tokens, text hidden * (1 + deepstack)]`). Parameter names are HF's (`visual.*`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.vision import ACTIVATIONS, VisionMLP, VisionRMSNorm

if TYPE_CHECKING:
    from conveyor.models.vision import VisionArch
    from conveyor.multimodal import ImageSpan


def _norm(v: VisionArch, dim: int) -> nn.Module:  # (Qwen2.5-VL's are RMS norms)
    return VisionRMSNorm(dim, v.layer_norm_eps) if v.style == "qwen2_5_vl" else nn.LayerNorm(dim, eps=v.layer_norm_eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's vision RoPE: the halves of each head turned, in float32."""
    h = x.float()
    x1, x2 = h.chunk(2, dim=-1)
    return (h * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[tuple[int, int]]
                      ) -> torch.Tensor:
    """Attention `[N, heads, d]` within each segment `[a, b)` of the rows (an image, or a
    window of one), every row seeing its whole segment: the segments of one length in one batch."""
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = defaultdict(list)
    for a, b in bounds:
        by_length[b - a].append(a)
    for n, starts in by_length.items():
        rows = (torch.tensor(starts)[:, None] + torch.arange(n)).to(q.device)  # [segments, n]
        qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [segments, heads, n, d]
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


class _Attention(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        d = v.hidden_size
        self.heads = v.num_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: list[tuple[int, int]]
                ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        cos, sin = rope
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(segment_attention(q, k, v, bounds).reshape(n, -1))


class _FcMLP(nn.Module):  # Qwen3-VL's (`VisionMLP` under other names)
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.linear_fc2 = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = ACTIVATIONS[v.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _GatedMLP(nn.Module):  # Qwen2.5-VL's
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.up_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.down_proj = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = ACTIVATIONS[v.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.norm1 = _norm(v, v.hidden_size)
        self.norm2 = _norm(v, v.hidden_size)
        self.attn = _Attention(v)
        self.mlp: nn.Module = {"qwen2_5_vl": _GatedMLP, "qwen3_vl": _FcMLP}.get(v.style, VisionMLP)(v)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: list[tuple[int, int]]
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, bounds)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        p = v.patch_size
        self.proj = nn.Conv3d(v.num_channels, v.hidden_size, (v.temporal_patch_size, p, p), (v.temporal_patch_size, p, p),
                              bias=v.style == "qwen3_vl")


class _Merger(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        width = v.hidden_size * v.merge_size**2
        self.ln_q = _norm(v, v.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, v.text_hidden_size))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class _FcMerger(nn.Module):
    """Qwen3-VL's merger: a LayerNorm before the four patches go side by side (or after, a
    DeepStack merger's `postshuffle`), then two linear layers with GELU between."""

    def __init__(self, v: VisionArch, postshuffle: bool = False) -> None:
        super().__init__()
        self.width = v.hidden_size * v.merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else v.hidden_size, eps=v.layer_norm_eps)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, v.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _Visual(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.patch_embed = _PatchEmbed(v)
        if v.position_embeddings:
            self.pos_embed = nn.Embedding(v.position_embeddings, v.hidden_size)
        self.blocks = nn.ModuleList(_Block(v) for _ in range(v.num_layers))
        self.merger: nn.Module = _FcMerger(v) if v.style == "qwen3_vl" else _Merger(v)
        if v.deepstack_layers:
            self.deepstack_merger_list = nn.ModuleList(_FcMerger(v, postshuffle=True) for _ in v.deepstack_layers)


class QwenVision(nn.Module):
    """Images `[channels, height, width]` (sides multiples of patch x merge, as
    `conveyor.multimodal.ImageProcessor` makes them) to embeddings `[tokens, text hidden]`, one
    every merge x merge patches, in the image's row order of merged blocks."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.config = v
        self.visual = _Visual(v)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """The 2D RoPE's frequencies in float32 (made here: the module is built on the meta device)."""
        v = self.config
        dim = v.hidden_size // v.num_heads // 2  # each of the row's and the column's share of a head
        return 1.0 / (v.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))

    def _patches(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An image's (or a video's frame group's, `[frames, channels, h, w]`) patch embeddings
        `[patches, hidden]` and their (row, column) `[patches, 2]`, each merge x merge block's
        patches together, blocks in row order (HF's layout)."""
        v = self.config
        m = v.merge_size
        proj = self.visual.patch_embed.proj
        if image.dim() == 4:  # (a frame group: the convolution spans its frames)
            p = v.patch_size
            x = F.conv3d(image.transpose(0, 1)[None].to(proj.weight.dtype), proj.weight, proj.bias,
                         stride=(image.shape[0], p, p))[0, :, 0]  # [hidden, gh, gw]
        else:
            weight = proj.weight.sum(dim=2)  # (an image's frames are the image, alike)
            x = F.conv2d(image[None].to(weight.dtype), weight, proj.bias, stride=v.patch_size)[0]  # [hidden, gh, gw]
        d, gh, gw = x.shape
        if v.position_embeddings:  # Qwen3-VL: the learned grid resampled to this image's patches
            side = math.isqrt(v.position_embeddings)
            table = self.visual.pos_embed.weight.view(side, side, d).permute(2, 0, 1)[None]
            x = x + F.interpolate(table.float(), size=(gh, gw), mode="bilinear", align_corners=True)[0].to(x.dtype)
        x = x.view(d, gh // m, m, gw // m, m).permute(1, 3, 2, 4, 0).reshape(gh * gw, d)
        rows = torch.arange(gh).view(gh // m, m, 1, 1).expand(-1, -1, gw // m, m).permute(0, 2, 1, 3).flatten()
        cols = torch.arange(gw).view(1, 1, gw // m, m).expand(gh // m, m, -1, -1).permute(0, 2, 1, 3).flatten()
        return x, torch.stack((rows, cols), dim=1)

    def _windows(self, gh: int, gw: int) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the order of an image's merged blocks by window (windows row by row,
        blocks row by row within each) and the windows' lengths in blocks."""
        v = self.config
        side = v.window_size // v.merge_size // v.patch_size  # a window's side in merged blocks
        h, w = gh // v.merge_size, gw // v.merge_size
        index = torch.arange(h * w).view(h, w)
        order, lengths = [], []
        for top in range(0, h, side):
            for left in range(0, w, side):
                part = index[top : top + side, left : left + side].flatten()
                order.append(part)
                lengths.append(part.numel())
        return torch.cat(order), lengths

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Images `[channels, h, w]` and videos `[frames, channels, h, w]` to their embeddings: a
        video's frame groups (`temporal_patch_size` frames each) are read as images are, each
        its own attention (and windows), and its embeddings are theirs in turn."""
        v = self.config
        groups = [1 if x.dim() == 3 else x.shape[0] // v.temporal_patch_size for x in images]
        units = [u for x in images for u in ([x] if x.dim() == 3 else x.split(v.temporal_patch_size))]
        out = self._encode(units)
        at = 0
        joined = []
        for n in groups:
            joined.append(out[at] if n == 1 else torch.cat(out[at : at + n]))
            at += n
        return joined

    def _encode(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        v = self.config
        unit = v.merge_size**2
        xs, positions, whole, windows, orders = [], [], [], [], []
        offset = 0
        for image in images:
            x, pos = self._patches(image)
            if v.window_size:  # (Qwen2.5-VL) the patches in window order
                order, lengths = self._windows(image.shape[-2] // v.patch_size, image.shape[-1] // v.patch_size)
                rows = (order[:, None] * unit + torch.arange(unit)).flatten()
                x, pos = x[rows.to(x.device)], pos[rows]
                orders.append(order)
                at = offset
                for n in lengths:
                    windows.append((at, at + n * unit))
                    at += n * unit
            whole.append((offset, offset + x.shape[0]))  # (each image's attention is its own)
            offset += x.shape[0]
            xs.append(x)
            positions.append(pos)
        x = torch.cat(xs)
        pos = torch.cat(positions).to(x.device)
        inv = self._inv_freq(x.device)
        freqs = torch.cat((pos[:, :1] * inv, pos[:, 1:] * inv), dim=-1)  # [N, head/2]
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None]  # (each head's two halves turn alike)
        rope = (freqs.cos(), freqs.sin())
        deep = []
        for i, block in enumerate(self.visual.blocks):
            x = block(x, rope, windows if windows and i not in v.full_attention_layers else whole)
            if i in v.deepstack_layers:
                deep.append(self.visual.deepstack_merger_list[v.deepstack_layers.index(i)](x))
        merged = self.visual.merger(x)
        if deep:  # (DeepStack's rows ride beside the embeddings: `LlamaForCausalLM.forward`)
            merged = torch.cat((merged, *deep), dim=-1)
        out = []
        for k, (a, b) in enumerate(whole):
            part = merged[a // unit : b // unit]
            if orders:  # back from window order to the image's
                part = part[torch.argsort(orders[k]).to(part.device)]
            out.append(part)
        return out


def mrope_positions(positions: torch.Tensor, spans: tuple[ImageSpan, ...],
                    grid: list[tuple[list[int], int, int]]) -> torch.Tensor:
    """The 3D rotary positions `[rows, 3]` (time, row, column) of a sequence's rows at the
    sequence positions `positions` (HF's `get_rope_index`, then `rope_deltas` for what follows
    the prompt): text at its index, shifted by what the images before it saved; an image's
    token at its image's first position plus its frame group's time (`times`; an image's is 0),
    that plus its row, that plus its column. `grid`: each span's (times, h, w), h x w tokens a
    frame group. What follows a span goes on from one past its largest position: an image of
    h x w tokens takes max(h, w) positions, a video max(its last time + 1, h, w) (Qwen's rule,
    vLLM's; HF's transformers 5 goes on from max(h, w) after a video too, where the two differ)."""
    out = positions[:, None].repeat(1, 3)
    for span, (times, h, w) in zip(spans, grid, strict=True):
        saved = span.length - max(times[-1] + 1, h, w)
        inside = (positions >= span.offset) & (positions < span.end)
        if inside.any():
            local = positions[inside] - span.offset
            first = out[inside, 0] - local  # (the shift of the spans before this one is in it)
            time = torch.tensor(times, dtype=local.dtype)[local // (h * w)]
            at = local % (h * w)
            out[inside] = torch.stack((first + time, first + at // w, first + at % w), dim=1)
        out[positions >= span.end] -= saved
    return out
