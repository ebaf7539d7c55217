"""gpt-oss: attention sinks, sliding and global layers by turns, YaRN, a mixture in every layer
with biased routers and experts and a clamped SwiGLU, and MXFP4 expert weights. Greedy tokens
equal HF transformers' on the same random weights in float64 under every scheduling, with
swaps, prefix hits and two tensor-parallel ranks; the float32 CPU path agrees with HF's
float32; the MXFP4 decoding equals transformers' over random codes (hypothesis), and a
checkpoint quantized to MXFP4 gives the tokens of HF's own dequantizing load. Sinks, the
window and the clamp are set so that each changes HF's tokens (checked here)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.models.arch import ArchConfig
from conveyor.models.loader import dequantize_mxfp4
from tests.conftest import build_tiny_model, triton_interpreted
from tests.models.test_moe import greedy_of, two_ranks_and_one
from tests.schedulings import SCHEDULINGS

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
# Windows of 6 tokens, 8 experts of 32 (2 a token), a clamp at 0.5 (gpt-oss's is 7.0).
SHAPE = dict(head_dim=16, sliding_window=6, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2,
             intermediate_size=32, swiglu_limit=0.5, rope_parameters=YARN)
_rng = random.Random(9)
LONG = [[_rng.randrange(3, 384) for _ in range(_rng.randint(1, 20))] for _ in range(6)]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("gpt_oss") / "m", "gpt_oss", seed=3, **SHAPE)


def hf_model(path, dtype=torch.float64, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                experts_implementation="eager", **config).eval()


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@SCHEDULINGS
def test_greedy_matches_transformers(gpt_oss, options):
    llm = LLM(str(gpt_oss), dtype="float64", **{"num_kv_blocks": 64, "block_size": 8, **options})
    assert tokens(llm.generate(LONG, PARAMS, use_tqdm=False)) == greedy_of(hf_model(gpt_oss), LONG, 16)
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0


def test_sinks_window_and_clamp_change_the_tokens(gpt_oss):
    """What the greedy test would miss if it were not built: HF's tokens without the sinks
    (each at -inf: no share of the softmax), with a window wider than every sequence, or with
    a clamp too wide to bite, are other tokens."""
    expected = greedy_of(hf_model(gpt_oss), LONG, 16)
    no_sinks = hf_model(gpt_oss)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    assert greedy_of(no_sinks, LONG, 16) != expected
    assert greedy_of(hf_model(gpt_oss, sliding_window=4096), LONG, 16) != expected
    assert greedy_of(hf_model(gpt_oss, swiglu_limit=1000.0), LONG, 16) != expected


@pytest.mark.parametrize("options", [
    {"preemption_mode": "swap", "num_kv_blocks": 24, "block_size": 4, "num_swap_blocks": 64},
    {"enable_prefix_caching": True, "max_num_batched_tokens": 32, "block_size": 4},
], ids=["swap", "prefix-hits"])
def test_cache_paths_keep_the_tokens(gpt_oss, options):
    shared = LONG[0] + LONG[1] + LONG[2]
    prompts = [shared + p for p in LONG[3:]] + LONG
    llm = LLM(str(gpt_oss), dtype="float64", **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert tokens(outs) == greedy_of(hf_model(gpt_oss), prompts, 12)
    if "preemption_mode" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    if "enable_prefix_caching" in options:
        assert sum(o.num_cached_tokens for o in outs) > 0


def test_float32_on_cpu_matches_transformers_float32(gpt_oss):
    """The CPU's float32 path (skinny GEMVs in every projection and expert, the experts'
    grouped GEMM past a few rows, the sinks in the native decode): HF's float32 tokens at batch
    1 and in a batch of six."""
    expected = greedy_of(hf_model(gpt_oss, torch.float32), LONG, 12)
    llm = LLM(str(gpt_oss), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [tokens(llm.generate([p], params, use_tqdm=False))[0] for p in LONG[:2]] == expected[:2]
    assert tokens(llm.generate(LONG, params, use_tqdm=False)) == expected
    from conveyor.kernels import paged_decode_attention

    if paged_decode_attention() is not None:  # the sinks in the native decode
        kinds = {type(m.backend).__name__ for m in llm.engine.runner.model.modules() if hasattr(m, "backend")}
        assert kinds == {"CpuEagerAttention"}


@pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreted(),
                    reason="the model on CPU tensors through Triton's interpreter (tests/kernels run the kernels on a GPU)")
def test_triton_backend_computes_the_sinks(gpt_oss):
    """On the Triton attention backend (here through its interpreter): one backend a window,
    each layer's sinks given to it before its call; HF's float32 tokens."""
    from conveyor.kernels.triton_attention import TritonPagedAttention

    prompts = LONG[:3]
    llm = LLM(str(gpt_oss), dtype="float32", num_kv_blocks=64, block_size=4, enforce_eager=True)
    model = llm.engine.runner.model
    model._use_triton_attention(torch.float32)  # on CUDA prepare_for_inference does it
    backends = {m.backend for m in model.modules() if hasattr(m, "backend")}
    assert all(isinstance(b, TritonPagedAttention) for b in backends) and len(backends) == 2
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == greedy_of(hf_model(gpt_oss, torch.float32),
                                                                              prompts, 10)


def test_two_tensor_parallel_ranks_equal_one(gpt_oss):
    """Heads (and their sinks) and each expert's width split over two ranks, the biases after
    the split (o_proj's, the experts' down projection's) added on rank 0 alone: one rank's
    tokens and logprobs, and HF's."""
    two, one = two_ranks_and_one(gpt_oss, LONG)
    assert two == one == greedy_of(hf_model(gpt_oss), LONG, 12)


@settings(max_examples=30, deadline=None)
@given(experts=st.integers(1, 3), rows=st.integers(1, 6), groups=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_mxfp4_decoding_equals_transformers(experts, rows, groups, seed):
    """Random codes and exponents (within float32's range) decode as transformers' MXFP4
    conversion decodes them (which also lays the result out `[E, in, out]`)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 100, 127 + 100, (experts, rows, groups), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), want)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` `[E, rows, cols]` (cols a multiple of 32) as MXFP4 blocks and scales: each block of 32
    scaled by the power of two that brings its largest magnitude within 6, each value rounded
    to the nearest FP4 code."""
    from conveyor.models.loader import FP4_E2M1

    e, r, c = w.shape
    blocks = w.reshape(e, r, c // 32, 32).double()
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0))
    lut = torch.tensor(FP4_E2M1, dtype=torch.float64)
    codes = ((blocks / torch.pow(2.0, exp)[..., None])[..., None] - lut).abs().argmin(dim=-1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def test_an_mxfp4_checkpoint_gives_hfs_dequantized_tokens(gpt_oss, tmp_path):
    """gpt-oss ships its experts in MXFP4 (`quant_method: mxfp4`): the tiny model's experts
    quantized so, saved as the Hub's checkpoints are (`*_blocks`, `*_scales`, `[E, out, in]`),
    load to the tokens of HF's own dequantizing load of the same folder."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Mxfp4Config

    out = tmp_path / "mxfp4"
    shutil.copytree(gpt_oss, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        save_file(tensors, str(f), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.layers.*.mlp.router",
                                                                                        "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    hf = hf_model(out, quantization_config=Mxfp4Config(dequantize=True))
    want = greedy_of(hf, LONG, 16)
    assert want != greedy_of(hf_model(gpt_oss), LONG, 16), "the rounding changes nothing: nothing is tested"
    assert tokens(LLM(str(out), dtype="float64", num_kv_blocks=64).generate(LONG, PARAMS, use_tqdm=False)) == want


def test_config_readings(gpt_oss):
    """gpt-oss-20b's and -120b's configs as the Hub has them: the shapes, the parameter counts
    of OpenAI's model card (20.91 B and 116.83 B, 3.61 B and 5.13 B active), and a saved
    tiny model's count equal to HF's."""
    from transformers import AutoModelForCausalLM

    base = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64, "hidden_size": 2880,
            "intermediate_size": 2880, "max_position_embeddings": 131072, "num_attention_heads": 64,
            "num_experts_per_tok": 4, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 150000,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
            "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088}
    small = ArchConfig.from_hf({**base, "num_hidden_layers": 24, "num_local_experts": 32})
    large = ArchConfig.from_hf({**base, "num_hidden_layers": 36, "num_local_experts": 128})
    assert small.layer_windows[:4] == (128, 0, 128, 0) and small.rope_theta == 150000.0
    assert small.num_params / 1e9 == pytest.approx(20.91, abs=0.01)
    assert large.num_params / 1e9 == pytest.approx(116.83, abs=0.01)
    embedding = base["vocab_size"] * base["hidden_size"]  # (the card's active counts leave the lookup out)
    assert (small.num_active_params - embedding) / 1e9 == pytest.approx(3.61, abs=0.01)
    assert (large.num_active_params - embedding) / 1e9 == pytest.approx(5.13, abs=0.01)
    arch = ArchConfig.from_hf(json.loads((gpt_oss / "config.json").read_text()))
    hf = AutoModelForCausalLM.from_pretrained(gpt_oss)
    assert arch.num_params == sum(p.numel() for p in hf.parameters())


def test_lora_on_the_attention(gpt_oss, tmp_path):
    """An adapter on q, k, v and o (o_proj with its bias, attention with sinks): HF's tokens with
    it merged, beside the base model's; one on a sparse layer's MLP is refused (as for every
    mixture)."""
    from conveyor import InvalidRequestError, LoRARequest
    from tests.test_lora import merged_reference, write_adapter

    adapter = write_adapter(tmp_path / "attn", gpt_oss, 8, 16, ("q_proj", "k_proj", "v_proj", "o_proj"), (0, 1, 2, 3),
                            False, seed=1, std=0.2)
    mlp = write_adapter(tmp_path / "mlp", gpt_oss, 4, 8, ("gate_proj",), (0,), False, seed=2)
    prompts = LONG[:3]
    want = merged_reference(gpt_oss, None, prompts, 12, experts_implementation="eager", attn_implementation="eager")
    want += merged_reference(gpt_oss, adapter, prompts, 12, experts_implementation="eager",
                             attn_implementation="eager")
    assert want[:3] != want[3:], "the adapter changes nothing: nothing is tested"
    llm = LLM(str(gpt_oss), dtype="float64", enable_lora=True, num_kv_blocks=64)
    lora = LoRARequest("attn", 1, str(adapter))
    outs = llm.generate(prompts * 2, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False,
                        lora_request=[None] * 3 + [lora] * 3)
    assert tokens(outs) == want
    with pytest.raises(InvalidRequestError, match=r"sparse|expert"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("mlp", 2, str(mlp)))


def write_gpt_oss_gguf(model_dir, out, experts: str = "F32", fused: bool = False) -> None:
    """The HF folder as llama.cpp's convert_hf_to_gguf.py writes a gpt-oss: the gguf package's
    names (the norm before the MLP `post_attention_norm`, the sinks `attn_sinks`), biases kept,
    each expert's interleaved gate and up columns split into rows of their own
    (`ffn_gate_exps`, `ffn_up_exps`; `fused`: one `ffn_gate_up_exps`, gates then ups) and down
    as rows; YaRN's factor and pretraining length, the window. `experts="MXFP4"` stores the
    expert weights as llama.cpp's MXFP4 blocks, `"MXFP4-dequantized"` the same values as F32."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from tests.models.test_gguf import _rope, close_gguf, gguf_writer

    cfg = json.loads((model_dir / "config.json").read_text())
    w = gguf_writer(cfg, out, "gpt-oss")
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    scaling = _rope(cfg)[1]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(scaling["factor"])
    w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
             **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
             **{f"self_attn.o_proj.{k}": f"attn_output.{k}" for k in ("weight", "bias")}}

    def add(name: str, t: torch.Tensor, expert: bool = False) -> None:
        data = np.ascontiguousarray(t.float().numpy())
        if expert and experts.startswith("MXFP4"):
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.MXFP4)
            if experts == "MXFP4":
                w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
                return
            data = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4).reshape(data.shape)
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))

    for name, t in load_file(str(next(model_dir.glob("*.safetensors")))).items():
        if name in top:
            add(top[name], t)
            continue
        _, _, i, rest = name.split(".", 3)
        blk = f"blk.{i}."
        if rest == "mlp.experts.gate_up_proj":  # [E, H, 2I], gate and up columns by turns
            rows = t.transpose(1, 2)
            if fused:
                add(blk + "ffn_gate_up_exps.weight", torch.cat((rows[:, 0::2], rows[:, 1::2]), dim=1), True)
            else:
                add(blk + "ffn_gate_exps.weight", rows[:, 0::2], True)
                add(blk + "ffn_up_exps.weight", rows[:, 1::2], True)
        elif rest == "mlp.experts.gate_up_proj_bias":
            if fused:
                add(blk + "ffn_gate_up_exps.bias", torch.cat((t[:, 0::2], t[:, 1::2]), dim=1))
            else:
                add(blk + "ffn_gate_exps.bias", t[:, 0::2])
                add(blk + "ffn_up_exps.bias", t[:, 1::2])
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            add(blk + "ffn_down_exps.weight", t.transpose(1, 2), True)
        else:
            add(blk + layer[rest], t)
    close_gguf(w)


