"""Prompt logprobs (vLLM's `prompt_logprobs`) against HF transformers on the same weights.

The reference is one HF forward pass over the whole prompt in float64: the log-softmax at
position p, read at the token at p + 1 (conveyor's logprobs are float32, as the sampler's). Every way a prompt reaches the model in pieces
(chunks, recompute after preemption, a prefix another request has cached) must give the
same values, one entry per prompt token, the first None.
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, InvalidRequestError, SamplingParams

VOCAB = 384


def hf_prompt_logprobs(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0]
            out.append(torch.log_softmax(logits, dim=-1))  # row p: the distribution of token p + 1
    return out


@pytest.fixture(scope="module")
def cases(tiny_models):
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(24)]  # a prefix some prompts share
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    prompts += [shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    return prompts, hf_prompt_logprobs(str(tiny_models["llama"]), prompts)


def check(out, prompt: list[int], want: torch.Tensor, k: int) -> None:
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for p, entry in enumerate(got[1:]):
        dist = want[p]
        token = prompt[p + 1]
        assert entry is not None and entry.token_id == token
        assert entry.logprob == pytest.approx(dist[token].item(), abs=1e-5)
        assert entry.rank == int((dist > dist[token]).sum()) + 1
        if k:
            top_vals, top_ids = dist.topk(k)
            assert entry.top is not None and [t for t, _ in entry.top] == top_ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top_vals.tolist(), abs=1e-5)
        else:
            assert entry.top is None


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16, "block_size": 4},  # prompts in chunks
        {"num_kv_blocks": 12, "block_size": 4},  # preemption by recompute, prompts computed again
        {"async_scheduling": True, "max_num_batched_tokens": 16},
        {"speculative_method": "ngram", "prompt_lookup_min": 1},
        {"enable_prefix_caching": True, "block_size": 4},
    ],
    ids=["default", "chunked-16", "preempt", "async-chunked", "speculative", "prefix-cache"],
)
def test_prompt_logprobs_equal_hf(tiny_models, cases, options):
    prompts, want = cases
    llm = LLM(str(tiny_models["llama"]), dtype="float64", **{"num_kv_blocks": 128, **options})
    if options.get("enable_prefix_caching"):  # the shared prefix cached by a request that asks nothing
        warm = llm.generate([prompts[-1]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert warm[0].prompt_logprobs is None
    ks = [i % 4 for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=k, logprobs=1 if k == 2 else None)
              for k in ks]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt, dist, k in zip(outs, prompts, want, ks, strict=True):
        check(out, prompt, dist, k)
        assert out.num_cached_tokens == 0  # computed whole: a cached block would have no logprobs
    if options.get("num_kv_blocks") == 12:
        assert llm.engine.scheduler.num_preemptions > 0
    if options.get("enable_prefix_caching"):  # the cache still serves requests that do not ask
        again = llm.generate([prompts[-2]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert again[0].num_cached_tokens > 0


def test_a_delta_stream_carries_them_once(tiny_models, cases):
    prompts, want = cases
    engine = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=64).engine
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=5, prompt_logprobs=1, output_kind="delta"),
                       stream=True)
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert len(seen) == 5
    check(seen[0], prompts[0], want[0], 1)
    assert all(o.prompt_logprobs is None for o in seen[1:])


@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.param == "prompt_logprobs"
