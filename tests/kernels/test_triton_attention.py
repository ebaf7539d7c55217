"""TritonPagedAttention against the torch reference backend, on random paged caches.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (float32 and float16;
the interpreter's `tl.dot` does not support bfloat16, triton-lang/triton#11584), so the
bfloat16 and large-shape checks run only on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")  # under the interpreter without CUDA (tests/conftest.py)

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.kernels.triton_attention import TritonPagedAttention, triton_available
from conveyor.models.attention import (
    AttentionMetadata,
    EagerAttention,
    TorchPagedAttention,
    build_metadata,
)
from tests.kernels.precision import examples

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton cannot run here")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (start_pos, new tokens) per sequence, decodes first: decodes at contexts 1, 7 and 13, a
# fresh prompt of 9, a chunk of 5 after 6 cached and a chunk of 19 after 20 cached.
MIXED = [(0, 1), (6, 1), (12, 1), (0, 9), (6, 5), (20, 19)]


class Step(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    window: int | None  # the one build_metadata was given: backend and reference must agree


def random_step(
    seed: int,
    schedule: list[tuple[int, int]],
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Step:
    """A step over `schedule` with every sequence on shuffled blocks of a random cache."""
    g = torch.Generator().manual_seed(seed)
    needs = [-(-(start + n) // block_size) for start, n in schedule]
    num_blocks = sum(needs) + 2  # two blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in needs:
        tables.append(perm[used : used + n])
        used += n
    starts, news = [s for s, _ in schedule], [n for _, n in schedule]
    # The masks are for the reference, which runs in float32.
    meta = build_metadata(tables, starts, news, block_size, DEVICE, window)
    tokens = sum(news)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    cache = randn(2, num_blocks * block_size, kv_heads, head_dim)
    return Step(randn(tokens, heads, head_dim), randn(tokens, kv_heads, head_dim),
                randn(tokens, kv_heads, head_dim), cache, meta, head_dim**-0.5, window)


def check(step: Step, split_len: int | None = None, tol: float = 2e-5, softcap: float = 0.0,
          sinks: torch.Tensor | None = None, merge: bool = False) -> None:
    """The Triton backend's output and written cache match the float32 reference's (with soft
    caps or sinks: the torch backend's explicit products, `EagerAttention`)."""
    ref_cache = step.cache.float()
    reference = TorchPagedAttention() if not softcap and sinks is None else EagerAttention(softcap)
    if sinks is not None:
        reference.sinks = sinks.float()
    ref = reference.forward(step.q.float(), step.k.float(), step.v.float(), ref_cache, step.meta, step.scale)
    cache = step.cache.clone()
    backend = TritonPagedAttention(step.window, split_len, merge_splits=merge, softcap=softcap)
    backend.sinks = sinks
    out = backend.forward(step.q, step.k, step.v, cache, step.meta, step.scale)
    assert out.dtype == step.q.dtype and out.shape == step.q.shape
    assert torch.equal(cache.float(), ref_cache)  # the write kernel put every K/V where the reference did
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(4, 2, 16, 4), (4, 4, 32, 16), (6, 2, 24, 1), (8, 1, 16, 3)],
    ids=["gqa", "mha", "head_dim_24_block_1", "mqa_block_3"],
)
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_mixed_step_matches_reference(heads, kv_heads, head_dim, block_size, window):
    step = random_step(heads + block_size, MIXED, heads, kv_heads, head_dim, block_size, window)
    check(step)


@pytest.mark.parametrize("window", [None, 100])
def test_long_decodes_split_over_the_context(window):
    # Contexts up to 700 in splits of 64 positions: up to 11 splits, some of them empty for
    # the shorter sequences or wholly before the window.
    schedule = [(699, 1), (300, 1), (64, 1), (0, 1), (40, 7)]
    step = random_step(7, schedule, block_size=16, window=window)
    check(step, split_len=64)
    check(step)  # one split: the first kernel writes the output itself


def test_decodes_only_and_prefills_only():
    check(random_step(1, [(3, 1), (17, 1)]))
    for window in (None, 9):  # several query tiles per sequence
        step = random_step(2, [(0, 70), (33, 40)], block_size=16, window=window)
        assert step.meta.num_decodes == 0
        check(step)


