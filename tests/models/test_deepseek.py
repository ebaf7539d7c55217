"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention over the paged cache, and their
routers; GLM-4.5, their mixture under grouped-query attention with partial RoPE. Greedy tokens equal HF transformers' on the same random weights in float64 under every
scheduling (prompts expanded, decodes absorbed), with prefix hits, swaps and a float16 cache;
the float32 CPU path agrees with HF's float32; the routers equal HF's over random inputs
(hypothesis); the cache holds one latent and one rotary key a token."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.models.arch import ArchConfig, UnsupportedModelError
from conveyor.models.moe import GroupedRouter
from tests.conftest import build_tiny_model
from tests.models.test_hf_parity import PROMPTS
from tests.models.test_moe import hf_greedy
from tests.schedulings import SCHEDULINGS

# Small MLA shapes: 4 heads, a latent of 32, rotary keys of 8, per-head keys of 16 + 8.
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1)
_rng = random.Random(11)
SHORT = [[_rng.randrange(3, 384) for _ in range(_rng.randint(1, 14))] for _ in range(6)]  # fit the preempt cache
FAMILIES = ["deepseek_v2", "deepseek_v3", "glm4_moe"]
# GLM-4.5's shape: grouped-query attention with q/k/v biases and q/k norms, RoPE over half of
# each head, under V3's mixture.
GLM = dict(num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True, n_routed_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
           n_group=4, topk_group=2, routed_scaling_factor=2.0, norm_topk_prob=True,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """V2: one query projection, softmax scores, the best 2 of 4 groups by their best expert,
    weights scaled, not renormalized. V3: a low-rank query, sigmoid scores with a learned bias,
    groups by their best two, renormalized and scaled, and YaRN-scaled RoPE (with the softmax
    scale's correction)."""
    root = tmp_path_factory.mktemp("deepseek")
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    return {
        "deepseek_v2": build_tiny_model(root / "v2", "deepseek_v2", seed=8, q_lora_rank=None,
                                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                        routed_scaling_factor=1.5, **MLA),
        "deepseek_v3": build_tiny_model(root / "v3", "deepseek_v3", seed=9, q_lora_rank=24, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=yarn,
                                        **MLA),
        "glm4_moe": build_tiny_model(root / "glm", "glm4_moe", seed=10, **GLM),
    }


@pytest.mark.parametrize("family", FAMILIES)
@SCHEDULINGS
def test_greedy_matches_transformers(deepseek_models, family, options):
    model_dir = deepseek_models[family]
    expected = hf_greedy(model_dir, SHORT, max_new_tokens=16)
    llm = LLM(str(model_dir), dtype="float64", **{"num_kv_blocks": 64, "block_size": 8, **options})
    outs = llm.generate(SHORT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_match_transformers(deepseek_models, family):
    """One prompt's last hidden states. HF computes its RMSNorms in float32 even in a float64
    model (V2 its rotary product too), so agreement stops near float32's precision; the rotary
    dims read in pairs, had the loader not put them in halves, would be off by 0.2 and more."""
    from transformers import AutoModelForCausalLM

    ids = PROMPTS[2][:40]
    hf = AutoModelForCausalLM.from_pretrained(deepseek_models[family], dtype=torch.float64,
                                              experts_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    llm = LLM(str(deepseek_models[family]), dtype="float64", num_kv_blocks=64)
    got = llm.engine.runner.model.forward_sequence(ids)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", [
    {"preemption_mode": "swap", "num_kv_blocks": 24, "block_size": 4, "num_swap_blocks": 64},
    {"kv_cache_dtype": "float32"},
    {"enable_prefix_caching": True, "max_num_batched_tokens": 32, "block_size": 4},
], ids=["swap", "kv-float32", "prefix-hits"])
def test_cache_paths_keep_the_tokens(deepseek_models, options):
    """The latent rows move as K/V do: swapped out and in, stored in another dtype (a float32
    cache under float64: rounded latents, the same greedy tokens here), read as prefix hits."""
    model_dir = deepseek_models["deepseek_v3"]
    shared = SHORT[0] + SHORT[1] + SHORT[2]  # a common prefix of several blocks
    prompts = [shared + p for p in SHORT[3:]] + SHORT
    expected = hf_greedy(model_dir, prompts, max_new_tokens=12)
    llm = LLM(str(model_dir), dtype="float64", **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "preemption_mode" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    if "enable_prefix_caching" in options:
        assert sum(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_on_cpu_matches_transformers_float32(deepseek_models, family):
    """The CPU's float32 path (native norms, the skinny GEMV in every projection and expert):
    HF's float32 greedy tokens, at batch 1 and in a batch of five."""
    model_dir = deepseek_models[family]
    expected = hf_greedy(model_dir, PROMPTS, 12, torch.float32)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:2]] == expected[:2]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected


def test_the_cache_holds_latents(deepseek_models):
    """A token's cache entry a layer is its latent and rotary key (32 + 8 values), half in each
    plane, where 4 heads of K and V would take 2 x 4 x 24 = 192."""
    llm = LLM(str(deepseek_models["deepseek_v3"]), dtype="float32", num_kv_blocks=16, block_size=4)
    runner = llm.engine.runner
    arch = runner.model.arch
    assert arch.is_mla and arch.kv_cache_shape == (1, 20)
    assert all(c.shape == (2, 17 * 4, 1, 20) for c in runner.kv_caches)
    assert arch.kv_bytes_per_token(4) == arch.num_layers * 40 * 4
    # The weights the engine counts are the checkpoint's (the memory plan rests on them).
    from safetensors.torch import load_file

    from conveyor.models.loader import read_hf_arch

    for family in FAMILIES:
        tensors = load_file(str(deepseek_models[family] / "model.safetensors"))
        assert read_hf_arch(deepseek_models[family]).num_params == sum(t.numel() for t in tensors.values()), family


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), method=st.sampled_from(["greedy", "group_limited_greedy", "noaux_tc"]),
       tokens=st.integers(1, 12), norm=st.booleans())
