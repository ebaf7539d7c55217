"""Pause and resume (vLLM's `pause_generation`, for an RL trainer's weight updates).

On the tiny Llama (greedy): "keep" freezes a request mid-answer, no step runs, and after the
resume it ends with the tokens of a request never paused; "wait" lets the requests already in
finish and holds the ones sent after it; "abort" ends them; `clear_cache` empties the prefix
cache. Through `AsyncLLM` the stream stops while paused and goes on after (over HTTP:
tests/server/test_pause_server.py).
"""

from __future__ import annotations

import asyncio

import pytest

from conveyor import AsyncLLM, EngineConfig, InvalidRequestError, SamplingParams
from conveyor.engine import Engine
from tests.conftest import finish_all as finish

PROMPT = list(range(10, 30))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def engine(model: str) -> Engine:
    return Engine.from_config(EngineConfig.from_kwargs(model=model, num_kv_blocks=64, block_size=8))


@pytest.fixture(scope="module")
def want(tiny_models) -> dict[str, list[int]]:
    e = engine(str(tiny_models["llama"]))
    e.add_request("a", PROMPT, GREEDY)
    e.add_request("b", PROMPT[:7], GREEDY)
    return finish(e)


def test_keep_freezes_requests_and_resume_ends_them_as_if_never_paused(tiny_models, want):
    e = engine(str(tiny_models["llama"]))
    e.add_request("a", PROMPT, GREEDY)
    for _ in range(4):
        e.step()
    assert e.pause_generation("keep") == [] and e.is_paused()
    steps = len(e.step_trace)
    e.add_request("b", PROMPT[:7], GREEDY)  # queued while paused
    assert e.step() == [] and not e.has_unfinished_requests() and len(e.step_trace) == steps
    assert e.resume_generation() and not e.is_paused()
    assert finish(e) == want


def test_wait_finishes_whats_in_and_holds_whats_sent_after(tiny_models, want):
    e = engine(str(tiny_models["llama"]))
    e.add_request("a", PROMPT, GREEDY)
    e.step()
    e.pause_generation("wait")
    assert not e.is_paused()  # "a" is still running
    e.add_request("b", PROMPT[:7], GREEDY)
    done = finish(e)
    assert done == {"a": want["a"]} and e.is_paused()
    e.resume_generation()
    assert finish(e) == {"b": want["b"]}


def test_abort_ends_everything_and_clear_cache_empties_the_prefix_cache(tiny_models):
    e = engine(str(tiny_models["llama"]))
    e.add_request("a", PROMPT, GREEDY)
    e.step()
    e.step()
    assert e.scheduler.block_manager.num_cached_blocks > 0
    outs = e.pause_generation("abort", clear_cache=True)
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("a", "abort")]
    assert e.is_paused() and e.scheduler.block_manager.num_cached_blocks == 0
    with pytest.raises(InvalidRequestError, match="mode"):
        e.pause_generation("later")


def test_async_llm_stream_stops_while_paused(tiny_models):
    # A long answer (400 tokens, the tiny model's room less the prompt), so that on a fast box the
    # pause lands while it runs: 12 tokens could all be made before the pause call reaches the engine.
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    e = engine(str(tiny_models["llama"]))
    e.add_request("a", PROMPT, long)
    want = finish(e)

    async def main() -> list[int]:
        llm = AsyncLLM(str(tiny_models["llama"]), num_kv_blocks=64, block_size=8)
        try:
            stream = llm.generate(PROMPT, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True,
                                                         output_kind="cumulative"), "a")
            first = await stream.__anext__()
            await llm.pause_generation("keep")
            assert await llm.is_paused()
            waiting = asyncio.ensure_future(stream.__anext__())
            while True:  # (the outputs made before the pause)
                done, _ = await asyncio.wait({waiting}, timeout=0.3)
                if not done:
                    break  # nothing moves while paused
                first = waiting.result()
                waiting = asyncio.ensure_future(stream.__anext__())
            assert len(first.outputs[0].token_ids) < 400
            await llm.resume_generation()
            outs = [await waiting] + [out async for out in stream]
            return list(outs[-1].outputs[0].token_ids)
        finally:
            await llm.shutdown()

    assert asyncio.run(main()) == want["a"]


# -- new weights (SGLang's update_weights_from_disk) ---------------------------------------------
@pytest.fixture(scope="module")
def second_weights(tmp_path_factory, tiny_models):
    """The tiny Llama's architecture with other weights (another seed), and another architecture."""
    from tests.conftest import TINY, build_tiny_model

    other = build_tiny_model(tmp_path_factory.mktemp("other") / "llama", "llama", seed=7)
    wider = build_tiny_model(tmp_path_factory.mktemp("wider") / "llama", "llama",
                             intermediate_size=2 * TINY.get("intermediate_size", 64))
    return other, wider


