"""The fused GEMVs (a projection with its norm, SiLU × up or residual add folded in) against the
torch ops they replace, and a model whose decode steps run through them against the plain one.

Without CUDA they run on CPU tensors under Triton's interpreter, in float32, float16 and
bfloat16. The reference multiplies in float32 and rounds once, as cuBLAS does; the kernel sums
in another order, so half precision may part by an ulp where a sum falls near a rounding tie.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # under the interpreter without CUDA (tests/conftest.py)

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.kernels.triton_gemv import MAX_ROWS, blocks, linear, triton_available
from conveyor.models.llama import RMSNorm
from tests.kernels.precision import close, examples

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton cannot run here")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w.T` summed in float32 and rounded once to x's dtype."""
    return (x.double() @ w.double().T).float().to(x.dtype)


def reference(x, w, norm, eps, silu_mul, residual):
    """The torch path's stages, each rounded to the model dtype as the model rounds them."""
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    if norm is not None:
        module = RMSNorm(x.shape[1], eps).to(x.device, x.dtype)
        module.weight.data.copy_(norm)
        x = module(x)
    y = matmul(x, w)
    return y if residual is None else residual + y


@settings(max_examples=examples(40), deadline=None)
@given(rows=st.integers(1, MAX_ROWS), n=st.integers(1, 300), k=st.integers(1, 700),
       stage=st.sampled_from(["plain", "norm", "silu_mul", "residual", "silu_mul+residual"]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 10_000))
def test_gemv_matches_the_torch_stages(rows, n, k, stage, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    silu = stage.startswith("silu_mul")
    x = torch.randn(rows, 2 * k if silu else k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    norm = torch.rand(k, generator=g).to(dtype).to(DEVICE) + 0.5 if stage == "norm" else None
    residual = torch.randn(rows, n, generator=g).to(dtype).to(DEVICE) if stage.endswith("residual") else None
    got = linear(x, w, norm=norm, eps=1e-5, silu_mul=silu, residual=residual)
    want = reference(x, w, norm, 1e-5, silu, residual)
    assert got.shape == (rows, n) and got.dtype == dtype
    # Outputs are about 1 in size; a prologue's rounding may part by an ulp on an input,
    # which moves a sum by about that ulp over sqrt(k): two ulps of 1 bound it.
    tol = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@settings(max_examples=examples(20), deadline=None)
@given(rows=st.integers(1, MAX_ROWS), n=st.integers(1, 200), k=st.integers(1, 300),
       stage=st.sampled_from(["plain", "norm", "silu_mul+residual"]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 10_000))
def test_the_matrix_product_path_matches_the_torch_stages(rows, n, k, stage, dtype, seed):
    """`Config(dot=True)`: each K tile as a matrix product of the (padded) rows and the weight
    tile, in every dtype, against the torch stages as `test_gemv_matches_the_torch_stages`."""
    from conveyor.kernels.triton_gemv import Config

    g = torch.Generator().manual_seed(seed)
    silu = stage.startswith("silu_mul")
    x = torch.randn(rows, 2 * k if silu else k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    norm = torch.rand(k, generator=g).to(dtype).to(DEVICE) + 0.5 if stage == "norm" else None
    residual = torch.randn(rows, n, generator=g).to(dtype).to(DEVICE) if silu else None
    got = linear(x, w, norm=norm, eps=1e-5, silu_mul=silu, residual=residual, config=Config(16, 64, dot=True))
    want = reference(x, w, norm, 1e-5, silu, residual)
    tol = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", ["norm", "silu_mul", "residual", "silu_mul+residual"])
def test_stages_round_as_torch_does(dtype, stage):
    """Through an identity weight each output is one input as the prologue made it (a sum of
    one term is exact), plus the residual: the roundings themselves, compared ulp by ulp."""
    g = torch.Generator().manual_seed(len(stage))
    rows, k = 5, 96
    silu = stage.startswith("silu_mul")
    x = (torch.randn(rows, 2 * k if silu else k, generator=g) * 2).to(dtype).to(DEVICE)
    w = torch.eye(k).to(dtype).to(DEVICE)
    norm = torch.rand(k, generator=g).to(dtype).to(DEVICE) + 0.5 if stage == "norm" else None
    residual = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE) if stage.endswith("residual") else None
    got = linear(x, w, norm=norm, eps=1e-5, silu_mul=silu, residual=residual)
    close(got, reference(x, w, norm, 1e-5, silu, residual), max_ulps=1, exact_share=0.97)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_llama_shaped_projections(dtype, rows):
    """The four projections of a layer at widths that take several programs and K tiles,
    chained as `DecoderLayer.forward_gemv` chains them."""
    g = torch.Generator().manual_seed(rows)
    hidden, inter, qkv = 256, 640, 384
    make = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dtype).to(DEVICE)  # noqa: E731
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)
    ln1, ln2 = (torch.rand(hidden, generator=g).to(dtype).to(DEVICE) + 0.5 for _ in range(2))
    w_qkv, w_o, w_gu, w_down = make(qkv, hidden), make(hidden, qkv), make(2 * inter, hidden), make(hidden, inter)
    steps = [
        (w_qkv, dict(norm=ln1, eps=1e-6)),
        (w_o, dict(residual=x)),
        (w_gu, dict(norm=ln2, eps=1e-6)),
        (w_down, dict(silu_mul=True, residual=x)),
    ]
    inp = {0: x, 1: make(rows, qkv), 2: x, 3: make(rows, 2 * inter)}
    for i, (w, kw) in enumerate(steps):
        got = linear(inp[i], w, **kw)
        want = reference(inp[i], w, kw.get("norm"), kw.get("eps", 0.0), kw.get("silu_mul", False), kw.get("residual"))
        tol = 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_blocks_keep_tiles_small_and_programs_many(monkeypatch):
    from conveyor.kernels import triton_gemv

    monkeypatch.setattr(triton_gemv, "_programs_wanted", lambda: 2 * 132)  # an H100's SMs
    for rows in range(1, MAX_ROWS + 1):
        for n, k in [(3072, 2048), (2048, 8192), (16384, 2048), (128256, 2048), (5, 3)]:
            bm, bn, bk = blocks(rows, n, k)
            assert bm >= rows and bm * bn * bk <= 8192 and 16 <= bk <= 2048 and 4 <= bn <= 32
    assert blocks(1, 2048, 8192)[1:] == (4, 2048)  # down_proj: 512 programs, long runs of K
    assert blocks(1, 128256, 2048)[1] == 32  # the LM head: wider blocks


