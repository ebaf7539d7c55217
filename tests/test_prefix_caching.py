"""Prefix caching on the real (tiny, float64) Llama: a hit changes how much is computed, never
which tokens come out.

Requests share a "system prompt", one repeats another whole, and a second turn extends a first
turn's prompt and answer, as a chat does. Under every prefill mode, with and without
preemption, the greedy tokens equal those of an engine with prefix caching off; the cached
tokens are reported per request and the steps compute exactly the prompts less the hits.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from conveyor import LLM, InvalidRequestError, SamplingParams
from conveyor.config import PREFILL_MODES, EngineConfig
from conveyor.engine import Engine
from conveyor.server.metrics import ServerMetrics
from tests.test_switchboard import drive, tokens

BLOCK_SIZE = 4


def shared_prefix_workload(seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 384) for _ in range(22)]
    prompts = [system + [rng.randrange(3, 384) for _ in range(rng.randint(1, 12))] for _ in range(7)]
    prompts.append(list(prompts[2]))  # the same prompt twice
    prompts.append(system[:9])  # a prefix of the others, not block-aligned
    params = [SamplingParams(max_tokens=rng.randint(2, 10), temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> str:
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def base(model_dir) -> LLM:
    return LLM(model_dir, dtype="float64", num_kv_blocks=256, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def make_engine(base, model_dir):
    def make(**options: Any) -> Engine:
        config = EngineConfig.from_kwargs(model=model_dir, dtype="float64", block_size=BLOCK_SIZE, **options)
        return Engine.from_model(config, base.engine.runner.model, base.engine.tokenizer)

    return make


@pytest.fixture(scope="module")
def reference(make_engine):
    prompts, params = shared_prefix_workload()
    return tokens(drive(make_engine(enable_prefix_caching=False, num_kv_blocks=128), prompts, params))


@pytest.mark.parametrize("prefill_mode", PREFILL_MODES)
@pytest.mark.parametrize("arrivals", ["together", "one_by_one"])
def test_hits_keep_the_tokens_and_compute_only_the_rest(make_engine, reference, prefill_mode, arrivals):
    prompts, params = shared_prefix_workload()
    engine = make_engine(prefill_mode=prefill_mode, num_kv_blocks=128, max_num_batched_tokens=64)
    if arrivals == "together":
        outs = drive(engine, prompts, params)
    else:  # each request after the one before finished: every prefix is cached by then
        outs = [drive(engine, [p], [sp], tag=f"r{i}-")[0] for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    assert tokens(outs) == reference
    cached = [o.num_cached_tokens for o in outs]
    assert all(c % BLOCK_SIZE == 0 and c < len(p) for c, p in zip(cached, prompts, strict=True))
    assert cached[0] == 0
    # The system prompt's 5 full blocks for every later request that holds them whole; the
    # repeated prompt all its full blocks but the last token's. Also for requests admitted in
    # the same step as the one whose prefill writes those blocks ("together").
    assert cached[1:7] == [20] * 6
    assert cached[7] == (len(prompts[7]) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached[8] == 8
    assert sum(cached) > 0
    bm = engine.scheduler.block_manager
    assert bm.num_hit_tokens == sum(cached)
    # Nothing was preempted: the steps computed each prompt less its hit, and each output but
    # the last (which is sampled, never fed back).
    assert sum(o.num_preemptions for o in outs) == 0
    computed = sum(s.num_prefill_tokens + s.num_decode_tokens for s in engine.step_trace)
    want = sum(len(p) - c for p, c in zip(prompts, cached, strict=True)) + sum(len(t) - 1 for t in reference)
    assert computed == want


def test_hits_with_async_scheduling_keep_the_tokens(make_engine, reference):
    """Step t+1 is scheduled before step t's tokens are back: its hits are blocks that step t
    or step t+1 itself writes, before step t+1's attention reads them."""
    prompts, params = shared_prefix_workload()
    engine = make_engine(async_scheduling=True, num_kv_blocks=128, max_num_batched_tokens=64)
    outs = drive(engine, prompts, params)
    assert tokens(outs) == reference
    assert [o.num_cached_tokens for o in outs][1:7] == [20] * 6


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_hits_under_preemption_keep_the_tokens(make_engine, reference, preemption_mode):
    """A cache too small for the batch: sequences are preempted, cached blocks evicted, and a
    recomputed sequence finds its own earlier blocks when they survive."""
    prompts, params = shared_prefix_workload()
    engine = make_engine(preemption_mode=preemption_mode, num_kv_blocks=16, max_num_batched_tokens=32, num_swap_blocks=64)
    outs = drive(engine, prompts, params)
    assert tokens(outs) == reference
    assert engine.scheduler.num_preemptions > 0


