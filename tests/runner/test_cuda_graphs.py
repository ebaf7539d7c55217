"""Graphed decode steps: padded to a captured size, on fixed buffers, with a scratch block.

A CPU has no CUDA graphs, but the padded fixed-buffer forward the graphs replay runs eagerly
on it (`capture=False`): the tokens must equal the plain forward's, whatever the batch size and
padding. On a GPU the capture itself is checked against eager decoding.
"""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.runner.cuda_graphs import GraphedDecode, capture_sizes
from tests.test_engine import mixed_requests, tokens


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert all(b - a <= 8 for a, b in zip(capture_sizes(256), capture_sizes(256)[1:], strict=False))


def graphed(llm: LLM, max_batch: int, capture: bool) -> list[int]:
    """Give `llm`'s runner a GraphedDecode; returns the list the batch sizes it ran go into."""
    runner = llm.engine.runner
    max_blocks = -(-llm.engine.max_model_len // runner.block_size)
    graphs = GraphedDecode(runner.model, runner.kv_caches, runner.block_size, max_blocks, runner.scratch_block,
                           max_batch, capture=capture, greedy=runner.sampler.greedy, **runner.graph_layout())
    sizes: list[int] = []
    call = graphs.__call__

    class Counting:
        def applies(self, n: int, all_decodes: bool) -> bool:
            return graphs.applies(n, all_decodes)

        def __call__(self, input_ids, positions, slots, tables, *window, **rope):  # (a hybrid cache's groups)
            sizes.append(len(positions))
            return call(input_ids, positions, slots, tables, *window, **rope)

    runner.graphs = Counting()
    return sizes


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_fixed_buffer_decode_gives_the_same_tokens(tiny_models, async_scheduling):
    prompts, params = mixed_requests(24, seed=5)
    path = str(tiny_models["llama"])
    plain = LLM(path, dtype="float64", num_kv_blocks=256, block_size=4)
    want = tokens(plain.generate(prompts, params, use_tqdm=False))
    llm = LLM(path, dtype="float64", num_kv_blocks=256, block_size=4, async_scheduling=async_scheduling)
    sizes = graphed(llm, max_batch=12, capture=False)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    ran = set(sizes)
    assert max(ran) == 12 and any(n not in capture_sizes(12) for n in ran)  # padding happened
    # Steps of more than 12 decodes went the eager way.
    assert max(s.num_decode_tokens for s in llm.engine.step_trace if not s.num_prefill_tokens) > 12
    # Padded rows wrote only to the scratch block; the scheduler's blocks all came back.
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_greedy_step_takes_the_graphs_tokens_and_samples_nothing(tiny_models):
    """The graph runs through the LM head and the argmax: a graphed step of greedy requests
    calls no sampler at all; steps with prompts (eager) still do."""
    prompts, params = mixed_requests(16, seed=8)
    llm = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=256, block_size=4)
    want = tokens(llm.generate(prompts, params, use_tqdm=False))
    sizes = graphed(llm, max_batch=16, capture=False)
    sampler = llm.engine.runner.sampler
    calls: list[int] = []
    sample = sampler.sample
    sampler.sample = lambda logits, batch: calls.append(len(logits)) or sample(logits, batch)  # type: ignore[method-assign]
    before = len(llm.engine.step_trace)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    steps = list(llm.engine.step_trace)[before:]
    with_prompts = sum(1 for s in steps if s.num_prefill_tokens)
    assert len(sizes) > 10 and 0 < len(calls) <= with_prompts  # graphed steps: none of the sampler's calls


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampled_penalised_and_logprob_steps_read_the_graphs_logits(tiny_models, async_scheduling):
    """Steps that do not take the graph's argmax sample from the graph's logits: seeded
    draws, penalties and logprobs come out as on the plain path, and greedy rows beside them."""
    prompts, base = mixed_requests(20, seed=9)
    kinds = [dict(temperature=0.0), dict(temperature=0.0, logprobs=3), dict(temperature=0.9, top_k=30),
             dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=1.0, top_p=0.8, logprobs=0)]
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, seed=i, **kinds[i % len(kinds)])
              for i, p in enumerate(base)]
    path = str(tiny_models["llama"])
    runs = []
    for graph in (False, True):
        llm = LLM(path, dtype="float64", num_kv_blocks=256, block_size=4, async_scheduling=async_scheduling)
        sizes = graphed(llm, max_batch=8, capture=False) if graph else []
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        assert not graph or sizes
    assert runs[0] == runs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_match_eager_on_gpu(tiny_models):
    prompts, params = mixed_requests(40, seed=6)
    path = str(tiny_models["llama"])
    outs = []
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=512, enforce_eager=eager, cuda_graph_max_batch=32)
        assert (llm.engine.runner.graphs is None) == eager
        if not eager:
            assert llm.engine.runner.graphs.captured
        outs.append(tokens(llm.generate(prompts, [SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=True) for p in params], use_tqdm=False)))
    assert outs[0] == outs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kernels", ["default", "fused", "fused+gemv"])