@pytest.fixture(scope="module")
def gpt_oss_7(tmp_path_factory: pytest.TempPathFactory):
    """The test shape with gpt-oss's own clamp (7.0), which a GGUF file assumes rather than says."""
    return build_tiny_model(tmp_path_factory.mktemp("gpt_oss_7") / "m", "gpt_oss", seed=4,
                            **{**SHAPE, "swiglu_limit": 7.0})


@pytest.mark.parametrize("fused", [False, True], ids=["gate-and-up-apart", "gate-up-fused"])
def test_a_gguf_file_as_llama_cpp_writes_it(gpt_oss_7, tmp_path, fused):
    """A GGUF gpt-oss (llama.cpp's names, biases, sinks, experts as rows, gate and up apart or
    fused): the arch and the greedy tokens of the HF folder it came from, float64, prompts past
    the window and the 64 pretraining positions."""
    write_gpt_oss_gguf(gpt_oss_7, tmp_path / "m.gguf", fused=fused)
    from_gguf = LLM(str(tmp_path / "m.gguf"), dtype="float64", num_kv_blocks=64)
    from_hf = LLM(str(gpt_oss_7), dtype="float64", num_kv_blocks=64)
    a, b = from_gguf.engine.arch, from_hf.engine.arch
    scaling = lambda arch: {k: v for k, v in arch.rope_scaling.items() if k != "rope_theta"}  # noqa: E731
    assert scaling(a) == scaling(b)  # (transformers 5 keeps the base in its copy too)
    for field in ("family", "layer_windows", "rope_theta", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "attention_sinks", "o_proj_bias", "expert_bias", "swiglu_limit",
                  "swiglu_alpha", "attention_bias", "tie_word_embeddings", "head_dim", "num_kv_heads"):
        assert getattr(a, field) == getattr(b, field), field
    prompts = [*LONG, list(range(5, 90))]
    assert tokens(from_gguf.generate(prompts, PARAMS, use_tqdm=False)) == tokens(
        from_hf.generate(prompts, PARAMS, use_tqdm=False))


def test_a_gguf_file_with_mxfp4_experts(gpt_oss_7, tmp_path):
    """Expert weights in llama.cpp's MXFP4 blocks: the tokens of the same values stored as F32
    (what the blocks decode to), and not those of the unquantized weights' file, which differ
    (the quantization changes the tokens: the test can tell a file read as F32 from one decoded)."""
    for kind in ("MXFP4", "MXFP4-dequantized", "F32"):
        write_gpt_oss_gguf(gpt_oss_7, tmp_path / f"{kind}.gguf", experts=kind)
    from conveyor.models.loader import open_gguf

    kinds = {t.name: t.tensor_type.name for t in open_gguf(tmp_path / "MXFP4.gguf").tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == "MXFP4" and kinds["blk.0.ffn_down_exps.weight"] == "MXFP4"
    runs = {kind: tokens(LLM(str(tmp_path / f"{kind}.gguf"), dtype="float64", num_kv_blocks=64).generate(
        LONG, PARAMS, use_tqdm=False)) for kind in ("MXFP4", "MXFP4-dequantized", "F32")}
    assert runs["MXFP4"] == runs["MXFP4-dequantized"]
    assert runs["MXFP4"] != runs["F32"], "MXFP4 changes no token: the test cannot tell"