def test_a_second_turn_reuses_the_first_turns_prompt_and_answer(make_engine):
    engine = make_engine(num_kv_blocks=64)
    rng = random.Random(1)
    first = [rng.randrange(3, 384) for _ in range(17)]
    sp = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    answer = drive(engine, [first], [sp], tag="turn1-")[0].outputs[0].token_ids
    second = first + answer + [rng.randrange(3, 384) for _ in range(5)]
    out = drive(engine, [second], [sp], tag="turn2-")[0]
    # Blocks 0-5 hold the first turn's prompt and all its answer but the last token (that
    # one was sampled, never computed): 24 of its 26 tokens.
    assert out.num_cached_tokens == 24
    off = make_engine(num_kv_blocks=64, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == drive(off, [second], [sp])[0].outputs[0].token_ids


def test_llm_generate_reports_cached_tokens_and_reset_forgets_them(model_dir):
    llm = LLM(model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=64)
    prompt = list(range(5, 30))
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 24)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_cache_salt_hits_only_its_own_prefixes(model_dir):
    """vLLM's cache_salt: the same prompt under another salt (or none) is computed again, under
    the same salt it hits; the tokens are the same either way."""
    llm = LLM(model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=64)
    prompt = list(range(5, 30))

    def cached(salt: str | None) -> tuple[int, list[int]]:
        out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, cache_salt=salt), use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first = cached("tenant-a")
    assert first[0] == 0
    assert cached("tenant-b")[0] == 0 and cached(None)[0] == 0
    assert cached("tenant-a") == (24, first[1])
    assert cached(None) == (24, first[1])
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_off_computes_every_prompt_token(make_engine, reference):
    prompts, params = shared_prefix_workload()
    engine = make_engine(enable_prefix_caching=False, num_kv_blocks=128)
    outs = drive(engine, prompts, params)
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
    assert engine.scheduler.block_manager.num_cached_blocks == 0


