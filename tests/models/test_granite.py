"""IBM Granite 3.x (`GraniteForCausalLM`): a Llama with four multipliers (embeddings, each
sublayer's output before its residual add, the softmax scale, the logits' divisor). Greedy
tokens equal HF transformers' on the same random weights in float64 under every scheduling,
over two tensor-parallel ranks, and in float32 on the CPU kernels (which fall back from the
fused decode, whose arithmetic is a Llama's); multipliers large enough that the tests would
see any of them missing."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.models.arch import ArchConfig
from tests.conftest import build_tiny_model
from tests.models.test_moe import hf_greedy, two_ranks_and_one
from tests.schedulings import SCHEDULINGS

MULTIPLIERS = dict(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.5, logits_scaling=4.0)
_rng = random.Random(6)
SHORT = [[_rng.randrange(3, 384) for _ in range(_rng.randint(1, 14))] for _ in range(6)]  # fit the preempt cache
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("granite") / "m", "granite", seed=5, tie_word_embeddings=True,
                            **MULTIPLIERS)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@SCHEDULINGS
def test_greedy_matches_transformers(granite, options):
    llm = LLM(str(granite), dtype="float64", **{"num_kv_blocks": 64, "block_size": 8, **options})
    assert tokens(llm.generate(SHORT, PARAMS, use_tqdm=False)) == hf_greedy(granite, SHORT, 16)


def test_each_multiplier_is_live(granite):
    """What the greedy test would miss if one were left out: HF's logits with any of the four
    at its plain value are other logits (each by more than 1e-3), and conveyor's logprobs are
    HF's log-softmax of the multiplied model's (float32's precision)."""
    from transformers import AutoModelForCausalLM

    prompt = SHORT[1]

    def last_logits(**config) -> torch.Tensor:
        hf = AutoModelForCausalLM.from_pretrained(granite, dtype=torch.float64, **config).eval()
        with torch.no_grad():
            return hf(torch.tensor([prompt])).logits[0, -1]

    logits = last_logits()
    for key, plain in (("embedding_multiplier", 1.0), ("residual_multiplier", 1.0), ("attention_multiplier", 0.25),
                       ("logits_scaling", 1.0)):
        assert (last_logits(**{key: plain}) - logits).abs().max() > 1e-3, key
    llm = LLM(str(granite), dtype="float64", num_kv_blocks=64)
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), use_tqdm=False)
    got = first[0].outputs[0].logprobs[0]  # the sampled token's, and the top 5
    want = torch.log_softmax(logits, -1)
    assert got.logprob == pytest.approx(float(want[got.token_id]), abs=1e-6)  # (logprobs are float32)
    assert [lp for _, lp in got.top] == pytest.approx([float(want[t]) for t, _ in got.top], abs=1e-6)


def test_float32_on_cpu_matches_transformers_float32(granite):
    llm = LLM(str(granite), dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.model.fused_decode is None  # (a Llama's arithmetic only)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert tokens(llm.generate(SHORT, params, use_tqdm=False)) == hf_greedy(granite, SHORT, 12, torch.float32)


def test_two_tensor_parallel_ranks_equal_one(granite):
    """Each rank's partial sums all-reduced before the residual multiplier, the logits' divisor
    after the gather: one rank's tokens and logprobs, and HF's."""
    two, one = two_ranks_and_one(granite, SHORT, 16)
    assert two == one == hf_greedy(granite, SHORT, 16)


def test_config_reading(granite):
    """granite-3.3-8b-instruct's multipliers as its config states them; the saved model's."""
    arch = ArchConfig.from_hf(json.loads((granite / "config.json").read_text()))
    assert (arch.embedding_multiplier, arch.residual_multiplier, arch.attention_scale, arch.logits_scaling) == (
        6.0, 0.3, 0.5, 4.0)
    hub = ArchConfig.from_hf({"architectures": ["GraniteForCausalLM"], "hidden_size": 4096, "intermediate_size": 12800,
                              "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "vocab_size": 49159, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                              "attention_multiplier": 0.0078125, "logits_scaling": 16.0, "tie_word_embeddings": True})
    assert hub.attention_scale == 0.0078125 and hub.num_params / 1e9 == pytest.approx(8.17, abs=0.01)
