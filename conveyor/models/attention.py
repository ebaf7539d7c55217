"""Paged attention: the interface, its per-step metadata, and the torch reference backend.

The KV cache of one layer is a single tensor `[2, num_slots, num_kv_heads, head_dim]` where
`num_slots = num_blocks * block_size` and slot `b * block_size + i` is token `i` of block `b`.
The runner orders each step's tokens decodes first, then prefills (whole or chunked), and
builds one `AttentionMetadata` per step that every layer reuses.

Every other backend (a CUDA kernel, say) is tested against `TorchPagedAttention`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from conveyor.core.speculative import TokenTree


@dataclass(slots=True)
class PrefillSpan:
    """One sequence computing more than one token this step."""

    token_start: int  # rows [token_start, token_end) of the step's flat token batch
    token_end: int
    start_pos: int  # tokens already in the cache before this step
    context_blocks: torch.Tensor | None  # blocks holding positions [0, start_pos + n); None if start_pos == 0
    bias: torch.Tensor | None  # [n, context] additive mask (0 or -inf); None means plain causal
    tree: bool = False  # the rows are a token tree's (`bias` is not causal within the span)
    # Position ranges whose rows see each other both ways (Gemma 3's images: `open_ranges`);
    # `bias` is then not causal within the span.
    ranges: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class CrossMetadata:
    """An encoder-decoder step's cross-attention (Whisper's): each row attends, unmasked, to all
    `length` encoder positions of its sequence, whose keys and values lie in the paged cache in
    the blocks of the sequence's cross table (`BlockManager.cross_pages`), in every layer's
    cache alike. `rows[i]`: sequence i's rows `(first, end)` in the step's flat batch; `tables`
    `[seqs, pages]` its cross table; `row_tables` `[T, pages]` and `row_lens` `[T]` (each
    `length`) the same a row, the decode kernels' form."""

    rows: list[tuple[int, int]]
    tables: torch.Tensor
    row_tables: torch.Tensor
    row_lens: torch.Tensor
    length: int
    block_size: int


