"""Engine behaviour on a tiny float64 Llama: outputs do not depend on the batch."""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, ConfigError, InvalidRequestError, SamplingParams


def mixed_requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(1, 70))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True)
        for _ in range(n)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def reference(model_dir):
    """Each request run alone, with a roomy cache and a large budget."""
    prompts, params = mixed_requests(32)
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=256, max_num_batched_tokens=4096)
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=False)]
    return prompts, params, alone


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def check_blocks_free(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity([])


def test_32_at_once_equals_each_alone(model_dir, reference):
    prompts, params, alone = reference
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=256, max_num_batched_tokens=4096)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == alone
    assert max(s.num_seqs for s in llm.engine.step_trace) > 16  # really batched
    check_blocks_free(llm)


@pytest.mark.parametrize("budget", [7, 16, 64])
def test_small_token_budget_chunks_prompts_same_tokens(model_dir, reference, budget):
    prompts, params, alone = reference
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=256, max_num_batched_tokens=budget, block_size=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == alone
    trace = llm.engine.step_trace
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in trace)
    assert any(s.num_prefill_tokens > 0 and s.num_decode_tokens for s in trace)  # mixed steps happened
    check_blocks_free(llm)


def test_no_chunking_waits_for_whole_prompts(model_dir, reference):
    prompts, params, alone = reference
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=256, max_num_batched_tokens=80,
              prefill_mode="mixed")
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == alone


def test_tiny_cache_preempts_and_recomputes_same_tokens(model_dir, reference):
    prompts, params, alone = reference
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=14, block_size=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) > 0
    assert tokens(outs) == alone
    check_blocks_free(llm)


def test_seeded_sampling_is_independent_of_the_batch(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=256)
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    prompts, params = mixed_requests(12, seed=3)
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=0.8, ignore_eos=True) for p in params]
    outs = llm.generate([*prompts[:6], [5, 6, 7], *prompts[6:]], [*params[:6], sp, *params[6:]], use_tqdm=False)
    assert outs[6].outputs[0].token_ids == alone
    again = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_abort_frees_blocks_and_keeps_others_running(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=64, block_size=4)
    engine = llm.engine
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), sp)
    engine.add_request("b", list(range(3, 20)), sp)
    engine.step()
    engine.step()
    used_before = engine.scheduler.block_manager.num_used_blocks
    out = engine.abort_request("a")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.scheduler.block_manager.num_used_blocks < used_before
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"]
    assert len(finished[0].outputs[0].token_ids) == 20
    check_blocks_free(llm)


def test_metrics_are_recorded(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=64)
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 5 and m.ttft is not None and m.tpot is not None


