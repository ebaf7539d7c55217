"""Gemma 2 and Gemma 3: sliding-window and global layers in one model (each its own window
over the same paged cache), Gemma 3's two RoPE bases, the (1 + w) norms around each sublayer,
the scaled embedding, GELU-gated MLPs and Gemma 2's soft caps. Greedy tokens equal HF
transformers' on the same random weights in float64 under every scheduling, with swaps, prefix
hits and a float32 cache; the float32 CPU path and the Triton backend agree with HF's float32;
a window of 6 and caps of 0.2 and 1 are small enough that the tests would fail without them."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.models.arch import ArchConfig, UnsupportedModelError
from tests.conftest import build_tiny_model, triton_interpreted
from tests.models import test_moe as moe
from tests.models.test_hf_parity import PROMPTS
from tests.schedulings import SCHEDULINGS

FAMILIES = ["gemma2", "gemma3"]
# Sliding and global layers by turns (Gemma 2's pattern; Gemma 3's is five to one), windows of
# 6 tokens, a softmax scale of its own; Gemma 3 with a local and a linearly scaled global RoPE.
SHAPE = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6, num_hidden_layers=4)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
_rng = random.Random(5)
# Prompts up to 20 tokens and 16 new ones: every sequence outgrows its window.
LONG = [[_rng.randrange(3, 384) for _ in range(_rng.randint(1, 20))] for _ in range(6)]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("gemma")
    return {
        "gemma2": build_tiny_model(root / "g2", "gemma2", seed=3, attn_logit_softcapping=0.2,
                                   final_logit_softcapping=1.0, **SHAPE),
        "gemma3": build_tiny_model(root / "g3", "gemma3", seed=4, sliding_window_pattern=2,
                                   rope_parameters=GEMMA3_ROPE, **SHAPE),
    }


def hf_greedy(model_dir, prompts, max_new_tokens=16, dtype=torch.float64, **config):
    """HF's greedy tokens (eager attention: the one that soft-caps), with `config` overriding
    the saved config's fields."""
    return moe.hf_greedy(model_dir, prompts, max_new_tokens, dtype, attn_implementation="eager", **config)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
