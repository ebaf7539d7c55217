"""SamplingParams.n: n choices of one prompt in one RequestOutput (vLLM's parallel sampling).

Choice i of a seeded request must be exactly the request with seed + i alone (the engine's
seeded draws do not depend on the batch); streams must deliver every choice's tokens once;
an abort ends every choice.
"""

from __future__ import annotations

import pytest

from conveyor import LLM, InvalidRequestError, SamplingParams
from conveyor.server.async_engine import EngineRequest

PROMPTS = [[5, 9, 33, 7, 100, 12], [200, 3, 41]]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=64, block_size=4)


def test_choice_i_equals_the_request_seeded_seed_plus_i(llm):
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
        alone = llm.generate([prompt] * 4, [SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i, logprobs=1)
                                            for i in range(4)], use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
            [a.outputs[0].cumulative_logprob for a in alone])
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # choices differ: the seeds were used


def test_greedy_choices_are_equal_and_the_prompt_is_computed_once(llm):
    llm.reset_prefix_cache()
    out = llm.generate([PROMPTS[0] * 3], SamplingParams(n=3, max_tokens=6, temperature=0.0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPTS[0] * 3)
    engine = llm.engine
    prefill = sum(s.num_prefill_tokens for s in list(engine.step_trace)[-20:])
    assert prefill < 2 * len(PROMPTS[0] * 3)  # the other choices' prompts came from the prefix cache


@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_a_stream_delivers_every_choice_once(llm, kind):
    engine = llm.engine
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=1, output_kind=kind)
    engine.add_request("p", PROMPTS[1], params, stream=True)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"p"} and outs[-1].finished and not any(o.finished for o in outs[:-1])
    for o in outs:
        for c in o.outputs:
            if kind == "delta":
                got[c.index] += c.token_ids
            else:
                got[c.index] = c.token_ids
    alone = llm.generate([PROMPTS[1]] * 3, [SamplingParams(max_tokens=10, temperature=1.0, seed=1 + i)
                                            for i in range(3)], use_tqdm=False)
    assert [got[i] for i in range(3)] == [a.outputs[0].token_ids for a in alone]
    if kind == "delta":
        assert all(len(o.outputs) == 1 for o in outs)
    else:
        assert [c.index for c in outs[-1].outputs] == [0, 1, 2]


def test_an_abort_ends_every_choice_and_frees_their_blocks(llm):
    engine = llm.engine
    engine.add_request("q", PROMPTS[0], SamplingParams(n=3, max_tokens=50, temperature=1.0, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort_request("q")
    assert out is not None and out.finished and out.request_id == "q"
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests() and engine.scheduler.block_manager.num_used_blocks == 0
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("r", PROMPTS[0], SamplingParams(n=2))
        engine.add_request("r", PROMPTS[0], SamplingParams(n=2))
    engine.abort_request("r")
    assert engine.abort_request("r") is None


@pytest.mark.parametrize("n", [0, -1, True, 2.0])
def test_a_bad_n_is_refused(n):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(n=n)
    assert e.value.param == "n"


def test_a_front_without_parallel_sampling_takes_one_choice_a_request(llm):
    """A front that takes one choice a request (replicas behind a router: the HTTP layer makes
    its n choices itself) refuses n > 1 by name, before anything runs."""
    import asyncio

    from conveyor.server.async_engine import AsyncEngine

    async def main() -> None:
        front = AsyncEngine(llm.engine)
        front.parallel_sampling = False  # (as `ReplicaSet`)
        front.start()
        try:
            with pytest.raises(InvalidRequestError) as e:
                await front.add([EngineRequest("x", [1, 2], SamplingParams(n=2))])
            assert e.value.param == "n"
        finally:
            await front.stop()

    asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()
