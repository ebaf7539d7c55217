"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini (`Phi3ForCausalLM`): fused q/k/v and gate/up projections
as the checkpoint stores them, RoPE over part of each head, LongRoPE's short and long factors.
Greedy tokens equal HF transformers' on the same random weights in float64 under every
scheduling, for prompts within the pretraining length, past it, and for sequences that cross
it while decoding; float32 on the CPU kernels; the long factors shown to matter."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.models.arch import ArchConfig
from tests.conftest import build_tiny_model
from tests.models.test_moe import hf_greedy
from tests.schedulings import SCHEDULINGS

_rng = random.Random(3)
SHORT_FACTORS = [_rng.uniform(1, 2) for _ in range(4)]
LONG_FACTORS = [_rng.uniform(2, 8) for _ in range(4)]
# Half of each 16-dim head turns (4 frequencies); pretrained on 64 positions, stretched to 512.
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT_FACTORS, "long_factor": LONG_FACTORS,
            "rope_theta": 10000.0}
SHAPE = dict(head_dim=16, partial_rotary_factor=0.5, max_position_embeddings=512,
             original_max_position_embeddings=64, rope_parameters=LONGROPE, pad_token_id=0)
SHORT = [[_rng.randrange(3, 384) for _ in range(_rng.randint(1, 14))] for _ in range(5)]  # fit the preempt cache
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("phi3") / "m", "phi3", seed=2, **SHAPE)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@SCHEDULINGS
def test_greedy_matches_transformers(phi3, options):
    llm = LLM(str(phi3), dtype="float64", **{"num_kv_blocks": 64, "block_size": 8, **options})
    assert tokens(llm.generate(SHORT, PARAMS, use_tqdm=False)) == hf_greedy(phi3, SHORT, 16)
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0


def hf_stepwise(model_dir, prompt, max_new_tokens, **config):
    """HF's model run as a server runs it: the prompt in one forward pass, then a token a pass
    over its cache. (HF's `generate` for Phi-3 instead drops the cache when a sequence crosses
    the pretraining length and encodes it all again with the long factors; vLLM, like conveyor,
    keeps the cached K/V.)"""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, **config).eval()
    cache, ids, out = DynamicCache(config=model.config), list(prompt), []
    with torch.no_grad():
        logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
        for _ in range(max_new_tokens):
            out.append(int(logits[0, -1].argmax()))
            ids.append(out[-1])
            logits = model(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[len(ids) - 1]])).logits
    return out


def test_past_the_pretraining_length(phi3):
    """HF's rule for one forward pass, which the engine applies a sequence a step: a prompt
    longer than 64 turns all of its positions with the long factors (HF's `generate` gives the
    same tokens); a sequence that crosses 64 while decoding turns its new tokens so from then
    on, its cached K/V keeping theirs. With the long factors replaced by the short ones, HF's
    tokens are other tokens."""
    rng = random.Random(4)
    long_prompt = [rng.randrange(3, 384) for _ in range(80)]
    crossing = [rng.randrange(3, 384) for _ in range(50)]
    llm = LLM(str(phi3), dtype="float64", num_kv_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(phi3, [long_prompt], 30)[0], hf_stepwise(phi3, crossing, 30)]
    assert want[0] == hf_stepwise(phi3, long_prompt, 30)
    assert tokens(llm.generate([long_prompt, crossing], params, use_tqdm=False)) == want
    shorts = {**LONGROPE, "long_factor": SHORT_FACTORS}
    assert [hf_stepwise(phi3, p, 30, rope_parameters=shorts) for p in (long_prompt, crossing)] != want


