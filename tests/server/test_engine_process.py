"""The engine in its own process (`ProcessAsyncEngine`, `conveyor serve --engine-process`).

The engine process is killed with SIGKILL mid-stream: the front end starts another and every
request in flight goes on from its last delivered token, with the tokens an engine that never
died gives (greedy and seeded requests), in every output kind. A request in flight through more
deaths than allowed fails alone; the server serves the next request.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor import EngineConfig, InvalidRequestError, SamplingParams
from conveyor.engine import Engine
from conveyor.outputs import RequestOutput
from conveyor.server.async_engine import EngineRequest, EngineShuttingDownError, OutputStream
from conveyor.server.engine_process import ProcessAsyncEngine, RequestFailedError
from conveyor.server.metrics import ServerMetrics
from tests.server.conftest import (
    ServerProcess,
    StreamReader,
    child_pids,
    engine_pids,
    sample,
    scrape,
)

LONG = 1500  # tokens: long enough to be killed in the middle of


def kwargs(model: Path) -> dict[str, Any]:
    return {"model": str(model), "num_kv_blocks": 1024, "max_num_seqs": 4, "num_threads": 1}


def run(model: Path, body: Callable[[ProcessAsyncEngine], Awaitable[Any]], **opts: Any) -> Any:
    async def main() -> Any:
        engine = ProcessAsyncEngine(kwargs(model), metrics=ServerMetrics("tiny"), **opts)
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


def reference(model: Path, prompts: dict[str, tuple[list[int], SamplingParams]], **options: Any) -> dict[str, RequestOutput]:
    """The same requests on an engine in this process that nobody kills."""
    import torch

    torch.set_num_threads(1)
    engine = Engine.from_config(EngineConfig.from_kwargs(**{**kwargs(model), **options}))
    for rid, (prompt, params) in prompts.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


async def collect(stream: OutputStream, into: list[RequestOutput] | None = None) -> list[RequestOutput]:
    outs = into if into is not None else []
    async for out in stream:
        outs.append(out)
    return outs


async def wait_for(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_killed_engine_restarts_and_every_request_resumes_with_the_same_tokens(tiny_model: Path) -> None:
    greedy = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    prompts = {
        "delta": ([5, 6, 7], SamplingParams(**{**_fields(greedy), "output_kind": "delta", "logprobs": 2})),
        "cumulative": ([8, 9], SamplingParams(**{**_fields(greedy), "output_kind": "cumulative"})),
        "final": ([10, 11, 12, 13], SamplingParams(**{**_fields(greedy), "output_kind": "final_only"})),
        "seeded": ([14, 15], SamplingParams(max_tokens=LONG, temperature=1.0, top_k=50, seed=7,
                                            ignore_eos=True, output_kind="delta")),
    }

    async def body(engine: ProcessAsyncEngine) -> tuple[dict[str, list[RequestOutput]], int, int | None, ServerMetrics]:
        first_pid = engine.engine_pid
        streams = {rid: await engine.add([EngineRequest(rid, p, sp)]) for rid, (p, sp) in prompts.items()}
        seen: list[RequestOutput] = []
        tasks = {rid: asyncio.create_task(collect(s, seen if rid == "delta" else None)) for rid, s in streams.items()}
        await wait_for(lambda: len(seen) > 50)  # tokens are flowing
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)
        results = {rid: await t for rid, t in tasks.items()}
        assert engine.engine_pid != first_pid
        assert engine.metrics is not None
        return results, engine.restarts, first_pid, engine.metrics

    results, restarts, _, metrics = run(tiny_model, body)
    ref = reference(tiny_model, {rid: (p, SamplingParams(**{**_fields(sp), "output_kind": "cumulative"}))
                                 for rid, (p, sp) in prompts.items()})
    assert restarts == 1
    assert metrics.engine_restarts._value.get() == 1
    assert metrics.requests_replayed._value.get() == 4  # all four were in flight

    delta = results["delta"]
    tokens = [t for out in delta for t in out.outputs[0].token_ids]
    assert tokens == ref["delta"].outputs[0].token_ids  # nothing lost, nothing twice
    logprobs = [lp for out in delta for lp in out.outputs[0].logprobs or []]
    assert [lp.token_id for lp in logprobs] == tokens and all(len(lp.top or []) == 2 for lp in logprobs)
    assert delta[-1].finished and delta[-1].outputs[0].finish_reason == "length"

    cumulative = results["cumulative"]
    assert cumulative[-1].outputs[0].token_ids == ref["cumulative"].outputs[0].token_ids
    assert all(a.outputs[0].token_ids == b.outputs[0].token_ids[: len(a.outputs[0].token_ids)]
               for a, b in itertools.pairwise(cumulative))  # each a prefix of the next

    final = results["final"]
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == ref["final"].outputs[0].token_ids
    assert final[0].prompt_token_ids == [10, 11, 12, 13]
    m = final[0].metrics  # timestamps span the restart: one per token, in order
    assert m.first_token_time is not None and len(m.token_times) == LONG
    assert m.token_times == sorted(m.token_times) and m.first_token_time == m.token_times[0]

    seeded = [t for out in results["seeded"] for t in out.outputs[0].token_ids]
    assert seeded == ref["seeded"].outputs[0].token_ids  # its generator went on where it stood


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


def test_n_choices_run_as_requests_of_one_choice_and_resume_each_after_a_death(tiny_model: Path) -> None:
    """A request with n = 3 in each output kind: its choices are requests of their own in the
    engine process, each resumed after a kill; the merged outputs are an engine's that never
    died (choice i seeded with seed + i, the prompt's logprobs once); aborting the request's id
    ends every choice."""
    base = {"max_tokens": 300, "temperature": 1.0, "top_k": 50, "seed": 11, "ignore_eos": True, "n": 3}
    prompts = {kind: ([5, 6, 7 + i], SamplingParams(**base, output_kind=kind, prompt_logprobs=1))
               for i, kind in enumerate(["delta", "cumulative", "final_only"])}

    async def body(engine: ProcessAsyncEngine) -> tuple[dict[str, list[RequestOutput]], RequestOutput]:
        streams = {rid: await engine.add([EngineRequest(rid, p, sp)]) for rid, (p, sp) in prompts.items()}
        assert streams["delta"].request_ids == ["delta#0", "delta#1", "delta#2"]
        seen: list[RequestOutput] = []
        tasks = {rid: asyncio.create_task(collect(s, seen if rid == "delta" else None)) for rid, s in streams.items()}
        await wait_for(lambda: len(seen) > 30)
        assert engine.engine_pid is not None
        os.kill(engine.engine_pid, signal.SIGKILL)
        results = {rid: await t for rid, t in tasks.items()}
        with pytest.raises(InvalidRequestError) as clash:  # a request id is one request's, choices and all
            endless = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True, n=2)
            held = await engine.add([EngineRequest("held", [5], endless)])
            await engine.add([EngineRequest("held", [6], endless)])
        assert clash.value.param == "request_id"
        first = await held.__anext__()
        engine.abort(["held"])
        last = (await collect(held))[-1] if not first.finished else first
        return results, last

    results, aborted = run(tiny_model, body)
    ref = reference(tiny_model, {rid: (p, SamplingParams(**{**_fields(sp), "output_kind": "cumulative"}))
                                 for rid, (p, sp) in prompts.items()})
    for rid, outs in results.items():
        want = ref[rid]
        assert all(o.request_id == rid for o in outs) and outs[-1].finished
        assert sum(o.finished for o in outs) == 1  # one final output, once every choice ended
        if rid == "delta":  # each output one choice's move; they add up to each choice's tokens
            got = [[t for o in outs for c in o.outputs if c.index == i for t in c.token_ids] for i in range(3)]
            assert sum(o.prompt_logprobs is not None for o in outs) == 1
        else:
            assert [c.index for c in outs[-1].outputs] == [0, 1, 2]
            got = [c.token_ids for c in outs[-1].outputs]
            assert outs[-1].prompt_logprobs == want.prompt_logprobs
        assert got == [c.token_ids for c in want.outputs]
        assert len({tuple(t) for t in got}) == 3
    assert len(results["final_only"]) == 1
    assert aborted.finished and {c.finish_reason for c in aborted.outputs} == {"abort"}
    assert [c.index for c in aborted.outputs] == [0, 1]


def test_a_request_through_more_deaths_than_allowed_fails_alone_and_serving_goes_on(tiny_model: Path) -> None:
    params = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True, output_kind="delta")
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def body(engine: ProcessAsyncEngine) -> tuple[BaseException | None, list[RequestOutput], ServerMetrics]:
        stream = await engine.add([EngineRequest("doomed", [5, 6, 7], params)])
        seen: list[RequestOutput] = []
        task = asyncio.create_task(collect(stream, seen))
        await wait_for(lambda: len(seen) > 5)
        assert engine.engine_pid is not None
        os.kill(engine.engine_pid, signal.SIGKILL)
        error: BaseException | None = None
        try:
            await task
        except RequestFailedError as e:
            error = e
        after = await collect(await engine.add([EngineRequest("next", [5, 6, 7], short)]))
        assert engine.metrics is not None
        return error, after, engine.metrics

    error, after, metrics = run(tiny_model, body, max_replays=0)
    assert isinstance(error, RequestFailedError) and "died 1 time" in str(error)
    ref = reference(tiny_model, {"next": ([5, 6, 7], short)})
    assert after[-1].outputs[0].token_ids == ref["next"].outputs[0].token_ids
    assert metrics.requests_failed._value.get() == 1
    assert metrics.requests_replayed._value.get() == 0


def test_bad_requests_full_queues_and_stop_behave_as_in_the_thread(tiny_model: Path) -> None:
    endless = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True, output_kind="delta")

    async def body(engine: ProcessAsyncEngine) -> None:
        with pytest.raises(InvalidRequestError) as bad:
            await engine.add([EngineRequest("bad", [5, 10**9], endless)])
        assert bad.value.param == "prompt"
        with pytest.raises(InvalidRequestError) as many:
            await engine.add([EngineRequest(f"g{i}", [5], endless) for i in range(3)])
        assert many.value.param == "n"
        running = await engine.add([EngineRequest("running", [5, 6], endless)])
        seen: list[RequestOutput] = []
        task = asyncio.create_task(collect(running, seen))
        await wait_for(lambda: len(seen) > 0)
        await engine.stop()
        outs = await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineShuttingDownError):
            await engine.add([EngineRequest("late", [5], endless)])
        assert engine.tokenizer is None and engine.max_model_len > 0

    run(tiny_model, body, max_queued_requests=2)


def _engine_pid(server: ServerProcess) -> int:
    """The server's one engine process."""
    pids = engine_pids(server)
    if not pids:
        raise AssertionError("no engine process")
    (pid,) = pids
    return pid


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the engine process through /proc")
def test_served_streams_survive_a_killed_engine(tiny_model: Path, tmp_path: Path) -> None:
    server = ServerProcess(
        ["--model", str(tiny_model), "--max-num-seqs", "4", "--num-kv-blocks", "1024"],  # the default
        tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        body = {"prompt": [5, 6, 7], "max_tokens": LONG, "ignore_eos": True, "temperature": 0.0,
                "logprobs": 0, "stream": True}
        reader = StreamReader(server.url, body)
        assert reader.flowing.wait(60)
        os.kill(_engine_pid(server), signal.SIGKILL)
        reader.join(120)
        events = reader.events
        assert events and events[-1] == {"done": True}, server.log()
        tokens = reader.tokens()
        assert len(tokens) == LONG
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        # The same tokens as a request nobody interrupted, on the restarted engine.
        again = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=120.0).json()
        assert again["choices"][0]["logprobs"]["tokens"] == tokens
        m = scrape(server.url)
        assert sample(m, "conveyor:engine_restarts_total") == 1
        assert sample(m, "conveyor:requests_replayed_total") == 1
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="looks for the engine process through /proc")
def test_no_engine_process_serves_from_a_thread(tiny_model: Path, tmp_path: Path) -> None:
    server = ServerProcess(
        ["--model", str(tiny_model), "--num-kv-blocks", "256", "--no-engine-process"], tmp_path / "server.log"
    )
    try:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4, "logprobs": 0},
                       timeout=60.0)
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 4
        with pytest.raises(AssertionError, match="no engine process"):
            _engine_pid(server)
    finally:
        assert server.stop() == 0, server.log()


