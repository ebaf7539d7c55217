"""Speculative decoding with a draft model (`speculative_method="draft_model"`).

Two drafts of the tiny Llama (float64, so verification and one-token decodes cannot part on
rounding):
  - `self`: the model is its own draft. Every guess is then the model's own greedy token, so
    every one must be accepted: any K/V the draft's cache got wrong (a stale block after a
    preemption, a token fed twice or never, a wrong position) shows as a rejected guess.
  - `noisy`: the model with its weights perturbed by 5%, which agrees with it on some tokens
    and not others, so rejections and their resampling are exercised too.
Both must give exactly the tokens of decoding one token a step, under every scheduling.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError, EngineConfig
from conveyor.engine import Engine
from conveyor.outputs import RequestOutput
from tests.conftest import build_tiny_model

SCHEDULINGS = [
    {},
    {"max_num_batched_tokens": 16, "block_size": 4},  # guesses compete with prompt chunks
    {"prefill_mode": "mixed", "max_num_batched_tokens": 64},
    {"num_kv_blocks": 14, "block_size": 8},  # preemption by recompute
    {"num_kv_blocks": 14, "block_size": 8, "preemption_mode": "swap", "num_swap_blocks": 64},
    {"enable_prefix_caching": False, "num_speculative_tokens": 1},
    {"num_speculative_tokens": 8},
    {"speculative_disable_by_batch_size": 4},  # steps without guesses: the draft falls behind
    {"speculative_draft_cost": 0.3},
]
IDS = ["default", "chunked-16", "mixed", "preempt", "swap", "one-draft", "eight-drafts", "by-batch-size", "adaptive"]


def requests(n: int, seed: int = 0, shared: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Random prompts (the first `shared` tokens common to all: prefix-cache hits)."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 384) for _ in range(shared)]
    prompts = [head + [rng.randrange(3, 384) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def target(tiny_models) -> Engine:
    """One load of the tiny Llama in float64; every engine here shares its weights."""
    return LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=64).engine


@pytest.fixture(scope="module")
def noisy_path(tiny_models, tmp_path_factory) -> Path:
    import torch
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(tiny_models["llama"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    out = tmp_path_factory.mktemp("noisy_draft")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def drafts(target, noisy_path) -> dict[str, object]:
    return {"self": target.runner.model, "noisy": LLM(str(noisy_path), dtype="float64", num_kv_blocks=8).engine.runner.model}


def engine(target: Engine, draft: object | None = None, **options) -> Engine:
    options = {"num_kv_blocks": 256, **options}
    if draft is not None:
        options["speculative_method"] = "draft_model"
    config = EngineConfig.from_kwargs(**options)
    return Engine.from_model(config, target.runner.model, target.tokenizer, draft_model=draft)


def run(engine: Engine, prompts, params) -> list[RequestOutput]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity([])
    return [done[str(i)] for i in range(len(prompts))]


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(target):
    prompts, params = requests(24)
    return prompts, params, tokens(run(engine(target), prompts, params))


@pytest.mark.parametrize("which", ["self", "noisy"])
@pytest.mark.parametrize("options", SCHEDULINGS, ids=IDS)
def test_greedy_tokens_equal_decoding_one_at_a_time(target, drafts, plain, options, which):
    prompts, params, want = plain
    eng = engine(target, drafts[which], **options)
    assert tokens(run(eng, prompts, params)) == want
    sched = eng.scheduler
    assert sched.num_draft_tokens > 0
    if which == "self":  # the draft's cache is right: each guess is the model's own token
        assert sched.num_accepted_tokens == sched.num_draft_tokens
    else:
        assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    if options.get("num_kv_blocks") == 14:
        assert sched.num_preemptions > 0


def test_prefix_cache_hits_feed_the_draft_the_whole_prompt(target, drafts):
    """The target finds the shared head cached and computes only the rest; the draft has no
    such cache and is fed every prompt whole, so its guesses stay the model's own."""
    prompts, params = requests(12, seed=3, shared=37)
    want = tokens(run(engine(target, enable_prefix_caching=False), prompts, params))
    eng = engine(target, drafts["self"], block_size=4)
    for _ in range(2):  # the second time, every prompt hits the cache
        assert tokens(run(eng, prompts, params)) == want
    assert eng.scheduler.block_manager.num_hit_tokens > 0
    sched = eng.scheduler
    assert sched.num_accepted_tokens == sched.num_draft_tokens > 0


