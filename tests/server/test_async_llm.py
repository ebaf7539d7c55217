"""`AsyncLLM`, the engine for asyncio programs, on a tiny random-weight model, with its engine
in a thread and in a process of its own: concurrent requests get `LLM.generate`'s outputs,
`n > 1` its choices, deltas add up, a consumer that leaves aborts its request, bad requests
raise before any output while the others go on; `encode`, `classify` and `score` give `LLM`'s."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from conveyor import AsyncLLM, InvalidRequestError, SamplingParams
from conveyor.llm import LLM
from conveyor.server.async_engine import AsyncEngine, EngineRequest, EngineShuttingDownError
from conveyor.server.engine_process import ProcessAsyncEngine

OPTIONS = {"num_kv_blocks": 256, "block_size": 8, "max_num_seqs": 4}
PROMPTS = [[5, 6, 7], [9, 3, 4, 12, 30], [17] * 9, [2, 40, 41]]
MODES = pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])


def make(model: Path | str, process: bool, **options) -> AsyncLLM:
    """An `AsyncLLM` with its engine in this process's thread or in a process of its own (one
    torch thread there: the tests' machine has two cores)."""
    if process:
        return AsyncLLM(str(model), engine_process=True, num_threads=1, **{**OPTIONS, **options})
    return AsyncLLM(str(model), **{**OPTIONS, **options})


async def drained(llm: AsyncLLM) -> None:
    """Wait until nothing is in flight; then no KV block is held (where the engine is here)."""
    for _ in range(300):
        if llm.num_unfinished_requests == 0 and (llm.engine is None or not llm.engine.has_unfinished_requests()):
            break
        await asyncio.sleep(0.01)
    assert llm.num_unfinished_requests == 0
    if llm.engine is not None:
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), **OPTIONS)


@MODES
def test_concurrent_requests_get_the_offline_outputs(tiny_model: Path, reference: LLM, process: bool) -> None:
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
        async with make(tiny_model, process) as llm:
            assert (llm.engine is None) == process and (llm.engine_process is not None) == process
            got = await asyncio.gather(*[final(llm, p, greedy, f"r{i}") for i, p in enumerate(PROMPTS)],
                                       final(llm, PROMPTS[1], sampled, "n3"))
            await drained(llm)
            return got

    got = asyncio.run(main())
    assert got[:4] == want
    assert got[4] == want_n and len({tuple(t) for t in want_n}) > 1


@MODES
def test_deltas_add_up_and_a_consumer_that_leaves_aborts(tiny_model: Path, reference: LLM, process: bool) -> None:
    """`output_kind="delta"` pieces of an n=2 request concatenate, per choice, to the final
    tokens; breaking out of a stream (or `abort`) ends its request at once and frees its blocks
    while another one goes on."""
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2, ignore_eos=True, output_kind="delta")
    want = [c.token_ids for c in reference.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs]
    endless = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        async with make(tiny_model, process) as llm:
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
            choices: list = []  # aborting an n = 3 request by its id ends every choice

            async def until_choices_aborted() -> None:
                async for out in llm.generate(PROMPTS[1], dataclasses.replace(endless, n=3, seed=1, temperature=0.5),
                                              "three"):
                    choices.append(out)
                    if len(choices) == 2:
                        llm.abort("three")

            await asyncio.wait_for(until_choices_aborted(), timeout=30)
            assert choices[-1].finished and [c.finish_reason for c in choices[-1].outputs] == ["abort"] * 3
            await drained(llm)

    asyncio.run(main())


@MODES
def test_a_stream_interval_sends_fewer_outputs_of_the_same_tokens(tiny_model: Path, reference: LLM,
                                                                   process: bool) -> None:
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True, output_kind="delta")
    want = reference.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids

    async def main() -> list[list[int]]:
        async with make(tiny_model, process, stream_interval=5) as llm:
            return [list(out.outputs[0].token_ids) async for out in llm.generate(PROMPTS[1], params, "s")]

    outs = asyncio.run(main())
    assert [len(o) for o in outs] == [1, 5, 5, 5, 5] and [t for o in outs for t in o] == want


@MODES
def test_reset_prefix_cache_forgets_the_engines_prefixes(tiny_model: Path, process: bool) -> None:
    """vLLM's `AsyncLLM.reset_prefix_cache`, run where the engine runs, between two steps."""
    prompt = list(range(100, 140))
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def cached(llm: AsyncLLM, rid: str) -> int:
        last = None
        async for out in llm.generate(prompt, greedy, rid):
            last = out
        assert last is not None
        return last.num_cached_tokens

    async def main() -> list[int]:
        async with make(tiny_model, process) as llm:
            first, again = await cached(llm, "a"), await cached(llm, "b")
            assert await llm.reset_prefix_cache() and await llm.reset_mm_cache()
            return [first, again, await cached(llm, "c")]

    assert asyncio.run(main()) == [0, 32, 0]


