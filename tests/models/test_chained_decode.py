"""A speculative step through the native decode call (CPU float32): each sequence's guessed rows
run as one-token decodes of its table side by side (`chain_decodes`), all written before any
attends, so a step with guesses costs about what a decode step of as many rows costs.

Shown against the module path over the same step as prefill spans (hidden states, K/V written,
the streams an EAGLE-3 head reads), and end to end: n-gram and draft-model speculation in
float32 give the tokens of decoding one token a step, bit for bit at batch 1, with their
verification (and the draft's catch-up) steps in the native call.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.models import llama
from conveyor.models.attention import build_metadata, chain_decodes
from conveyor.runner.model_runner import ModelRunner
from tests.conftest import build_tiny_model
from tests.test_speculative import repetitive_requests


def native() -> bool:
    from conveyor.kernels import decode_layers

    return decode_layers() is not None


needs_kernel = pytest.mark.skipif(not native(), reason="native CPU kernels unavailable (no AVX2/FMA or no compiler)")
CPU = torch.device("cpu")


@pytest.fixture
def calls(monkeypatch):
    """Every native decode call of the test: (chained, rows, streams kept), counted."""
    seen: collections.Counter = collections.Counter()
    original = llama.FusedDecode.__call__

    def counted(self, input_ids, positions, kv_caches, meta, keep=None):
        seen[(meta.chained, input_ids.shape[0], keep is not None)] += 1
        return original(self, input_ids, positions, kv_caches, meta, keep)

    monkeypatch.setattr(llama.FusedDecode, "__call__", counted)
    return seen


def test_chain_decodes_gives_each_row_its_position_slot_and_context():
    tables = [[7, 2], [5, 9, 4]]
    meta = chain_decodes(tables, [3, 6], [1, 3], 4, CPU)
    assert meta.chained and meta.num_decodes == 4 and not meta.prefills
    assert meta.positions.tolist() == [3, 6, 7, 8]
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 9 * 4 + 2, 9 * 4 + 3, 4 * 4 + 0]
    assert meta.decode_context_lens.tolist() == [4, 7, 8, 9]
    assert meta.decode_blocks.tolist() == [[7, 2, 0], [5, 9, 4], [5, 9, 4], [5, 9, 4]]
    assert not build_metadata(tables, [3, 6], [1, 3], 4, CPU).chained


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window"])
def test_chained_rows_in_the_native_call_match_the_module_path_over_spans(tiny_models, tmp_path, family, kv_dtype):
    """One step of decodes and spans of 2-5 rows: the native call over the spans' rows as chained
    decodes gives the module path's hidden states and K/V over the same spans as prefills, and
    the residual streams it keeps are the module path's (`aux_layers`). Spans of few rows and of
    many (both regimes of the projections), one crossing a block, a sliding window of 5."""
    path = (build_tiny_model(tmp_path / "m", "mistral", seed=4, sliding_window=5) if family == "mistral-window"
            else tiny_models[family])
    model = LLM(str(path), dtype="float32", num_kv_blocks=16).engine.runner.model
    fused_path = model.fused_decode
    assert isinstance(fused_path, llama.FusedDecode)
    arch, bs = model.arch, 4
    g = torch.Generator().manual_seed(3)
    for num_new in ([1, 2], [3], [1, 1, 4, 2, 5], [5, 5, 5, 5, 5, 5, 4]):
        n = len(num_new)
        num_new = sorted(num_new)  # decodes first, as the runner orders a step
        starts = torch.randint(0, 30, (n,), generator=g).tolist()
        perm = torch.randperm(n * 12, generator=g).tolist()
        tables = [perm[i * 12 : (i + 1) * 12] for i in range(n)]
        caches = [torch.randn(2, n * 12 * bs, arch.num_kv_heads, arch.head_dim, generator=g).to(kv_dtype)
                  for _ in range(arch.num_layers)]
        ids = torch.randint(0, arch.vocab_size, (sum(num_new),), generator=g)
        chained = chain_decodes(tables, starts, num_new, bs, CPU, arch.sliding_window)
        spans = build_metadata(tables, starts, num_new, bs, CPU, arch.sliding_window)
        assert torch.equal(chained.positions, spans.positions) and torch.equal(chained.slot_mapping, spans.slot_mapping)
        assert fused_path.applies(ids.shape[0], chained, kv_dtype) and not fused_path.applies(ids.shape[0], spans, kv_dtype)
        ref_caches, module_caches = copy.deepcopy(caches), copy.deepcopy(caches)
        model.aux_layers = (0, 1, arch.num_layers - 1)
        try:
            with torch.inference_mode():
                got = model(ids, chained.positions, caches, chained)
                kept = model.aux_hidden
                model.fused_decode = None
                try:
                    ref = model(ids, spans.positions, ref_caches, spans)
                    ref_kept = model.aux_hidden
                    # the chained metadata through the modules (the CPU backend's decodes)
                    modules = model(ids, chained.positions, module_caches, chained)
                finally:
                    model.fused_decode = fused_path
        finally:
            model.aux_layers = ()
        # A float16 cache: a prefill attends to its own rows' K/V before they are rounded into
        # the cache, a decode reads them back rounded (as a step of one-token decodes always has).
        near = 1e-4 if kv_dtype == torch.float32 else 5e-3
        torch.testing.assert_close(got, ref, rtol=near, atol=near)
        torch.testing.assert_close(got, modules, rtol=1e-4, atol=1e-4)
        assert kept is not None and ref_kept is not None and kept.shape == (ids.shape[0], 3 * arch.hidden_size)
        torch.testing.assert_close(kept, ref_kept, rtol=near, atol=near)
        tol = 1e-5 if kv_dtype == torch.float32 else 1e-3
        for a, b in zip(caches, ref_caches, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def run(path, prompts, params, **options):
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return llm, [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture(scope="module")
def workload():
    prompts, params = repetitive_requests(16, seed=5)
    return prompts, [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
                     for p in params]


@needs_kernel
@pytest.mark.parametrize("guesses", [1, 3])
def test_ngram_verification_in_the_native_call_is_bit_exact_at_batch_1(tiny_models, workload, calls, guesses):
    """At batch 1 a verification step of up to 4 rows computes each row as a decode of one row
    does (every product streams its rows one by one), so the tokens and logprobs are those of
    decoding one token a step, bit for bit; and every step with guesses ran in the native call."""
    prompts, params = workload
    path = tiny_models["llama"]
    _, want = run(path, prompts, params, max_num_seqs=1)
    calls.clear()
    llm, got = run(path, prompts, params, max_num_seqs=1, speculative_method="ngram",
                   num_speculative_tokens=guesses, prompt_lookup_min=1)
    assert got == want
    sched = llm.engine.scheduler
    assert sched.num_accepted_tokens > 0
    chained = sum(c for (ch, _, _), c in calls.items() if ch)
    assert chained > 0 and all(rows <= 1 + guesses for (ch, rows, _) in calls if ch)


@needs_kernel
def test_ngram_at_batch_in_the_native_call_and_past_its_rows(tiny_models, workload, calls):
    """Many sequences' guesses in one native call give decoding's tokens (and logprobs within
    float32 rounding: products of more rows take register tiles); a step with more rows than
    the call takes runs as the module path's spans, still right."""
    prompts, params = workload
    path = tiny_models["llama"]
    _, want = run(path, prompts, params)
    for max_rows in (64, 9):
        calls.clear()
        llm = LLM(str(path), dtype="float32", num_kv_blocks=256, speculative_method="ngram",
                  num_speculative_tokens=4, prompt_lookup_min=1)
        llm.engine.runner.model.fused_decode.max_rows = max_rows
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert llm.engine.scheduler.num_accepted_tokens > 0
        chained = {rows for (ch, rows, _) in calls if ch}
        assert chained and max(chained) <= max_rows and max(chained) > 5


@needs_kernel
def test_a_draft_model_catches_up_in_the_native_call(tiny_models, workload, monkeypatch):
    """The model as its own draft, float32, batch 1: the draft's first step of a round (the
    tokens the last round accepted) runs as chained decodes, and as the draft computes each row
    as the model does, every guess is the model's own token and is accepted."""
    prompts, params = workload
    path = tiny_models["llama"]
    chains: collections.Counter = collections.Counter()
    original = ModelRunner._chains

    def counted(self, items, num_new, bare):
        ok = original(self, items, num_new, bare)
        if max(num_new) > 1:
            chains[(self.chain_max_span > 0, ok)] += 1
        return ok

    monkeypatch.setattr(ModelRunner, "_chains", counted)
    _, want = run(path, prompts, params, max_num_seqs=1)
    llm, got = run(path, prompts, params, max_num_seqs=1, speculative_method="draft_model",
                   speculative_model=str(path), num_speculative_tokens=3)
    assert got == want
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens == sched.num_draft_tokens
    assert llm.engine.drafter.runner.chain_max_span == 4
    assert chains[(True, True)] > 0  # the draft's catch-up steps
    assert chains[(False, True)] > 0  # the target's verification steps
