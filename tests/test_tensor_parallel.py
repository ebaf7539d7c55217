"""Tensor parallelism (`tensor_parallel_size`): two CPU ranks over gloo give the tokens of one.

The references: HF transformers' greedy tokens on the same float64 weights, and a one-rank
engine under the same schedule (its logprobs, to 1e-9: the ranks' partial sums round apart
from one whole product only in the last bits)."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import LLM, ConfigError, InvalidRequestError, PoolingParams, SamplingParams
from conveyor.models.arch import ArchConfig
from conveyor.models.tensor_parallel import shard_arch, shard_tensor
from tests.models.test_hf_parity import PROMPTS, hf_greedy
from tests.schedulings import SCHEDULINGS


@pytest.fixture(autouse=True)
def keep_threads():
    """A tensor-parallel engine sets this process's torch threads (rank 0's share of the cores)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tp_llm(path, size=2, **options) -> LLM:
    return LLM(str(path), dtype="float64", tensor_parallel_size=size, num_threads=1, **options)


def run(llm: LLM, prompts, params) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or []]) for o in outs]


def assert_same(got, want, tol=1e-9):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=tol)


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_two_ranks_give_transformers_greedy_tokens(tiny_models, family):
    """Llama (GQA, llama3 RoPE, untied head), Qwen2 (q/k/v biases, tied head), Qwen3 (q/k
    norms, a head_dim of its own), Mistral."""
    expected = hf_greedy(tiny_models[family], PROMPTS, max_new_tokens=16)
    llm = tp_llm(tiny_models[family], num_kv_blocks=64, block_size=8)
    got = run(llm, PROMPTS, GREEDY)
    assert [t for t, _ in got] == expected
    one = LLM(str(tiny_models[family]), dtype="float64", num_kv_blocks=64, block_size=8)
    assert_same(got, run(one, PROMPTS, GREEDY))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_mixtures_of_experts_split_each_expert(tiny_moe_models, family):
    """Each expert's inner width (and Qwen2-MoE's shared expert's) split across the ranks; the
    router whole on each."""
    path = tiny_moe_models[family]
    got = run(tp_llm(path, num_kv_blocks=64, block_size=8), PROMPTS, GREEDY)
    assert_same(got, run(LLM(str(path), dtype="float64", num_kv_blocks=64, block_size=8), PROMPTS, GREEDY))


@SCHEDULINGS
def test_every_scheduling_gives_one_ranks_tokens(tiny_models, options):
    """Chunked prompts, preemption by recompute, async scheduling, n-gram speculation: the
    workers follow whatever rows rank 0 runs."""
    path = tiny_models["llama"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(1, 40))] for _ in range(10)]
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 20), temperature=rng.choice([0.0, 0.8]), seed=i, logprobs=0,
                       ignore_eos=True)
        for i in range(10)
    ]
    options = {"num_kv_blocks": 64, "block_size": 8, **options}
    got = run(tp_llm(path, **options), prompts, params)
    assert_same(got, run(LLM(str(path), dtype="float64", **options), prompts, params))