@MODES
def test_a_bad_request_raises_before_any_output_and_the_others_go_on(tiny_model: Path, process: bool) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        async with make(tiny_model, process, max_queued_requests=2) as llm:
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


@MODES
def test_encode_gives_the_offline_pooled_outputs(tiny_model: Path, reference: LLM, process: bool) -> None:
    """Pooled vectors (and one a token) equal `LLM.encode`'s; a model without a tokenizer has no chat."""
    from conveyor import PoolingParams

    want = [o.outputs.data for o in reference.encode(PROMPTS[:2], use_tqdm=False)]
    every = reference.encode([PROMPTS[2]], PoolingParams(pooling_type="all"), use_tqdm=False)[0].outputs.data

    async def main() -> list:
        async with make(tiny_model, process) as llm:
            async def one(prompt, params=None):
                outs = [o async for o in llm.encode(prompt, params)]
                assert len(outs) == 1 and outs[0].finished
                return outs[0].outputs.data
            with pytest.raises(InvalidRequestError, match="no tokenizer"):  # (the tiny model has none)
                [o async for o in llm.chat([{"role": "user", "content": "hi"}])]
            return await asyncio.gather(one(PROMPTS[0]), one(PROMPTS[1]), one(PROMPTS[2], PoolingParams(pooling_type="all")))

    got = asyncio.run(main())
    assert len(every) == len(PROMPTS[2])
    if not process:
        assert got[:2] == want and got[2] == every
    else:  # one torch thread there: float32 sums in another order
        assert [pytest.approx(v, abs=1e-5) for v in want] == got[:2]
        assert [pytest.approx(v, abs=1e-5) for v in every] == got[2]


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


def test_only_a_router_takes_one_choice_a_request() -> None:
    """An engine's front end takes n > 1 in one request, in this process or another (the
    HTTP layer makes its own choices as requests); replicas behind a router take one."""
    from conveyor.server.replicas import ReplicaSet

    assert AsyncEngine.parallel_sampling and ProcessAsyncEngine.parallel_sampling
    assert not ReplicaSet.parallel_sampling
    assert EngineRequest("a", [1], SamplingParams(n=2)).params.n == 2


def test_an_engine_process_never_served_ends_with_shutdown(tiny_model: Path) -> None:
    """The model loads before `AsyncLLM(engine_process=True)` returns (its facts are known), and
    `shutdown` ends the process though no request was made."""
    llm = make(tiny_model, True)
    front = llm.engine_process
    assert front is not None and front.engine_pid is not None and llm.tokenizer is None and llm.head.labels == ()
    asyncio.run(llm.shutdown())
    assert front._proc is not None and not front._proc.is_alive()


@pytest.fixture(scope="module")
def scorers(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, str]:
    """A two-class classifier, a one-class cross-encoder, and the tiny model with a tokenizer
    (an embedding model's scores)."""
    import shutil

    from tests.conftest import build_tiny_classifier, save_word_tokenizer

    root = tmp_path_factory.mktemp("scorers")
    embedder = root / "embedder"
    shutil.copytree(tiny_model, embedder)
    save_word_tokenizer(embedder)
    return {"classifier": str(build_tiny_classifier(root / "classifier", "llama", ["no", "yes"])),
            "reranker": str(build_tiny_classifier(root / "reranker", "qwen3", ["relevant"], seed=1, head_dim=32)),
            "embedder": str(embedder)}