def test_a_token_trees_span_attends_under_its_mask():
    """A speculative step's token tree (a decode, the tree's rows as a span, a chunk after it):
    the tree's rows take the torch reference's attention under the tree's mask, the rest the
    kernels'. `TorchPagedAttention` itself is held to a plain decode of each branch in
    tests/models/test_token_tree.py."""
    from conveyor.core.speculative import TokenTree

    tree = TokenTree.parse([(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 1, 0)])
    schedule = [(9, 1), (13, 1 + tree.num_nodes), (20, 6)]
    step = random_step(11, schedule, block_size=4)
    tables = [[int(b) for b in t] for t in step.meta.prefill_blocks.tolist()]
    first = step.meta.decode_blocks.tolist()[0]
    meta = build_metadata([first, *tables], [s for s, _ in schedule], [n for _, n in schedule], 4, DEVICE,
                          trees=[None, tree, None])
    assert meta.prefills[0].tree and not meta.prefills[1].tree
    check(step._replace(meta=meta))


def test_decodes_along_branch_paths_take_the_reference():
    """An EAGLE head's token-tree rows (one-token decodes reading their branch's positions,
    `path_decodes`): the Triton backend gives the torch reference's attention for them."""
    from conveyor.models.attention import path_decodes

    step = random_step(12, [(22, 1), (22, 1), (22, 1), (9, 1)], block_size=4)
    t = [[int(b) for b in row] for row in step.meta.decode_blocks.tolist()]
    # Three rows of one table after a root at 19: two siblings at depth 1 written at 20 and 21,
    # a child of the second at depth 2 written at 22 (it skips the first sibling); a plain decode.
    meta = path_decodes([t[0], t[0], t[0], t[3]], [20, 20, 21, 9], [20, 21, 22, 9], [[20], [21], [21, 22], []], 4,
                        DEVICE)
    assert meta.decode_path_lens.tolist() == [1, 1, 2, 0]
    check(step._replace(meta=meta))


def test_prefill_blocks_cover_each_prefill():
    meta = random_step(3, MIXED, block_size=4).meta
    assert meta.prefill_blocks is not None
    assert meta.prefill_blocks.shape == (3, 10)  # the longest prefill: 39 positions in 10 blocks
    for row, span in zip(meta.prefill_blocks, meta.prefills, strict=True):
        if span.context_blocks is not None:
            assert torch.equal(row[: len(span.context_blocks)], span.context_blocks)
    assert random_step(3, [(5, 1)]).meta.prefill_blocks is None


def test_strided_views_of_a_fused_projection():
    """q/k/v as the model passes them: head slices of one [T, heads + 2 kv_heads, d] tensor."""
    step = random_step(4, MIXED, heads=4, kv_heads=2)
    qkv = torch.cat((step.q, step.k, step.v), dim=1)
    fused = step._replace(q=qkv[:, :4], k=qkv[:, 4:6], v=qkv[:, 6:])
    assert not fused.q.is_contiguous()
    check(fused)


def test_float16_accumulates_in_float32():
    check(random_step(5, MIXED, window=6, dtype=torch.float16), tol=2e-3)


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_on_gpu(dtype, tol):
    schedule = [(s, 1) for s in (0, 100, 1000, 4095)] + [(0, 300), (512, 129)]
    for window, split_len in ((None, None), (256, 512)):
        step = random_step(6, schedule, 32, 8, 128, 16, window, dtype)
        check(step, split_len, tol=tol)


def test_write_kernel_skips_padding_slots():
    step = random_step(8, [(0, 3)])
    slots = step.meta.slot_mapping.clone()
    slots[1] = -1
    cache = step.cache.clone()
    TritonPagedAttention()._write(step.k, step.v, cache, slots)
    expected = step.cache.clone()
    for t in (0, 2):
        expected[0, slots[t]], expected[1, slots[t]] = step.k[t], step.v[t]
    assert torch.equal(cache, expected)


def test_rejects_what_the_kernels_cannot_do():
    step = random_step(9, [(0, 2)])
    backend = TritonPagedAttention()
    with pytest.raises(TypeError, match="share one of"):
        backend.forward(step.q.double(), step.k, step.v, step.cache, step.meta, step.scale)
    big = random_step(9, [(0, 2)], head_dim=320)
    with pytest.raises(ValueError, match="head_dim 320"):
        backend.forward(big.q, big.k, big.v, big.cache, big.meta, big.scale)


