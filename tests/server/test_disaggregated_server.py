"""Prefill/decode disaggregation served (`DisaggregatedSet`, `conveyor serve --prefill-replicas
P --decode-replicas D`): prefill and decode replicas in threads and in processes give the
tokens one engine gives, greedy and seeded, in every output kind and for a group of n choices;
the client sees the first token before the rest; an abort during either stage frees both
pools; a request that ends with its first token (or an embedding request) never reaches a decode replica; request
metrics count each request once; over HTTP on SmolLM2, streamed and whole, the session
server's greedy text."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import openai
import pytest

from conveyor import EngineConfig, SamplingParams
from conveyor.core.routing import RouterConfig
from conveyor.engine import Engine
from conveyor.outputs import RequestOutput
from conveyor.server.async_engine import EngineRequest, OutputStream
from conveyor.server.disaggregated import DisaggregatedSet, build_disaggregated_set
from conveyor.server.metrics import ServerMetrics
from tests.server.conftest import ServerProcess, sample, scrape
from tests.server.test_replicas import kwargs, reference

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
PD = RouterConfig(prefill_replicas=1, decode_replicas=1)


def run(pd: DisaggregatedSet, body: Any) -> Any:
    async def main() -> Any:
        pd.start()
        try:
            return await body(pd)
        finally:
            await pd.stop()

    return asyncio.run(main())


async def collect(stream: OutputStream) -> list[RequestOutput]:
    return [out async for out in stream]


def pd_set(model: Path, engine_process: bool = False, metrics: ServerMetrics | None = None) -> DisaggregatedSet:
    pd = build_disaggregated_set(kwargs(model), PD, engine_process=engine_process, metrics=metrics)
    pd.launch()
    return pd


@pytest.mark.parametrize("engine_process", [False, True], ids=["threads", "processes"])
def test_both_pools_give_one_engines_tokens_in_every_output_kind(tiny_model: Path, engine_process: bool) -> None:
    prompts = {f"r{i}": [5 + i, 6, 7, 8 + i, 9] * (i + 1) for i in range(4)}
    want_greedy = reference(tiny_model, prompts)
    want_seeded = reference(tiny_model, prompts, SEEDED)
    metrics = ServerMetrics("tiny")
    pd = pd_set(tiny_model, engine_process, metrics)

    async def body(pd: DisaggregatedSet) -> None:
        for kind in ("delta", "cumulative", "final_only"):
            for params, want in ((GREEDY, want_greedy), (SEEDED, want_seeded)):
                p = dataclasses.replace(params, output_kind=kind)
                streams = [await pd.add([EngineRequest(f"{rid}-{kind}-{p.seed}", prompt, p)])
                           for rid, prompt in prompts.items()]
                for (rid, _), outs in zip(prompts.items(), await asyncio.gather(*map(collect, streams)), strict=True):
                    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
                    if kind == "delta":
                        got = [t for o in outs for t in o.outputs[0].token_ids]
                        assert len(outs) > 1 and outs[0].outputs[0].token_ids == want[rid][:1]  # first, alone
                    else:
                        got = outs[-1].outputs[0].token_ids
                        assert kind == "cumulative" or len(outs) == 1
                    assert got == want[rid], (rid, kind)
        await pd.wait_idle(10)

    run(pd, body)
    decode = pd.decode.replicas[0]
    if not engine_process:
        assert decode.engine.num_kv_received == 24 and decode.engine.num_kv_recomputed == 0  # type: ignore[attr-defined]
    counted = parsed(metrics)
    assert sample(counted, "conveyor:request_success_total", finished_reason="length") == 24  # once each, not a stage
    assert sample(counted, "conveyor:generation_tokens_total") == 3 * (4 * 16 + 4 * 12)


def parsed(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`scrape`'s dict, read off the registry in this process."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_a_group_of_choices_and_requests_that_end_with_their_first_token(tiny_model: Path) -> None:
    prompt = [11, 12, 13, 14, 15, 16]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    want = reference(tiny_model, {"a": prompt}, dataclasses.replace(GREEDY, max_tokens=1))["a"]
    choices = [dataclasses.replace(SEEDED, seed=SEEDED.seed + i) for i in range(3)]  # type: ignore[operator]
    wants = [reference(tiny_model, {"c": prompt}, p)["c"] for p in choices]
    pd = pd_set(tiny_model)

    async def body(pd: DisaggregatedSet) -> None:
        outs = await collect(await pd.add([EngineRequest("one", prompt, one)]))
        assert [o.outputs[0].token_ids for o in outs if o.finished] == [want]
        group = [EngineRequest(f"g#{i}", prompt, dataclasses.replace(p, output_kind="final_only"))
                 for i, p in enumerate(choices)]
        finals = {o.request_id: o.outputs[0].token_ids for o in await collect(await pd.add(group)) if o.finished}
        assert [finals[f"g#{i}"] for i in range(3)] == wants
        # An embedding request is done at its prefill replica, with nothing handed over.
        outs = await collect(await pd.add([EngineRequest("emb", prompt, SamplingParams.for_pooling())]))
        assert [o.embedding for o in outs if o.finished] == [want_embedding]

    engine = Engine.from_config(EngineConfig.from_kwargs(**kwargs(tiny_model)))
    engine.add_request("emb", prompt, SamplingParams.for_pooling())
    want_embedding = next(o.embedding for _ in range(3) for o in engine.step() if o.finished)
    assert want_embedding is not None and len(want_embedding) == engine.runner.hidden_size  # type: ignore[attr-defined]
    run(pd, body)
    assert pd.decode.replicas[0].engine.num_kv_received == 3  # type: ignore[attr-defined]


def test_an_abort_in_either_stage_frees_both_pools(tiny_model: Path) -> None:
    long = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    pd = pd_set(tiny_model)

    async def body(pd: DisaggregatedSet) -> None:
        stream = await pd.add([EngineRequest("x", [5, 6, 7], long)])
        seen = 0
        async for out in stream:
            seen += 1
            if seen == 3:  # decoding by now
                stream.abort()
            if out.finished:
                assert out.outputs[0].finish_reason == "abort"
        # one aborted while its prefill may still run
        stream = await pd.add([EngineRequest("y", [5, 6, 7] * 50, long)])
        stream.abort()
        outs = await collect(stream)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert await pd.wait_idle(10)

    run(pd, body)
    for pool in (pd.prefill, pd.decode):
        engine = pool.replicas[0].engine  # type: ignore[attr-defined]
        bm = engine.scheduler.block_manager
        assert not engine.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_blocks and bm.num_free_swap_blocks == bm.num_swap_blocks


def test_served_over_http(tmp_path: Path, smol_server: ServerProcess) -> None:
    """`conveyor serve --prefill-replicas 1 --decode-replicas 1` on SmolLM2 answers as the session
    server does, whole and streamed."""
    server = ServerProcess(["--kv-cache-memory", str(128 << 20), "--max-model-len", "1024",
                            "--prefill-replicas", "1", "--decode-replicas", "1"], tmp_path / "pd.log")
    try:
        server.wait_ready()
        messages = [{"role": "user", "content": "Name three colors."}]
        ref = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0)
        pd = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        want = ref.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        got = pd.chat.completions.create(messages=messages, max_tokens=24, temperature=0, model=pd.models.list().data[0].id)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens
        chunks = pd.chat.completions.create(messages=messages, max_tokens=24, temperature=0, stream=True,
                                            model=pd.models.list().data[0].id)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.choices[0].message.content
        metrics = scrape(server.url)
        reason = want.choices[0].finish_reason
        assert sample(metrics, "conveyor:request_success_total", finished_reason=reason) == 2, (reason, {
            k: v for k, v in metrics.items() if "success" in k[0]})
    finally:
        server.stop()


def test_a_decode_replica_killed_mid_stream_resumes_the_request(tiny_model: Path) -> None:
    """Its successor takes the request back with the prompt's K/V (still a prefix of its tokens)
    and the tokens delivered so far: the stream goes on as if nothing happened."""
    import os
    import signal

    params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True, output_kind="delta")
    want = reference(tiny_model, {"k": [5, 6, 7, 8]}, params)["k"]
    pd = pd_set(tiny_model, engine_process=True)

    async def body(pd: DisaggregatedSet) -> list[int]:
        stream = await pd.add([EngineRequest("k", [5, 6, 7, 8], params)])
        got: list[int] = []
        async for out in stream:
            got += out.outputs[0].token_ids
            if len(got) >= 20 and pd.decode.replicas[0].restarts == 0 and not getattr(body, "killed", False):
                os.kill(pd.decode.replicas[0].engine_pid, signal.SIGKILL)  # type: ignore[attr-defined]
                body.killed = True  # type: ignore[attr-defined]
        return got

    assert run(pd, body) == want
    assert pd.decode.replicas[0].restarts == 1