def test_swapping_prefix_cache_and_embeddings(tiny_models):
    """Preemption by swap moves each rank's blocks; prefix-cache hits reuse each rank's K/V;
    an embedding request pools rank 0's whole hidden states."""
    path = tiny_models["llama"]
    options = dict(num_kv_blocks=12, block_size=4, preemption_mode="swap", swap_space=1 << 20,
                   enable_prefix_caching=True)
    shared = list(range(10, 30))
    prompts = [shared + [i + 3] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=0)
    two, one = tp_llm(path, **options), LLM(str(path), dtype="float64", **options)
    got = run(two, prompts, params)
    assert_same(got, run(one, prompts, params))
    assert two.engine.scheduler.num_swaps_out > 0 and two.engine.scheduler.num_swaps_in > 0
    again = run(two, prompts[:2], params)  # the shared prefix is cached now
    assert_same(again, got[:2])
    pooling = PoolingParams(pooling_type="mean")
    a = two.embed(prompts[:3], pooling, use_tqdm=False)
    b = one.embed(prompts[:3], pooling, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs.embedding == pytest.approx(y.outputs.embedding, abs=1e-9)


def test_kv_offloading_stores_and_loads_each_ranks_blocks(tiny_models):
    """KV offloading's tier over two ranks: each rank copies its own shard of an evicted block
    out and back, and the hits give one rank's tokens and log-probabilities."""
    path = tiny_models["llama"]
    options = dict(num_kv_blocks=8, block_size=4, num_offload_blocks=32)
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 380) for _ in range(16)] for _ in range(3)]
    prompts = [prefixes[i % 3] + [rng.randrange(3, 380)] for i in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    two, one = tp_llm(path, **options), LLM(str(path), dtype="float64", **options)
    got = [run(two, [p], params)[0] for p in prompts]  # one at a time: each prefix evicted before its turn
    assert_same(got, [run(one, [p], params)[0] for p in prompts])
    assert two.engine.scheduler.block_manager.num_offload_hit_tokens == 3 * 16


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(
        st.tuples(st.lists(st.integers(3, 380), min_size=1, max_size=30), st.integers(1, 12),
                  st.sampled_from([0.0, 0.7]), st.integers(0, 3)),
        min_size=1, max_size=8,
    ),
    abort=st.integers(-1, 7),
)
def test_random_arrivals_and_aborts_keep_the_ranks_in_step(tp_pair, requests, abort):
    """Requests arrive between steps in a random pattern, one may be aborted mid-way, under a
    small cache and token budget (chunking, preemption): the two-rank engine's outputs are the
    one-rank engine's, and every block comes back."""
    results = []
    for llm in tp_pair:
        engine = llm.engine
        done: dict[str, tuple[list[int], list[float]]] = {}
        pending = list(enumerate(requests))
        steps = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][1][3] <= steps:
                i, (prompt, max_tokens, temperature, _) = pending.pop(0)
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                   seed=i, logprobs=0, ignore_eos=True))
            if steps == 2 and 0 <= abort < len(requests):
                engine.abort_request(f"r{abort}")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].token_ids, [lp.logprob for lp in out.outputs[0].logprobs or []])
            steps += 1
            if not engine.has_unfinished_requests() and pending:
                steps = max(steps, pending[0][1][3])
        assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
        results.append(done)
    two, one = results
    assert two.keys() == one.keys()
    for key in one:
        assert_same([two[key]], [one[key]])


@pytest.fixture(scope="module")
def tp_pair(tiny_models):
    path = tiny_models["llama"]
    options = dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=24, max_num_seqs=4)
    threads = torch.get_num_threads()
    pair = (tp_llm(path, **options), LLM(str(path), dtype="float64", **options))
    torch.set_num_threads(threads)
    yield pair


def test_int8_ranks_are_as_close_to_float32_as_one_int8_engine(tiny_models):
    """int8 quantizes each rank's shard (a column split gets its own row scales), so its tokens
    may differ from one int8 engine's; they stay as close to float32's."""
    path = str(tiny_models["llama"])
    ids = [(7 * i + 3) % 380 + 2 for i in range(60)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def prompt_logprobs(llm: LLM) -> torch.Tensor:
        out = llm.generate([ids], params, use_tqdm=False)[0]
        return torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]], dtype=torch.float64)

    reference = prompt_logprobs(LLM(path, dtype="float32", num_kv_blocks=64, block_size=8))
    one = prompt_logprobs(LLM(path, quantization="int8", num_kv_blocks=64, block_size=8))
    two = prompt_logprobs(LLM(path, quantization="int8", tensor_parallel_size=2, num_threads=1, num_kv_blocks=64,
                              block_size=8))
    err_one, err_two = (one - reference).abs().mean(), (two - reference).abs().mean()
    assert err_two < max(2 * err_one, 1e-3)


def test_a_draft_model_runs_on_rank_0(tiny_models):
    path = tiny_models["llama"]
    options = dict(num_kv_blocks=64, block_size=8, speculative_method="draft_model", speculative_model=str(path),
                   num_speculative_tokens=3)
    got = run(tp_llm(path, **options), PROMPTS, GREEDY)
    assert_same(got, run(LLM(str(path), dtype="float64", num_kv_blocks=64, block_size=8), PROMPTS, GREEDY))


def test_workers_end_with_their_engine(tiny_models):
    llm = tp_llm(tiny_models["llama"], num_kv_blocks=16, block_size=8)
    procs = list(llm.engine.runner.peers.procs)
    assert all(p.poll() is None for p in procs)
    del llm
    gc.collect()
    assert all(p.poll() is not None for p in procs)


