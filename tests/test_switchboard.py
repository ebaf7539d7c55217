"""The scheduling switchboard on the real (tiny, float64) Llama: every combination of the
scheduler's axes changes *when* tokens are computed, never *which* tokens come out.

Coverage of the output-invariance tests (`test_every_combination_*`): the **full product**
batching (continuous, static, dynamic) x prefill_mode (chunked, mixed, prefill_first) x policy
(fcfs, priority, sjf, spf, mlfq) x preemption_mode (recompute, swap, auto) = 135 runs, each with a
KV cache small enough that every run preempts, plus kv_reservation='reserve' (never preempts)
over batching x prefill_mode x policy (45 runs), plus the continuous admission triggers
(interval, ratio) x prefill_mode x preemption_mode with the policy rotating (18 runs).
This stays fast because the model is loaded once per module: every run builds a fresh `Engine`
(its own KV cache, swap space, scheduler and trace) around the same weights with
`Engine.from_model`, which costs a few milliseconds instead of a checkpoint load.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import time
from typing import Any

import pytest

from conveyor import LLM, ConfigError, InvalidRequestError, SamplingParams
from conveyor.config import (
    BATCHING_MODES,
    PREEMPTION_MODES,
    PREFILL_MODES,
    PRESETS,
    EngineConfig,
)
from conveyor.engine import Engine
from conveyor.outputs import RequestOutput

POLICIES = ("fcfs", "priority", "sjf", "spf", "mlfq")

# The tight engine every combination runs on: 12 blocks of 4 tokens (48 slots) for 12 requests
# of up to 30 + 16 tokens, a step budget of 32 tokens (so chunked prefill really splits prompts
# and whole prompts still fit a step), and room in CPU swap space for everything.
BLOCK_SIZE = 4
NUM_BLOCKS = 12
BUDGET = 32
TIGHT = dict(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=BUDGET)
NUM_SWAP_BLOCKS = 64
AUTO_SWAP_MIN_TOKENS = 16
MAX_STEPS = 5_000  # a livelock fails the test instead of hanging it


# -- workload ------------------------------------------------------------------------------
def workload(n: int = 12, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed lengths (a 1-token prompt, a 30-token one), priorities 0-2, and
    expected_output_tokens hints for spf (some right, some wrong, some missing)."""
    rng = random.Random(seed)
    lengths = [1, 30, *(rng.randint(2, 29) for _ in range(n - 2))]
    prompts = [[rng.randrange(3, 384) for _ in range(k)] for k in lengths]
    params = []
    for i in range(n):
        max_tokens = rng.randint(1, 16)
        hint = (None, max_tokens, rng.randint(1, 16))[i % 3]
        params.append(
            SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                priority=rng.randint(0, 2), expected_output_tokens=hint,
            )
        )
    return prompts, params


def scheduler_options(batching: str, policy: str, preemption: str, reserve: bool = False) -> dict[str, Any]:
    """Options that make each axis matter on this small workload."""
    kw: dict[str, Any] = dict(batching=batching, policy=policy)
    if batching != "continuous":
        kw["max_batch_size"] = 5  # batches of 5, 5, 2: the last one partial
    if batching == "dynamic":
        kw["batch_timeout_ms"] = 5.0  # the partial batch starts after 5 ms
    if policy == "mlfq":
        kw.update(mlfq_quantum=4, mlfq_prompt_quantum=8)  # long prompts skip levels, others drop
    if reserve:
        kw["kv_reservation"] = "reserve"
    else:
        kw["preemption_mode"] = preemption
        if preemption != "recompute":
            kw["num_swap_blocks"] = NUM_SWAP_BLOCKS
        if preemption == "auto":
            kw["auto_swap_min_tokens"] = AUTO_SWAP_MIN_TOKENS
    return kw


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_models) -> str:
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def base(model_dir) -> LLM:
    """The one loaded model; every other engine of this module shares its weights."""
    return LLM(model_dir, dtype="float64", num_kv_blocks=256, max_num_batched_tokens=4096)


@pytest.fixture(scope="module")
def make_engine(base, model_dir):
    def make(**options: Any) -> Engine:
        config = EngineConfig.from_kwargs(model=model_dir, dtype="float64", **options)
        return Engine.from_model(config, base.engine.runner.model, base.engine.tokenizer)

    return make


@pytest.fixture(scope="module")
def requests_and_alone(base):
    """The workload, and each request's tokens when it runs alone in a roomy engine."""
    prompts, params = workload()
    alone = [
        base.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in zip(prompts, params, strict=True)
    ]
    return prompts, params, alone


