"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy tokens equal HF transformers' on
the same weights in float64 under every scheduling, the float32 CPU path agrees with HF's
float32, and the routed layer equals a per-token reference over random shapes (hypothesis)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.models.arch import ArchConfig, UnsupportedModelError
from conveyor.models.loader import ModelLoadError, iter_hf_tensors, load_weights, read_hf_arch
from conveyor.models.moe import SparseMoE
from tests.models.test_hf_parity import PROMPTS
from tests.schedulings import SCHEDULINGS

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
_rng = random.Random(7)
SHORT = [[_rng.randrange(3, 384) for _ in range(_rng.randint(1, 14))] for _ in range(6)]  # fit the preempt cache
EAGER = {"experts_implementation": "eager"}  # HF's loop over experts (its grouped GEMM takes no float64)


def hf_greedy(model_dir, prompts, max_new_tokens, dtype=torch.float64, **load):
    """HF's greedy tokens of the folder's model (`load`: from_pretrained's other options)."""
    from transformers import AutoModelForCausalLM

    return greedy_of(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **{**EAGER, **load}).eval(),
                     prompts, max_new_tokens)


def two_ranks_and_one(path, prompts, max_tokens=12):
    """The greedy tokens of two tensor-parallel ranks and of one (float64), whose logprobs must
    agree to 1e-9: (two ranks' tokens, one rank's tokens)."""
    import gc

    from conveyor import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    threads = torch.get_num_threads()
    try:
        llm = LLM(str(path), dtype="float64", tensor_parallel_size=2, num_threads=1, num_kv_blocks=64, block_size=8)
        got = llm.generate(prompts, params, use_tqdm=False)
        del llm
        gc.collect()
    finally:
        torch.set_num_threads(threads)
    one = LLM(str(path), dtype="float64", num_kv_blocks=64, block_size=8).generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, one, strict=True):
        assert [lp.logprob for lp in a.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in b.outputs[0].logprobs], abs=1e-9)
    return [o.outputs[0].token_ids for o in got], [o.outputs[0].token_ids for o in one]


def greedy_of(model, prompts, max_new_tokens):
    """An HF model's greedy tokens for each prompt, alone, to `max_new_tokens` (no early end)."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("family", FAMILIES)
@SCHEDULINGS
def test_greedy_matches_transformers(tiny_moe_models, family, options):
    model_dir = tiny_moe_models[family]
    expected = hf_greedy(model_dir, SHORT, max_new_tokens=16)
    kwargs = {"num_kv_blocks": 64, "block_size": 8, **options}
    llm = LLM(str(model_dir), dtype="float64", **kwargs)
    outs = llm.generate(SHORT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0


def test_the_experts_are_used(tiny_moe_models):
    """The routers spread tokens over every expert (the parity above would hold trivially for a
    model whose router always picked the same ones)."""
    from conveyor.models.moe import Experts

    llm = LLM(str(tiny_moe_models["qwen3_moe"]), dtype="float64", num_kv_blocks=64)
    model = llm.engine.runner.model
    seen: dict[int, set[int]] = {}
    hooks = []
    for index, layer in enumerate(model.layers):
        def record(module, args, index=index):  # Experts.forward(rows, counts)
            seen.setdefault(index, set()).update(e for e, n in enumerate(args[1].tolist()) if n)
        assert isinstance(layer.mlp.experts, Experts)
        hooks.append(layer.mlp.experts.register_forward_pre_hook(record))
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for h in hooks:
        h.remove()
    assert all(seen[i] == set(range(8)) for i in range(len(model.layers))), seen


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_on_cpu_matches_transformers_float32(tiny_moe_models, family):
    """The CPU's float32 path (native norms, RoPE, attention; each expert's rows through the
    skinny GEMV or MKL): HF's float32 greedy tokens, at batch 1 and in a batch of five."""
    model_dir = tiny_moe_models[family]
    expected = hf_greedy(model_dir, PROMPTS, 16, torch.float32)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.model.fused_decode is None  # the native decode has no router
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:2]] == expected[:2]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected


def test_arch_counts_every_parameter(tiny_models, tiny_moe_models):
    """`num_params` sizes the weights in a memory budget; it is HF's count, dense models too."""
    from transformers import AutoModelForCausalLM

    for family, folder in {**tiny_models, **tiny_moe_models}.items():
        arch = read_hf_arch(folder)
        hf = AutoModelForCausalLM.from_pretrained(folder)
        assert arch.num_params == sum(p.numel() for p in hf.parameters()), family
        idle = (arch.num_experts - arch.num_experts_per_tok) * arch.expert_params * arch.num_sparse_layers
        assert arch.num_active_params == arch.num_params - idle > 0
    qwen2 = read_hf_arch(tiny_moe_models["qwen2_moe"])
    assert [qwen2.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    assert qwen2.attention_bias and qwen2.shared_expert_intermediate_size == 64 and not qwen2.norm_topk_prob
    mixtral = read_hf_arch(tiny_moe_models["mixtral"])
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == mixtral.intermediate_size


def _stacked_copy(src, dst):
    """The checkpoint rewritten in transformers >= 5's stacked layout (experts.gate_up_proj)."""
    from safetensors.torch import save_file

    dst.mkdir()
    tensors = dict(iter_hf_tensors(src))
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    layers = {k.split(".experts.")[0] for k in tensors if ".experts." in k}
    for prefix in layers:
        n = 1 + max(int(k.split(".experts.")[1].split(".")[0]) for k in tensors if k.startswith(prefix + ".experts."))
        gate = [tensors[f"{prefix}.experts.{e}.gate_proj.weight"] for e in range(n)]
        up = [tensors[f"{prefix}.experts.{e}.up_proj.weight"] for e in range(n)]
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up, strict=True)])
        out[f"{prefix}.experts.down_proj"] = torch.stack([tensors[f"{prefix}.experts.{e}.down_proj.weight"]
                                                          for e in range(n)])
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_stacked_checkpoint_loads_the_same(tiny_moe_models, tmp_path):
    src = tiny_moe_models["qwen3_moe"]
    stacked = _stacked_copy(src, tmp_path / "stacked")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a = LLM(str(src), dtype="float64", num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False)
    b = LLM(str(stacked), dtype="float64", num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_a_missing_expert_is_a_load_error(tiny_moe_models):
    from conveyor.models.attention import TorchPagedAttention
    from conveyor.models.llama import LlamaForCausalLM

    folder = tiny_moe_models["mixtral"]
    arch = read_hf_arch(folder)
    tensors = [(n, t) for n, t in iter_hf_tensors(folder) if "experts.3.w3" not in n]
    model = LlamaForCausalLM(arch, TorchPagedAttention(), 64)
    with pytest.raises(ModelLoadError, match=r"lacks 3 tensors.*experts\.gate_up_proj#3@"):
        load_weights(model, iter(tensors))
    odd = [*tensors, ("model.layers.0.block_sparse_moe.experts.0.w9.weight", torch.zeros(2, 2))]
    with pytest.raises(ModelLoadError, match="unexpected expert tensor"):
        load_weights(LlamaForCausalLM(arch, TorchPagedAttention(), 64), iter(odd))


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_experts_close_to_float32(tiny_moe_models, family):
    """quantization="int8" on a mixture: every projection and each expert's two in int8, the
    routers float32; the logits as close to float32's as a dense model's (the int8 tests'
    bounds), and the engine serves."""
    from conveyor.models.quantize import int8_supported
    from tests.models.test_int8 import assert_int8_close_to_float32

    if not int8_supported():
        pytest.skip("torch has no fbgemm int8 kernels here")
    quantized = assert_int8_close_to_float32(str(tiny_moe_models[family]))
    moe = next(m for m in quantized.engine.runner.model.modules() if isinstance(m, SparseMoE))
    assert moe.experts.int8 is not None and moe.experts.gate_up_proj.numel() == 0  # (the float copy dropped)
    assert isinstance(moe.gate, torch.nn.Module) and not hasattr(moe.gate, "qweight")  # the router stays float32


@settings(max_examples=20, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=4, max_size=4), seed=st.integers(0, 9))
def test_int8_experts_rows_few_and_many(counts, seed):
    """An expert's rows through its int8 weights, a decode step's few (the native weight-only
    product) and a prompt's many (fbgemm's GEMM): each row within 5% of the float32 expert's,
    and the same whatever rows run beside it."""
    import copy

    from conveyor.kernels import Q8_MAX_ROWS, skinny_linear_q8
    from conveyor.models.moe import Experts
    from conveyor.models.quantize import int8_supported

    if not int8_supported() or sum(counts) == 0:
        return
    arch = ArchConfig.from_hf({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 64,
                               "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "num_local_experts": 4,
                               "num_experts_per_tok": 2})
    g = torch.Generator().manual_seed(seed)
    experts = Experts(arch)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) / 8)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) / 10)
    q = copy.deepcopy(experts)
    q.quantize_int8(skinny_linear_q8(), Q8_MAX_ROWS)
    experts.requires_grad_(False)
    rows = torch.randn(sum(counts), 64, generator=g)
    counts_t = torch.tensor(counts)
    want, got = experts(rows, counts_t), q(rows, counts_t)
    assert float((got - want).norm() / want.norm()) < 0.05
    first = next(i for i, c in enumerate(counts) if c)
    alone = q(rows[: counts[first]], torch.tensor([counts[first] if i == first else 0 for i in range(4)]))
    assert torch.equal(alone, got[: counts[first]])