def test_a_captured_graph_replays_the_forward_it_captured_on_gpu(tiny_models, kernels, monkeypatch):
    """In bfloat16 on each CUDA path: the captured graphs (LM head and argmax inside, the
    GEMV's own argmax on the GEMV path) give the tokens of the same fixed-buffer forward run
    eagerly, greedy and sampled requests together; the GEMV argmax's counter is back at zero."""
    from conveyor.kernels import triton_gemv

    monkeypatch.setenv("CONVEYOR_TRITON_FUSED", "1" if "fused" in kernels else "0")
    monkeypatch.setenv("CONVEYOR_TRITON_GEMV", "1" if "gemv" in kernels else "0")
    monkeypatch.setenv("CONVEYOR_GEMV_MAX_ROWS", "8")  # graphs of 2-8 rows through the GEMVs too (opt-in)
    prompts, base = mixed_requests(40, seed=10)
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, seed=i,
                             temperature=0.0 if i % 3 else 0.8) for i, p in enumerate(base)]
    outs = []
    for capture in (True, False):
        llm = LLM(str(tiny_models["llama"]), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                  cuda_graph_max_batch=32)
        runner = llm.engine.runner
        assert runner.graphs is not None and runner.graphs.captured
        assert (runner.model.gemv_head is not None) == ("gemv" in kernels)
        if not capture:
            graphed(llm, max_batch=32, capture=False)
        outs.append(tokens(llm.generate(prompts, params, use_tqdm=False)))
    assert outs[0] == outs[1]
    counter = triton_gemv.ARGMAX_COUNTER.current
    assert counter is None or not counter.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("eager", [False, True])
def test_launching_a_step_never_waits_for_the_device(tiny_models, eager):
    """Async scheduling prepares and launches step t+1 while the device runs step t, so nothing
    in `submit` may wait for the stream: torch's sync debug mode raises where anything does
    (a blocking copy to the device, a list index, `.item()`). Greedy and sampled requests,
    prompts and decodes; not penalties or logprobs, which read the device by design."""
    prompts, base = mixed_requests(24, seed=3)
    samplings = [dict(temperature=0.0), dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.9, seed=7),
                 dict(temperature=0.7, min_p=0.05)]
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, **samplings[i % len(samplings)])
              for i, p in enumerate(base)]
    llm = LLM(str(tiny_models["llama"]), device="cuda", dtype="bfloat16", num_kv_blocks=512, enforce_eager=eager,
              cuda_graph_max_batch=32, async_scheduling=True, max_num_batched_tokens=96)
    llm.generate(prompts, params, use_tqdm=False)  # compiles the Triton kernels first
    runner = llm.engine.runner
    submit = runner.submit
    kinds: set[str] = set()

    def strict(out):  # type: ignore[no-untyped-def]
        kinds.update("prompt" if len(s.token_ids) > 1 else "decode" for s in out.scheduled)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return submit(out)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.submit = strict
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert kinds == {"prompt", "decode"}
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory: pytest.TempPathFactory):
    """Gemma 2 (capped scores and logits, every other layer sliding) and Gemma 3 (per-layer
    windows, a local RoPE base), tiny, with windows of 6 tokens."""
    from tests.conftest import build_tiny_model
    from tests.models.test_gemma import GEMMA3_ROPE, SHAPE

    root = tmp_path_factory.mktemp("windowed")
    return {"gemma2": build_tiny_model(root / "g2", "gemma2", seed=3, attn_logit_softcapping=0.2,
                                       final_logit_softcapping=1.0, **SHAPE),
            "gemma3": build_tiny_model(root / "g3", "gemma3", seed=4, sliding_window_pattern=2,
                                       rope_parameters=GEMMA3_ROPE, **SHAPE)}


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_capped_and_windowed_models_decode_the_same_on_fixed_buffers(windowed_models, family):
    """The graphs' padded fixed-buffer forward of Gemma 2 (capped scores, capped logits, windows)
    and Gemma 3 (windows by layer, two RoPE bases): the plain forward's tokens, contexts past the
    window."""
    prompts, params = mixed_requests(16, seed=11)
    path = str(windowed_models[family])
    want = tokens(LLM(path, dtype="float64", num_kv_blocks=256, block_size=4).generate(prompts, params,
                                                                                        use_tqdm=False))
    llm = LLM(path, dtype="float64", num_kv_blocks=256, block_size=4)
    sizes = graphed(llm, max_batch=8, capture=False)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert sizes and max(p.max_tokens + len(q) for p, q in zip(params, prompts, strict=True)) > 6


def test_capped_scores_take_graphs_where_triton_attends(monkeypatch):
    """The engine's rule: capped scores or sinks run eagerly on the torch backend (its masks are
    built on the host) and take graphs where the Triton kernels attend: triton there, not
    switched off, a dtype they take (the GPU test below captures Gemma 2)."""
    from conveyor import engine

    monkeypatch.setattr("conveyor.kernels.triton_attention.triton_available", lambda: True)
    monkeypatch.delenv("CONVEYOR_TRITON", raising=False)
    assert engine._triton_attends(torch.bfloat16) and not engine._triton_attends(torch.float64)
    monkeypatch.setenv("CONVEYOR_TRITON", "0")
    assert not engine._triton_attends(torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_gemma2_captures_its_decode_on_gpu(windowed_models):
    """Gemma 2 on a GPU in bfloat16 (the Triton kernels cap its scores): its decode steps are
    captured, and give the tokens of the same fixed-buffer forward run eagerly."""
    prompts, base = mixed_requests(24, seed=12)
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True) for p in base]
    outs = []
    for capture in (True, False):
        llm = LLM(str(windowed_models["gemma2"]), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                  cuda_graph_max_batch=16)
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.captured
        if not capture:
            graphed(llm, max_batch=16, capture=False)
        outs.append(tokens(llm.generate(prompts, params, use_tqdm=False)))
    assert outs[0] == outs[1]