@st.composite
def schedules(draw: st.DrawFn) -> list[tuple[int, int]]:
    decodes = draw(st.lists(st.integers(0, 90), max_size=3))
    prefills = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(2, 24)), max_size=3))
    if not decodes and not prefills:
        decodes = [draw(st.integers(0, 90))]
    return [(s, 1) for s in decodes] + prefills


@settings(max_examples=examples(15), deadline=None)
@given(
    schedule=schedules(),
    shape=st.sampled_from([(4, 2, 16), (2, 2, 16), (3, 1, 32)]),
    block_size=st.sampled_from([1, 2, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 30)),
    split_len=st.sampled_from([None, 64]),
    seed=st.integers(0, 2**16),
)
def test_random_schedules_match_reference(schedule, shape, block_size, window, split_len, seed):
    heads, kv_heads, head_dim = shape
    check(random_step(seed, schedule, heads, kv_heads, head_dim, block_size, window), split_len)


def decodes_step(seed: int, contexts: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                 window: int | None, dtype: torch.dtype) -> Step:
    """A step of decodes only: sequence i holds contexts[i] tokens, the last of them new."""
    return random_step(seed, [(c - 1, 1) for c in contexts], heads, kv_heads, head_dim, block_size, window, dtype)


@settings(max_examples=examples(20), deadline=None)
@given(
    contexts=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    shape=st.sampled_from([(4, 2, 16), (2, 2, 16), (3, 1, 32), (8, 2, 24)]),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 200)),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_merged_splits_match_the_reduce_launch(contexts, shape, block_size, window, dtype, seed):
    """With `merge_splits`, the last split of each (sequence, kv head) to finish merges the
    splits in the decode launch itself: the same output, bit for bit, as the reduce launch,
    and every counter back at zero for the next launch."""
    heads, kv_heads, head_dim = shape
    step = decodes_step(seed, contexts, heads, kv_heads, head_dim, block_size, window, dtype)
    outs = []
    for merge in (False, True):
        backend = TritonPagedAttention(window, decode_split_len=64, merge_splits=merge)
        cache = step.cache.clone()
        outs.append(backend.forward(step.q, step.k, step.v, cache, step.meta, step.scale))
        if merge and max(contexts) > 64:  # more than one split: the counters were used
            assert backend.counters.current is not None and not backend.counters.current.any()
    assert torch.equal(outs[0], outs[1])
    check(step, split_len=64, tol=2e-5 if dtype == torch.float32 else 2e-3)


def test_merge_counters_outgrown_stay_alive_for_captured_graphs():
    """A step that needs more counters than the buffer holds gets a larger one; the old one,
    which a captured CUDA graph may still read, is kept, not freed."""
    backend = TritonPagedAttention(None, decode_split_len=64, merge_splits=True)
    counters = backend.counters
    small = counters.get(8, DEVICE)
    assert counters.get(1000, DEVICE) is small  # within the first 1024
    big = counters.get(4096, DEVICE)
    assert big.numel() >= 4096 and not big.any()
    assert len(counters.retired) == 1 and counters.retired[0] is small


def rope_tables(seed: int, tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(tokens, 1, head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 50
    return angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


@settings(max_examples=examples(20), deadline=None)
@given(
    contexts=st.lists(st.integers(1, 200), min_size=1, max_size=4),
    shape=st.sampled_from([(4, 2, 16), (2, 2, 16), (3, 1, 32), (8, 2, 24)]),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 150)),
    split_len=st.sampled_from([None, 64]),
    merge=st.booleans(),
    padding=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_decodes_with_rope_and_kv_write_in_the_attention_launch(
    contexts, shape, block_size, window, split_len, merge, padding, dtype, seed
):
    """`attend_decodes_rope` (RoPE, the K/V write and the attention in one launch) gives the
    output and the cache of `rope_write_kv_` followed by `attend_cached`, bit for bit, leaves
    the projection's output as it was, and writes nothing for a padding row (slot -1)."""
    from conveyor.kernels.triton_fused import rope_write_kv_

    heads, kv_heads, head_dim = shape
    step = decodes_step(seed, contexts, heads, kv_heads, head_dim, block_size, window, dtype)
    qkv = torch.cat((step.q, step.k, step.v), dim=1)
    cos, sin = rope_tables(seed, len(contexts), head_dim, dtype)
    meta = step.meta
    if padding:
        meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.clone())
        meta.slot_mapping[0] = -1
    backend = TritonPagedAttention(window, split_len, merge_splits=merge)

    want_qkv, want_cache = qkv.clone(), step.cache.clone()
    rope_write_kv_(want_qkv, cos, sin, heads, want_cache, meta.slot_mapping)
    want = backend.attend_cached(want_qkv[:, :heads], want_cache, meta, step.scale)
    got_qkv, got_cache = qkv.clone(), step.cache.clone()
    got = backend.attend_decodes_rope(got_qkv, cos, sin, got_cache, meta, step.scale)
    assert torch.equal(got_qkv, qkv)
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(got, want)