def test_bad_configs_are_refused(tiny_moe_models, tmp_path):
    cfg = json.loads((tiny_moe_models["qwen3_moe"] / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9"):
        ArchConfig.from_hf({**cfg, "num_experts_per_tok": 9})


def reference_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, straight from the definition: the top-k of the router's softmax (its
    weights renormalized where the model says so), each chosen expert's SiLU-gated MLP."""
    out = torch.zeros_like(x)
    experts = moe.experts
    half = experts.gate_up_proj.shape[1] // 2
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.gate.weight.t(), dim=-1, dtype=torch.float32)
        top = probs.topk(moe.top_k)
        weights = top.values / top.values.sum() if moe.norm_topk_prob else top.values
        for e, w in sorted(zip(top.indices.tolist(), weights.tolist(), strict=True)):
            gu = experts.gate_up_proj[e] @ x[t]
            h = torch.nn.functional.silu(gu[:half]) * gu[half:]
            out[t] += w * (experts.down_proj[e] @ h)
        if moe.shared_expert is not None:
            out[t] += torch.sigmoid(moe.shared_expert_gate.weight @ x[t]) * moe.shared_expert(x[t : t + 1])[0]
    return out


@settings(max_examples=80, deadline=None)
@given(
    experts=st.integers(1, 9), data=st.data(), tokens=st.integers(1, 40),
    norm=st.booleans(), shared=st.booleans(), mixtral=st.booleans(), seed=st.integers(0, 2**16),
    grouped=st.booleans(),
)
def test_routed_layer_matches_a_per_token_reference(experts, data, tokens, norm, shared, mixtral, seed, grouped):
    """float64 through the loop over experts; float32 through torch's grouped GEMM (the CPU's
    path past a few rows), against the reference in float64."""
    from conveyor.models.llama import MLP

    if grouped and not hasattr(torch.nn.functional, "grouped_mm"):
        return

    k = data.draw(st.integers(1, experts))
    arch = ArchConfig(family="mixtral" if mixtral else "qwen2_moe", vocab_size=8, hidden_size=16,
                      intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True,
                      num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=12, norm_topk_prob=norm,
                      shared_expert_intermediate_size=20 if shared else 0)
    g = torch.Generator().manual_seed(seed)
    moe = SparseMoE(arch, MLP(16, 20) if shared else None).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    x = torch.randn(tokens, 16, generator=g, dtype=torch.float64)
    want = reference_moe(moe, x)
    if not grouped:
        torch.testing.assert_close(moe(x), want, rtol=1e-9, atol=1e-9)
        return
    chosen = moe.route(x)[0]
    moe.float()
    moe.experts.grouped_mm, moe.experts.loop_max_rows = torch.nn.functional.grouped_mm, 0
    if not torch.equal(moe.route(x.float())[0], chosen):
        return  # a near tie between two experts' probabilities, decided otherwise in float32
    torch.testing.assert_close(moe(x.float()), want.float(), rtol=1e-4, atol=1e-4)