def test_length_limit_and_stop_token_ids(model_dir, reference):
    prompts, params, alone = reference
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=256)
    i = next(i for i, a in enumerate(alone) if len(a) >= 5)
    stop_tok = alone[i][3]
    first = alone[i].index(stop_tok)
    sp = SamplingParams(max_tokens=params[i].max_tokens, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok])
    out = llm.generate([prompts[i]], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == alone[i][: first + 1]
    out = llm.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"


def test_eos_stops_unless_ignored(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=256)
    llm.engine.scheduler.eos_token_ids = frozenset({llm.generate([[9, 9]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0].outputs[0].token_ids[0]})
    out = llm.generate([[9, 9]], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1
    out = llm.generate([[9, 9]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_sequence_stops_at_max_model_len(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=64, max_model_len=20)
    out = llm.generate([list(range(3, 18))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 20


# -- bad input: a clear error, before any work, and the engine keeps serving ----------------
def test_bad_prompts_raise_before_any_work(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=8, block_size=4)  # 32-token capacity
    good = [3, 4, 5]
    sp = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([good, []], sp, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="at most 32 tokens"):
        llm.generate([good, list(range(3, 43))], sp, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[3, 99999]], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.num_free_blocks == 8
    out = llm.generate([good], sp, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_prompt_longer_than_the_model_context(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=256)  # context 512 from config.json
    assert llm.engine.max_model_len == 512
    with pytest.raises(InvalidRequestError, match="600 tokens"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=1), use_tqdm=False)


def test_bad_engine_options(model_dir):
    with pytest.raises(ConfigError, match="block_size"):
        LLM(model_dir, block_size=3)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM(model_dir, max_num_seqs=0)
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(model_dir, max_num_seq=4)
    with pytest.raises(ConfigError, match="exceeds the KV cache"):
        LLM(model_dir, num_kv_blocks=2, block_size=4, max_model_len=100)


def test_unknown_model_path():
    from conveyor.models.loader import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="not found"):
        LLM("/nonexistent/model")


def test_unsupported_architecture(tmp_path):
    import json

    from conveyor.models.arch import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


# -- async scheduling: step t+1 launched before step t's tokens are back --------------------
class CountPending:
    """Wraps `runner.submit` to count decodes whose input token was still pending."""

    def __init__(self, engine) -> None:
        from conveyor.sequence import PLACEHOLDER

        self.count = 0
        submit = engine.runner.submit

        def counted(out):
            self.count += sum(1 for it in out.scheduled if it.token_ids == [PLACEHOLDER])
            return submit(out)

        engine.runner.submit = counted


@pytest.mark.parametrize(
    "options",
    [
        dict(num_kv_blocks=256),
        dict(num_kv_blocks=256, max_num_batched_tokens=16, block_size=4),  # chunked prompts
        dict(num_kv_blocks=14, block_size=8),  # preemption by recompute
        dict(num_kv_blocks=14, block_size=8, preemption_mode="swap"),
        dict(num_kv_blocks=256, prefill_mode="prefill_first"),
    ],
    ids=["roomy", "chunked", "recompute", "swap", "prefill_first"],
)
def test_async_scheduling_gives_the_same_tokens(model_dir, reference, options):
    prompts, params, alone = reference
    llm = LLM(model_dir, dtype="float64", async_scheduling=True, **options)
    counter = CountPending(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == alone
    assert counter.count > 100  # decodes really were launched before their input came back
    if options.get("num_kv_blocks") == 14:
        assert llm.engine.scheduler.num_preemptions > 0
    check_blocks_free(llm)


def test_async_scheduling_with_early_stops_penalties_seeds_and_logprobs(model_dir, reference):
    """Requests that stop on a token (one decode wasted), penalties (the pending token read
    back for the history), seeded sampling and logprobs: the same results as without."""
    prompts, _, alone = reference
    stops = [a[len(a) // 2] for a in alone]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stops[0]]),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3),
    ] * 4
    chosen = prompts[: len(params)]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model_dir, dtype="float64", num_kv_blocks=256, async_scheduling=async_scheduling)
        outs = llm.generate(chosen, params, use_tqdm=False)
        results.append(outs)
        check_blocks_free(llm)
    sync, overlapped = results
    assert tokens(overlapped) == tokens(sync)
    assert [o.outputs[0].finish_reason for o in overlapped] == [o.outputs[0].finish_reason for o in sync]
    assert any(o.outputs[0].finish_reason == "stop" for o in sync)
    for a, b in zip(sync, overlapped, strict=True):
        if a.outputs[0].logprobs is not None:
            assert [(lp.token_id, round(lp.logprob, 9)) for lp in a.outputs[0].logprobs] == [
                (lp.token_id, round(lp.logprob, 9)) for lp in b.outputs[0].logprobs
            ]


def test_async_scheduling_abort_while_a_step_is_in_flight(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=64, block_size=4, async_scheduling=True)
    engine = llm.engine
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), sp)
    engine.add_request("b", list(range(3, 20)), sp)
    engine.step()
    engine.step()
    assert engine._in_flight is not None  # the next step is launched, its tokens pending
    out = engine.abort_request("a")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert -1 not in out.outputs[0].token_ids  # a pending placeholder is never an output
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"]
    assert len(finished[0].outputs[0].token_ids) == 20
    assert engine._in_flight is None
    check_blocks_free(llm)