def test_decodes_with_rope_takes_decodes_only():
    step = random_step(10, MIXED)
    qkv = torch.cat((step.q, step.k, step.v), dim=1)
    cos, sin = rope_tables(10, qkv.shape[0], 16, torch.float32)
    with pytest.raises(ValueError, match="decodes only"):
        TritonPagedAttention().attend_decodes_rope(qkv, cos, sin, step.cache, step.meta, step.scale)


@needs_cuda
def test_one_launch_decodes_replayed_in_a_cuda_graph():
    """On a GPU, where the splits of a launch really run at once: the one-launch decode (RoPE,
    the K/V write, the attention, the splits merged by the last to finish) captured in a CUDA
    graph and replayed over changing contexts gives the two-launch path's output and cache at
    every replay, and leaves every counter at zero (the graph never zeroes them itself)."""
    from conveyor.kernels.triton_fused import rope_write_kv_

    heads, kv_heads, head_dim, block, n, width = 32, 8, 64, 16, 4, 64
    dtype, dev = torch.bfloat16, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    tables = torch.arange(n * width, device=dev).view(n, width)
    cache = torch.randn(2, n * width * block, kv_heads, head_dim, device=dev, generator=g).to(dtype)
    qkv = torch.empty(n, heads + 2 * kv_heads, head_dim, device=dev, dtype=dtype)
    cos = torch.empty(n, 1, head_dim // 2, device=dev, dtype=dtype)
    sin = torch.empty_like(cos)
    lens = torch.ones(n, dtype=torch.long, device=dev)
    slots = torch.zeros(n, dtype=torch.long, device=dev)
    meta = AttentionMetadata(block_size=block, positions=lens - 1, slot_mapping=slots, num_decodes=n,
                             decode_blocks=tables, decode_context_lens=lens)
    merged, two_launch = TritonPagedAttention(merge_splits=True), TritonPagedAttention()

    def fill(trial: int) -> None:
        gen = torch.Generator().manual_seed(trial)
        contexts = torch.randint(1, width * block + 1, (n,), generator=gen)
        lens.copy_(contexts)
        last = contexts - 1
        slots.copy_(tables.cpu().gather(1, (last // block)[:, None])[:, 0] * block + last % block)
        qkv.copy_(torch.randn(qkv.shape, generator=gen))
        angles = torch.rand(cos.shape, generator=gen) * 50
        cos.copy_(angles.cos())
        sin.copy_(angles.sin())

    fill(0)
    merged.attend_decodes_rope(qkv, cos, sin, cache.clone(), meta, 0.125)  # compiles, allocates the counters
    graph_cache = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = merged.attend_decodes_rope(qkv, cos, sin, graph_cache, meta, 0.125)
    for trial in range(1, 40):
        fill(trial)
        graph_cache.copy_(cache)
        graph.replay()
        want_cache, want_qkv = cache.clone(), qkv.clone()
        rope_write_kv_(want_qkv, cos, sin, heads, want_cache, slots)
        want = two_launch.attend_cached(want_qkv[:, :heads], want_cache, meta, 0.125)
        torch.cuda.synchronize()
        assert torch.equal(graph_cache, want_cache)
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-3)
        assert merged.counters.current is not None and not merged.counters.current.any()


@settings(max_examples=examples(12), deadline=None)
@given(
    schedule=schedules(),
    shape=st.sampled_from([(4, 2, 16), (3, 1, 32)]),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 30)),
    split=st.sampled_from([(None, False), (64, False), (64, True)]),
    kind=st.sampled_from(["softcap", "sinks", "both"]),
    seed=st.integers(0, 2**16),
)
def test_soft_caps_and_sinks_match_the_explicit_reference(schedule, shape, block_size, window, split, kind, seed):
    """Gemma 2's capped scores and gpt-oss's sinks in the kernels: decodes in one split, in
    several merged by the reduce launch or by the last split, prompts and chunks, windows; a
    cap of 0.5 (scores up to about 4 here: it bites) and sinks around the scores' size."""
    heads, kv_heads, head_dim = shape
    step = random_step(seed, schedule, heads, kv_heads, head_dim, block_size, window)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)).to(DEVICE) * 2
    split_len, merge = split
    check(step, split_len, softcap=0.5 if kind != "sinks" else 0.0, sinks=None if kind == "softcap" else sinks,
          merge=merge)


