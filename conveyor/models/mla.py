"""Multi-head latent attention (MLA: DeepSeek-V2, DeepSeek-V3 / R1) over the paged cache.

MLA caches no per-head K/V. Each token keeps one latent `c` (`kv_lora_rank` values, after
`kv_a_layernorm`) and one rotary key `k_pe` (`qk_rope_head_dim`) that every head shares; a
head's key is `[W_UK c, k_pe]` and its value `W_UV c`, where `kv_b_proj` stacks each head's
`W_UK` and `W_UV`. DeepSeek-V3's 576 values a token a layer are 1/57 of what 128 heads of
K/V would take (DeepSeek-V2 paper, section 2.1).

The cache keeps the latent and the rotary key as one row `[c, k_pe]`, its first half in the
layer's K plane and its second in the V plane (`ArchConfig.kv_cache_shape`), so that blocks,
swaps, prefix hits and hand-overs move it as they move K and V.

Two orders of the same product, as in vLLM and SGLang:
- a prompt's rows expand their context's latents into per-head keys and values (`kv_b_proj`)
  and attend as multi-head attention does: one expansion serves many queries (a few rows over
  a cached context, a speculative verification's or a short chunk's, are absorbed instead, as
  decodes are, where that costs less: `_absorbs`);
- a decode row absorbs `W_UK` into its query (`q_nope W_UK`, a query over the latent) and
  attends over the latents themselves as one shared head (multi-query attention with keys
  `[c, k_pe]` and values `c`), then applies `W_UV` to the result: a decode reads the small
  latents and never expands a context.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.arch import ArchConfig
from conveyor.models.attention import AttentionMetadata, gather_blocks


class LatentAttention(nn.Module):
    """Parameter names are HF's (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`,
    `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`)."""

    def __init__(self, arch: ArchConfig) -> None:
        from conveyor.models.llama import RMSNorm, softmax_scale_factor

        super().__init__()
        h, n = arch.hidden_size, arch.num_heads
        self.num_heads = n
        self.nope, self.rope_dim, self.v_dim = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        self.rank = arch.kv_lora_rank
        qk = self.nope + self.rope_dim
        self.q_proj: nn.Module | None = None
        self.q_a_proj: nn.Module | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Module | None = None
        if arch.q_lora_rank:
            self.q_a_proj = nn.Linear(h, arch.q_lora_rank, bias=arch.attention_bias)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, 1e-6)  # (HF's default eps, not the model's)
            self.q_b_proj = nn.Linear(arch.q_lora_rank, n * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=arch.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, n * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(n * self.v_dim, h, bias=arch.attention_bias)
        self.scale = qk**-0.5 * softmax_scale_factor(arch)
        self.plane = arch.kv_cache_shape[1]  # values of the row in each plane

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        from conveyor.models.llama import apply_rope

        T, n = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, n, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope], apply_rope(q[..., self.nope :], rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        rows = torch.cat((self.kv_a_layernorm(latent.contiguous()), apply_rope(k_pe[:, None], rope)[:, 0]), dim=-1)
        self._write(rows, kv_cache, meta.slot_mapping)
        out = q.new_empty(T, n, self.v_dim)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], kv_cache, meta)
        for span in meta.prefills:
            a, b = span.token_start, span.token_end
            if span.context_blocks is None:
                out[a:b] = self._expanded(q_nope[a:b], q_pe[a:b], rows[a:b], span.bias)
                continue
            length = span.start_pos + (b - a)
            context = self._read(kv_cache, span.context_blocks[None], meta.block_size, length)[0].to(q.dtype)
            assert span.bias is not None  # (a span after cached context always has its mask)
            if self._absorbs(b - a):  # a few rows over a long context: a verification, a short chunk
                out[a:b] = self._absorbed_span(q_nope[a:b], q_pe[a:b], context, span.bias)
            else:
                out[a:b] = self._expanded(q_nope[a:b], q_pe[a:b], context, span.bias)
        return self.o_proj(out.reshape(T, n * self.v_dim))

    def _write(self, rows: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """This step's `[c, k_pe]` rows `[T, rank + rope]` into their slots, half a plane."""
        if rows.shape[1] < 2 * self.plane:  # an odd row: one value of padding
            rows = F.pad(rows, (0, 2 * self.plane - rows.shape[1]))
        rows = rows.to(kv_cache.dtype).view(-1, 2, 1, self.plane)
        kv_cache[0].index_copy_(0, slots, rows[:, 0])
        kv_cache[1].index_copy_(0, slots, rows[:, 1])

    def _read(self, kv_cache: torch.Tensor, tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
        """The `[c, k_pe]` rows of the first `length` positions of each table: `[rows, length, rank + rope]`."""
        first = gather_blocks(kv_cache[0], tables, block_size, length)
        second = gather_blocks(kv_cache[1], tables, block_size, length)
        return torch.cat((first, second), dim=-1)[:, :, 0, : self.rank + self.rope_dim]

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_b_proj`'s weight as each head's `W_UK` `[heads, nope, rank]` and `W_UV` `[heads, v, rank]`."""
        proj: Any = self.kv_b_proj  # an nn.Linear, or what prepare_for_inference made of it
        weight = proj.weight_t.t() if hasattr(proj, "weight_t") else proj.weight
        w = weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """A prompt's rows `[S, heads, .]` over its context's latents `[L, rank + rope]`,
        expanded into per-head keys and values; `[S, heads, v]`."""
        L, n = context.shape[0], self.num_heads
        kv = self.kv_b_proj(context[:, : self.rank]).view(L, n, self.nope + self.v_dim)
        k_pe = context[:, None, self.rank :].expand(L, n, self.rope_dim)
        k = torch.cat((kv[..., : self.nope], k_pe), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        v = kv[..., self.nope :]
        pad = q.shape[-1] - self.v_dim
        if pad > 0:  # SDPA's fused kernels take equal widths: values padded with zeros, as vLLM
            v = F.pad(v, (0, pad))  # pads them for flash attention (on this CPU, 3.4x the math path for 8 heads over 512 tokens)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=bias, is_causal=bias is None, scale=self.scale,
        )
        return o[0].transpose(0, 1)[..., : self.v_dim]

    def _absorbs(self, rows: int) -> bool:
        """Whether `rows` queries over a context are cheaper absorbed: per context token, the
        expansion costs `rank (nope + v)` multiply-adds a head once, plus `nope + rope + v` a
        query; absorbed, `2 rank + rope` a query. (DeepSeek-V3's shapes: up to 170 rows.)"""
        expanded = self.rank * (self.nope + self.v_dim) + rows * (self.nope + self.rope_dim + self.v_dim)
        return rows * (2 * self.rank + self.rope_dim) < expanded

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
        """Rows `[R, heads, .]` by absorption: queries over the latents as one shared head, in
        `B = len(context)` batches of `R / B` rows, batch b over `context[b]` `[L, rank + rope]`
        under `mask[b]` (`[rows x heads, L]`, or `[1, L]` for all); `[R, heads, v]`.

        Two batched products by hand: SDPA takes keys and values of unequal widths only on its
        math path, which copies the context for every head (through it, benchmarks/mla.py ran
        0.65-0.88x this throughput at batches 1-32)."""
        rows, n = q_nope.shape[:2]
        w_uk, w_uv = self._up()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [R, heads, rank]
        q = torch.cat((q_latent, q_pe), dim=-1).reshape(len(context), rows // len(context) * n, -1)
        scores = torch.baddbmm(mask, q, context.transpose(1, 2), alpha=self.scale)
        o = torch.bmm(torch.softmax(scores, dim=-1), context[:, :, : self.rank]).view(rows, n, self.rank)
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _absorbed_span(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor,
                       bias: torch.Tensor) -> torch.Tensor:
        """A span's rows `[S, heads, .]` absorbed, as decodes are, over its context's latents
        `[L, rank + rope]` with its mask `[S, L]`; `[S, heads, v]`."""
        S, n = q_nope.shape[:2]
        mask = bias[:, None, :].expand(S, n, bias.shape[-1]).reshape(1, S * n, -1)
        return self._absorbed(q_nope, q_pe, context[None], mask)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows `[D, heads, .]` by absorption, each over its own context's latents."""
        assert meta.decode_blocks is not None
        bias = meta.decode_mask()  # [D, 1, 1, L]
        context = self._read(kv_cache, meta.decode_blocks, meta.block_size, bias.shape[-1]).to(q_nope.dtype)
        return self._absorbed(q_nope, q_pe, context, bias[:, 0])