def test_seeded_sampling_penalties_and_logprobs_are_the_same(target, drafts):
    prompts, _ = requests(12, seed=5)
    params = [
        SamplingParams(max_tokens=30, temperature=0.05, top_p=0.9, seed=100 + i, ignore_eos=True, logprobs=2,
                       repetition_penalty=1.2 if i % 2 else 1.0, presence_penalty=0.3 if i % 3 == 1 else 0.0)
        for i in range(len(prompts))
    ]
    want = run(engine(target), prompts, params)
    eng = engine(target, drafts["noisy"])
    got = run(eng, prompts, params)
    assert tokens(got) == tokens(want)
    assert eng.scheduler.num_accepted_tokens > 0
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-9)


def test_parallel_samples_and_aborts(target, drafts):
    """n=2 choices of seeded requests (each choice drafted for on its own), two requests
    aborted mid-way: the others get the tokens they get without drafts, and nothing leaks."""
    prompts, _ = requests(6, seed=9)
    sp = [SamplingParams(max_tokens=25, temperature=0.05, seed=i, n=2, ignore_eos=True) for i in range(6)]
    got = {}
    for eng in (engine(target), engine(target, drafts["noisy"], num_kv_blocks=40, block_size=4)):
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, sp[i])
        done: dict[str, list[list[int]]] = {}
        steps = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
            steps += 1
            if steps == 3:
                eng.abort_request("0")
                eng.abort_request("3")
        bm = eng.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        got[eng.drafter is not None] = {k: v for k, v in done.items() if k not in ("0", "3")}
    assert got[True] == got[False] and len(got[True]) == 4
    assert eng.scheduler.num_accepted_tokens > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    num_kv_blocks=st.integers(12, 80),
    budget=st.sampled_from([None, 8, 16, 48]),
    k=st.integers(1, 6),
    preemption=st.sampled_from(["recompute", "swap"]),
    prefix=st.booleans(),
    max_num_seqs=st.integers(1, 8),
)
def test_random_schedules_keep_every_guess_of_the_model_itself(
    target, drafts, seed, block_size, num_kv_blocks, budget, k, preemption, prefix, max_num_seqs
):
    """Over random caches, budgets and batch sizes (preemptions, swaps, chunked prompts,
    prefix hits), the model drafting for itself has every guess kept and the same tokens."""
    prompts, params = requests(8, seed=seed, shared=seed % 3 * 9)
    capacity = num_kv_blocks * block_size
    keep = [i for i, (p, sp) in enumerate(zip(prompts, params, strict=True)) if len(p) + sp.max_tokens <= capacity]
    prompts, params = [prompts[i] for i in keep], [params[i] for i in keep]
    options = dict(block_size=block_size, num_kv_blocks=num_kv_blocks, num_speculative_tokens=k,
                   max_num_seqs=max_num_seqs, enable_prefix_caching=prefix, preemption_mode=preemption)
    if budget is not None:
        options["max_num_batched_tokens"] = budget
    if preemption == "swap":
        options["num_swap_blocks"] = num_kv_blocks
    want = tokens(run(engine(target), prompts, params))
    eng = engine(target, drafts["self"], **options)
    assert tokens(run(eng, prompts, params)) == want
    sched = eng.scheduler
    assert sched.num_accepted_tokens == sched.num_draft_tokens


def test_bad_configurations_are_refused(target, drafts, tiny_models, noisy_path, tmp_path):
    with pytest.raises(ConfigError, match="speculative_model is the draft"):
        EngineConfig.from_kwargs(speculative_model=str(noisy_path))
    with pytest.raises(ConfigError, match="needs a speculative_model"):
        LLM(str(tiny_models["llama"]), speculative_method="draft_model")
    with pytest.raises(ConfigError, match="speculative_quantization applies only"):
        EngineConfig.from_kwargs(speculative_quantization="int8")
    other = build_tiny_model(tmp_path / "other", "llama", vocab_size=400)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(str(tiny_models["llama"]), speculative_method="draft_model", speculative_model=str(other), num_kv_blocks=8)
    with pytest.raises(ConfigError, match="goes with speculative_method='draft_model'"):
        engine(target, None, speculative_method="draft_model")
    with pytest.raises(ConfigError, match="async_scheduling"):
        engine(target, drafts["self"], async_scheduling=True)


