"""The scheduling switchboard on the real (tiny, float64) Llama: every combination of the
scheduler's axes changes *when* tokens are computed, never *which* tokens come out.

Output invariance is checked on the **full product**, not a covering array:
- `test_every_combination_gives_the_tokens_of_each_request_alone`: batching (continuous, static,
  dynamic) x prefill_mode (chunked, mixed, prefill_first) x policy (fcfs, priority, sjf, spf,
  mlfq) x preemption_mode (recompute, swap, auto) = 135 runs, each on a KV cache small enough
  that every run preempts (and every swap/auto run swaps);
- `test_every_combination_with_reserved_kv_never_preempts`: kv_reservation='reserve' over
  batching x prefill_mode x policy = 45 runs;
- `test_admission_triggers_keep_outputs`: admission (interval, ratio) x prefill_mode x
  preemption_mode = 18 continuous runs, the policy rotating through all five;
- `test_estimated_kv_keeps_outputs`: kv_reservation='estimate' over prefill_mode x
  preemption_mode x two first ratios = 18 continuous runs, the policy rotating.
Every run is compared with each request generated alone. This stays fast because the model is
loaded once per module: each run builds a fresh `Engine` (its own KV cache, swap space,
scheduler and trace) around the same weights with `Engine.from_model`, in milliseconds.

Then: swap and auto preemption in detail, priority displacement, timed replay and JSONL
workloads, JSON / Chrome traces, option validation and presets through `LLM(...)`, the CLI.
"""

from __future__ import annotations

import argparse
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

