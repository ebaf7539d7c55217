"""`AsyncLLM`, the engine for asyncio programs, on a tiny random-weight model: concurrent
requests get `LLM.generate`'s outputs, `n > 1` its choices, deltas add up, a consumer that
leaves aborts its request, bad requests raise before any output while the others go on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conveyor import AsyncLLM, InvalidRequestError, SamplingParams
from conveyor.llm import LLM
from conveyor.server.async_engine import AsyncEngine, EngineRequest
from conveyor.server.engine_process import ProcessAsyncEngine

OPTIONS = {"num_kv_blocks": 256, "block_size": 8, "max_num_seqs": 4}
PROMPTS = [[5, 6, 7], [9, 3, 4, 12, 30], [17] * 9, [2, 40, 41]]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), **OPTIONS)


def test_concurrent_requests_get_the_offline_outputs(tiny_model: Path, reference: LLM) -> None:
    """Four requests at once (more than max_num_seqs... a batch of them), greedy and a seeded
    n=3 one: the final outputs are `LLM.generate`'s, choices in order."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=3, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs] for o in reference.generate(PROMPTS, greedy, use_tqdm=False)]
    want_n = [c.token_ids for c in reference.generate([PROMPTS[1]], sampled, use_tqdm=False)[0].outputs]

    async def final(llm: AsyncLLM, prompt, params, rid) -> list[list[int]]:
        last = None
        async for out in llm.generate(prompt, params, rid):
            last = out
        assert last is not None and last.finished and last.request_id == rid
        assert [c.index for c in last.outputs] == list(range(params.n))
        return [c.token_ids for c in last.outputs]

    async def main() -> list:
        async with AsyncLLM(str(tiny_model), **OPTIONS) as llm:
            got = await asyncio.gather(*[final(llm, p, greedy, f"r{i}") for i, p in enumerate(PROMPTS)],
                                       final(llm, PROMPTS[1], sampled, "n3"))
            assert llm.num_unfinished_requests == 0
            assert llm.engine.scheduler.block_manager.num_used_blocks == 0
            return got

    got = asyncio.run(main())
    assert got[:4] == want
    assert got[4] == want_n and len({tuple(t) for t in want_n}) > 1


def test_deltas_add_up_and_a_consumer_that_leaves_aborts(tiny_model: Path, reference: LLM) -> None:
    """`output_kind="delta"` pieces of an n=2 request concatenate, per choice, to the final
    tokens; breaking out of a stream (or `abort`) ends its request at once and frees its blocks
    while another one goes on."""
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2, ignore_eos=True, output_kind="delta")
    want = [c.token_ids for c in reference.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs]
    endless = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        async with AsyncLLM(str(tiny_model), **OPTIONS) as llm:
            pieces: list[list[int]] = [[], []]
            async for out in llm.generate(PROMPTS[0], params):
                for c in out.outputs:
                    pieces[c.index] += c.token_ids
            assert pieces == want
            seen = 0
            async for _ in llm.generate(PROMPTS[2], endless, "leaves"):
                seen += 1
                if seen == 3:
                    break
            outs = []

            async def until_aborted() -> None:
                async for out in llm.generate(PROMPTS[3], endless, "aborted"):
                    outs.append(out)
                    if len(outs) == 2:
                        llm.abort("aborted")

            await asyncio.wait_for(until_aborted(), timeout=30)
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            for _ in range(100):
                if not llm.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert not llm.engine.has_unfinished_requests()
            assert llm.engine.scheduler.block_manager.num_used_blocks == 0

    asyncio.run(main())


def test_a_bad_request_raises_before_any_output_and_the_others_go_on(tiny_model: Path) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        async with AsyncLLM(str(tiny_model), max_queued_requests=2, **OPTIONS) as llm:
            async def good() -> int:
                return sum([1 async for _ in llm.generate(PROMPTS[0], greedy)])

            async def bad(prompt, params) -> None:
                async for _ in llm.generate(prompt, params):
                    raise AssertionError("no output for a refused request")

            running = asyncio.create_task(good())
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                await bad([5, 10**7], greedy)
            with pytest.raises(InvalidRequestError) as info:  # n choices count in the queue
                await bad(PROMPTS[1], SamplingParams(max_tokens=4, n=3))
            assert info.value.param == "n"
            assert await running > 0

    asyncio.run(main())


def test_encode_gives_the_offline_pooled_outputs(tiny_model: Path, reference: LLM) -> None:
    """Pooled vectors (and one a token) equal `LLM.encode`'s; a model without a tokenizer has no chat."""
    from conveyor import PoolingParams

    want = [o.outputs.data for o in reference.encode(PROMPTS[:2], use_tqdm=False)]
    every = reference.encode([PROMPTS[2]], PoolingParams(pooling_type="all"), use_tqdm=False)[0].outputs.data

    async def main() -> list:
        async with AsyncLLM(str(tiny_model), **OPTIONS) as llm:
            async def one(prompt, params=None):
                outs = [o async for o in llm.encode(prompt, params)]
                assert len(outs) == 1 and outs[0].finished
                return outs[0].outputs.data
            with pytest.raises(InvalidRequestError, match="no tokenizer"):  # (the tiny model has none)
                [o async for o in llm.chat([{"role": "user", "content": "hi"}])]
            return await asyncio.gather(one(PROMPTS[0]), one(PROMPTS[1]), one(PROMPTS[2], PoolingParams(pooling_type="all")))

    got = asyncio.run(main())
    assert got[:2] == want and got[2] == every and len(every) == len(PROMPTS[2])


def test_chat_puts_messages_through_the_template(smollm2: str) -> None:
    """SmolLM2's ChatML template: the same greedy tokens as `LLM.chat`."""
    messages = [{"role": "user", "content": "Name a color."}]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    options = {"kv_cache_memory": 64 << 20, "max_model_len": 512}
    want = LLM(smollm2, **options).chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids

    async def main() -> list[int]:
        async with AsyncLLM(smollm2, **options) as llm:
            outs = [o async for o in llm.chat(messages, params)]
            return outs[-1].outputs[0].token_ids

    assert asyncio.run(main()) == want


def test_only_an_engine_in_this_process_merges_choices() -> None:
    """The HTTP layer's fronts over another process take one choice a request."""
    assert AsyncEngine.parallel_sampling and not ProcessAsyncEngine.parallel_sampling
    assert EngineRequest("a", [1], SamplingParams(n=2)).params.n == 2