def test_too_many_rows_is_refused():
    x = torch.zeros(MAX_ROWS + 1, 16, device=DEVICE)
    with pytest.raises(AssertionError):
        linear(x, torch.zeros(8, 16, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_forward_through_the_gemvs(tiny_models, dtype, monkeypatch):
    """The whole model with `_use_triton_gemv` against the same weights without it: the same
    greedy tokens over prefills (more rows: the other path) and decodes of a paged cache, one
    sequence and several at once."""
    from conveyor import LLM, SamplingParams

    path = str(tiny_models["llama"])
    prompts = [[5 + (i * 7 + j * 3) % 300 for j in range(3 + 4 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    rows: list[int] = []  # of each GEMV the model calls
    monkeypatch.setenv("CONVEYOR_GEMV_MAX_ROWS", str(MAX_ROWS))  # the few-row path too (opt-in)
    for on in (False, True):
        monkeypatch.setenv("CONVEYOR_TRITON_GEMV", "1" if on else "0")
        llm = LLM(path, device=str(DEVICE), dtype=str(dtype).removeprefix("torch."), num_kv_blocks=128,
                  block_size=4, enforce_eager=True)
        model = llm.engine.runner.model
        if DEVICE.type == "cpu":
            model._use_triton_gemv(dtype)  # on CUDA prepare_for_inference has done it
        assert (model.gemv is not None) == on
        if on:
            model.gemv = lambda x, *a, **kw: rows.append(x.shape[0]) or linear(x, *a, **kw)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        out.append(llm.generate([prompts[-1]], params, use_tqdm=False)[0].outputs[0].token_ids)  # batch 1
        runs.append(out)
        if on:  # decodes of six sequences and of one took the GEMVs
            assert {1, 6} <= set(rows) and max(rows) <= MAX_ROWS
    plain, gemv = runs
    agree = sum(a == b for a, b in zip(plain, gemv, strict=True))
    assert agree >= len(plain) - 1, f"{agree}/{len(plain)} prompts agree"


def test_a_model_with_projection_biases_keeps_the_other_path(tiny_models, monkeypatch):
    from conveyor import LLM

    monkeypatch.setenv("CONVEYOR_TRITON_GEMV", "1")
    llm = LLM(str(tiny_models["qwen2"]), device=str(DEVICE), dtype="bfloat16", num_kv_blocks=16, enforce_eager=True)
    model = llm.engine.runner.model
    model._use_triton_gemv(torch.bfloat16)
    assert model.gemv is None


def test_the_model_takes_the_gemvs_at_one_row_unless_told_more(tiny_models, monkeypatch):
    """By default only batch-1 steps run through the GEMVs (at 2-8 rows they lost to cuBLAS on
    an H100); CONVEYOR_GEMV_MAX_ROWS opts the few-row path in, and a value out of 1-8 is refused
    with the variable's name."""
    from conveyor import LLM
    from conveyor.kernels.triton_gemv import model_max_rows

    monkeypatch.delenv("CONVEYOR_GEMV_MAX_ROWS", raising=False)
    assert model_max_rows() == 1
    monkeypatch.setenv("CONVEYOR_TRITON_GEMV", "1")
    llm = LLM(str(tiny_models["llama"]), device=str(DEVICE), dtype="bfloat16", num_kv_blocks=16, enforce_eager=True)
    model = llm.engine.runner.model
    if DEVICE.type == "cpu":
        model._use_triton_gemv(torch.bfloat16)
    assert model.gemv is not None and model.gemv_max_rows == 1
    monkeypatch.setenv("CONVEYOR_GEMV_MAX_ROWS", "4")
    assert model_max_rows() == 4
    for bad in ("0", "9", "two"):
        monkeypatch.setenv("CONVEYOR_GEMV_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="CONVEYOR_GEMV_MAX_ROWS"):
            model_max_rows()


def test_gemvs_are_opt_in(monkeypatch):
    from conveyor.kernels.triton_gemv import enabled

    monkeypatch.delenv("CONVEYOR_TRITON_GEMV", raising=False)
    assert not enabled()
    monkeypatch.setenv("CONVEYOR_TRITON_GEMV", "1")
    assert enabled()
    monkeypatch.setenv("CONVEYOR_TRITON", "0")
    assert not enabled()


@settings(max_examples=examples(25), deadline=None)
@given(rows=st.integers(1, MAX_ROWS), n=st.integers(1, 200), k=st.integers(1, 400),
       block_n=st.sampled_from([1, 2, 4, 8, 16, 32]), block_k=st.sampled_from([16, 32, 64, 128, 256]),
       warps=st.sampled_from([1, 2, 4, 8]), prefetch=st.booleans(), stage=st.sampled_from(["norm", "silu_mul+residual"]),
       seed=st.integers(0, 10_000), dot=st.booleans())
def test_any_config_gives_the_same_result(rows, n, k, block_n, block_k, warps, prefetch, stage, seed, dot):
    """The sweep on a GPU (`gpu_speed.py --parts gemv`) may pick any config: each must compute
    the same projection, K tiles that end short of K and column blocks past N included, the
    tiles reduced in registers or multiplied as matrix products (`dot`, rows padded to 16)."""
    from conveyor.kernels.triton_gemv import Config

    if dot:
        block_n = max(block_n, 16)
    g = torch.Generator().manual_seed(seed)
    silu = stage.startswith("silu_mul")
    x = torch.randn(rows, 2 * k if silu else k, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).to(DEVICE)
    norm = torch.rand(k, generator=g).to(torch.bfloat16).to(DEVICE) + 0.5 if stage == "norm" else None
    residual = torch.randn(rows, n, generator=g).to(torch.bfloat16).to(DEVICE) if silu else None
    got = linear(x, w, norm=norm, eps=1e-5, silu_mul=silu, residual=residual, config=Config(block_n, block_k, warps, prefetch=prefetch, dot=dot))
    want = reference(x, w, norm, 1e-5, silu, residual)
    tol = 2 * torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_the_config_table_is_read_saved_and_used(tmp_path, monkeypatch):
    from conveyor.kernels import triton_gemv
    from conveyor.kernels.triton_gemv import (
        Config,
        config_for,
        load_configs,
        save_configs,
        set_configs,
    )

    monkeypatch.setattr(triton_gemv, "_configs", {})
    monkeypatch.setattr(triton_gemv, "_configs_loaded", False)
    table = {(1, 3072, 2048): Config(16, 512, 8, 1, prefetch=True), (4, 2048, 8192): Config(4, 256, 4)}
    save_configs(table, tmp_path / "t.json")
    assert load_configs(tmp_path / "t.json") == table
    # CONVEYOR_GEMV_CONFIGS is read at the first lookup; rows round up to a power of two.
    monkeypatch.setenv("CONVEYOR_GEMV_CONFIGS", str(tmp_path / "t.json"))
    assert config_for(1, 3072, 2048) == Config(16, 512, 8, 1, prefetch=True)
    assert config_for(3, 2048, 8192) == Config(4, 256, 4)
    heuristic = blocks(2, 3072, 2048)
    assert config_for(2, 3072, 2048) == Config(heuristic[1], heuristic[2])  # not in the table
    set_configs({})
    assert config_for(1, 3072, 2048) == Config(*blocks(1, 3072, 2048)[1:])


def test_a_config_is_validated():
    from conveyor.kernels.triton_gemv import Config

    for bad in [dict(block_n=3, block_k=64), dict(block_n=4, block_k=8), dict(block_n=4, block_k=100),
                dict(block_n=4, block_k=64, num_warps=3), dict(block_n=8, block_k=64, dot=True)]:
        with pytest.raises(ValueError):
            Config(**bad)


def test_pdl_is_opt_in_and_needs_hopper(monkeypatch):
    from conveyor.kernels.triton_gemv import pdl_enabled

    monkeypatch.delenv("CONVEYOR_TRITON_PDL", raising=False)
    assert not pdl_enabled()
    monkeypatch.setenv("CONVEYOR_TRITON_PDL", "1")
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    assert pdl_enabled() == hopper  # never under the interpreter


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper GPU or later")
@pytest.mark.parametrize("graphed", [False, True])
def test_pdl_chain_matches_the_plain_chain(graphed):
    """A layer's four GEMVs launched with programmatic dependent launch, each reading the one
    before's output: every GEMV waits for its input (`gdc_wait`) though its first weight tile
    was loaded before, so the chain's result is bit for bit the plain one, eager and graphed."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter, qkv, rows = 2048, 8192, 3072, 1
    make = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16) / s[-1] ** 0.5  # noqa: E731
    x = torch.randn(rows, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    ln = torch.rand(hidden, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5
    w_qkv, w_o, w_gu, w_down = make(qkv, hidden), make(hidden, qkv), make(2 * inter, hidden), make(hidden, inter)

    def chain(pdl: bool) -> torch.Tensor:
        h = x
        for _ in range(4):
            q = linear(h, w_qkv, norm=ln, eps=1e-5, pdl=pdl)
            h = linear(q, w_o, residual=h, pdl=pdl)
            gu = linear(h, w_gu, norm=ln, eps=1e-5, pdl=pdl)
            h = linear(gu, w_down, silu_mul=True, residual=h, pdl=pdl)
        return h

    want = chain(False)
    if not graphed:
        torch.testing.assert_close(chain(True), want, rtol=0, atol=0)
        return
    chain(True)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@settings(max_examples=examples(30), deadline=None)
@given(rows=st.integers(1, MAX_ROWS), n=st.integers(1, 1200), k=st.integers(1, 200),
       block_n=st.sampled_from([None, 4, 32, "dot"]), norm=st.booleans(), ties=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 10_000))
def test_the_lm_head_gemv_takes_the_argmax_in_the_same_launch(rows, n, k, block_n, norm, ties, dtype, seed):
    """`linear_argmax`: the logits are `linear`'s bit for bit, and the tokens are torch's argmax
    of those logits (the first column of a tie, across the programs' blocks too); the arrival
    counter is back at zero for the next launch, and the buffers given are the ones written."""
    from conveyor.kernels import triton_gemv
    from conveyor.kernels.triton_gemv import Config, linear_argmax

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    if ties:  # few distinct logits: the largest is in several columns, in several blocks
        w = torch.randint(-2, 3, (n, k), generator=g).to(dtype).to(DEVICE)
        x = x.sign()
    else:
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    gain = torch.rand(k, generator=g).to(dtype).to(DEVICE) + 0.5 if norm else None
    config = Config(16, 64, dot=True) if block_n == "dot" else Config(block_n, 64) if block_n else None
    out = torch.full((rows, n), 7.0, dtype=dtype, device=DEVICE)
    tokens = torch.full((rows,), -1, dtype=torch.long, device=DEVICE)
    logits, got = linear_argmax(x, w, norm=gain, eps=1e-5, config=config, out=out, tokens=tokens)
    assert logits is out and got is tokens
    assert torch.equal(logits, linear(x, w, norm=gain, eps=1e-5, config=config))
    assert torch.equal(got, logits.argmax(-1))
    counter = triton_gemv.ARGMAX_COUNTER.current
    assert counter is not None and counter.device.type == DEVICE.type and counter.item() == 0


@pytest.mark.parametrize("rows", [1, 3])
def test_the_argmax_merges_its_partials_a_block_at_a_time(rows, monkeypatch):
    """More programs than the merge reads at once: the blocks' maxima are taken in turns, and a
    tie between turns keeps the earlier column."""
    from conveyor.kernels import triton_gemv
    from conveyor.kernels.triton_gemv import Config, linear_argmax

    monkeypatch.setattr(triton_gemv, "ARGMAX_MERGE_BLOCK", 16)
    n = 300  # 75 programs of 4 columns: 5 turns of 16
    x = torch.ones(rows, 16, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(n, 16, dtype=torch.bfloat16, device=DEVICE)
    w[[170, 90, 299]] = 1.0  # the maximum in the 2nd, 3rd and 5th turns (programs 22, 42 and 74)
    w[17] = 0.5
    assert linear_argmax(x, w, config=Config(4, 16))[1].tolist() == [90] * rows
    w[90] = 0.0
    assert linear_argmax(x, w, config=Config(4, 16))[1].tolist() == [170] * rows


def gemv_engine(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """The tiny Llama in bfloat16 on the GEMV path, and the row counts its LM head's GEMV
    with the argmax (`gemv_head`) is called with."""
    from conveyor import LLM

    monkeypatch.setenv("CONVEYOR_TRITON_GEMV", "1")
    monkeypatch.setenv("CONVEYOR_GEMV_MAX_ROWS", str(MAX_ROWS))  # the few-row path too (opt-in)
    llm = LLM(str(tiny_models["llama"]), device=str(DEVICE), dtype="bfloat16", num_kv_blocks=128, block_size=4,
              enforce_eager=True)
    model = llm.engine.runner.model
    if DEVICE.type == "cpu":
        model._use_triton_gemv(torch.bfloat16)  # on CUDA prepare_for_inference has done it
    heads: list[int] = []
    head = model.gemv_head
    assert head is not None
    model.gemv_head = lambda x, *a, **kw: heads.append(x.shape[0]) or head(x, *a, **kw)
    return llm, heads


def test_the_model_folds_the_final_norm_lm_head_and_argmax_into_one_gemv(tiny_models, monkeypatch):
    """`forward_greedy` on the GEMV path (the final norm, the LM head and the argmax in one
    launch) against the model's own forward and LM head: logits within the ulp a folded norm
    may move them, tokens the argmax of the logits it returns."""
    from conveyor.models.attention import build_metadata

    llm, calls = gemv_engine(tiny_models, monkeypatch)
    model = llm.engine.runner.model
    caches = llm.engine.runner.kv_caches
    rows = 5
    meta = build_metadata([[i] for i in range(rows)], [0] * rows, [1] * rows, 4, DEVICE, None, torch.bfloat16)
    ids = torch.tensor([3, 50, 101, 7, 250], device=DEVICE)
    want = model.compute_logits(model(ids, meta.positions, caches, meta))
    logits = torch.empty_like(want)
    tokens = torch.empty(rows, dtype=torch.long, device=DEVICE)
    model.forward_greedy(ids, meta.positions, caches, meta, lambda lg, out: None, logits, tokens)
    assert calls == [rows]
    tol = 2 * torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(logits, want, rtol=tol, atol=tol * want.abs().max().item())
    assert torch.equal(tokens, logits.argmax(-1))


def test_graphed_decode_steps_through_the_gemv_head(tiny_models, monkeypatch):
    """The engine on the GEMV path with graphed decode steps (replayed eagerly on a CPU): each
    step's tokens come from the LM head's own argmax (`forward_greedy`), padded rows included,
    and agree with the eager GEMV path's (the folded final norm may move a logit by an ulp)."""
    from conveyor import SamplingParams
    from tests.runner.test_cuda_graphs import graphed

    prompts = [[5 + (i * 7 + j * 3) % 300 for j in range(3 + 4 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    runs = []
    for graph in (False, True):
        llm, heads = gemv_engine(tiny_models, monkeypatch)
        sizes = graphed(llm, max_batch=8, capture=False) if graph else []
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if graph:  # six decodes padded to eight rows, down to one
            assert 6 in sizes and 8 in heads and len(heads) == len(sizes)
        else:
            assert not heads
    agree = sum(a == b for a, b in zip(*runs, strict=True))
    assert agree >= len(prompts) - 1, f"{agree}/{len(prompts)} prompts agree"