def test_new_weights_serve_as_an_engine_built_on_them(tiny_models, second_weights):
    other, wider = second_weights
    fresh = engine(str(other))
    fresh.add_request("a", PROMPT, GREEDY)
    want = finish(fresh)

    e = engine(str(tiny_models["llama"]))
    e.add_request("a", PROMPT, GREEDY)
    before = finish(e)
    assert before != want and e.scheduler.block_manager.num_cached_blocks > 0
    assert e.update_weights_from_disk(str(other)) and e.model_path == str(other)
    assert e.scheduler.block_manager.num_cached_blocks == 0  # (K/V of the old weights forgotten)
    e.add_request("a", PROMPT, GREEDY)
    assert finish(e) == want

    e.add_request("busy", PROMPT, GREEDY)
    with pytest.raises(InvalidRequestError, match="idle or paused"):
        e.update_weights_from_disk(str(tiny_models["llama"]))
    e.pause_generation("keep")
    e.update_weights_from_disk(str(tiny_models["llama"]))  # (paused: the frozen request goes on with them)
    e.resume_generation()
    assert len(finish(e)["busy"]) == 12
    with pytest.raises(InvalidRequestError, match="another architecture"):
        e.update_weights_from_disk(str(wider))
    with pytest.raises(InvalidRequestError, match="model_path"):
        e.update_weights_from_disk(str(other / "nowhere"))


# -- sleep mode (vLLM's) --------------------------------------------------------------------------
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_memory_back_and_wake_up_serves_as_before(tiny_models, want, level):
    import gc
    import weakref

    e = engine(str(tiny_models["llama"]))
    e.add_request("a", PROMPT, GREEDY)
    finish(e)
    runner = e.runner
    pages = [*runner.kv_pages, *runner.swap_pages]  # type: ignore[attr-defined]
    model = weakref.ref(runner.model)  # type: ignore[attr-defined]
    assert e.sleep(level) and e.is_sleeping()
    assert all(t.untyped_storage().nbytes() == 0 for t in pages)
    assert e.scheduler.block_manager.num_cached_blocks == 0
    gc.collect()
    assert (model() is None) == (level == 2)  # level 2: the weights are gone too
    with pytest.raises(InvalidRequestError, match="asleep"):
        e.add_request("b", PROMPT, GREEDY)
    assert e.wake_up() and not e.is_sleeping()
    assert all(t.untyped_storage().nbytes() > 0 for t in pages[:1])
    e.add_request("a", PROMPT, GREEDY)
    e.add_request("b", PROMPT[:7], GREEDY)
    assert finish(e) == want


@pytest.mark.parametrize("options", [
    {"speculative_method": "ngram", "prompt_lookup_min": 1},
    {"speculative_method": "draft_model", "speculative_model": "<tiny>", "num_speculative_tokens": 3},
    {"dtype": "float64", "tensor_parallel_size": 2, "num_threads": 1},
], ids=["ngram", "draft-model", "tensor-parallel"])
def test_sleep_level_1_with_a_drafter_or_ranks_gives_their_caches_back_too(tiny_models, options):
    """A draft model's own KV cache is given back beside the target's (each worker rank its own
    through a step message), and after `wake_up` the greedy tokens are those of before; level 2
    is refused where the model cannot be built again (a draft model, tensor parallelism)."""
    from conveyor import LLM

    kw = {k: str(tiny_models["llama"]) if v == "<tiny>" else v for k, v in options.items()}
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=64, block_size=8, **kw)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def ask() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate([PROMPT, PROMPT[:7]], params, use_tqdm=False)]

    before = ask()
    draft = getattr(llm.engine.drafter, "runner", None)
    pages = [*llm.engine.runner.kv_pages, *(draft.kv_pages if draft is not None else [])]  # type: ignore[attr-defined]
    assert llm.sleep(1)
    assert all(t.untyped_storage().nbytes() == 0 for t in pages)
    assert llm.wake_up() and ask() == before
    if options.get("speculative_method") != "ngram":
        with pytest.raises(InvalidRequestError, match="not built"):
            llm.sleep(2)


def test_sleep_needs_an_idle_engine(tiny_models):
    e = engine(str(tiny_models["llama"]))
    e.add_request("a", PROMPT, GREEDY)
    with pytest.raises(InvalidRequestError, match="idle"):
        e.sleep(1)
    with pytest.raises(InvalidRequestError, match="level"):
        e.sleep(3)
    e.pause_generation("keep")
    with pytest.raises(InvalidRequestError, match="idle"):
        e.sleep(1)  # (a paused request still holds its K/V)