POLICIES = ("fcfs", "priority", "sjf", "spf", "mlfq", "lpm", "slo", "vtc")

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
                priority=rng.randint(0, 2), expected_output_tokens=hint, tenant=f"tenant{i % 3}",
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
    if policy == "slo":
        kw.update(slo_ttft_ms=20.0, slo_tpot_ms=2.0)  # tight: some requests fall late on this CPU
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
def drive(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], tag: str = "r") -> list[RequestOutput]:
    """Queue everything at once and step to the end, checking the block accounting every step.
    Request i is named `{tag}{i}`."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{tag}{i}", p, sp)
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
    return [done[f"{tag}{i}"] for i in range(len(prompts))]


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


ESTIMATES = list(itertools.product(PREFILL_MODES, PREEMPTION_MODES, [0.7, 0.05]))


@pytest.mark.parametrize("index", range(len(ESTIMATES)))
def test_estimated_kv_keeps_outputs(make_engine, requests_and_alone, index):
    """kv_reservation='estimate' (SGLang's new-token ratio) over prefill_mode x preemption_mode
    x a first ratio (SGLang's, and one so low that it preempts), continuous batching, the
    policy rotating through all of them: the tokens are each request's alone."""
    prefill_mode, preemption, ratio = ESTIMATES[index]
    prompts, params, alone = requests_and_alone
    engine = make_engine(prefill_mode=prefill_mode, kv_reservation="estimate", init_new_token_ratio=ratio,
                         min_new_token_ratio=min(ratio, 0.098), **TIGHT,
                         **scheduler_options("continuous", POLICIES[index % len(POLICIES)], preemption))
    outs = drive(engine, prompts, params)
    check_outputs(outs, params, alone)
    check_trace(engine, outs)
    if ratio < 0.1:  # admitted nearly as on demand: the tight cache runs short
        assert engine.scheduler.num_preemptions > 0


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
    policy = POLICIES[(admission * 9 + PREFILL_MODES.index(prefill_mode) * 3 + PREEMPTION_MODES.index(preemption)) % len(POLICIES)]
    engine = make_engine(
        prefill_mode=prefill_mode, **TIGHT, **ADMISSIONS[admission],
        **scheduler_options("continuous", policy, preemption),
    )
    outs = drive(engine, prompts, params)
    check_outputs(outs, params, alone)
    check_trace(engine, outs)
    assert engine.scheduler.num_preemptions > 0
    if ADMISSIONS[admission]["admission"] == "interval":
        check_interval_admission(list(engine.step_trace), ADMISSIONS[admission]["schedule_interval"])


def check_interval_admission(trace: list, interval: int) -> None:
    """A new request joins a busy batch only after `interval` decode steps since the last
    one joined (the first step a sequence appears in is its admission)."""
    seen: set[int] = set()
    last_admission = None
    gated = 0
    for j, s in enumerate(trace):
        new = set(s.seq_ids) - seen
        seen |= new
        if not new:
            continue
        busy = j > 0 and trace[j - 1].num_running + trace[j - 1].num_swapped > 0
        if busy and last_admission is not None:
            decodes = sum(1 for t in trace[last_admission + 1 : j] if t.num_decode_tokens)
            assert decodes >= interval, (trace[last_admission], s)
            gated += 1
        last_admission = j
    assert gated > 0  # the trigger was really exercised


# -- 2. swap really swaps ------------------------------------------------------------------
def test_swap_moves_blocks_out_and_back_and_recomputes_nothing(make_engine, requests_and_alone):
    prompts, params, alone = requests_and_alone
    runs = {}
    for mode in ("recompute", "swap"):
        engine = make_engine(**TIGHT, **scheduler_options("continuous", "fcfs", mode))
        runs[mode] = (engine, drive(engine, prompts, params))
    swap_engine, swap_outs = runs["swap"]
    rec_outs = runs["recompute"][1]
    assert tokens(swap_outs) == tokens(rec_outs) == alone
    trace = list(swap_engine.step_trace)
    assert sum(s.blocks_swapped_out for s in trace) > 0
    assert sum(s.blocks_swapped_in for s in trace) > 0
    assert any(s.num_swapped > 0 for s in trace)
    sched = swap_engine.scheduler
    assert sched.num_preemptions > 0 and sched.num_swaps_out == sched.num_preemptions
    check_trace(swap_engine, swap_outs)
    # Swapped KV stays computed: every token is computed exactly once (the last sampled token
    # of each request is never fed back); recompute computes preempted tokens again.
    once = sum(len(p) + sp.max_tokens - 1 for p, sp in zip(prompts, params, strict=True))
    computed = {
        mode: sum(s.num_prefill_tokens + s.num_decode_tokens for s in engine.step_trace)
        for mode, (engine, _) in runs.items()
    }
    assert computed["swap"] == once < computed["recompute"]


def test_auto_swaps_long_sequences_and_recomputes_short_ones(make_engine, requests_and_alone, monkeypatch):
    prompts, params, alone = requests_and_alone
    engine = make_engine(**TIGHT, **scheduler_options("continuous", "fcfs", "auto"))
    sched = engine.scheduler
    decisions: list[tuple[int, bool]] = []
    preempt = sched._preempt

    def spy(seq, out, *args, **kwargs):
        computed = seq.num_computed_tokens
        swapped = preempt(seq, out, *args, **kwargs)
        decisions.append((computed, swapped))
        return swapped

    monkeypatch.setattr(sched, "_preempt", spy)
    outs = drive(engine, prompts, params)
    assert tokens(outs) == alone
    check_trace(engine, outs)
    assert 0 < sched.num_swaps_out < sched.num_preemptions == len(decisions)
    for computed, swapped in decisions:
        assert swapped == (computed >= AUTO_SWAP_MIN_TOKENS), decisions


def test_runner_copies_swap_outs_before_swap_ins(base):
    """A device block swapped out and handed to a swap-in in the same step keeps its old
    content in swap space (the runner copies every swap-out first)."""
    import torch

    from conveyor.core.scheduler import SchedulerOutput
    from conveyor.runner.model_runner import ModelRunner

    model = base.engine.runner.model
    runner = ModelRunner(model, 4, BLOCK_SIZE, torch.float64, torch.device("cpu"), num_swap_blocks=2)
    for dev, cpu in zip(runner.kv_caches, runner.swap_caches, strict=True):
        dev.view(2, -1, BLOCK_SIZE, *dev.shape[2:])[:, 0] = 1.0  # device block 0 holds "A"
        cpu.view(2, 2, BLOCK_SIZE, *cpu.shape[2:])[:, 1] = 2.0  # swap block 1 holds "B"
    out = SchedulerOutput(step_id=1, scheduled=[], blocks_to_swap_out=[(0, 0)], blocks_to_swap_in=[(1, 0)])
    runner.execute(out)
    for dev, cpu in zip(runner.kv_caches, runner.swap_caches, strict=True):
        assert bool((cpu.view(2, 2, BLOCK_SIZE, *cpu.shape[2:])[:, 0] == 1.0).all())  # A saved
        assert bool((dev.view(2, -1, BLOCK_SIZE, *dev.shape[2:])[:, 0] == 2.0).all())  # B loaded


@pytest.mark.parametrize("preemption", PREEMPTION_MODES)
def test_priority_arrival_displaces_running_work_once(make_engine, base, preemption):
    """A high-priority request that does not fit beside a running low-priority one displaces
    it: in the same step (no empty step), by recompute (a swapped victim would come back
    first), once, and is served first. Tokens are those of each request alone."""
    low_prompt, high_prompt = list(range(10, 30)), list(range(40, 68))
    low = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, priority=5)
    high = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, priority=0)
    alone = [base.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in ((low_prompt, low), (high_prompt, high))]
    extra = dict(auto_swap_min_tokens=1) if preemption == "auto" else {}
    engine = make_engine(**TIGHT, **{**scheduler_options("continuous", "priority", preemption), **extra})
    engine.add_request("low", low_prompt, low)
    for _ in range(3):
        engine.step()
    engine.add_request("high", high_prompt, high)
    finished: list[RequestOutput] = []
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        finished += [o for o in engine.step() if o.finished]
        engine.scheduler.check_integrity()
    assert [o.request_id for o in finished] == ["high", "low"]
    by_id = {o.request_id: o for o in finished}
    assert [by_id["low"].outputs[0].token_ids, by_id["high"].outputs[0].token_ids] == alone
    assert by_id["low"].num_preemptions == 1 and by_id["high"].num_preemptions == 0
    trace = list(engine.step_trace)
    assert all(s.num_seqs > 0 for s in trace)
    displacing = [s for s in trace if s.num_preempted]
    assert len(displacing) == 1 and displacing[0].seq_ids == (1,)  # "high" joins at once
    assert engine.scheduler.num_swaps_out == 0
    assert sum(s.blocks_swapped_out for s in trace) == 0