def test_a_cap_and_sinks_change_the_output():
    """What the test above would miss if the kernels ignored them."""
    step = random_step(11, MIXED)
    plain = TritonPagedAttention().forward(step.q, step.k, step.v, step.cache.clone(), step.meta, step.scale)
    capped = TritonPagedAttention(softcap=0.5).forward(step.q, step.k, step.v, step.cache.clone(), step.meta,
                                                        step.scale)
    sunk = TritonPagedAttention()
    sunk.sinks = torch.full((4,), 1.0, device=DEVICE)
    with_sinks = sunk.forward(step.q, step.k, step.v, step.cache.clone(), step.meta, step.scale)
    assert (plain - capped).abs().max() > 0.05 and (plain - with_sinks).abs().max() > 0.05


@pytest.mark.parametrize(("length", "block_size", "dtype"), [(37, 4, torch.float32), (150, 16, torch.float16)])
def test_cross_attention_is_the_references(length, block_size, dtype):
    """An encoder-decoder's cross-attention (`cross`: Whisper's): every row of a sequence over all
    `length` encoder positions in the blocks of its cross table (shuffled, the last one partly
    used), unmasked; the Triton decode kernel's, the torch reference's and the native kernel's
    (where built) equal a softmax over the gathered keys and values."""
    from conveyor.kernels import paged_decode_attention
    from conveyor.models.attention import CpuPagedAttention, CrossMetadata

    g = torch.Generator().manual_seed(length)
    heads, kv_heads, head_dim = 4, 4, 16
    pages = -(-length // block_size)
    rows = [(0, 1), (1, 4), (4, 6)]  # a decode, a prompt of 3, a chunk of 2
    blocks = torch.randperm(len(rows) * pages + 3, generator=g)
    cache = torch.randn(2, (len(rows) * pages + 3) * block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = blocks[: len(rows) * pages].view(len(rows), pages)
    q = torch.randn(6, heads, head_dim, generator=g).to(dtype)
    row_tables = torch.cat([tables[i : i + 1].expand(b - a, -1) for i, (a, b) in enumerate(rows)])
    cross = CrossMetadata(rows, tables.to(DEVICE), row_tables.contiguous().to(DEVICE),
                          torch.full((6,), length, dtype=torch.int64, device=DEVICE), length, block_size)
    want = torch.empty(6, heads, head_dim, dtype=torch.float64)
    for i, (a, b) in enumerate(rows):
        slots = (tables[i][:, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]
        k, v = cache[0][slots].double(), cache[1][slots].double()  # [length, kv_heads, d]
        scores = torch.einsum("thd,lhd->htl", q[a:b].double(), k) * 0.25
        want[a:b] = torch.einsum("htl,lhd->thd", torch.softmax(scores, -1), v)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    got = TritonPagedAttention().cross(q.to(DEVICE), cache.to(DEVICE), cross, 0.25)
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=tol)
    if DEVICE.type == "cpu":
        ref = TorchPagedAttention().cross(q.float(), cache, cross, 0.25)
        torch.testing.assert_close(ref.double(), want, rtol=0, atol=tol)
        kernel = paged_decode_attention()
        if kernel is not None:
            native = CpuPagedAttention(kernel).cross(q.float(), cache, cross, 0.25)
            torch.testing.assert_close(native.double(), want, rtol=0, atol=tol)