@dataclass(slots=True)
class AttentionMetadata:
    block_size: int
    positions: torch.Tensor  # [num_tokens] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V goes to
    num_decodes: int  # the first num_decodes rows are single-token decodes
    decode_blocks: torch.Tensor | None = None  # [num_decodes, max_blocks] block tables, padded with 0
    decode_bias: torch.Tensor | None = None  # built on first use by `decode_mask()`
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64, the new token included
    prefills: list[PrefillSpan] = field(default_factory=list)
    prefill_blocks: torch.Tensor | None = None  # [num_prefills, max_blocks] block tables, padded with 0
    sliding_window: int | None = None
    mask_dtype: torch.dtype = torch.float32  # the compute dtype, for additive masks
    windows: dict[int, AttentionMetadata] = field(default_factory=dict)  # `windowed`'s, by window
    # The decodes include rows of one sequence side by side (a speculative step's guesses, each
    # a one-token decode of the same table at the next position: `chain_decodes`): each reads
    # the K/V its sequence's rows before it write in this step.
    chained: bool = False
    # Chained rows of a token tree (`chain_decodes` with trees): row r's last `decode_path_lens[r]`
    # context positions are not the ones before it but those listed in `decode_paths[r]` (the
    # positions, in its table's order, of the guesses its branch follows, its own last).
    decode_paths: torch.Tensor | None = None  # [num_decodes, depth] int64, padded with 0
    decode_path_lens: torch.Tensor | None = None  # [num_decodes] int64, 0 for a row of no tree
    # A hybrid KV cache (conveyor/core/block_manager.py: HybridLayout): each layer's metadata,
    # this one for a global layer's, its group's (tables and slots of its own) for a sliding one.
    layer_metas: list[AttentionMetadata] | None = None
    # Rows whose input is an embedding, not a token's (a LLaVA's image tokens): their row
    # indices `[R]` and embeddings `[R, hidden]` (conveyor/multimodal.py).
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # M-RoPE (Qwen2-VL): each row's (time, row, column) rotary positions `[T, 3]`, where a
    # sequence of the step holds images (conveyor/models/qwen_vision.py: `mrope_positions`).
    mrope: torch.Tensor | None = None
    # An encoder-decoder's (Whisper's) cross-attention: where each sequence's encoder keys and
    # values lie in the cache, and the clips encoded this step (conveyor/models/whisper.py `CrossStates`).
    cross: Any = None

    def windowed(self, window: int) -> AttentionMetadata:
        """This step's metadata for a layer that attends within its last `window` positions
        (Gemma's sliding layers, where the step's own is global): the same rows, slots and
        tables, the masks of that window. Built on the first such layer's call, then shared."""
        if window == (self.sliding_window or 0):
            return self
        hit = self.windows.get(window)
        if hit is not None:
            return hit
        device = self.positions.device
        neg_inf = torch.tensor(float("-inf"), dtype=self.mask_dtype)
        zero = torch.tensor(0.0, dtype=self.mask_dtype)
        prefills = []
        for span in self.prefills:
            start, ctx_len = span.start_pos, span.start_pos + span.token_end - span.token_start
            bias = None
            if start > 0 or (window and ctx_len > window) or span.ranges:
                keep = _keep(start, ctx_len, window or None, span.ranges)
                bias = to_device(torch.where(keep, zero, neg_inf), device)
            prefills.append(PrefillSpan(span.token_start, span.token_end, start, span.context_blocks, bias,
                                        ranges=span.ranges))
        hit = self.windows[window] = AttentionMetadata(
            block_size=self.block_size, positions=self.positions, slot_mapping=self.slot_mapping,
            num_decodes=self.num_decodes, decode_blocks=self.decode_blocks,
            decode_context_lens=self.decode_context_lens, prefills=prefills, prefill_blocks=self.prefill_blocks,
            sliding_window=window or None, mask_dtype=self.mask_dtype,
        )
        return hit

    def decode_mask(self) -> torch.Tensor:
        """`[num_decodes, 1, 1, max_blocks * block_size]` additive mask (0 / -inf) over the
        decodes' padded contexts, for backends that attend over padding (the torch reference);
        built on first use, since the native and Triton kernels read the context lengths."""
        if self.decode_bias is None:
            assert self.decode_blocks is not None and self.decode_context_lens is not None
            ctx = self.decode_context_lens
            pos = torch.arange(self.decode_blocks.shape[1] * self.block_size, device=ctx.device)
            if self.decode_paths is None:
                keep = pos[None, :] < ctx[:, None]
            else:  # a tree's row: the context before its branch, then its branch's positions
                assert self.decode_path_lens is not None
                keep = pos[None, :] < (ctx - self.decode_path_lens)[:, None]
                keep.scatter_(1, self.decode_paths, True)  # (padding: position 0, seen anyway)
            if self.sliding_window is not None:
                keep &= pos[None, :] >= (ctx[:, None] - self.sliding_window)
            bias = torch.zeros(keep.shape, dtype=self.mask_dtype, device=ctx.device).masked_fill_(~keep, float("-inf"))
            self.decode_bias = bias[:, None, None, :]
        return self.decode_bias