def test_finished_sequences_reach_the_runner_through_an_idle_step(make_engine):
    """A seeded request's generator is dropped even when the step after it finished computes
    nothing (a dynamic batch still waiting for its window)."""
    engine = make_engine(num_kv_blocks=16, batching="dynamic", max_batch_size=2, batch_timeout_ms=100.0)
    seeded = SamplingParams(max_tokens=3, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], seeded)
    while not engine.step_trace:
        engine.step()  # waits for the window, then runs "a"'s prefill
    engine.add_request("b", [8, 9], seeded)  # cannot join; its own window is 100 ms
    assert 0 in engine.runner._generators
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == ["a", "b"]
    assert 0 not in engine.runner._generators


# -- 3. replay -----------------------------------------------------------------------------
def test_replay_serves_a_timed_jsonl_workload_at_its_arrival_times(make_engine, requests_and_alone, tmp_path):
    prompts, params, alone = requests_and_alone
    path = tmp_path / "workload.jsonl"
    arrivals = [round(0.5 * i / (len(prompts) - 1), 3) for i in range(len(prompts))]
    lines = [
        json.dumps({
            "arrival_s": t, "prompt_token_ids": p, "max_tokens": sp.max_tokens, "ignore_eos": True,
            "priority": sp.priority, "expected_output_tokens": sp.expected_output_tokens, "tenant": sp.tenant,
        })
        for t, p, sp in zip(arrivals, prompts, params, strict=True)
    ]
    path.write_text("\n".join(lines[::-1]) + "\n")  # out of order: replay sorts by arrival
    workload_ = load_jsonl_checked(path)[::-1]
    assert [r.arrival_s for r in workload_] == arrivals
    assert [r.params for r in workload_] == params
    engine = make_engine(**TIGHT, **scheduler_options("continuous", "priority", "swap"))
    # Slow steps, so that requests arrive while a step runs and join only after it.
    execute = engine.runner.execute

    def slow_execute(out):
        time.sleep(0.015)
        return execute(out)

    engine.runner.execute = slow_execute  # type: ignore[method-assign]
    added: dict[str, float] = {}
    add_request = engine.add_request

    def spy_add(request_id, *args, **kwargs):
        added[request_id] = engine.clock()
        return add_request(request_id, *args, **kwargs)

    engine.add_request = spy_add  # type: ignore[method-assign]
    from conveyor.replay import replay

    t0 = engine.clock()
    outs = replay(engine, workload_)
    assert engine.clock() - t0 >= arrivals[-1]
    assert tokens(outs) == alone
    check_trace(engine, outs)
    start = outs[0].metrics.arrival_time  # arrival 0: the replay's start
    assert t0 <= start <= t0 + 0.01
    lags = []
    for out, t in zip(outs, arrivals, strict=True):
        m = out.metrics
        assert m.arrival_time == pytest.approx(start + t, abs=1e-9)  # as scheduled, not as added
        assert m.arrival_time <= added[out.request_id] <= m.first_scheduled_time <= m.first_token_time
        assert m.ttft == pytest.approx(m.first_token_time - m.arrival_time)
        lags.append(added[out.request_id] - m.arrival_time)
    assert max(lags) > 0.002  # some arrived mid-step: their TTFT includes that wait