@MODES
def test_classify_and_score_give_the_offline_results(scorers: dict[str, str], process: bool) -> None:
    """`classify` is `LLM.classify` (probabilities, label); `score` is `LLM.score` for a
    cross-encoder (pairs read as one input) and for an embedding model (cosines), its pairs
    concurrent; a token-level or generating model's refusals are `LLM`'s."""
    from conveyor import PoolingParams

    texts = ["w10 w11 w12", "w20 w21", "w30 w31 w32 w33"]
    options = {"dtype": "float64", "num_kv_blocks": 64}
    want: dict[str, object] = {}
    for name, path in scorers.items():
        offline = LLM(path, **options)
        if name == "classifier":
            outs = offline.classify(texts, use_tqdm=False)
            logits = offline.classify(texts[:1], PoolingParams(activation=False), use_tqdm=False)[0]
            want[name] = ([o.outputs.probs for o in outs], [o.label for o in outs], logits.outputs.probs)
        else:
            want[name] = (offline.score(texts[0], texts[1:], use_tqdm=False),
                          offline.score(texts[:2], texts[1:], use_tqdm=False))

    async def main() -> dict[str, object]:
        got: dict[str, object] = {}
        for name, path in scorers.items():
            async with make(path, process, **options) as llm:
                if name == "classifier":
                    outs = await asyncio.gather(*[llm.classify(t) for t in texts])
                    logits = await llm.classify(texts[0], PoolingParams(activation=False))
                    got[name] = ([o.outputs.probs for o in outs], [o.label for o in outs], logits.outputs.probs)
                    with pytest.raises(InvalidRequestError, match="one-class"):
                        await llm.score(texts[0], texts[1:])
                else:
                    got[name] = (await llm.score(texts[0], texts[1:]), await llm.score(texts[:2], texts[1:]))
                    with pytest.raises(InvalidRequestError, match="as many as text_2"):
                        await llm.score(texts[:2], texts)
                if name == "embedder":
                    with pytest.raises(InvalidRequestError) as refused:  # a causal LM has no classes
                        await llm.classify(texts[0])
                    assert refused.value.param == "task"
                await drained(llm)
        return got

    got = asyncio.run(main())
    if not process:
        assert got == want
    else:  # float64 there too, on one torch thread: the same to rounding
        assert got.keys() == want.keys()
        assert got["classifier"][1] == want["classifier"][1]  # type: ignore[index]
        assert numbers(got) == pytest.approx(numbers(want), rel=1e-12, abs=1e-12)
    probs, labels, _ = want["classifier"]  # type: ignore[misc]
    assert labels == ["no" if p[0] > p[1] else "yes" for p in probs]


def numbers(tree: object) -> list[float]:
    """Every float in nested dicts, tuples and lists, in order."""
    if isinstance(tree, float):
        return [tree]
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in numbers(tree[k])]
    if isinstance(tree, list | tuple):
        return [x for item in tree for x in numbers(item)]
    return []


@MODES
def test_adapters_added_pinned_and_removed(tiny_models: dict[str, Path], tmp_path: Path, process: bool) -> None:
    """vLLM's `AsyncLLM.add_lora`, `pin_lora`, `list_loras`, `remove_lora`, run where the engine
    runs: an added adapter serves HF's merged tokens, a refusal raises; in a process of its own,
    an engine started again after a SIGKILL has the adapters added and pinned before."""
    import os
    import signal

    from conveyor import LoRARequest
    from tests.test_lora import SPECS, merged_reference, write_adapter

    model = tiny_models["llama"]
    a = LoRARequest("a", 1, str(write_adapter(tmp_path / "a", model, *SPECS["attn-qv"], seed=0)))
    b = LoRARequest("b", 2, str(write_adapter(tmp_path / "b", model, *SPECS["mlp-some"], seed=1)))
    prompt = [5, 17, 99, 120, 7, 64]
    want = merged_reference(model, Path(a.lora_path), [prompt], 8)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def run(llm: AsyncLLM, lora: LoRARequest | None = a) -> list[int]:
        async for out in llm.generate(prompt, params, lora_request=lora):
            if out.finished:
                return out.outputs[0].token_ids
        raise AssertionError("no final output")

    async def main() -> None:
        async with make(model, process, dtype="float64", enable_lora=True, max_cpu_loras=1) as llm:
            assert await llm.add_lora(a) and await llm.pin_lora(1) and await llm.list_loras() == {1}
            with pytest.raises(InvalidRequestError, match="add_lora it first"):
                await llm.pin_lora(2)
            with pytest.raises(InvalidRequestError, match=r"no adapter_config\.json"):
                await llm.add_lora(LoRARequest("c", 3, str(tmp_path / "nowhere")))
            assert await run(llm) == want
            front = llm.engine_process
            if front is not None:
                first = front.engine_pid
                assert first is not None
                os.kill(first, signal.SIGKILL)
                assert await run(llm, None) != want  # (the base model's, in the new engine)
                assert front.engine_pid != first
                assert await llm.list_loras() == {1}  # added again (no request named it), and pinned:
            assert await llm.add_lora(b) and await llm.list_loras() == {1, 2}  # beside max_cpu_loras' one place
            assert await llm.remove_lora(1) and not await llm.remove_lora(1)
            assert await llm.list_loras() == {2}
        with pytest.raises(EngineShuttingDownError, match="shutting down"):
            await llm.list_loras()

    asyncio.run(main())
