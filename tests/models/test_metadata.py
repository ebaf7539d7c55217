"""The decode-only fast path of build_metadata gives what the general path gives."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.models.attention import _decode_metadata, _mixed_metadata


@st.composite
def decode_batches(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    rows = draw(st.integers(1, 12))
    starts = [draw(st.integers(0, 60)) for _ in range(rows)]
    pool = draw(st.permutations(list(range(rows * 80))))
    tables, used = [], 0
    for s in starts:
        n = s // block_size + 1 + draw(st.integers(0, 2))  # tables may hold spare blocks
        tables.append(list(pool[used : used + n]))
        used += n
    window = draw(st.one_of(st.none(), st.integers(1, 20)))
    return tables, starts, block_size, window


@settings(max_examples=150, deadline=None)
@given(decode_batches())
def test_decode_fast_path_equals_the_general_path(batch):
    tables, starts, bs, window = batch
    cpu = torch.device("cpu")
    fast = _decode_metadata(tables, starts, bs, cpu, window, torch.float32)
    ref = _mixed_metadata(tables, starts, [1] * len(starts), bs, cpu, window, torch.float32)
    assert fast.num_decodes == ref.num_decodes == len(starts)
    assert not fast.prefills and fast.prefill_blocks is None
    for name in ("positions", "slot_mapping", "decode_blocks", "decode_context_lens"):
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fast.decode_bias is None  # built only when a backend asks
    mask = fast.decode_mask()
    assert torch.equal(mask, ref.decode_mask())
    assert mask.shape == (len(starts), 1, 1, fast.decode_blocks.shape[1] * bs)
    for i, s in enumerate(starts):  # visible: positions [max(0, ctx - window), ctx)
        ctx = s + 1
        lo = 0 if window is None else max(0, ctx - window)
        visible = [j for j in range(mask.shape[-1]) if mask[i, 0, 0, j] == 0]
        assert visible == list(range(lo, ctx)) and bool((mask[i, 0, 0, :] != 0).eq(mask[i, 0, 0, :] == float("-inf")).all())