def test_a_new_grammar_compiles_while_the_running_requests_go_on(tiny_model: Path, tmp_path: Path) -> None:
    """The engine process's loop, in a thread, with each grammar's compile held until the test
    lets it go: meanwhile the running request's tokens keep coming, step after step; then the
    constrained request is added and served, and one whose grammar cannot be built is refused
    with the error adding it gives."""
    import multiprocessing
    import threading
    import time

    from conveyor import StructuredOutputParams
    from conveyor.server.engine_process import _AddItem, _EngineCore
    from tests.structured.tiny_tokenizer import with_tokenizer

    engine = Engine.from_config(EngineConfig.from_kwargs(
        model=str(with_tokenizer(tiny_model, tmp_path / "llama")), num_kv_blocks=256, num_threads=1))
    release = threading.Event()
    compile_grammars = engine.compile_grammars

    def held(specs):  # the worker's compile, held
        release.wait(60)
        compile_grammars(specs)

    engine.compile_grammars = held  # type: ignore[method-assign]
    ours, theirs = multiprocessing.Pipe()
    core = _EngineCore(engine, theirs, None, 0.01)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()

    def add(add_id: int, rid: str, params: SamplingParams) -> None:
        ours.send(("add", add_id, [_AddItem(rid, [5, 6, 7], params, None)], time.perf_counter(), True))

    def until(kind: str) -> list[tuple[Any, ...]]:
        seen = []
        while True:
            assert ours.poll(60), f"no {kind!r} message"
            msg = ours.recv()
            seen.append(msg)
            if msg[0] == kind:
                return seen

    try:
        add(1, "plain", SamplingParams(max_tokens=400, ignore_eos=True, output_kind="delta"))
        assert until("added")[-1] == ("added", 1, None)
        add(2, "json", SamplingParams(max_tokens=30, temperature=0.0, output_kind="delta",
                                      structured_outputs=StructuredOutputParams(regex=r"(cat|dog)s? [0-9]{1,3}")))
        add(3, "huge", SamplingParams(structured_outputs=StructuredOutputParams(regex="[a-z]{1,3000}x{1,3000}")))
        steps_meanwhile = 0
        while steps_meanwhile < 5:  # the compiles are held: only the plain request moves
            msg = until("step")[-1]
            assert all(u.request_id == "plain" for u in msg[1])
            steps_meanwhile += any(u.token_ids for u in msg[1])
        release.set()
        answers: dict[int, Any] = {}
        texts: dict[str, list[int]] = {"json": []}
        while len(answers) < 2 or not any(texts.get("done", [])):
            msg = ours.recv() if ours.poll(60) else pytest.fail("the loop went quiet")
            if msg[0] == "added":
                answers[msg[1]] = msg[2]
            elif msg[0] == "step":
                for u in msg[1]:
                    if u.request_id == "json":
                        texts["json"] += u.token_ids
                        if u.finish_reason is not None:
                            texts["done"] = [1]
        assert answers[2] is None
        kind, message, param = answers[3]
        assert kind == "InvalidRequestError" and param == "structured_outputs" and "too large" in message
        assert engine.tokenizer is not None
        import regex

        assert regex.fullmatch(r"(cat|dog)s? [0-9]{1,3}", engine.tokenizer.decode(texts["json"]))
    finally:
        ours.send(("stop",))
        loop.join(30)
        release.set()