# -- helpers -------------------------------------------------------------------------------
def drive(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
    """Queue everything at once and step to the end, checking the block accounting every step."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    done: dict[str, RequestOutput] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_integrity()
    else:
        pytest.fail(f"not finished after {MAX_STEPS} steps: {engine.config.scheduler}")
    return [done[f"r{i}"] for i in range(len(prompts))]


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def check_trace(engine: Engine, outs: list[RequestOutput]) -> None:
    """Step records agree with the configuration and with each other; nothing leaks."""
    sc = engine.scheduler.config
    seats = sc.batch_size if sc.batching != "continuous" else sc.max_num_seqs
    trace = list(engine.step_trace)
    assert trace
    for s in trace:
        assert s.num_prefill_tokens + s.num_decode_tokens <= sc.max_num_batched_tokens, s
        assert len(s.seq_ids) == s.num_seqs <= seats, s
        assert len(set(s.seq_ids)) == len(s.seq_ids), s
        assert 0 <= s.kv_blocks_used <= NUM_BLOCKS, s
    assert [s.step_id for s in trace] == sorted(s.step_id for s in trace)
    sched = engine.scheduler
    assert sum(s.num_preempted for s in trace) == sched.num_preemptions
    assert sum(o.num_preemptions for o in outs) == sched.num_preemptions
    out_blocks = sum(s.blocks_swapped_out for s in trace)
    assert out_blocks == sum(s.blocks_swapped_in for s in trace)  # every swapped block came back
    assert (out_blocks > 0) == (sched.num_swaps_out > 0)
    assert sched.num_swaps_in == sched.num_swaps_out
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_free_swap_blocks == bm.num_swap_blocks
    assert not sched.has_unfinished()
    assert len(engine.finished_requests) == len(outs)


def check_outputs(outs: list[RequestOutput], params: list[SamplingParams], alone: list[list[int]]) -> None:
    assert tokens(outs) == alone
    for out, sp in zip(outs, params, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == sp.max_tokens


# -- 1. output invariance ------------------------------------------------------------------
@pytest.mark.parametrize(
    "batching,prefill_mode,policy,preemption",
    list(itertools.product(BATCHING_MODES, PREFILL_MODES, POLICIES, PREEMPTION_MODES)),
)
def test_every_combination_gives_the_tokens_of_each_request_alone(
    make_engine, requests_and_alone, batching, prefill_mode, policy, preemption
):
    prompts, params, alone = requests_and_alone
    engine = make_engine(prefill_mode=prefill_mode, **TIGHT, **scheduler_options(batching, policy, preemption))
    outs = drive(engine, prompts, params)
    check_outputs(outs, params, alone)
    check_trace(engine, outs)
    sched = engine.scheduler
    assert sched.num_preemptions > 0  # the cache is small enough to matter in every combination
    if preemption == "recompute":
        assert sched.num_swaps_out == 0
    else:
        assert sched.num_swaps_out > 0
    if batching != "continuous":
        assert sched.batching.batches_formed >= 3  # 12 requests, batches of at most 5


@pytest.mark.parametrize(
    "batching,prefill_mode,policy",
    list(itertools.product(BATCHING_MODES, PREFILL_MODES, POLICIES)),
)
def test_every_combination_with_reserved_kv_never_preempts(
    make_engine, requests_and_alone, batching, prefill_mode, policy
):
    prompts, params, alone = requests_and_alone
    engine = make_engine(
        prefill_mode=prefill_mode, **TIGHT, **scheduler_options(batching, policy, "recompute", reserve=True)
    )
    outs = drive(engine, prompts, params)
    check_outputs(outs, params, alone)
    check_trace(engine, outs)
    assert engine.scheduler.num_preemptions == 0
    assert all(s.num_preempted == 0 for s in engine.step_trace)


ADMISSIONS = [
    dict(admission="interval", schedule_interval=4),
    dict(admission="ratio", waiting_served_ratio=2.0, max_waiting_tokens=6),
]


@pytest.mark.parametrize(
    "admission,prefill_mode,preemption",
    list(itertools.product(range(len(ADMISSIONS)), PREFILL_MODES, PREEMPTION_MODES)),
)
def test_admission_triggers_keep_outputs(make_engine, requests_and_alone, admission, prefill_mode, preemption):
    prompts, params, alone = requests_and_alone
    policy = POLICIES[(admission * 9 + PREFILL_MODES.index(prefill_mode) * 3 + PREEMPTION_MODES.index(preemption)) % 5]
    engine = make_engine(
        prefill_mode=prefill_mode, **TIGHT, **ADMISSIONS[admission],
        **scheduler_options("continuous", policy, preemption),
    )
    outs = drive(engine, prompts, params)
    check_outputs(outs, params, alone)
    check_trace(engine, outs)