def test_a_seeded_sample_is_the_same_with_and_without_a_hit(model_dir):
    llm = LLM(model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=64)
    prompt = list(range(5, 40))
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    first, again = (llm.generate([prompt], sp, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


# -- KV offloading: the prefix cache's host tier ---------------------------------------------
def rotating_prefixes_workload(seed: int = 3) -> tuple[list[list[int]], list[SamplingParams]]:
    """Four 20-token "system prompts" asked in turn, twice round: a device cache of 12 blocks of
    4 holds the K/V of about two of them, so each is evicted before its turn comes again."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 384) for _ in range(20)] for _ in range(4)]
    prompts = [systems[i % 4] + [rng.randrange(3, 384) for _ in range(rng.randint(1, 6))] for i in range(8)]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2) for _ in prompts]
    return prompts, params


def one_by_one(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    return [drive(engine, [p], [sp], tag=f"r{i}-")[0] for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]


def logprobs_of(outs: list[Any]) -> list[float]:
    """Each sampled token's log-probability and its top two's, all requests' in a row."""
    return [lp for o in outs for t in o.outputs[0].logprobs for lp in (t.logprob, *(v for _, v in t.top or ()))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offloaded_prefixes_come_back_with_their_kv(make_engine, async_scheduling):
    """Evicted cached blocks are copied to the host tier and a later prompt loads them back: the
    second round hits all 20 system-prompt tokens (5 blocks from the tier, none on the device),
    and the tokens and log-probabilities equal those computed without any cache."""
    prompts, params = rotating_prefixes_workload()
    want = one_by_one(make_engine(enable_prefix_caching=False, num_kv_blocks=64), prompts, params)
    without = one_by_one(make_engine(num_kv_blocks=12), prompts, params)
    engine = make_engine(num_kv_blocks=12, num_offload_blocks=64, async_scheduling=async_scheduling)
    outs = one_by_one(engine, prompts, params)
    assert tokens(outs) == tokens(want)
    assert logprobs_of(outs) == pytest.approx(logprobs_of(want), abs=1e-6)
    assert [o.num_cached_tokens for o in without] == [0] * 8  # the device cache alone forgot each one
    assert [o.num_cached_tokens for o in outs] == [0] * 4 + [20] * 4
    bm = engine.scheduler.block_manager
    assert bm.num_offload_hit_tokens == 80 and bm.num_offload_stores >= 20
    loaded = sum(s.blocks_loaded for s in engine.step_trace)
    assert loaded == 20 and sum(s.blocks_stored for s in engine.step_trace) == bm.num_offload_stores
    metrics = ServerMetrics("m")  # what /metrics counts from the same step records
    for record in engine.step_trace:
        metrics.on_step(record)
    text = metrics.render().decode()
    assert 'conveyor:kv_offload_blocks_loaded_total{model_name="m"} 20.0' in text
    assert f'conveyor:kv_offload_blocks_stored_total{{model_name="m"}} {float(bm.num_offload_stores)}' in text
    # The steps computed each prompt less its hit, and each output but the last.
    computed = sum(s.num_prefill_tokens + s.num_decode_tokens for s in engine.step_trace)
    assert computed == sum(len(p) for p in prompts) - 80 + 8 * 3


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_offloading_under_preemption_keeps_the_tokens(make_engine, reference, preemption_mode):
    """All at once into a cache too small for the batch: sequences are preempted (by swap, into
    the same host pool as the tier, or by recompute, which may find its own blocks in the tier)
    and cached blocks are evicted and loaded back while others run."""
    prompts, params = shared_prefix_workload()
    engine = make_engine(preemption_mode=preemption_mode, num_kv_blocks=16, max_num_batched_tokens=32,
                         num_swap_blocks=64, num_offload_blocks=24)
    outs = drive(engine, prompts, params)
    assert tokens(outs) == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.block_manager.num_offload_stores > 0


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_write_through_policies_keep_the_tokens(make_engine, policy):
    """The tier written the step after a block is computed (or once it is reused): the second
    round finds every system prompt in the tier, with the tokens and log-probabilities of no cache."""
    prompts, params = rotating_prefixes_workload()
    want = one_by_one(make_engine(enable_prefix_caching=False, num_kv_blocks=64), prompts, params)
    engine = make_engine(num_kv_blocks=12, num_offload_blocks=64, kv_offloading_policy=policy)
    outs = one_by_one(engine, prompts, params)
    assert tokens(outs) == tokens(want)
    assert logprobs_of(outs) == pytest.approx(logprobs_of(want), abs=1e-6)
    bm = engine.scheduler.block_manager
    # write_through stores every full block (each system prompt's 5 and the rest), so the second
    # round hits them all; no block is reused on the device, so write_through_selective stores none.
    assert [o.num_cached_tokens for o in outs] == [0] * 4 + ([20] * 4 if policy == "write_through" else [0] * 4)
    assert bm.num_offload_stores >= 4 * 5 if policy == "write_through" else bm.num_offload_stores == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_disk_tier_gives_a_restarted_engine_its_prefixes(base, model_dir, tmp_path, async_scheduling):
    """Blocks stored into the host tier are written to a directory; an engine started later on
    it (same model, same layout) reads them back: the K/V, tokens and log-probabilities of
    computing them. The first engine's host tier of two blocks stores a step's blocks over the
    following steps (write-through waits for a tier block; the engine steps until it is done)."""
    prompts, params = rotating_prefixes_workload()

    def make(**options: Any) -> Engine:
        config = EngineConfig.from_kwargs(model=model_dir, dtype="float64", block_size=BLOCK_SIZE, **options)
        return Engine.from_model(config, base.engine.runner.model, base.engine.tokenizer, model_path=model_dir)

    want = one_by_one(make(enable_prefix_caching=False, num_kv_blocks=64), prompts, params)
    disk = {"kv_disk_path": str(tmp_path), "kv_disk_size": 1 << 20}
    first = make(num_kv_blocks=12, num_offload_blocks=2, kv_offloading_policy="write_through",
                 async_scheduling=async_scheduling, **disk)
    outs = one_by_one(first, prompts[:4], params[:4])
    assert tokens(outs) == tokens(want[:4])
    files = list(tmp_path.glob("*/*.kv"))
    assert len(files) >= 4 * 5  # every full block of the four prompts (a 20-token system prompt and more)
    # (A disk hit is read into a host tier block: a chain of five takes five.)
    again = make(num_kv_blocks=12, num_offload_blocks=6, async_scheduling=async_scheduling, **disk)
    outs = one_by_one(again, prompts[4:], params[4:])
    assert tokens(outs) == tokens(want[4:])
    assert logprobs_of(outs) == pytest.approx(logprobs_of(want[4:]), abs=1e-6)
    assert [o.num_cached_tokens for o in outs] == [20] * 4
    bm = again.scheduler.block_manager
    assert bm.num_disk_hit_tokens == 80 and sum(s.blocks_loaded for s in again.step_trace) == 20
    assert sum(s.disk_blocks_read for s in again.step_trace) == 20
    assert sum(s.disk_blocks_written for s in first.step_trace) == len(files)
    metrics = ServerMetrics("m")
    for record in again.step_trace:
        metrics.on_step(record)
    assert 'conveyor:kv_disk_blocks_read_total{model_name="m"} 20.0' in metrics.render().decode()


def test_two_engines_on_one_directory_share_their_prefixes(base, model_dir, tmp_path):
    """Both alive: what one computes (written through to disk) the other reads, with the tokens
    of computing it."""
    prompts, params = rotating_prefixes_workload()

    def make(**options: Any) -> Engine:
        config = EngineConfig.from_kwargs(model=model_dir, dtype="float64", block_size=BLOCK_SIZE, **options)
        return Engine.from_model(config, base.engine.runner.model, base.engine.tokenizer, model_path=model_dir)

    want = one_by_one(make(enable_prefix_caching=False, num_kv_blocks=64), prompts, params)
    shared = dict(num_kv_blocks=12, num_offload_blocks=8, kv_offloading_policy="write_through",
                  kv_disk_path=str(tmp_path), kv_disk_size=1 << 20)
    a, b = make(**shared), make(**shared)
    first = one_by_one(a, prompts[:4], params[:4])
    second = one_by_one(b, prompts[4:], params[4:])
    assert tokens(first) + tokens(second) == tokens(want)
    assert [o.num_cached_tokens for o in second] == [20] * 4
    assert b.scheduler.block_manager.num_disk_hit_tokens == 80


def test_disk_tier_options_are_checked(model_dir, tmp_path):
    from conveyor.config import ConfigError

    with pytest.raises(ConfigError, match="needs kv_offloading_size"):
        EngineConfig.from_kwargs(model="m", kv_disk_path=str(tmp_path), kv_disk_size=1 << 20)
    with pytest.raises(ConfigError, match="go together"):
        EngineConfig.from_kwargs(model="m", kv_offloading_size=1 << 20, kv_disk_path=str(tmp_path))
    with pytest.raises(ConfigError, match="kv_offloading_policy"):
        EngineConfig.from_kwargs(model="m", kv_offloading_policy="write_around")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot hold the KV disk tier"):
        LLM(model_dir, dtype="float64", num_kv_blocks=8, num_offload_blocks=4, kv_disk_path=str(blocked),
            kv_disk_size=1 << 20)
    with pytest.raises(ConfigError, match="holds no KV block"):
        LLM(model_dir, dtype="float64", num_kv_blocks=8, num_offload_blocks=4, kv_disk_path=str(tmp_path),
            kv_disk_size=8)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_lfu_eviction_keeps_the_tokens(make_engine, reference, preemption_mode):
    """eviction_policy='lfu' changes which cached blocks go first, never the tokens: a cache too
    small for the batch, with preemption and a host tier."""
    prompts, params = shared_prefix_workload()
    engine = make_engine(eviction_policy="lfu", preemption_mode=preemption_mode, num_kv_blocks=16,
                         max_num_batched_tokens=32, num_swap_blocks=64, num_offload_blocks=8)
    assert tokens(drive(engine, prompts, params)) == reference
    assert engine.scheduler.block_manager.lfu and engine.scheduler.block_manager.num_hit_tokens > 0


def test_reset_prefix_cache_forgets_the_tier_too(model_dir):
    llm = LLM(model_dir, dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=8, num_offload_blocks=16)
    prompt, other = list(range(5, 30)), list(range(100, 125))
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    llm.generate([prompt], sp, use_tqdm=False)
    llm.generate([other], sp, use_tqdm=False)  # evicts `prompt`'s blocks to the tier
    assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 24
    assert llm.reset_prefix_cache()
    assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_tier_too_small_for_a_block_is_refused_with_the_unit(model_dir):
    from conveyor.config import ConfigError

    with pytest.raises(ConfigError, match="in bytes, where vLLM's --kv-offloading-size is in GiB"):
        LLM(model_dir, dtype="float64", num_kv_blocks=8, kv_offloading_size=8)


@pytest.mark.parametrize(("options", "match"), [
    ({"num_offload_blocks": 8, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ({"kv_offloading_size": 1 << 20, "hybrid_kv_cache": True}, "hybrid"),
    ({"kv_offloading_size": -1}, ">= 0"),
])
def test_offloading_options_are_checked(options, match):
    from conveyor.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs(model="m", **options)
