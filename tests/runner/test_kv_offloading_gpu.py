"""KV offloading on a GPU: stores copy device blocks into pinned host memory and loads copy them
back on the step's stream, before the step's attention (and a captured decode) reads them.
(On CPU, tests/test_prefix_caching.py and the property tests cover the same scheduling.)"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, SamplingParams


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offloaded_prefixes_come_back_on_gpu(tiny_models, async_scheduling):
    """Four 20-token prefixes in turn, twice round: a device cache of 12 blocks of 4 forgets
    each before its turn, the tier gives it back. The tokens equal those of an engine whose
    device cache holds every prefix (the same hits, computed the same way, found on the device)."""
    rng = random.Random(3)
    systems = [[rng.randrange(3, 380) for _ in range(20)] for _ in range(4)]
    prompts = [systems[i % 4] + [rng.randrange(3, 380) for _ in range(rng.randint(1, 6))] for i in range(8)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    path = str(tiny_models["llama"])

    def run(**options) -> tuple[LLM, list[list[int]]]:
        llm = LLM(path, device="cuda", dtype="bfloat16", block_size=4, async_scheduling=async_scheduling, **options)
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        assert [o.num_cached_tokens for o in outs] == [0] * 4 + [20] * 4
        return llm, [o.outputs[0].token_ids for o in outs]

    _, want = run(num_kv_blocks=256)
    llm, got = run(num_kv_blocks=12, num_offload_blocks=64)
    assert got == want
    assert llm.engine.scheduler.block_manager.num_offload_hit_tokens == 80
    assert llm.engine.runner.swap_pages[0].is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_disk_tier_gives_a_restarted_gpu_engine_its_prefixes(tiny_models, tmp_path):
    """The disk tier on a GPU: the stores' device-to-host copies land before the files are
    written (the runner waits for the stream), and a restarted engine's reads fill the pinned
    tier blocks its loads copy to the device. Tokens equal those of an engine whose device cache
    holds the prefixes (the same hits, computed the same way, found on the device)."""
    rng = random.Random(5)
    systems = [[rng.randrange(3, 380) for _ in range(20)] for _ in range(4)]
    prompts = [s + [rng.randrange(3, 380) for _ in range(3)] for s in systems]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    path = str(tiny_models["llama"])
    common = dict(device="cuda", dtype="bfloat16", block_size=4, async_scheduling=True)
    roomy = LLM(path, num_kv_blocks=256, **common)
    computed = [o.outputs[0].token_ids for o in roomy.generate(prompts, sp, use_tqdm=False)]
    hit = [roomy.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in hit] == [20] * 4
    disk = dict(num_kv_blocks=64, num_offload_blocks=16, kv_disk_path=str(tmp_path), kv_disk_size=1 << 24, **common)
    first = LLM(path, kv_offloading_policy="write_through", **disk)
    assert [o.outputs[0].token_ids for o in first.generate(prompts, sp, use_tqdm=False)] == computed
    again = LLM(path, **disk)
    outs = [again.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [20] * 4
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in hit]
    assert again.engine.scheduler.block_manager.num_disk_hit_tokens == 80