def load_jsonl_checked(path):
    from conveyor.replay import load_jsonl

    return load_jsonl(path, vocab_size=384)


def test_load_jsonl_parses_every_line_kind(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"arrival_s": 0.0, "prompt": "hello world", "max_tokens": 4, "priority": 2}\n'
        "\n"
        '{"arrival_s": 0.1, "prompt_token_ids": [5, 6, 7], "expected_output_tokens": 3, "request_id": "ids"}\n'
        '{"arrival_s": 0.25, "prompt_len": 12, "output_len": 5, "temperature": 0.5}\n'
    )
    text, ids, synth = load_jsonl_checked(path)
    assert (text.arrival_s, text.prompt, text.request_id) == (0.0, "hello world", None)
    assert (text.params.max_tokens, text.params.priority, text.params.temperature) == (4, 2, 0.0)
    assert (ids.arrival_s, ids.prompt, ids.request_id) == (0.1, [5, 6, 7], "ids")
    assert ids.params.expected_output_tokens == 3
    assert synth.arrival_s == 0.25
    assert isinstance(synth.prompt, list) and len(synth.prompt) == 12
    assert all(10 <= t < 384 - 10 for t in synth.prompt)
    assert (synth.params.max_tokens, synth.params.ignore_eos, synth.params.temperature) == (5, True, 0.5)
    assert load_jsonl_checked(path)[2].prompt == synth.prompt  # seeded


@pytest.mark.parametrize(
    "bad,match",
    [
        ('{"arrival_s": 0.2, "prompt": "x"', "not JSON"),
        ('{"arrival_s": 0.2, "max_tokens": 3}', "needs prompt, prompt_token_ids or prompt_len"),
        ('{"prompt_len": 4, "temperature": -1}', "temperature"),
        ('{"prompt_len": "many"}', "many"),
        ("[1, 2, 3]", "JSON object"),
    ],
)
def test_load_jsonl_names_the_file_and_line_of_a_bad_line(tmp_path, bad, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + bad + "\n")
    with pytest.raises(ValueError, match=match) as info:
        load_jsonl_checked(path)
    assert str(info.value).startswith(f"{path}:3: ")