def test_adapters_reach_attention_and_dense_layers(tiny_moe_models, tmp_path):
    """LoRA on a mixture: the attention projections, and the MLP of a layer that stays dense,
    take adapters (HF's greedy tokens with the adapter merged); an adapter of a sparse layer's
    MLP is refused for its request alone."""
    from conveyor import InvalidRequestError, LoRARequest
    from tests.test_lora import merged_reference, write_adapter

    folder = tiny_moe_models["qwen2_moe"]
    attn = write_adapter(tmp_path / "attn", folder, 4, 8, ("q_proj", "v_proj"), (0, 1, 2), False, seed=1)
    dense_mlp = write_adapter(tmp_path / "dense", folder, 4, 8, ("gate_proj", "down_proj"), (1,), False, seed=2)
    sparse_mlp = write_adapter(tmp_path / "sparse", folder, 4, 8, ("gate_proj",), (0,), False, seed=3)
    llm = LLM(str(folder), dtype="float64", enable_lora=True, max_loras=2, num_kv_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(3, 15))] for _ in range(3)]
    for i, path in enumerate((attn, dense_mlp)):
        want = merged_reference(folder, path, prompts, 10, **EAGER)
        assert want != merged_reference(folder, None, prompts, 10, **EAGER)  # the adapter changes something
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest(path.name, i + 1, str(path)))
        assert [o.outputs[0].token_ids for o in outs] == want
    with pytest.raises(InvalidRequestError, match="mixture of experts"):
        llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("sparse", 3, str(sparse_mlp)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == merged_reference(folder, None, prompts, 10, **EAGER)


# -- GGUF: the layout llama.cpp's convert_hf_to_gguf.py writes for mixtures -------------------
_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_GGUF_MOE_NAMES = {  # HF name past "mlp." -> GGUF name past "blk.N."
    "gate.weight": "ffn_gate_inp.weight",
    "shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def write_moe_gguf(model_dir, out, family):
    """Experts stacked per projection `[E, rows, cols]`, the router `ffn_gate_inp`, Qwen2-MoE's
    shared expert `*_shexp` (its one-row gate a vector), Mixtral as a Llama (Q/K permuted)."""
    import numpy as np

    from tests.models.test_gguf import gguf_writer, hf_gguf_name, hf_state, llama_cpp_permute

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = _GGUF_ARCH[family]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    w = gguf_writer(cfg, out, arch)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if family != "mixtral":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, tensor in hf_state(model_dir).items():
        data = tensor.float().numpy()
        name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, kv_heads)
        if ".mlp.experts." in name:
            layer, rest = name.split(".")[2], name.split(".mlp.experts.")[1]
            e, proj, _ = rest.split(".")
            stacks.setdefault(f"blk.{layer}.{_GGUF_EXPERTS[proj]}.weight", {})[int(e)] = data
            continue
        tail = name.split(".mlp.", 1)[1] if ".mlp." in name else None
        if tail in _GGUF_MOE_NAMES:
            gname = f"blk.{name.split('.')[2]}.{_GGUF_MOE_NAMES[tail]}"
            data = data.reshape(-1) if tail == "shared_expert_gate.weight" else data
        else:
            gname = hf_gguf_name(name)
        w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
    for gname, parts in stacks.items():
        w.add_tensor(gname, np.ascontiguousarray(np.stack([parts[e] for e in range(experts)]), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_mixture_loads_as_its_hf_folder(tiny_moe_models, tmp_path, family):
    """A mixture converted to GGUF (F32) reads back to the same architecture and the same
    greedy tokens as its HF folder."""
    folder = tiny_moe_models[family]
    path = write_moe_gguf(folder, tmp_path / f"{family}.gguf", family)
    from conveyor.models.loader import open_gguf, read_gguf_arch

    got, want = read_gguf_arch(open_gguf(path)), read_hf_arch(folder)
    for field in ("family", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size", "qk_norm", "attention_bias"):
        assert getattr(got, field) == getattr(want, field), field
    assert [got.is_sparse_layer(i) for i in range(3)] == [want.is_sparse_layer(i) for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a = LLM(str(folder), dtype="float64", num_kv_blocks=64).generate(SHORT, params, use_tqdm=False)
    b = LLM(str(path), dtype="float64", num_kv_blocks=64).generate(SHORT, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