def host_longs(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of `values`, through an `array`: about 3x faster than `torch.tensor`
    on a list (which inspects every element), and a step builds several lists of one int per
    sequence."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


def host_table(tables: Sequence[Sequence[int]], width: int, fill: int) -> torch.Tensor:
    """Block tables as a CPU int64 tensor `[len(tables), width]`, each row cut to `width` or
    padded with `fill`: built as one flat `array`, not a nested `torch.tensor`. Rows that are
    int64 arrays already (`HostBlockTables`) are copied as memory; lists are converted int by
    int (at 256 rows of 70 blocks, about 20x the time)."""
    if not tables or not width:
        return torch.empty(len(tables), width, dtype=torch.long)
    flat = array("q")
    pad = array("q", [fill]) * width
    for t in tables:
        n = len(t)
        if n < width:
            flat.extend(t)
            flat += pad[: width - n]
        else:
            flat.extend(t[:width] if n > width else t)
    return torch.frombuffer(flat, dtype=torch.long).view(len(tables), width)


class HostBlockTables:
    """Each running sequence's block table as an int64 `array`, kept from step to step, so
    that a step's tables are copied as memory rather than converted from Python ints: a
    decode step's host time would otherwise grow with every sequence's context (about 1.2 ms
    a step at 256 sequences of 4,000 tokens).

    The scheduler's contract makes this exact: a sequence's table list only ever grows in
    place by appends (`BlockManager.allocate`); anything else (free, swap out or in) assigns
    the sequence a new list. So a row is valid while it was built from the same list object,
    and only that list's new tail is appended to it."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[list[int], array]] = {}

    def rows(self, seq_ids: Sequence[int], tables: Sequence[list[int]]) -> list[array]:
        """The rows of these sequences' tables (the cached arrays themselves: copy them, as
        `host_table` does, before the tables grow again)."""
        cache = self._rows
        out = []
        for seq_id, table in zip(seq_ids, tables, strict=True):
            hit = cache.get(seq_id)
            if hit is not None and hit[0] is table and len(hit[1]) <= len(table):
                row = hit[1]
                if len(row) < len(table):
                    row.extend(table[len(row):])
            else:
                row = array("q", table)
                cache[seq_id] = (table, row)
            out.append(row)
        return out

    def drop(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._rows)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`. To CUDA through pinned memory and without blocking: torch's blocking
    copy to the device waits for the whole stream, and with async scheduling that stream is
    still running the step before (a list index or `torch.tensor(..., device=cuda)` copies the
    same way)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def build_metadata(
    block_tables: Sequence[Sequence[int]],
    start_positions: list[int],
    num_new_tokens: list[int],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    trees: Sequence[TokenTree | None] | None = None,
) -> AttentionMetadata:
    """Metadata for sequences given decodes first (num_new == 1), then prefills.

    Built once per step on the host and shared by every layer. K/V are gathered by whole
    blocks (one index per block, not per token); masks are additive, in the compute dtype.

    `trees`: per sequence, the token tree its new tokens are (a speculative step's branching
    drafts; None: a run of consecutive tokens). Such a span's row k sits at position
    `start + tree.depths[k]` and its K/V in the slot of `start + k`; it sees the context before
    the span, the root, and its own branch (`tree_keep`). No sliding window with trees.
    """
    if all(n == 1 for n in num_new_tokens):
        return _decode_metadata(block_tables, start_positions, block_size, device, sliding_window, dtype)
    return _mixed_metadata(block_tables, start_positions, num_new_tokens, block_size, device, sliding_window, dtype,
                           trees)


@cache
def tree_keep(tree: TokenTree, n: int) -> torch.Tensor:
    """`[n, n]` bool: which of a tree's first `n` rows each row sees (the root, its branch)."""
    keep = torch.zeros((n, n), dtype=torch.bool)
    keep[:, 0] = True
    for k in range(1, n):
        keep[k, tree.branch(k)] = True
    return keep


