"""Prefill/decode disaggregation on a real model: a prefill engine computes each prompt and its
first token and hands the K/V over; a decode engine takes the request from there. Outputs
must be those of one engine doing both (greedy, seeded and penalised sampling), on the tiny
Llama in float64, under every scheduling, across block sizes, through a receive space too
small to hold every handoff at once, and when a handoff can never fit."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.engine import Engine, Resume
from conveyor.kv_transfer import KVHandoff
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import InvalidRequestError
from tests.schedulings import SCHEDULINGS

VOCAB = 384
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, VOCAB) for _ in range(_rng.randint(2, 14))] for _ in range(6)]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5),
    SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4),
    SamplingParams(max_tokens=1, temperature=0.0),  # all of it done by the prefill engine
    SamplingParams(max_tokens=9, temperature=0.7, top_k=20, seed=11),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
]


@pytest.fixture(scope="module")
def model(tiny_models):
    """One load of the tiny Llama in float64; every engine here shares its weights."""
    return LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=64).engine


def engine(model: Engine, **options) -> Engine:
    from conveyor.config import EngineConfig

    options = {"num_kv_blocks": 64, "block_size": 8, **options}
    return Engine.from_model(EngineConfig.from_kwargs(**options), model.runner.model, model.tokenizer)


def run(engine: Engine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def disaggregated(prefill: Engine, decode: Engine, prompts, params) -> dict[str, list[int]]:
    """The requests through both engines, as a PD front end drives them (`decode.handed_over`:
    how many went on to the decode engine)."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        prefill.add_request(f"r{i}", prompt, dataclasses.replace(p, max_tokens=1), export_kv=True)
    tokens: dict[str, list[int]] = {}
    for rid, out in run(prefill).items():
        i = int(rid[1:])
        first = out.outputs[0]
        assert out.kv_handoff is not None and out.kv_handoff.num_tokens == len(prompts[i])
        if first.finish_reason == "stop" or params[i].max_tokens == 1:
            tokens[rid] = first.token_ids  # ended with its first token
            continue
        resume = Resume(first.token_ids, len(first.text), out.metrics)
        decode.add_request(rid, prompts[i], params[i], resume=resume, kv_handoff=out.kv_handoff)
        decode.handed_over = getattr(decode, "handed_over", 0) + 1  # type: ignore[attr-defined]
    for rid, out in run(decode).items():
        tokens[rid] = out.outputs[0].token_ids
    return tokens


def together(model: Engine, prompts, params, **options) -> dict[str, list[int]]:
    one = engine(model, **options)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        one.add_request(f"r{i}", prompt, p)
    return {rid: out.outputs[0].token_ids for rid, out in run(one).items()}


@SCHEDULINGS
def test_disaggregated_equals_one_engine(model, options):
    want = together(model, PROMPTS, PARAMS)
    prefill = engine(model, **options)
    decode = engine(model, kv_receive_space=1 << 20, **options)
    assert disaggregated(prefill, decode, PROMPTS, PARAMS) == want
    assert decode.num_kv_received == decode.handed_over >= 4 and decode.num_kv_recomputed == 0  # type: ignore[attr-defined]
    if options.get("num_kv_blocks") != 10:  # (no preemption: nothing recomputed)
        # the decode engine computed a token a request before decoding, never a prompt
        assert all(s.num_prefill_tokens == 0 for s in decode.step_trace)
    bm = decode.scheduler.block_manager
    assert bm.num_free_swap_blocks == bm.num_swap_blocks and bm.num_free_blocks == bm.num_blocks


def test_engines_of_other_block_sizes_and_a_warm_prefix_cache(model):
    """The handoff is token by token: a prefill engine of 4-token blocks feeds one of 16, and a
    prompt whose prefix the prefill engine's cache holds hands over the cached K/V too."""
    shared = PROMPTS[0] * 3
    prompts = [shared + p for p in PROMPTS]
    want = together(model, prompts, PARAMS)
    prefill = engine(model, block_size=4, max_num_batched_tokens=16)
    decode = engine(model, block_size=16, kv_receive_space=1 << 20)
    assert disaggregated(prefill, decode, prompts, PARAMS) == want
    assert prefill.scheduler.block_manager.num_hit_tokens > 0


