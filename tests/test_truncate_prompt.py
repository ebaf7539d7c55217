"""`SamplingParams.truncate_prompt_tokens` (vLLM's): a prompt cut to its last k tokens runs as
that shorter prompt would (the same greedy tokens, n choices included); -1 keeps as many as
leave room for one token (an embedding's may fill the context); bad values are refused."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float64", max_model_len=32, block_size=4)


PROMPT = [(7 * i) % 300 + 3 for i in range(50)]
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def test_a_truncated_prompt_runs_as_its_last_tokens(llm):
    cut = dataclasses.replace(GREEDY, max_tokens=6, truncate_prompt_tokens=10)
    got = llm.generate([PROMPT], cut, use_tqdm=False)[0]
    want = llm.generate([PROMPT[-10:]], dataclasses.replace(GREEDY, max_tokens=6), use_tqdm=False)[0]
    assert got.prompt_token_ids == PROMPT[-10:]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    two = llm.generate([PROMPT], dataclasses.replace(cut, n=2), use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [want.outputs[0].token_ids] * 2
    short = llm.generate([PROMPT[:5]], dataclasses.replace(GREEDY, truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert short.prompt_token_ids == PROMPT[:5]  # shorter than k: as it is


def test_minus_one_keeps_as_many_as_fit(llm):
    with pytest.raises(InvalidRequestError, match="at most 32 tokens"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    out = llm.generate([PROMPT], dataclasses.replace(GREEDY, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT[-31:] and len(out.outputs[0].token_ids) == 1
    embed = dataclasses.replace(SamplingParams.for_pooling(), truncate_prompt_tokens=-1)
    llm.engine.add_request("e", PROMPT, embed)
    outs = [o for _ in range(4) for o in llm.engine.step() if o.finished]
    assert outs[0].prompt_token_ids == PROMPT[-32:] and outs[0].embedding


@pytest.mark.parametrize("k", [0, -2, 1.5, True])
def test_bad_values_are_refused(k):
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=k)
