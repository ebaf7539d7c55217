"""Paged attention: the interface, its per-step metadata, and the torch reference backend.

The KV cache of one layer is a single tensor `[2, num_slots, num_kv_heads, head_dim]` where
`num_slots = num_blocks * block_size` and slot `b * block_size + i` is token `i` of block `b`.
The runner orders each step's tokens decodes first, then prefills (whole or chunked), and
builds one `AttentionMetadata` per step that every layer reuses.

Every other backend (a CUDA kernel, say) is tested against `TorchPagedAttention`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One sequence computing more than one token this step."""

    token_start: int  # rows [token_start, token_end) of the step's flat token batch
    token_end: int
    start_pos: int  # tokens already in the cache before this step
    context_slots: torch.Tensor | None  # cache slots of positions [0, start_pos + n); None if start_pos == 0
    mask: torch.Tensor | None  # [n, context] bool (True = attend); None means plain causal


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V goes to
    num_decodes: int  # the first num_decodes rows are single-token decodes
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_context] gather index
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] True = attend
    prefills: list[PrefillSpan] = field(default_factory=list)


def build_metadata(
    block_tables: list[list[int]],
    start_positions: list[int],
    num_new_tokens: list[int],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Metadata for sequences given decodes first (num_new == 1), then prefills."""
    num_decodes = 0
    while num_decodes < len(num_new_tokens) and num_new_tokens[num_decodes] == 1:
        num_decodes += 1
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.tensor(
        [t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long
    )

    # Slot of every new token: one vectorised gather over the padded block tables.
    seq_index = torch.repeat_interleave(
        torch.arange(len(num_new_tokens)), torch.tensor(num_new_tokens)
    )
    starts = torch.tensor(start_positions, dtype=torch.long)
    offsets = torch.cat([torch.arange(n) for n in num_new_tokens])
    positions = starts[seq_index] + offsets
    slot_mapping = tables[seq_index, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        positions=positions.to(device), slot_mapping=slot_mapping.to(device), num_decodes=num_decodes
    )

    if num_decodes:
        ctx = starts[:num_decodes] + 1
        max_ctx = int(ctx.max())
        pos = torch.arange(max_ctx)
        dtables = tables[:num_decodes]
        slots = (
            torch.gather(dtables, 1, (pos // block_size).expand(num_decodes, -1).clamp_max(max_blocks - 1))
            * block_size
            + pos % block_size
        )
        mask = pos[None, :] < ctx[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] >= (ctx[:, None] - sliding_window)
        slots = torch.where(mask, slots, torch.zeros_like(slots))
        meta.decode_slots = slots.to(device)
        meta.decode_mask = mask[:, None, None, :].to(device)

    row = num_decodes
    for i in range(num_decodes, len(num_new_tokens)):
        n, start = num_new_tokens[i], start_positions[i]
        ctx_len = start + n
        context_slots = None
        mask = None
        if start > 0:
            pos = torch.arange(ctx_len)
            context_slots = (tables[i, pos // block_size] * block_size + pos % block_size).to(device)
        if start > 0 or (sliding_window is not None and ctx_len > sliding_window):
            q_pos = torch.arange(start, ctx_len)[:, None]
            k_pos = torch.arange(ctx_len)[None, :]
            m = k_pos <= q_pos
            if sliding_window is not None:
                m &= k_pos > q_pos - sliding_window
            mask = m.to(device)
        meta.prefills.append(PrefillSpan(row, row + n, start, context_slots, mask))
        row += n
    return meta


class AttentionBackend(ABC):
    """Computes attention for a step's flat token batch over the paged KV cache.

    Contract: `forward` first writes this step's `k`/`v` into `kv_cache` at
    `meta.slot_mapping`, then returns attention over each sequence's whole context.
    """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchPagedAttention(AttentionBackend):
    """Reference backend: gathers K/V through the block tables and calls SDPA.

    Decodes run as one padded batch; prefills run one sequence at a time.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            assert meta.decode_slots is not None and meta.decode_mask is not None
            kd = k_cache[meta.decode_slots].transpose(1, 2)  # [D, kvh, L, d]
            vd = v_cache[meta.decode_slots].transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [D, h, 1, d]
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
            )
            out[:nd] = od.squeeze(2)
        for span in meta.prefills:
            a, b = span.token_start, span.token_end
            if span.context_slots is None:
                ks, vs = k[a:b], v[a:b]
            else:
                ks, vs = k_cache[span.context_slots], v_cache[span.context_slots]
            o = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1),
                ks.transpose(0, 1),
                vs.transpose(0, 1),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            out[a:b] = o.transpose(0, 1)
        return out