# -- 4. traces -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced(make_engine, requests_and_alone):
    prompts, params, _ = requests_and_alone
    engine = make_engine(**TIGHT, **scheduler_options("continuous", "mlfq", "auto"))
    return engine, drive(engine, prompts, params)


def test_export_json_holds_steps_requests_and_config(traced, tmp_path):
    from conveyor.engine import RequestRecord, StepRecord
    from conveyor.trace import export_json

    engine, outs = traced
    path = tmp_path / "trace.json"
    export_json(engine, path)
    data = json.loads(path.read_text())
    assert set(data) == {"config", "steps", "requests"}
    assert data["config"] == json.loads(json.dumps(engine.config.flat()))
    assert data["config"]["policy"] == "mlfq"
    step_fields = {f.name for f in dataclasses.fields(StepRecord)}
    assert len(data["steps"]) == len(engine.step_trace) > 0
    for s, rec in zip(data["steps"], engine.step_trace, strict=True):
        assert set(s) == step_fields
        assert s["step_id"] == rec.step_id and s["seq_ids"] == list(rec.seq_ids)
        assert len(s["seq_ids"]) == s["num_seqs"]
        assert s["num_prefill_tokens"] + s["num_decode_tokens"] <= BUDGET
    assert sum(s["num_preempted"] for s in data["steps"]) == engine.scheduler.num_preemptions > 0
    assert sum(s["blocks_swapped_out"] for s in data["steps"]) > 0
    assert {r["request_id"] for r in data["requests"]} == {o.request_id for o in outs}
    assert len(data["requests"]) == len(engine.finished_requests) == len(outs)
    assert {f.name for f in dataclasses.fields(RequestRecord)} - {"metrics"} <= set(data["requests"][0])
    by_id = {o.request_id: o for o in outs}
    for r in data["requests"]:
        out = by_id[r["request_id"]]
        assert r["output_len"] == len(out.outputs[0].token_ids)
        assert r["prompt_len"] == len(out.prompt_token_ids)
        assert r["finish_reason"] == "length"
        assert r["num_preemptions"] == out.num_preemptions
        assert r["num_cached_tokens"] == out.num_cached_tokens
        assert r["arrival_time"] <= r["first_scheduled_time"] <= r["first_token_time"] <= r["finished_time"]
        assert r["ttft"] >= 0 and r["e2e"] >= r["ttft"]


def test_chrome_trace_events_are_well_formed(traced, tmp_path):
    from conveyor.trace import chrome_trace, export_chrome_trace

    engine, outs = traced
    trace = chrome_trace(engine)
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"X", "C", "M"}
    assert sum(e["ph"] == "M" for e in events) == 2
    for e in events:
        if e["ph"] in ("X", "C"):
            assert e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    step_events = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    assert len(step_events) == len(engine.step_trace)
    assert {e["name"] for e in step_events} <= {"prefill", "decode", "prefill+decode"}
    request_events = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    assert len(request_events) == 2 * len(outs)  # queued + run, per request
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == 2 * len(engine.step_trace)
    path = tmp_path / "chrome.json"
    export_chrome_trace(engine, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))