def test_a_small_receive_space_holds_handoffs_back_until_one_fits(model):
    """Room for about one handoff at a time: the rest wait in arrival order, none is lost,
    none computed again."""
    long = [[(7 * i + j) % VOCAB + 3 for j in range(40)] for i in range(4)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 4
    want = together(model, long, params)
    one_block = model.runner.kv_bytes(16)
    decode = engine(model, block_size=16, kv_receive_space=3 * one_block)  # 3 blocks: one 40-token prompt
    prefill = engine(model)
    seen = []
    step = decode.step

    def watched():
        seen.append((len(decode._incoming), decode.scheduler.block_manager.num_free_swap_blocks))
        return step()

    decode.step = watched  # type: ignore[method-assign]
    assert disaggregated(prefill, decode, long, params) == want
    assert max(n for n, _ in seen) >= 2  # handoffs waited
    assert decode.num_kv_received == 4 and decode.num_kv_recomputed == 0


def test_a_handoff_that_can_never_fit_is_computed_again(model):
    long = [[(5 * j) % VOCAB + 3 for j in range(40)]]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    want = together(model, long, params)
    decode = engine(model, block_size=16, kv_receive_space=model.runner.kv_bytes(16))  # one block
    assert disaggregated(engine(model), decode, long, params) == want
    assert decode.num_kv_recomputed == 1 and decode.num_kv_received == 0


def handoff_for(model: Engine, prompt: list[int]) -> tuple[RequestOutput, KVHandoff]:
    prefill = engine(model)
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    out = run(prefill)["p"]
    assert out.kv_handoff is not None
    return out, out.kv_handoff


def test_aborts_free_what_a_handed_over_request_holds(model):
    prompt = PROMPTS[1] * 4
    out, handoff = handoff_for(model, prompt)
    resume = Resume(out.outputs[0].token_ids, 0, out.metrics)
    decode = engine(model, kv_receive_space=1 << 20, max_num_seqs=1)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    decode.add_request("a", prompt, params, resume=resume, kv_handoff=handoff)
    decode.add_request("b", prompt, params, resume=dataclasses.replace(resume), kv_handoff=handoff)
    assert len(decode._incoming) == 1  # one seat: "b" waits outside the scheduler
    aborted = decode.abort_request("b")
    assert aborted is not None and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    bm = decode.scheduler.block_manager
    assert bm.num_free_swap_blocks < bm.num_swap_blocks  # "a" waits in swap space
    decode.abort_request("a")
    assert bm.num_free_swap_blocks == bm.num_swap_blocks and not decode.has_unfinished_requests()


def test_bad_handoffs_are_refused(model, tiny_models):
    prompt = PROMPTS[2]
    out, handoff = handoff_for(model, prompt)
    resume = Resume(out.outputs[0].token_ids, 0, out.metrics)
    decode = engine(model, kv_receive_space=1 << 20)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="not a proper prefix") as e:
        decode.add_request("x", [9, *prompt[1:]], params, resume=resume, kv_handoff=handoff)
    assert e.value.param == "kv_transfer"
    with pytest.raises(InvalidRequestError, match="not a proper prefix"):  # nothing left to compute
        decode.add_request("x", prompt, params, kv_handoff=handoff)
    wrong = dataclasses.replace(handoff, data=handoff.data[:, :, :, :1])
    with pytest.raises(InvalidRequestError, match="do not fit this model"):
        decode.add_request("x", prompt, params, resume=resume, kv_handoff=wrong)
    with pytest.raises(InvalidRequestError, match="adapter \\('sql', 1\\)"):
        decode.add_request("x", prompt, params, resume=resume, kv_handoff=dataclasses.replace(handoff, lora_key=("sql", 1)))
    with pytest.raises(InvalidRequestError, match="max_tokens must be 1"):
        decode.add_request("x", prompt, SamplingParams(max_tokens=2), export_kv=True)
    with pytest.raises(InvalidRequestError, match="n=1"):
        decode.add_request("x", prompt, SamplingParams(max_tokens=1, n=2), export_kv=True)
    assert not decode.has_unfinished_requests()
    # a handoff in another KV dtype is converted on the way in
    half = engine(model, kv_receive_space=1 << 20, kv_cache_dtype="float32")
    half.add_request("y", prompt, params, resume=resume, kv_handoff=handoff)
    assert handoff.data.dtype == torch.float64 and run(half)["y"].finished