def _tp_workers(parent: int) -> list[int]:
    """The tensor-parallel worker processes whose parent is `parent`."""
    return child_pids(parent, "conveyor.runner.tensor_parallel")


def test_a_killed_tensor_parallel_engine_takes_its_workers_and_restarts_with_new_ones(tiny_model: Path) -> None:
    """The engine process (rank 0) of a two-rank engine is killed mid-stream: its worker exits
    (its input closes), a new engine starts a new worker, and the request goes on with the
    tokens a one-rank engine that never died gives."""
    opts = {**kwargs(tiny_model), "dtype": "float64", "tensor_parallel_size": 2}
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, output_kind="delta")

    async def main() -> tuple[list[int], list[int], list[int]]:
        engine = ProcessAsyncEngine(opts, metrics=ServerMetrics("tiny"))
        engine.start()
        try:
            stream = await engine.add([EngineRequest("r", [5, 6, 7], params)])
            seen: list[RequestOutput] = []
            task = asyncio.create_task(collect(stream, seen))
            await wait_for(lambda: len(seen) > 20)
            first = engine.engine_pid
            assert first is not None
            old = _tp_workers(first)
            os.kill(first, signal.SIGKILL)
            await task
            assert engine.engine_pid != first
            assert engine.metrics is not None and engine.metrics.requests_replayed._value.get() == 1  # mid-stream
            await wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in old), timeout=30)
            new = _tp_workers(engine.engine_pid or 0)
            return [t for out in seen for t in out.outputs[0].token_ids], old, new
        finally:
            await engine.stop()

    tokens, old, new = asyncio.run(main())
    assert len(old) == 1 and len(new) == 1 and old != new
    ref = reference(tiny_model, {"r": ([5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))},
                    dtype="float64")
    assert tokens == ref["r"].outputs[0].token_ids


def test_an_engine_started_again_loads_the_weights_last_loaded_from_disk(tiny_model: Path, tmp_path: Path) -> None:
    """`update_weights_from_disk` is loaded again by the engine started after a death, before any
    request (the front keeps the last such call)."""
    from tests.conftest import build_tiny_model

    other = build_tiny_model(tmp_path / "other", "llama", seed=5, max_position_embeddings=8192)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def body(engine: ProcessAsyncEngine) -> tuple[list[int], list[int], str]:
        await engine.call_engine("update_weights_from_disk", str(other), "v1")
        before = (await collect(await engine.add([EngineRequest("a", [5, 6, 7], short)])))[-1]
        first = engine.engine_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await wait_for(lambda: engine.engine_pid not in (None, first))
        after = (await collect(await engine.add([EngineRequest("b", [5, 6, 7], short)])))[-1]
        return before.outputs[0].token_ids, after.outputs[0].token_ids, await engine.call_engine("get_weight_version")

    before, after, version = run(tiny_model, body)
    want = reference(other, {"a": ([5, 6, 7], short)})["a"].outputs[0].token_ids
    assert before == after == want and version == "v1"