# -- 5. validation through the public API --------------------------------------------------
@pytest.mark.parametrize(
    "options,match",
    [
        (dict(batching="static", admission="interval", schedule_interval=4), "never lets anyone join; use batching='continuous'"),
        (dict(long_prefill_token_threshold=64, prefill_mode="mixed"), "never splits prompts; use prefill_mode='chunked'"),
        (dict(kv_reservation="reserve", preemption_mode="swap"), "kv_reservation='reserve' never preempts"),
        (dict(preset="fastest"), r"preset='fastest' is not one of \['latency', 'throughput', 'ttft'\]"),
        (dict(max_batch_size=4), "applies to static/dynamic batching"),
        (dict(batching="static", max_batch_size=8, max_num_seqs=4), r"max_batch_size=8 must be in \[1, max_num_seqs=4\]"),
        (dict(batching="static", batch_timeout_ms=10), "applies only to batching='dynamic'"),
        (dict(schedule_interval=4), "applies only to admission='interval'"),
        (dict(admission="interval"), "needs schedule_interval >= 2"),
        (dict(waiting_served_ratio=2.0), "apply only to admission='ratio'"),
        (dict(aging_bound_s=5.0), "fcfs cannot"),
        (dict(policy="sjf", mlfq_quantum=8), "apply only to policy='mlfq'"),
        (dict(preemption_mode="swap", auto_swap_min_tokens=8), "applies only to preemption_mode='auto'"),
        (dict(batching="round_robin"), r"batching='round_robin' is not one of \['continuous', 'static', 'dynamic'\]"),
        (dict(prefill_mode="whole"), "prefill_mode='whole' is not one of"),
        (dict(preemption_mode="drop"), "preemption_mode='drop' is not one of"),
        # an explicit contradiction stays one even when a preset is in play
        (dict(preset="latency", prefill_mode="mixed", long_prefill_token_threshold=64), "use prefill_mode='chunked'"),
        (dict(preset="ttft", policy="fcfs", aging_bound_s=5.0), "fcfs cannot"),
    ],
)
def test_contradictory_options_raise_config_error(model_dir, options, match):
    with pytest.raises(ConfigError, match=match):
        LLM(model_dir, dtype="float64", **options)


def test_unknown_policy_name_raises_config_error(make_engine):
    with pytest.raises(ConfigError, match=r"policy='lifo' is not one of \[.*'fcfs'.*'mlfq'.*\]"):
        make_engine(num_kv_blocks=8, policy="lifo")