def _mixed_metadata(
    block_tables: Sequence[Sequence[int]],
    start_positions: list[int],
    num_new_tokens: list[int],
    block_size: int,
    device: torch.device,
    sliding_window: int | None,
    dtype: torch.dtype,
    trees: Sequence[TokenTree | None] | None = None,
) -> AttentionMetadata:
    num_decodes = 0
    while num_decodes < len(num_new_tokens) and num_new_tokens[num_decodes] == 1:
        num_decodes += 1
    max_blocks = max(len(t) for t in block_tables)
    tables = host_table(block_tables, max_blocks, 0)

    # Slot of every new token: one vectorised gather over the padded block tables.
    counts = torch.tensor(num_new_tokens)
    seq_index = torch.repeat_interleave(torch.arange(len(num_new_tokens)), counts)
    starts = torch.tensor(start_positions, dtype=torch.long)
    first_row = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(int(counts.sum())) - first_row[seq_index]
    slot_mapping = tables[seq_index, (starts[seq_index] + offsets) // block_size] * block_size + (
        starts[seq_index] + offsets) % block_size
    if trees is not None and any(t is not None for t in trees):
        assert sliding_window is None, "no sliding window with token trees"
        for i, tree in enumerate(trees):
            if tree is not None:
                a = int(first_row[i])
                offsets[a : a + num_new_tokens[i]] = torch.tensor(tree.depths[: num_new_tokens[i]])
    positions = starts[seq_index] + offsets
    meta = AttentionMetadata(
        block_size=block_size,
        positions=to_device(positions, device), slot_mapping=to_device(slot_mapping, device), num_decodes=num_decodes,
        sliding_window=sliding_window, mask_dtype=dtype,
    )
    neg_inf = torch.tensor(float("-inf"), dtype=dtype)
    zero = torch.tensor(0.0, dtype=dtype)

    if num_decodes:
        ctx = starts[:num_decodes] + 1
        nb = int((ctx.max() + block_size - 1) // block_size)
        meta.decode_blocks = to_device(tables[:num_decodes, :nb], device)
        meta.decode_context_lens = to_device(ctx, device)

    if num_decodes < len(num_new_tokens):
        ends = starts[num_decodes:] + counts[num_decodes:]
        nb = int((ends.max() + block_size - 1) // block_size)
        meta.prefill_blocks = to_device(tables[num_decodes:, :nb], device)

    row = num_decodes
    for i in range(num_decodes, len(num_new_tokens)):
        n, start = num_new_tokens[i], start_positions[i]
        ctx_len = start + n
        context_blocks = None
        bias = None
        if start > 0:
            context_blocks = to_device(tables[i, : (ctx_len + block_size - 1) // block_size], device)
        tree = None if trees is None else trees[i]
        if tree is not None:
            keep = torch.ones((n, ctx_len), dtype=torch.bool)
            keep[:, start:] = tree_keep(tree, n)
            bias = to_device(torch.where(keep, zero, neg_inf), device)
        elif start > 0 or (sliding_window is not None and ctx_len > sliding_window):
            bias = to_device(torch.where(_keep(start, ctx_len, sliding_window), zero, neg_inf), device)
        meta.prefills.append(PrefillSpan(row, row + n, start, context_blocks, bias, tree is not None))
        row += n
    return meta


def open_ranges(meta: AttentionMetadata, ranges: Sequence[tuple[tuple[int, int], ...]]) -> None:
    """Let the rows of each range (positions `[a, b)`) see each other both ways, not only the
    ones before them: Gemma 3's image tokens, which attend over their whole image (HF's
    `token_type_ids` mask; in a sliding layer, within its window too). `ranges[j]` are those of
    `meta.prefills[j]`'s sequence; a range must lie whole in the span's context (the scheduler
    never ends a chunk inside one: `Scheduler._prefill_chunk`). Such a span's mask is built
    here, and its blocks named even for a fresh prompt (the Triton backend computes it with the
    torch reference, from the cache). A hybrid cache's layer metadata (`layer_metas`) open too."""
    for group in {id(m): m for m in meta.layer_metas or []}.values():
        if group is not meta:
            open_ranges(group, ranges)
    device = meta.positions.device
    neg_inf = torch.tensor(float("-inf"), dtype=meta.mask_dtype)
    zero = torch.tensor(0.0, dtype=meta.mask_dtype)
    assert meta.prefill_blocks is not None or not meta.prefills
    for j, (span, own) in enumerate(zip(meta.prefills, ranges, strict=True)):
        start, ctx_len = span.start_pos, span.start_pos + span.token_end - span.token_start
        own = tuple((a, b) for a, b in own if a < ctx_len and b > start)
        if not own:
            continue
        keep = _keep(start, ctx_len, meta.sliding_window, own)
        span.bias = to_device(torch.where(keep, zero, neg_inf), device)
        span.ranges = own
        if span.context_blocks is None:
            assert meta.prefill_blocks is not None
            span.context_blocks = meta.prefill_blocks[j, : (ctx_len + meta.block_size - 1) // meta.block_size]
    meta.windows.clear()


def _keep(start: int, ctx_len: int, window: int | None, ranges: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """`[ctx_len - start, ctx_len]`: which positions each of a span's new rows sees (those
    before it, and the whole of a range it is in: `open_ranges`), within `window`."""
    q_pos = torch.arange(start, ctx_len)[:, None]
    k_pos = torch.arange(ctx_len)[None, :]
    keep = k_pos <= q_pos
    for a, b in ranges:
        keep |= (q_pos >= a) & (q_pos < b) & (k_pos >= a) & (k_pos < b)
    if window is not None:
        keep &= k_pos > q_pos - window
    return keep


def _decode_metadata(
    block_tables: Sequence[Sequence[int]],
    start_positions: list[int],
    block_size: int,
    device: torch.device,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> AttentionMetadata:
    """`build_metadata` for a step of decodes only (the common step), from plain lists: about
    a quarter of the general path's host time, which at batch 1 is a few percent of a step."""
    bs = block_size
    ctx = [s + 1 for s in start_positions]
    nb = (max(ctx) + bs - 1) // bs
    slots = [t[s // bs] * bs + s % bs for t, s in zip(block_tables, start_positions, strict=True)]
    return AttentionMetadata(
        block_size=bs,
        positions=to_device(host_longs(start_positions), device),
        slot_mapping=to_device(host_longs(slots), device),
        num_decodes=len(ctx),
        decode_blocks=to_device(host_table(block_tables, nb, 0), device),
        decode_context_lens=to_device(host_longs(ctx), device),
        sliding_window=sliding_window,
        mask_dtype=dtype,
    )


def chain_decodes(
    block_tables: Sequence[Sequence[int]],
    start_positions: list[int],
    num_new_tokens: list[int],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    trees: Sequence[TokenTree | None] | None = None,
) -> AttentionMetadata:
    """`build_metadata` for the same step with each sequence's `n` new tokens as `n` one-token
    decodes of its table, at positions `start, ..., start + n - 1` (`chained`): row `j` attends
    to the context up to its own position, which is what a prefill's causal mask gives it. Every
    backend writes all of a step's K/V before it attends (`AttentionBackend`'s contract), so the
    rows before it in its sequence are there. A speculative step's guesses take the native
    decode call this way on CPU (conveyor/models/llama.py: FusedDecode).

    A sequence with a token tree (`trees`, as in `build_metadata`): row k decodes at position
    `start + depth(k)`, writes the slot of `start + k`, and sees the context up to the root,
    then its branch's slots in place of the positions after it (`decode_paths`)."""
    if trees is None or all(t is None for t in trees):
        tables: list[Sequence[int]] = []
        starts: list[int] = []
        for table, start, n in zip(block_tables, start_positions, num_new_tokens, strict=True):
            tables.extend([table] * n)
            starts.extend(range(start, start + n))
        meta = _decode_metadata(tables, starts, block_size, device, sliding_window, dtype)
        meta.chained = True
        return meta
    assert sliding_window is None, "no sliding window with token trees"
    rows: list[Sequence[int]] = []
    positions: list[int] = []
    writes: list[int] = []
    paths: list[list[int]] = []
    for table, start, n, tree in zip(block_tables, start_positions, num_new_tokens, trees, strict=True):
        for k in range(n):
            rows.append(table)
            positions.append(start + (k if tree is None else tree.depths[k]))
            writes.append(start + k)
            paths.append([] if tree is None else [start + r for r in tree.branch(k)])
    return path_decodes(rows, positions, writes, paths, block_size, device, dtype)


def path_decodes(
    block_tables: Sequence[Sequence[int]],
    positions: list[int],
    write_positions: list[int],
    paths: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """One-token decodes (`chained`: all written before any attends) whose rows need not be a
    sequence's next positions: row r computes the token at `positions[r]` (its rotary position),
    writes its K/V to the slot of `write_positions[r]` in its table, and attends to the
    positions `[0, positions[r] + 1 - len(paths[r]))` through its table, then to `paths[r]` (in
    the table's order; a token tree's branch, its own write position last). A tree's rows in the
    target's step (`chain_decodes`) or in an EAGLE head's drafting steps."""
    meta = _decode_metadata(block_tables, positions, block_size, device, None, dtype)
    meta.chained = True
    bs = block_size
    if write_positions != positions:  # (a branch's positions are its rows' write positions)
        meta.slot_mapping = to_device(host_longs(
            [t[w // bs] * bs + w % bs for t, w in zip(block_tables, write_positions, strict=True)]), device)
        meta.decode_blocks = to_device(host_table(block_tables, (max(max(write_positions), *positions) + bs) // bs, 0),
                                       device)
    width = max(len(p) for p in paths)
    if width:
        meta.decode_paths = to_device(host_table(paths, width, 0), device)
        meta.decode_path_lens = to_device(host_longs([len(p) for p in paths]), device)
    return meta


class AttentionBackend(ABC):
    """Computes attention for a step's flat token batch over the paged KV cache.

    `sinks` `[heads]`: a learned logit a head in each softmax's denominator (gpt-oss), set by
    the layer before each call; only the backends that compute them (`EagerAttention`, the
    Triton backend) are given a layer that has them.

    Contract: `forward` first writes this step's `k`/`v` into `kv_cache` at
    `meta.slot_mapping`, then returns attention over each sequence's whole context. Prefix
    caching relies on it: a sequence may read, as a cached prefix, blocks that another
    sequence's prefill writes in the same step (`Scheduler._emit`).
    """

    sinks: torch.Tensor | None = None

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

    def write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor) -> None:
        """K/V rows `[T, kv_heads, head_dim]` into their cache slots (the torch reference's
        write; outside a step's `forward`, an encoder-decoder's cross keys and values, once a
        request)."""
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))

    def cross(self, q: torch.Tensor, kv_cache: torch.Tensor, cross: CrossMetadata, scale: float) -> torch.Tensor:
        """An encoder-decoder's cross-attention of the step's rows `q` `[T, heads, head_dim]`
        over their sequences' encoder keys and values in the cache (`CrossMetadata`)."""
        raise NotImplementedError(f"{type(self).__name__} has no cross-attention")


class TorchPagedAttention(AttentionBackend):
    """Reference backend: gathers K/V block by block through the block tables and calls SDPA.

    Decodes run as one padded batch (an additive mask hides the padding) in `decode`, which a
    faster backend overrides; prefills run one sequence at a time (plain causal for a fresh
    prompt, the cached context for a later chunk).
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
        # A cache in another dtype (kv_cache_dtype) stores rounded K/V; attention reads them
        # back in the compute dtype. A fresh prompt attends over its unrounded K/V, as in vLLM.
        self.write(k, v, k_cache, v_cache, meta.slot_mapping)
        gqa = q.shape[1] != k_cache.shape[1]
        bs = meta.block_size
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta, scale)
        for span in meta.prefills:
            a, b = span.token_start, span.token_end
            if span.context_blocks is None:
                ks, vs = k[a:b], v[a:b]
            else:
                ctx = span.start_pos + (b - a)
                ks = gather_blocks(k_cache, span.context_blocks[None], bs, ctx)[0].to(q.dtype)
                vs = gather_blocks(v_cache, span.context_blocks[None], bs, ctx)[0].to(q.dtype)
            # 4-D, a batch of one: PyTorch's fused (flash) CPU kernel takes only 4-D inputs and
            # 3-D falls back to the unfused math path, 2-3.5x slower here (BENCHMARKS.md).
            o = self.sdpa(q[a:b].transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                          span.bias, scale, gqa)
            out[a:b] = o[0].transpose(0, 1)
        return out

    def cross(self, q: torch.Tensor, kv_cache: torch.Tensor, cross: CrossMetadata, scale: float) -> torch.Tensor:
        """Cross-attention of the step's rows `q` `[T, heads, head_dim]` over their sequences'
        encoder keys and values in the cache (`CrossMetadata`): each sequence's gathered once,
        its rows attending together (no mask: every row sees every encoder position)."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        bs, n = cross.block_size, cross.length
        out = torch.empty_like(q)
        for i, (a, b) in enumerate(cross.rows):
            table = cross.tables[i : i + 1]
            ks = gather_blocks(k_cache, table, bs, n)[0].to(q.dtype).transpose(0, 1)  # [kvh, n, d]
            vs = gather_blocks(v_cache, table, bs, n)[0].to(q.dtype).transpose(0, 1)
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], ks[None], vs[None], scale=scale,
                                               enable_gqa=q.shape[1] != ks.shape[0])
            out[a:b] = o[0].transpose(0, 1)
        return out

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Attention of the step's decode rows `q` `[D, heads, head_dim]` over their contexts."""
        assert meta.decode_blocks is not None
        bias = meta.decode_mask()
        bs = meta.block_size
        length = bias.shape[-1]
        kd = gather_blocks(k_cache, meta.decode_blocks, bs, length).to(q.dtype)  # [D, L, kvh, d]
        vd = gather_blocks(v_cache, meta.decode_blocks, bs, length).to(q.dtype)
        od = self.sdpa(q.unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2), bias, scale,  # q [D, h, 1, d]
                       q.shape[1] != k_cache.shape[1])
        return od.squeeze(2)

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float,
             gqa: bool) -> torch.Tensor:
        """Attention of `q` `[B, heads, n, d]` over `k`, `v` `[B, kv_heads, L, d]` under the
        additive mask `bias` (None: causal, n == L)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None, scale=scale,
                                              enable_gqa=gqa)


class EagerAttention(TorchPagedAttention):
    """The torch reference with explicit products and softmax, for what SDPA, the native and
    the Triton kernels do not compute, as HF's eager attention computes it: each score
    soft-capped, `cap * tanh(score / cap)`, before the mask (Gemma 2), with a float32 softmax;
    or a learned logit a head joining each softmax's denominator (gpt-oss's sinks, `sinks`
    `[heads]`, set by the layer before each call), the softmax in the scores' dtype."""

    def __init__(self, cap: float = 0.0) -> None:
        self.cap = cap
        self.sinks: torch.Tensor | None = None

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float,
             gqa: bool) -> torch.Tensor:
        if gqa:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if self.cap:
            scores = torch.tanh(scores / self.cap) * self.cap
        if bias is None:
            n = q.shape[2]
            bias = torch.full((n, n), float("-inf"), dtype=scores.dtype, device=scores.device).triu_(1)
        scores = scores + bias
        if self.sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            sinks = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            both = torch.cat((scores, sinks), dim=-1)
            both = both - both.amax(dim=-1, keepdim=True)
            probs = torch.softmax(both, dim=-1, dtype=both.dtype)[..., :-1].to(q.dtype)
        return torch.matmul(probs, v)


NATIVE_KV_DTYPES = (torch.float32, torch.float16)  # the cache dtypes the native CPU kernels read


class CpuPagedAttention(TorchPagedAttention):
    """float32 on CPU (a float32 or float16 cache): decodes through the native kernel (conveyor/kernels), which reads each
    sequence's K/V in place through its block table, with no gather and no padding; K/V written
    to their slots in one native pass (`writer`, rounded to float16 as torch rounds); prefills
    as in the torch backend. Tested against `TorchPagedAttention`."""

    def __init__(self, kernel: Callable[..., torch.Tensor], sliding_window: int | None = None,
                 writer: Callable[..., None] | None = None) -> None:
        self.kernel = kernel
        self.window = sliding_window or 0
        self.writer = writer

    def write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor) -> None:
        if self.writer is None or k.dtype != torch.float32 or k_cache.dtype not in NATIVE_KV_DTYPES:
            return super().write(k, v, k_cache, v_cache, slots)
        self.writer(k, v, k_cache, v_cache, slots)

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if q.dtype != torch.float32 or k_cache.dtype not in NATIVE_KV_DTYPES or meta.decode_context_lens is None:
            return super().decode(q, k_cache, v_cache, meta, scale)
        assert meta.decode_blocks is not None
        return self.kernel(q, k_cache, v_cache, meta.decode_blocks, meta.decode_context_lens,
                           meta.block_size, scale, self.window, self.cap, self.sinks, meta.decode_paths,
                           meta.decode_path_lens)

    def cross(self, q: torch.Tensor, kv_cache: torch.Tensor, cross: CrossMetadata, scale: float) -> torch.Tensor:
        """Each row as a decode over its sequence's encoder positions, read in place by the
        native kernel (no gather), its context all `length` of them."""
        k_cache = kv_cache[0]
        if q.dtype != torch.float32 or k_cache.dtype not in NATIVE_KV_DTYPES:
            return super().cross(q, kv_cache, cross, scale)
        return self.kernel(q, k_cache, kv_cache[1], cross.row_tables, cross.row_lens, cross.block_size, scale, 0)

    cap = 0.0  # (CpuEagerAttention's soft cap)


class CpuEagerAttention(CpuPagedAttention, EagerAttention):
    """`EagerAttention` (capped scores, sinks) with its decodes through the native kernel, which
    computes both; prompts take the explicit products."""

    def __init__(self, kernel: Callable[..., torch.Tensor], sliding_window: int | None,
                 writer: Callable[..., None] | None, cap: float) -> None:
        CpuPagedAttention.__init__(self, kernel, sliding_window, writer)
        EagerAttention.__init__(self, cap)


def gather_blocks(
    cache: torch.Tensor, tables: torch.Tensor, block_size: int, length: int
) -> torch.Tensor:
    """K or V of the first `length` positions of each row's blocks: `[rows, length, kvh, d]`."""
    _, kvh, d = cache.shape
    rows, nb = tables.shape
    # index_select on whole blocks: about 2.7x faster on CPU than advanced indexing.
    gathered = torch.index_select(cache.view(-1, block_size, kvh, d), 0, tables.reshape(-1))
    return gathered.view(rows, nb * block_size, kvh, d)[:, :length]
