"""`AsyncEngine` in-process (no HTTP), on a tiny random-weight model: streams, aborts, errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from conveyor import EngineConfig, InvalidRequestError, SamplingParams
from conveyor.engine import Engine
from conveyor.server.async_engine import (
    AsyncEngine,
    EngineRequest,
    EngineShuttingDownError,
    QueueFullError,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENDLESS = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    import torch

    torch.set_num_threads(1)
    return Engine.from_config(
        EngineConfig.from_kwargs(model=str(tiny_model), num_kv_blocks=1024, max_num_seqs=4)
    )


def run(engine: Engine, body: Callable[[AsyncEngine], Awaitable[Any]], **kwargs: Any) -> Any:
    """Run `body` against a fresh AsyncEngine over `engine`; stop it whatever happens."""

    async def main() -> Any:
        async_engine = AsyncEngine(engine, **kwargs)
        async_engine.start()
        try:
            return await body(async_engine)
        finally:
            await async_engine.stop()

    result = asyncio.run(main())
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    return result


def sync_tokens(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("sync", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final is not None
    return final.outputs[0].token_ids


def test_generate_streams_deltas_that_add_up_to_the_sync_engines_tokens(engine: Engine) -> None:
    async def body(ae: AsyncEngine) -> tuple[list[int], list[int], int]:
        deltas: list[int] = []
        final: list[int] = []
        count = 0
        async for out in ae.generate([5, 6, 7], GREEDY, "a"):
            count += 1
            deltas += out.outputs[0].delta_token_ids
            final = out.outputs[0].token_ids
            assert out.finished == (len(final) == GREEDY.max_tokens)
        return deltas, final, count

    deltas, final, count = run(engine, body)
    assert deltas == final == sync_tokens(engine, [5, 6, 7], GREEDY)
    assert count == GREEDY.max_tokens  # one output per step, the last one finished


def test_a_group_streams_every_member_to_its_end(engine: Engine) -> None:
    async def body(ae: AsyncEngine) -> dict[str, list[int]]:
        reqs = [EngineRequest(f"g-{i}", [9, 8, 7 + i], GREEDY) for i in range(3)]
        stream = await ae.add(reqs)
        finals: dict[str, list[int]] = {}
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        assert stream.finished
        return finals

    finals = run(engine, body)
    assert sorted(finals) == ["g-0", "g-1", "g-2"]
    assert all(len(t) == GREEDY.max_tokens for t in finals.values())


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_a_consumer_that_goes_away_aborts_its_request(engine: Engine, how: str) -> None:
    async def body(ae: AsyncEngine) -> None:
        if how == "aclose":
            async with contextlib.aclosing(ae.generate([5, 6], ENDLESS, "gone")) as outs:
                async for out in outs:
                    if len(out.outputs[0].token_ids) >= 3:
                        break  # GeneratorExit inside generate(): it aborts
        else:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in ae.generate([5, 6], ENDLESS, "gone"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()  # CancelledError inside generate(): it aborts
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # The abort is applied before the next step, and its final output closes the stream.
        assert await ae.wait_idle(timeout=5.0)
        assert engine.scheduler.block_manager.num_used_blocks == 0
        assert not engine.has_unfinished_requests()

    run(engine, body)


def test_invalid_requests_raise_before_any_output_and_queue_nothing(engine: Engine) -> None:
    async def body(ae: AsyncEngine) -> None:
        with pytest.raises(InvalidRequestError, match="outside the vocabulary") as info:
            await ae.add([EngineRequest("bad", [5, 10**7], GREEDY)])
        assert info.value.param == "prompt"
        # A group is accepted whole or not at all: the valid member is not left behind.
        with pytest.raises(InvalidRequestError):
            await ae.add([EngineRequest("ok", [5], ENDLESS), EngineRequest("bad", [], ENDLESS)])
        gen = ae.generate([], GREEDY, "empty")
        with pytest.raises(InvalidRequestError, match="empty"):
            await gen.__anext__()
        assert await ae.wait_idle(timeout=1.0)
        assert not engine.has_unfinished_requests()

    run(engine, body)


def test_a_group_larger_than_the_queue_is_refused(engine: Engine) -> None:
    async def body(ae: AsyncEngine) -> None:
        with pytest.raises(InvalidRequestError) as info:
            await ae.add([EngineRequest(f"n-{i}", [5], GREEDY) for i in range(3)])
        assert info.value.param == "n"
        assert issubclass(QueueFullError, RuntimeError)

    run(engine, body, max_queued_requests=2)


def test_the_idle_engine_thread_sleeps(engine: Engine) -> None:
    async def body(ae: AsyncEngine) -> float:
        async for _ in ae.generate([5], GREEDY, "warm"):
            pass
        cpu = time.process_time()
        await asyncio.sleep(0.5)
        return time.process_time() - cpu

    assert run(engine, body) < 0.1  # a busy loop would burn ~0.5 s of CPU here


def test_stop_aborts_what_is_in_flight_and_refuses_new_work(engine: Engine) -> None:
    async def body(ae: AsyncEngine) -> tuple[str | None, type[BaseException] | None]:
        stream = await ae.add([EngineRequest("long", [5, 6], ENDLESS)])
        first = await stream.__anext__()
        assert not first.finished
        await ae.stop()
        last = first
        async for out in stream:
            last = out
        error: type[BaseException] | None = None
        try:
            await ae.add([EngineRequest("late", [5], GREEDY)])
        except EngineShuttingDownError as e:
            error = type(e)
        return last.outputs[0].finish_reason, error

    reason, error = run(engine, body)
    assert reason == "abort"
    assert error is EngineShuttingDownError


def test_a_new_grammar_compiles_while_the_running_requests_go_on(tiny_model: Path, tmp_path: Path) -> None:
    """A request bringing a new grammar is added once a worker thread has compiled it; held
    there, the running request's tokens keep coming; a grammar that cannot be built makes
    `add` raise, naming the field."""
    import threading

    import regex

    from conveyor import StructuredOutputParams
    from tests.structured.tiny_tokenizer import with_tokenizer

    engine = Engine.from_config(EngineConfig.from_kwargs(
        model=str(with_tokenizer(tiny_model, tmp_path / "llama")), num_kv_blocks=256, num_threads=1))
    release = threading.Event()
    compile_grammars = engine.compile_grammars

    def held(specs):
        release.wait(60)
        compile_grammars(specs)

    engine.compile_grammars = held  # type: ignore[method-assign]
    pattern = r"(cat|dog)s? [0-9]{1,3}"

    async def body(ae: AsyncEngine) -> None:
        plain = await ae.add([EngineRequest("plain", [5, 6, 7], ENDLESS)])
        outputs = aiter(plain)
        await anext(outputs)
        constrained = asyncio.create_task(ae.add([EngineRequest("json", [5, 6, 7], SamplingParams(
            max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputParams(regex=pattern)))]))
        for _ in range(5):  # the compile is held: the plain stream moves on
            await asyncio.wait_for(anext(outputs), 30)
        assert not constrained.done()
        release.set()
        stream = await asyncio.wait_for(constrained, 30)
        finals = [o async for o in stream]
        assert engine.tokenizer is not None
        assert regex.fullmatch(pattern, finals[-1].outputs[0].text)
        with pytest.raises(InvalidRequestError) as e:
            await ae.add([EngineRequest("huge", [5, 6, 7], SamplingParams(
                structured_outputs=StructuredOutputParams(regex="[a-z]{1,3000}x{1,3000}")))])
        assert e.value.param == "structured_outputs"
        plain.abort()

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            await body(ae)
        finally:
            release.set()
            await ae.stop()

    asyncio.run(main())