@SCHEDULINGS
def test_greedy_matches_transformers(gemma_models, family, options):
    model_dir = gemma_models[family]
    llm = LLM(str(model_dir), dtype="float64", **{"num_kv_blocks": 64, "block_size": 8, **options})
    assert tokens(llm.generate(LONG, PARAMS, use_tqdm=False)) == hf_greedy(model_dir, LONG)
    if options.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_window_and_the_caps_change_the_tokens(gemma_models, family):
    """What the greedy test would miss if it were not built: HF's tokens with the window wider
    than every sequence (and, for Gemma 2, without the cap on scores) are other tokens. (The
    cap on logits keeps their order: the logits test shows it.)"""
    model_dir = gemma_models[family]
    expected = hf_greedy(model_dir, LONG)
    assert hf_greedy(model_dir, LONG, sliding_window=4096) != expected
    if family == "gemma2":
        assert hf_greedy(model_dir, LONG, attn_logit_softcapping=None) != expected


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_and_logits_match_transformers(gemma_models, family):
    """One prompt's last hidden states and logits. HF's Gemma norms compute in float32 even in a
    float64 model, as conveyor's do, so agreement stops near float32's precision."""
    from transformers import AutoModelForCausalLM

    ids = PROMPTS[2][:40]
    hf = AutoModelForCausalLM.from_pretrained(gemma_models[family], dtype=torch.float64,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    llm = LLM(str(gemma_models[family]), dtype="float64", num_kv_blocks=64)
    model = llm.engine.runner.model
    hidden = model.forward_sequence(ids)
    assert torch.allclose(hidden, out.hidden_states[-1][0], atol=1e-5, rtol=0)
    assert torch.allclose(model.compute_logits(hidden), out.logits[0], atol=1e-5, rtol=0)
    if family == "gemma2":  # logits beyond the cap of 1: capped, they are other logits
        assert (hidden @ model.head_weight.T).abs().max() > 1.5


@pytest.mark.parametrize("options", [
    {"preemption_mode": "swap", "num_kv_blocks": 24, "block_size": 4, "num_swap_blocks": 64},
    {"kv_cache_dtype": "float32"},
    {"enable_prefix_caching": True, "max_num_batched_tokens": 32, "block_size": 4},
], ids=["swap", "kv-float32", "prefix-hits"])
def test_cache_paths_keep_the_tokens(gemma_models, options):
    """Both kinds of layer read the same cache: swapped out and in, rounded to float32, read
    as a prefix hit (a hit's chunk attends over its window of the cached prefix)."""
    model_dir = gemma_models["gemma3"]
    shared = LONG[0] + LONG[1] + LONG[2]
    prompts = [shared + p for p in LONG[3:]] + LONG
    llm = LLM(str(model_dir), dtype="float64", **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert tokens(outs) == hf_greedy(model_dir, prompts, 12)
    if "preemption_mode" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    if "enable_prefix_caching" in options:
        assert sum(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_on_cpu_matches_transformers_float32(gemma_models, family):
    """The CPU's float32 path: the native decode kernel with each layer's window (Gemma 2's
    capping its scores; its prompts take the explicit products), the skinny GEMV in every
    projection, at batch 1 and in a batch of six."""
    model_dir = gemma_models[family]
    expected = hf_greedy(model_dir, LONG, 12, torch.float32)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [tokens(llm.generate([p], params, use_tqdm=False))[0] for p in LONG[:2]] == expected[:2]
    assert tokens(llm.generate(LONG, params, use_tqdm=False)) == expected
    windows = {type(m.backend).__name__ + f"/{m.backend.window}" for m in llm.engine.runner.model.modules()
               if hasattr(m, "backend") and hasattr(m.backend, "window")}
    kind = "CpuEagerAttention" if family == "gemma2" else "CpuPagedAttention"  # (Gemma 2's capped scores)
    assert windows == {f"{kind}/6", f"{kind}/0"}


@pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreted(),
                    reason="the model on CPU tensors through Triton's interpreter (tests/kernels run the kernels on a GPU)")
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_backend_takes_each_layers_window(gemma_models, family):
    """On the Triton attention backend (here through its interpreter), one backend a window,
    Gemma 2's with the soft cap in the kernels: HF's float32 tokens over sequences that outgrow
    the window."""
    from conveyor.kernels.triton_attention import TritonPagedAttention

    model_dir = gemma_models[family]
    prompts = LONG[:3]
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, block_size=4, enforce_eager=True)
    model = llm.engine.runner.model
    model._use_triton_attention(torch.float32)  # on CUDA prepare_for_inference does it
    backends = {m.backend for m in model.modules() if hasattr(m, "backend")}
    assert all(isinstance(b, TritonPagedAttention) for b in backends)
    assert sorted(b.window for b in backends) == [6, 1 << 30]
    assert {b.softcap for b in backends} == ({0.2} if family == "gemma2" else {0.0})
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == hf_greedy(model_dir, prompts, 10, torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_tensor_parallel_ranks_equal_one(gemma_models, family):
    """Heads and MLP rows split over two ranks, the four norms whole on each, the caps applied
    after the logits' all-reduce: one rank's tokens and logprobs, and HF's."""
    two, one = moe.two_ranks_and_one(gemma_models[family], LONG)
    assert two == one == hf_greedy(gemma_models[family], LONG, 12)


def test_config_readings(gemma_models):
    """Configs as the Hub has them (transformers 4: `rope_theta`, `rope_local_base_freq`,
    `sliding_window_pattern`, no `layer_types`) and as transformers 5 writes them; the
    parameter count equals HF's."""
    from transformers import AutoModelForCausalLM

    hub = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 1152,
           "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 256, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rope_scaling": None,
           "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
           "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768}  # gemma-3-1b-it's
    arch = ArchConfig.from_hf(hub)
    assert arch.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_scaling) == (1_000_000.0, 10_000.0, None)
    assert arch.attention_scale == 256**-0.5 and arch.tie_word_embeddings and arch.qk_norm
    scaled = ArchConfig.from_hf({**hub, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 8.0} and scaled.local_rope.rope_scaling is None
    g2 = ArchConfig.from_hf({**hub, "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
                             "final_logit_softcapping": 30.0, "sliding_window": 4096})
    assert g2.layer_windows[:4] == (4096, 0, 4096, 0) and not g2.qk_norm and g2.local_rope_theta == 0
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    for family, path in gemma_models.items():
        cfg = json.loads((path / "config.json").read_text())
        arch = ArchConfig.from_hf(cfg)
        assert arch.layer_windows == (6, 0, 6, 0), family
        hf = AutoModelForCausalLM.from_pretrained(path)
        assert arch.num_params == sum(p.numel() for p in hf.parameters())
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        ArchConfig.from_hf({**hub, "use_bidirectional_attention": True})
    with pytest.raises(UnsupportedModelError, match="hidden_activation"):
        ArchConfig.from_hf({**hub, "hidden_activation": "relu"})


def test_lora_adapters_on_both_kinds_of_layer(gemma_models, tmp_path):
    """An adapter on all seven projections of every layer (sliding and global), and one on q
    and v: HF's tokens with each merged (its eager attention: Gemma 2's caps), beside the base."""
    from conveyor import LoRARequest
    from tests.test_lora import SPECS, merged_reference, write_adapter

    for family, model_dir in gemma_models.items():
        loras = [LoRARequest(name, k + 1, str(write_adapter(tmp_path / family / name, model_dir, *SPECS[name],
                                                             seed=k, std=0.2)))
                 for k, name in enumerate(("everything", "attn-qv"))]
        prompts = LONG[:3]
        want = []
        for lora in (None, *loras):
            path = None if lora is None else tmp_path / family / lora.lora_name
            want += merged_reference(model_dir, path, prompts, 12, attn_implementation="eager")
        assert want[:3] != want[3:6] and want[:3] != want[6:], "an adapter changes nothing: nothing is tested"
        llm = LLM(str(model_dir), dtype="float64", enable_lora=True, max_loras=2, num_kv_blocks=64)
        params = SamplingParams(max_tokens=12, temperature=0.0)
        outs = llm.generate(prompts * 3, params, use_tqdm=False, lora_request=[lo for lo in (None, *loras) for _ in prompts])
        assert tokens(outs) == want, family


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_weights_stay_close_to_float32(gemma_models, family):
    """`quantization="int8"` quantizes Gemma's projections as any dense model's: teacher-forced
    logits within the bound the Llama tests keep, and it serves."""
    from tests.models.test_int8 import rel_err, teacher_forced_logits

    path = str(gemma_models[family])
    reference = LLM(path, dtype="float32", num_kv_blocks=64, block_size=8)
    quantized = LLM(path, quantization="int8", num_kv_blocks=64, block_size=8)
    ids = [(7 * i + 3) % 380 + 2 for i in range(60)]
    ref, q8 = teacher_forced_logits(reference, ids), teacher_forced_logits(quantized, ids)
    assert rel_err(q8, ref) < 0.05
    assert (q8.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    outs = quantized.generate(LONG[:2], PARAMS, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [16, 16]


def build_tiny_gemma3_multimodal(out_dir, seed: int = 6):
    """A random-weight `Gemma3ForConditionalGeneration` (a tiny SigLIP tower and projector
    beside the text model of `SHAPE`), saved as transformers 5 writes it."""
    import transformers as tf

    from tests.conftest import TINY

    text = tf.Gemma3TextConfig(**{**TINY, **SHAPE, "sliding_window_pattern": 2, "rope_parameters": GEMMA3_ROPE})
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                             boi_token_index=381, eoi_token_index=382, image_token_index=383)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def test_the_text_model_of_an_image_text_checkpoint(tmp_path):
    """Gemma 3's 4B-27B ship as `Gemma3ForConditionalGeneration`: its text model loads (the
    vision tower and projector skipped) and gives HF's greedy tokens on text prompts; a Hub
    config that names only what differs from Gemma3TextConfig's defaults reads with them."""
    from transformers import AutoModelForImageTextToText

    path = build_tiny_gemma3_multimodal(tmp_path / "mm")
    cfg = json.loads((path / "config.json").read_text())
    arch = ArchConfig.from_hf(cfg)
    assert arch.multimodal and arch.family == "gemma3" and arch.layer_windows == (6, 0, 6, 0)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
    want = []
    for p in LONG:
        ids = torch.tensor([p])
        gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        want.append(gen[0, len(p):].tolist())
    llm = LLM(str(path), dtype="float64", num_kv_blocks=64)
    assert tokens(llm.generate(LONG, PARAMS, use_tqdm=False)) == want
    old = rename_as_transformers_4(path, tmp_path / "mm4")  # the Hub's checkpoints' names
    assert tokens(LLM(str(old), dtype="float64", num_kv_blocks=64).generate(LONG, PARAMS, use_tqdm=False)) == want
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}}  # gemma-3-4b-it's text_config
    arch = ArchConfig.from_hf(hub)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (8, 4, 256, 262_208)
    assert arch.layer_windows.count(0) == 5 and arch.eos_token_ids == (1, 106)
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_scaling["factor"]) == (1_000_000.0, 10_000.0, 8.0)