def test_float32_on_cpu_matches_transformers_float32(phi3):
    """The CPU's float32 path (skinny GEMVs over the fused projections; no fused native decode:
    its RoPE turns whole heads from one table)."""
    llm = LLM(str(phi3), dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.model.fused_decode is None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert tokens(llm.generate(SHORT, params, use_tqdm=False)) == hf_greedy(phi3, SHORT, 12, torch.float32)


def test_config_readings(phi3):
    """Phi-4-mini-instruct's config as the Hub has it (3.84 B weights, a quarter of each head
    unturned, LongRoPE from 4,096 positions to 131,072); a saved tiny model's count equal to
    HF's; tensor parallelism refused by name."""
    import json

    from transformers import AutoModelForCausalLM

    factors = [1.0] * 48
    mini = ArchConfig.from_hf({
        "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064, "partial_rotary_factor": 0.75,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "short_factor": factors, "long_factor": factors},
        "tie_word_embeddings": True, "sliding_window": 262144, "rms_norm_eps": 1e-5})
    assert mini.num_params / 1e9 == pytest.approx(3.84, abs=0.01)
    assert (mini.rotary_dim, mini.sliding_window) == (96, 262144)
    assert mini.rope_scaling["factor"] == 32 and mini.rope_scaling["original_max_position_embeddings"] == 4096
    arch = ArchConfig.from_hf(json.loads((phi3 / "config.json").read_text()))
    assert arch.num_params == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(phi3).parameters())


def test_two_tensor_parallel_ranks_equal_one(phi3):
    """The fused q/k/v rows split by their q, k and v widths, the fused gate/up by halves, each
    rank's share of the heads: one rank's tokens and logprobs (to 1e-9), and HF's, a prompt
    past the pretraining length included."""
    from tests.models.test_moe import two_ranks_and_one

    prompts = [*SHORT, list(range(5, 90))]
    two, one = two_ranks_and_one(phi3, prompts)
    assert two == one == hf_greedy(phi3, prompts, 12)


def write_phi3_gguf(model_dir, out) -> None:
    """The HF folder as llama.cpp's convert_hf_to_gguf.py writes a Phi-3 (F32): the fused
    projections under the gguf package's names, the rotary width, the window, and LongRoPE's
    factors as two tensors beside the pretraining length and attention factor."""
    import math

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from tests.models.test_gguf import close_gguf, gguf_writer

    cfg = json.loads((model_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, cfg["num_hidden_layers"])
    w = gguf_writer(cfg, out, "phi3")  # (a real file has its vocabulary beside the vocab size)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1)))
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    for name, tensor in load_file(str(next(model_dir.glob("*.safetensors")))).items():
        w.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", np.ascontiguousarray(tensor.float().numpy()))
    close_gguf(w)


@pytest.mark.parametrize("window", [None, 6], ids=["phi-4-no-window", "window-6"])
def test_a_gguf_file_as_llama_cpp_writes_it(phi3, tmp_path, window):
    """A GGUF Phi-3 (fused q/k/v and gate/up under llama.cpp's names, half of each head turned,
    the window or none, LongRoPE's factors as tensors): the arch and the tokens of the HF folder
    it came from, a prompt past the pretraining length included (the long factors)."""
    if window is not None:
        phi3 = build_tiny_model(tmp_path / "windowed", "phi3", seed=2, sliding_window=window, **SHAPE)
    write_phi3_gguf(phi3, tmp_path / "m.gguf")
    from_gguf = LLM(str(tmp_path / "m.gguf"), dtype="float64", num_kv_blocks=64)
    from_hf = LLM(str(phi3), dtype="float64", num_kv_blocks=64)
    a, b = from_gguf.engine.arch, from_hf.engine.arch
    assert (a.rotary_dim, a.sliding_window, a.tie_word_embeddings) == (b.rotary_dim, b.sliding_window,
                                                                       b.tie_word_embeddings)
    assert a.rope_scaling["long_factor"] == pytest.approx(b.rope_scaling["long_factor"])
    assert from_gguf.engine.runner.model.rotary.long_from == 64
    prompts = [*SHORT, list(range(5, 90))]  # the last past the 64 pretraining positions
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert tokens(from_gguf.generate(prompts, params, use_tqdm=False)) == tokens(from_hf.generate(prompts, params,
                                                                                                    use_tqdm=False))