def test_a_worker_that_dies_is_an_error_not_a_hang(tiny_models):
    llm = tp_llm(tiny_models["llama"], num_kv_blocks=16, block_size=8)
    proc = llm.engine.runner.peers.procs[0]
    proc.kill()
    proc.wait()
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_bad_configurations_say_why(tiny_models, tmp_path):
    path = str(tiny_models["llama"])  # 4 heads, 2 KV heads, MLP width 128
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        tp_llm(path, size=4)
    with pytest.raises(ConfigError, match="at least 1"):
        LLM(path, tensor_parallel_size=0)
    from conveyor.config import EngineConfig
    from conveyor.engine import Engine

    one = LLM(path, dtype="float64", num_kv_blocks=16)
    with pytest.raises(ConfigError, match="from_config"):
        Engine.from_model(EngineConfig.from_kwargs(tensor_parallel_size=2), one.engine.runner.model, None)


def test_a_workers_load_error_comes_back():
    """A rank that cannot build its shard says why, at start-up."""
    from conveyor.runner.tensor_parallel import Recipe, TensorParallelGroup

    group = TensorParallelGroup(2, Recipe("/nonexistent/model", "float64", "float64", 64, 4, 8, 0, 1))
    with pytest.raises(RuntimeError, match="rank 1 could not start: ModelLoadError: cannot read"):
        group.wait_ready()
    assert group.procs[0].poll() is not None


def test_shards_put_back_together_are_the_tensor():
    g = torch.Generator().manual_seed(0)
    cases = {
        "layers.0.self_attn.q_proj.weight": (torch.randn(8, 6, generator=g), -2),
        "layers.0.self_attn.k_proj.bias": (torch.randn(8, generator=g), 0),
        "layers.0.self_attn.o_proj.weight": (torch.randn(6, 8, generator=g), -1),
        "layers.0.mlp.down_proj.weight": (torch.randn(6, 8, generator=g), -1),
        "layers.0.mlp.experts.down_proj": (torch.randn(3, 6, 8, generator=g), -1),  # stacked (GGUF)
        "layers.0.mlp.experts.gate_proj": (torch.randn(3, 8, 6, generator=g), -2),
        "layers.0.mlp.experts.1.w1.weight": (torch.randn(8, 6, generator=g), -2),  # Mixtral
    }
    for name, (tensor, dim) in cases.items():
        parts = [shard_tensor(name, tensor, r, 2) for r in range(2)]
        assert torch.equal(torch.cat(parts, dim=dim), tensor), name
    whole = {"embed_tokens.weight", "layers.0.mlp.gate.weight", "layers.0.input_layernorm.weight",
             "layers.0.mlp.shared_expert_gate.weight"}
    for name in whole:
        t = torch.randn(4, 6, generator=g)
        assert shard_tensor(name, t, 1, 2) is t
    stacked = torch.randn(3, 8, 6, generator=g)  # transformers >= 5: gate rows, then up rows
    parts = [shard_tensor("layers.0.mlp.experts.gate_up_proj", stacked, r, 2) for r in range(2)]
    gate = torch.cat([p[:, :2] for p in parts], dim=1)
    up = torch.cat([p[:, 2:] for p in parts], dim=1)
    assert torch.equal(gate, stacked[:, :4]) and torch.equal(up, stacked[:, 4:])
    fused = torch.randn(8 + 4 + 4, 6, generator=g)  # Phi-3's qkv_proj: q (8 rows), k and v (4 each)
    parts = [shard_tensor("layers.0.self_attn.qkv_proj.weight", fused, r, 2, qkv=(8, 4)) for r in range(2)]
    for section, (lo, hi) in enumerate(((0, 8), (8, 12), (12, 16))):  # each rank: q, then k, then v
        width = (hi - lo) // 2
        offset = sum((8, 4, 4)[i] // 2 for i in range(section))
        assert torch.equal(torch.cat([p[offset:offset + width] for p in parts]), fused[lo:hi])
    with pytest.raises(ValueError, match="qkv"):
        shard_tensor("layers.0.self_attn.qkv_proj.weight", fused, 0, 2)


def test_shard_arch_divides_heads_and_widths():
    arch = ArchConfig(family="llama", vocab_size=10, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=8, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=False)
    local = shard_arch(arch, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.head_dim) == (2, 1, 24, 8)
    assert local.kv_bytes_per_token(4) * 4 == arch.kv_bytes_per_token(4)
    with pytest.raises(ConfigError, match="num_key_value_heads=4"):
        shard_arch(arch, 8)


def test_gloo_all_reduce_gives_the_same_tokens(tiny_models, monkeypatch):
    monkeypatch.setenv("CONVEYOR_TP_ALL_REDUCE", "gloo")
    llm = tp_llm(tiny_models["llama"], num_kv_blocks=64, block_size=8)
    assert llm.engine.runner.peers.all_reduce._map is None  # gloo, not the shared mapping
    got = run(llm, PROMPTS, GREEDY)
    assert_same(got, run(LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=64, block_size=8), PROMPTS,
                         GREEDY))