def test_a_draft_model_from_a_path_and_int8(smollm2):
    """SmolLM2 drafting for itself in int8 (CPU float32): the same text as without drafts,
    and most guesses kept."""
    prompts = ["<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"]
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    want = [o.outputs[0].text for o in LLM(smollm2, num_kv_blocks=64).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(smollm2, num_kv_blocks=64, speculative_method="draft_model", speculative_model=smollm2,
              speculative_quantization="int8")
    got = [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    sched = llm.engine.scheduler
    assert sched.num_accepted_tokens > sched.num_draft_tokens / 2


def test_speculative_sampling_keeps_the_target_distribution():
    """`_speculative_sampling` over fixed target rows p and draft rows q (5 tokens, 2 guesses
    drawn from q, the bonus from the last p row): the first token given is distributed as p0
    and the second as p1, to within sampling error over 40,000 chains, whatever q; a guess
    with q = p is always kept."""
    from types import SimpleNamespace

    import torch

    from conveyor.runner.model_runner import ModelRunner

    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, 5, generator=g) * 1.5, dim=-1).double()
    q = torch.softmax(torch.randn(2, 5, generator=g) * 1.5, dim=-1).double()
    me = SimpleNamespace(sampler=SimpleNamespace(generator=g))
    trials = 40_000
    guesses = torch.multinomial(q, trials, replacement=True, generator=g).T.tolist()  # [trials, 2]
    bonus = torch.multinomial(p[2], trials, replacement=True, generator=g).tolist()
    first, second = torch.zeros(5), torch.zeros(5)
    kept = 0
    for guess, b in zip(guesses, bonus, strict=True):
        out = ModelRunner._speculative_sampling(me, guess, p, q, b)  # type: ignore[arg-type]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
        kept += len(out) - 1
    assert (first / trials - p[0].float()).abs().max() < 0.012
    assert (second / second.sum() - p[1].float()).abs().max() < 0.015
    # (a guess is kept with probability sum(min(p, q)), 1 minus their total variation distance)
    assert kept / trials == pytest.approx(float(torch.minimum(p[0], q[0]).sum()) * (1 + float(
        torch.minimum(p[1], q[1]).sum())), abs=0.02)
    same = ModelRunner._speculative_sampling(me, [2, 4], p, p[:2].clone(), 1)  # type: ignore[arg-type]
    assert same == [2, 4, 1]


def test_sampled_drafts_are_kept_by_speculative_sampling(target, drafts):
    """Unseeded sampled requests draw their guesses from the draft's distribution: the model
    drafting for itself has nearly every guess kept (p = q), where greedy guesses matched
    against sampled tokens keep far fewer (the seeded requests, which still draft greedily,
    give the tokens of decoding one at a time, and `speculative_draw_guesses=False` keeps greedy
    guesses for all); the noisy draft's requests run to their end."""
    prompts, _ = requests(16, seed=11)
    sampled = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, ignore_eos=True) for _ in prompts]
    seeded = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    rates = {}
    for name, params in (("sampled", sampled), ("seeded", seeded)):
        eng = engine(target, drafts["self"], num_speculative_tokens=4)
        outs = run(eng, prompts, params)
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        rates[name] = eng.scheduler.num_accepted_tokens / eng.scheduler.num_draft_tokens
        if name == "seeded":
            assert tokens(outs) == tokens(run(engine(target), prompts, seeded))
    assert rates["sampled"] > 0.97 and rates["seeded"] < 0.8 * rates["sampled"], rates
    greedy = engine(target, drafts["self"], num_speculative_tokens=4, speculative_draw_guesses=False)
    run(greedy, prompts, sampled)  # (speculative_draw_guesses=False: greedy guesses, matched)
    assert greedy.scheduler.num_accepted_tokens / greedy.scheduler.num_draft_tokens < 0.8 * rates["sampled"]
    eng = engine(target, drafts["noisy"], num_speculative_tokens=4)
    outs = run(eng, prompts, sampled)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs) and eng.scheduler.num_accepted_tokens > 0
