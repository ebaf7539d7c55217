"""Speculative decoding on real models: the same outputs as decoding one token a step.

Greedy requests must give the same tokens (float64, so that the verification step's batched
attention and a decode's cannot part on rounding), seeded sampled ones the same tokens too
(each position draws its own row of noise), logprobs the same values, and a stop string that
falls inside a step's accepted drafts must end the output exactly where it would have.
"""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams


def repetitive_requests(n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts that repeat a phrase (prompt lookup finds matches), and random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 3:
            phrase = [rng.randrange(3, 384) for _ in range(rng.randint(2, 6))]
            prompts.append((phrase * 8)[: rng.randint(6, 40)])
        else:
            prompts.append([rng.randrange(3, 384) for _ in range(rng.randint(1, 40))])
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True) for _ in range(n)]
    return prompts, params


def run(model_dir: str, prompts, params, **options):
    llm = LLM(model_dir, dtype="float64", **{"num_kv_blocks": 256, **options})
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity([])
    return llm, outs


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def plain(model_dir):
    prompts, params = repetitive_requests(24)
    _, outs = run(model_dir, prompts, params)
    return prompts, params, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16, "block_size": 4},  # drafts compete with prompt chunks
        {"prefill_mode": "mixed", "max_num_batched_tokens": 64},
        {"num_kv_blocks": 14, "block_size": 8},  # preemption by recompute
        {"num_kv_blocks": 14, "block_size": 8, "preemption_mode": "swap", "num_swap_blocks": 64},
        {"enable_prefix_caching": False, "num_speculative_tokens": 1},
        {"num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
        {"speculative_disable_by_batch_size": 4},
        {"speculative_draft_cost": 0.3},
        {"speculative_draft_budget": 12},
        {"speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)]", "prompt_lookup_min": 1},
        {"speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0)]", "num_kv_blocks": 14, "block_size": 8},
    ],
    ids=["default", "chunked-16", "mixed", "preempt", "swap", "one-draft", "eight-drafts", "by-batch-size", "adaptive",
         "draft-budget", "tree", "tree-preempt"],
)
def test_greedy_tokens_equal_decoding_one_at_a_time(model_dir, plain, options):
    prompts, params, want = plain
    llm, outs = run(model_dir, prompts, params, speculative_method="ngram", **options)
    assert [o.outputs[0].token_ids for o in outs] == want
    sched = llm.engine.scheduler
    assert sched.num_accepted_tokens > 0, "no draft was ever accepted: nothing was tested"
    # Fewer steps than one a token would take: drafts were kept.
    assert sched.num_accepted_tokens <= sched.num_draft_tokens
    if options.get("num_kv_blocks") == 14:
        assert sched.num_preemptions > 0


def test_seeded_sampling_and_penalties_give_the_same_tokens(model_dir):
    prompts, _ = repetitive_requests(12, seed=5)
    params = [
        SamplingParams(max_tokens=30, temperature=0.05, top_p=0.9, seed=100 + i, ignore_eos=True,
                       repetition_penalty=1.2 if i % 2 else 1.0, presence_penalty=0.3 if i % 3 == 1 else 0.0)
        for i in range(len(prompts))
    ]
    _, want = run(model_dir, prompts, params)
    llm, got = run(model_dir, prompts, params, speculative_method="ngram", prompt_lookup_min=1)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.scheduler.num_accepted_tokens > 0


def test_logprobs_are_those_of_each_token(model_dir, plain):
    prompts, params, _ = plain
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True, logprobs=3) for p in params]
    _, want = run(model_dir, prompts, params)
    llm, got = run(model_dir, prompts, params, speculative_method="ngram")
    assert llm.engine.scheduler.num_accepted_tokens > 0
    for a, b in zip(want, got, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None and len(la) == len(lb) == len(a.outputs[0].token_ids)
        for x, y in zip(la, lb, strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-9)
            assert [t for t, _ in x.top or []] == [t for t, _ in y.top or []]


def test_streams_deliver_every_token_once(model_dir, plain):
    prompts, params, want = plain
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=256, speculative_method="ngram")
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=sp.max_tokens, temperature=0.0,
                                                     ignore_eos=True, output_kind="delta"), stream=True)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    several = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = out.outputs[0].token_ids
            several += len(delta) > 1
            got[out.request_id] += delta
    assert [got[str(i)] for i in range(len(prompts))] == want
    assert several > 0  # some steps gave a request several tokens at once


def test_max_model_len_is_never_overrun(model_dir):
    prompt = [7, 8, 9] * 5
    sp = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    _, want = run(model_dir, [prompt], [sp], max_model_len=40)
    _, got = run(model_dir, [prompt], [sp], max_model_len=40, speculative_method="ngram", prompt_lookup_min=1)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert len(prompt) + len(got[0].outputs[0].token_ids) == 40


def test_a_stop_string_inside_the_accepted_drafts_ends_the_output_there(smollm2):
    """SmolLM2 repeats a list it was shown, so whole runs of drafts are accepted, and the stop
    string ends the output mid-run: the same text, tokens and reason as without drafts."""
    prompt = ("Repeat the list exactly.\nList: apple, pear, plum, fig, kiwi, lime, date, "
              "apple, pear, plum, fig, kiwi, lime, date.\nRepeated: apple, pear, plum,")
    outs = {}
    for spec in (False, True):
        llm = LLM(smollm2, **({"speculative_method": "ngram"} if spec else {}))
        sp = [SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], logprobs=1) for stop in ("lime", " date, apple")]
        outs[spec] = llm.generate([prompt, prompt], sp, use_tqdm=False)
        if spec:
            assert llm.engine.scheduler.num_accepted_tokens > 0
    for a, b in zip(outs[False], outs[True], strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.text, y.token_ids, y.finish_reason, y.stop_reason) == (x.text, x.token_ids, x.finish_reason, x.stop_reason)
        assert x.finish_reason == "stop" and isinstance(x.stop_reason, str)
        assert y.logprobs is not None and len(y.logprobs) == len(y.token_ids)
        assert len(b.metrics.token_times) == len(y.token_ids)