def shared_all_reduces(tmp_path, size: int) -> list:
    from conveyor.kernels import shm_all_reduce
    from conveyor.runner.tensor_parallel import AllReduce

    if shm_all_reduce() is None:
        pytest.skip("native kernels unavailable here")
    path = str(tmp_path / "shm")
    return [AllReduce(None, r, size, path, create=(r == 0)) for r in range(size)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(2, 4), numels=st.lists(st.sampled_from([1, 7, 1024, 1 << 20, (1 << 20) + 3, 3 << 20]),
                                               min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_shared_memory_all_reduce_sums_in_rank_order(tmp_path_factory, size, numels, dtype):
    """Ranks as threads over one mapping (the kernel waits without the GIL): every rank gets
    the sum in rank order, bit for bit, over calls of any size (several rounds of a slot)."""
    import threading

    reducers = shared_all_reduces(tmp_path_factory.mktemp("shm"), size)
    g = torch.Generator().manual_seed(size)
    for numel in numels:
        inputs = [torch.randn(numel, generator=g, dtype=dtype) for _ in range(size)]
        want = inputs[0].clone()
        for x in inputs[1:]:
            want += x
        outs = [x.clone() for x in inputs]
        threads = [threading.Thread(target=reducers[r], args=(outs[r],)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for out in outs:
            assert torch.equal(out, want)


def test_a_rank_that_never_arrives_is_aborted(tmp_path):
    import threading

    reducers = shared_all_reduces(tmp_path, 2)
    threading.Timer(0.3, reducers[0].abort).start()  # what the watchdog does when a rank dies
    with pytest.raises(RuntimeError, match="a rank is gone"):
        reducers[0](torch.ones(8))


def test_adapters_split_with_the_model(tiny_models, tmp_path):
    """LoRA adapters on every projection, several in one step beside the base model, on two
    ranks: each rank takes its slice of B (projections into a slice) or of A (out of one), and
    the tokens are HF transformers' with each adapter merged into the weights."""
    from pathlib import Path

    from conveyor import LoRARequest
    from tests.test_lora import SPECS, merged_reference, write_adapter

    model_dir = tiny_models["llama"]
    adapters = [LoRARequest(name, k + 1, str(write_adapter(tmp_path / name, model_dir, *spec, seed=k)))
                for k, (name, spec) in enumerate(SPECS.items())]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(17, 24))] for _ in range(3)]
    cases = [(p, lora) for lora in [None, *adapters] for p in prompts]
    llm = tp_llm(model_dir, num_kv_blocks=64, block_size=8, enable_lora=True, max_loras=2, max_num_batched_tokens=40)
    llm.add_lora(adapters[1])
    llm.pin_lora(adapters[1].lora_int_id)  # (rank 0's pins go to the workers with each step's adapters)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate([p for p, _ in cases], params, lora_request=[lora for _, lora in cases], use_tqdm=False)
    for lora in [None, *adapters]:
        want = merged_reference(model_dir, None if lora is None else Path(lora.lora_path), prompts, 12)
        got = [o.outputs[0].token_ids for (_, used), o in zip(cases, outs, strict=True) if used is lora]
        assert got == want, lora
    dora = LoRARequest("dora", 9, str(write_adapter(tmp_path / "dora", model_dir, *SPECS["attn-qv"], seed=7, dora=True)))
    with pytest.raises(InvalidRequestError, match="DoRA under tensor parallelism is not built"):
        llm.add_lora(dora)