def test_router_matches_transformers(seed, method, tokens, norm):
    """The chosen experts (as sets) and their weights equal HF's routers' on random inputs."""
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    g = torch.Generator().manual_seed(seed)
    v3 = method == "noaux_tc"
    hf_cfg = dict(hidden_size=16, num_attention_heads=2, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                  routed_scaling_factor=1.7, norm_topk_prob=norm if v3 else False)
    if v3:
        hf = DeepseekV3TopkRouter(tf.DeepseekV3Config(**hf_cfg))
    else:
        hf = DeepseekV2TopkRouter(tf.DeepseekV2Config(topk_method=method, **hf_cfg))
    arch = ArchConfig.from_hf({"architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
                               "vocab_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
                               "moe_intermediate_size": 8, "topk_method": method, **hf_cfg})
    ours = GroupedRouter(arch)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(8, 16, generator=g))
        hf.weight.copy_(ours.weight)
        if v3:
            assert ours.e_score_correction_bias is not None
            ours.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
            hf.e_score_correction_bias.copy_(ours.e_score_correction_bias)
        x = torch.randn(tokens, 16, generator=g)
        _, ref_w, ref_e = hf(x)
        experts, weights = ours(x)
    order, ref_order = experts.argsort(dim=-1), ref_e.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), ref_e.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_split_the_heads_and_keep_the_latent(deepseek_models, family):
    """Tensor parallelism: each rank takes half the heads (`q_proj` / `q_b_proj` and `kv_b_proj`
    by rows, `o_proj` by columns) and half of each expert, computes and caches the whole
    latent (GLM: half the KV heads, the q/k/v biases split with them); the tokens and logprobs
    of one rank, and HF's greedy tokens."""
    import gc

    path = deepseek_models[family]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    threads = torch.get_num_threads()
    try:
        llm = LLM(str(path), dtype="float64", tensor_parallel_size=2, num_threads=1, num_kv_blocks=64, block_size=8)
        got = llm.generate(SHORT, params, use_tqdm=False)
        # the whole latent on rank 0; GLM's rank its one of the two KV heads
        assert llm.engine.runner.kv_caches[0].shape[2:] == ((1, 32) if family == "glm4_moe" else (1, 20))
        del llm
        gc.collect()
    finally:
        torch.set_num_threads(threads)
    one = LLM(str(path), dtype="float64", num_kv_blocks=64, block_size=8).generate(SHORT, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in one]
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(path, SHORT, 12)
    for a, b in zip(got, one, strict=True):
        assert [lp.logprob for lp in a.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in b.outputs[0].logprobs], abs=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_close_to_float32(deepseek_models, family):
    """quantization="int8" with latent attention and DeepSeek's routers: the projections and the
    experts int8, `kv_b_proj` (read as W_UK and W_UV) and the routers float32; logits within the
    dense int8 tests' bounds of float32's, and the engine serves (its absorbed decode included)."""
    from conveyor.models.mla import LatentAttention
    from conveyor.models.quantize import Int8Linear, int8_supported
    from tests.models.test_int8 import assert_int8_close_to_float32

    if not int8_supported():
        pytest.skip("torch has no fbgemm int8 kernels here")
    quantized = assert_int8_close_to_float32(str(deepseek_models[family]))
    attention = [m for m in quantized.engine.runner.model.modules() if isinstance(m, LatentAttention)]
    assert all(not isinstance(m.kv_b_proj, Int8Linear) and isinstance(m.o_proj, Int8Linear) for m in attention)


def test_what_is_not_built_is_refused(deepseek_models, tmp_path):
    model = str(deepseek_models["deepseek_v2"])
    with pytest.raises(UnsupportedModelError, match="adapters"):
        LLM(model, dtype="float32", enable_lora=True)
    cfg = json.loads((deepseek_models["deepseek_v2"] / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="moe_layer_freq"):
        ArchConfig.from_hf({**cfg, "moe_layer_freq": 2})