@pytest.mark.parametrize("prefill_mode", ["mixed", "prefill_first"])
def test_prompt_longer_than_the_step_budget_is_refused_when_prompts_run_whole(make_engine, prefill_mode):
    engine = make_engine(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, prefill_mode=prefill_mode)
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="20 tokens, more than max_num_batched_tokens=16") as info:
        engine.add_request("long", list(range(3, 23)), sp)
    assert f"prefill_mode={prefill_mode!r}" in str(info.value) and info.value.param == "prompt"
    assert not engine.has_unfinished_requests()
    engine.add_request("fits", list(range(3, 19)), sp)  # 16 tokens: exactly the budget
    chunked = make_engine(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    chunked.add_request("long", list(range(3, 23)), sp)  # chunked prefill splits it


def test_prompt_longer_than_the_step_budget_through_llm_generate(model_dir):
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, prefill_mode="mixed")
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(InvalidRequestError, match=r"prompt 1: the prompt has 20 tokens, more than max_num_batched_tokens=16"):
        llm.generate([[5, 6, 7], list(range(3, 23))], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    # Presets apply and explicit options override them, through LLM(...) too.
    llm = LLM(model_dir, dtype="float64", num_kv_blocks=64, preset="latency", max_num_batched_tokens=1024)
    sc = llm.config.scheduler
    assert sc.max_num_batched_tokens == 1024
    assert (sc.long_prefill_token_threshold, sc.max_num_seqs, sc.prefill_mode, sc.policy) == (256, 128, "chunked", "fcfs")
    assert llm.engine.scheduler.config is sc
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_apply_and_explicit_options_win(preset):
    config = EngineConfig.from_kwargs(preset=preset).scheduler
    for key, value in PRESETS[preset].items():
        assert getattr(config, key) == value, key
    config = EngineConfig.from_kwargs(preset=preset, max_num_seqs=7, max_num_batched_tokens=100).scheduler
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (7, 100)
    assert config.policy == PRESETS[preset]["policy"]
    # None means "not given" (the CLI passes unset flags as None): the preset's value stays.
    assert EngineConfig.from_kwargs(preset=preset, max_num_seqs=None).scheduler.max_num_seqs == PRESETS[preset]["max_num_seqs"]


def test_overriding_a_preset_axis_drops_the_preset_knobs_it_makes_meaningless():
    # latency caps prompt chunks at 256; prefill_mode='mixed' never splits prompts.
    sc = EngineConfig.from_kwargs(preset="latency", prefill_mode="mixed").scheduler
    assert (sc.prefill_mode, sc.long_prefill_token_threshold, sc.max_num_batched_tokens) == ("mixed", 0, 512)
    # ttft ages sjf at 10 s; fcfs cannot starve and takes no aging bound.
    sc = EngineConfig.from_kwargs(preset="ttft", policy="fcfs").scheduler
    assert (sc.policy, sc.aging_bound_s, sc.prefill_mode) == ("fcfs", None, "prefill_first")
    # ...but a knob that still applies is kept.
    sc = EngineConfig.from_kwargs(preset="ttft", policy="priority").scheduler
    assert (sc.policy, sc.aging_bound_s) == ("priority", 10.0)
    assert EngineConfig.from_kwargs(preset="ttft", aging_bound_s=5.0).scheduler.aging_bound_s == 5.0


def test_from_model_shares_weights_and_caps_max_model_len(base, make_engine):
    engine = make_engine(num_kv_blocks=256)
    assert engine.runner.model is base.engine.runner.model
    assert engine.runner.kv_caches[0].data_ptr() != base.engine.runner.kv_caches[0].data_ptr()
    assert engine.max_model_len == base.engine.max_model_len == 512  # the model's positions
    assert make_engine(num_kv_blocks=8, block_size=4).max_model_len == 32  # the cache
    with pytest.raises(ConfigError, match="exceeds the 512 positions this model was built for"):
        make_engine(num_kv_blocks=256, max_model_len=600)


# -- 6. CLI --------------------------------------------------------------------------------
def test_cli_generate_lists_every_switchboard_flag(capsys):
    from conveyor.cli import main

    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--preset", "--batching", "--max-batch-size", "--batch-timeout-ms", "--prefill-mode",
        "--long-prefill-token-threshold", "--admission", "--schedule-interval", "--policy",
        "--aging-bound-s", "--preemption-mode", "--auto-swap-min-tokens", "--kv-reservation",
        "--num-swap-blocks", "--max-num-batched-tokens",
    ):
        assert flag in text, flag
    for name in PRESETS:
        assert name in text


def test_every_commands_help_renders():
    """argparse formats each option's help with %: a stray percent sign breaks `--help`."""
    from conveyor.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in commands.items():
        assert sub.format_help(), name


def test_cli_flags_become_engine_options():
    from conveyor.cli import build_parser, engine_kwargs

    args = build_parser().parse_args([
        "generate", "hi", "--preset", "latency", "--max-num-batched-tokens", "1024",
        "--batching", "static", "--max-batch-size", "4", "--policy", "priority",
        "--preemption-mode", "swap", "--kv-reservation", "on_demand", "--prefill-mode", "chunked",
    ])
    kwargs = engine_kwargs(args)
    assert kwargs == dict(
        preset="latency", max_num_batched_tokens=1024, batching="static", max_batch_size=4,
        policy="priority", preemption_mode="swap", kv_reservation="on_demand", prefill_mode="chunked",
    )
    sc = EngineConfig.from_kwargs(**kwargs).scheduler
    assert (sc.batching, sc.batch_size, sc.max_num_batched_tokens, sc.long_prefill_token_threshold) == ("static", 4, 1024, 256)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--preset", "fastest"])