def rename_as_transformers_4(path, out):
    """The checkpoint with transformers 4's names (`language_model.model.*`, `vision_tower.*`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        renamed = {}
        for name, t in tensors.items():
            if name.startswith("model.language_model."):
                name = "language_model.model." + name.removeprefix("model.language_model.")
            elif name.startswith("model."):
                name = name.removeprefix("model.")
            elif name == "lm_head.weight":
                name = "language_model.lm_head.weight"
            renamed[name] = t
        assert any(n.startswith("vision_tower.") for n in renamed)
        save_file(renamed, str(f), metadata={"format": "pt"})
    return out


def write_gemma_gguf(model_dir, out) -> None:
    """The HF folder as llama.cpp's convert_hf_to_gguf.py writes a Gemma 2 / 3 (F32): the gguf
    package's own tensor names, the (1 + w) norm scales stored whole, its metadata keys."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from tests.models.test_gguf import close_gguf, gguf_writer

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3}[cfg["model_type"]]
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    rope = cfg.get("rope_parameters") or {}
    # (a real file has its vocabulary beside the vocab size)
    w = gguf_writer(cfg, out, cfg["model_type"].removesuffix("_text"),
                    (rope.get("full_attention") or rope).get("rope_theta", 10000.0))
    w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("attn_logit_softcapping"):
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    for name, tensor in load_file(str(next(model_dir.glob("*.safetensors")))).items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no `output`
        data = tensor.float().numpy()
        if name.endswith("norm.weight"):
            data = data + 1
        w.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", np.ascontiguousarray(data))
    close_gguf(w)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_file_as_llama_cpp_writes_it(gemma_models, tmp_path, family):
    """A GGUF Gemma (llama.cpp's names, norms stored as 1 + w, the window and caps in its
    metadata, the pattern and Gemma 3's local RoPE base of 10,000 assumed as llama.cpp assumes
    them): the same windows and the tokens of the HF folder it came from."""
    shape = {**SHAPE, "query_pre_attn_scalar": SHAPE["head_dim"]}  # (llama.cpp's scale below 27B)
    if family == "gemma3":
        shape.update(num_hidden_layers=6, rope_parameters={  # its default pattern: five sliding, one global
            "full_attention": GEMMA3_ROPE["full_attention"] | {"rope_type": "default"},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    folder = build_tiny_model(tmp_path / "hf", family, seed=8, **shape,
                              **({"attn_logit_softcapping": 0.2, "final_logit_softcapping": 1.0}
                                 if family == "gemma2" else {}))
    write_gemma_gguf(folder, tmp_path / "m.gguf")
    from_gguf = LLM(str(tmp_path / "m.gguf"), dtype="float64", num_kv_blocks=64)
    from_hf = LLM(str(folder), dtype="float64", num_kv_blocks=64)
    a, b = from_gguf.engine.arch, from_hf.engine.arch
    assert (a.layer_windows, a.qk_norm, a.tie_word_embeddings) == (b.layer_windows, b.qk_norm, b.tie_word_embeddings)
    floats = ("attention_scale", "local_rope_theta", "attn_logit_softcapping", "final_logit_softcapping")
    assert [getattr(a, f) for f in floats] == pytest.approx([getattr(b, f) for f in floats], rel=1e-6)  # (float32 keys)
    assert tokens(from_gguf.generate(LONG, PARAMS, use_tqdm=False)) == hf_greedy(folder, LONG)


# -- EmbeddingGemma: Gemma 3 with bidirectional attention, as an encoder ----------------------
def build_embedding_gemma(out_dir, window: int = 8, seed: int = 9):
    """A random-weight `Gemma3TextModel` with `use_bidirectional_attention` (EmbeddingGemma's
    shape, tiny: sliding layers by turns, a window of `window`), with EmbeddingGemma's
    sentence-transformers modules: mean pooling, Dense to 4x the width and back (no activation,
    no bias), Normalize."""
    import transformers as tf
    from safetensors.torch import save_file

    from tests.conftest import TINY

    cfg = tf.Gemma3TextConfig(**{**TINY, "head_dim": 16, "num_hidden_layers": 4, "sliding_window": window,
                                 "sliding_window_pattern": 2, "use_bidirectional_attention": True,
                                 "query_pre_attn_scalar": 16})
    torch.manual_seed(seed)
    model = tf.Gemma3TextModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    h = cfg.hidden_size
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out_dir / "modules.json").write_text(json.dumps(modules))
    (out_dir / "1_Pooling").mkdir()
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": h, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    denses = []
    for folder, (fan_in, fan_out) in (("2_Dense", (h, 4 * h)), ("3_Dense", (4 * h, h))):
        (out_dir / folder).mkdir()
        (out_dir / folder / "config.json").write_text(json.dumps({
            "in_features": fan_in, "out_features": fan_out, "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity"}))
        weight = torch.randn(fan_out, fan_in) / fan_in**0.5
        save_file({"linear.weight": weight.contiguous()}, str(out_dir / folder / "model.safetensors"))
        denses.append(weight.double())
    return out_dir, denses


def test_embedding_gemma_matches_transformers(tmp_path):
    """Every token's hidden state equal to HF's `Gemma3TextModel` with bidirectional attention
    (float64; prompts of 1 to 30 tokens, the sliding layers seeing 4 tokens either side, which
    HF's own states with a wider window show to matter), and the embedding as its
    sentence-transformers modules make it: the mean, two Dense layers, normalized."""
    from transformers import AutoModel

    from conveyor import PoolingParams

    path, denses = build_embedding_gemma(tmp_path / "eg")
    hf = AutoModel.from_pretrained(path, dtype=torch.float64).eval()
    wide = AutoModel.from_pretrained(path, dtype=torch.float64, sliding_window=64).eval()
    prompts = [LONG[0][:1], LONG[1][:7], (LONG[2] + LONG[3])[:30]]
    llm = LLM(str(path), dtype="float64")
    assert llm.engine.arch.layer_windows == (4, 0, 4, 0) and llm.engine.arch.default_pooling == "mean"
    states = llm.encode(prompts, PoolingParams("all", normalize=False), use_tqdm=False)
    embeddings = llm.embed(prompts, use_tqdm=False)
    for p, s, e in zip(prompts, states, embeddings, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).last_hidden_state[0]
            other = wide(torch.tensor([p])).last_hidden_state[0]
        got = torch.tensor(s.outputs.data, dtype=torch.float64)
        assert torch.allclose(got, ref, atol=1e-6, rtol=0)
        if len(p) > 5:
            assert (other - ref).abs().max() > 1e-3  # the window is live
        want = torch.nn.functional.normalize(ref.mean(dim=0) @ denses[0].T @ denses[1].T, dim=0)
        assert e.outputs.embedding == pytest.approx(want.tolist(), abs=1e-6)


def test_embedding_gemma_is_an_encoder():
    """It generates nothing; a Gemma3TextModel without bidirectional attention is a decoder's
    body, refused as an encoder."""
    base = {"architectures": ["Gemma3TextModel"], "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    arch = ArchConfig.from_hf({**base, "use_bidirectional_attention": True, "sliding_window": 512})
    assert arch.is_encoder and arch.layer_windows == (256, 256) and arch.pooling == "mean"
    with pytest.raises(UnsupportedModelError, match="decoder's body"):
        ArchConfig.from_hf(base)
