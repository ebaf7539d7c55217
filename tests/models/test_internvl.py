"""InternVL in HF's format (`InternVLForConditionalGeneration`, conveyor/models/internvl_vision.py)
against HF transformers on the same random weights: the tiling (HF's `crop_to_patches`), the
frame `<img>` ... `</img>`, the tower's embeddings, and greedy tokens whole and in chunks."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.multimodal import ImagePrompt, tile_grid
from tests.conftest import TINY, save_image_tokenizer

PIL = pytest.importorskip("PIL.Image")

START, END, CONTEXT = 380, 381, 382  # <img>, </img>, <IMG_CONTEXT>
TILE, MAX_TILES = 56, 6
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<IMG_CONTEXT> "
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def build_tiny_internvl(out_dir, seed: int = 2):
    """A random-weight `InternVLForConditionalGeneration`: InternViT of 2 layers on 56-pixel tiles
    (16 patches, 4 tokens a tile after the pixel shuffle), RMS-normed queries and keys, layer
    scales, over conftest's TINY as a Qwen2; a word-level tokenizer with `<img>`, `</img>` and
    `<IMG_CONTEXT>`; a processor config of at most 6 tiles."""
    import transformers as tf

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=[TILE, TILE], patch_size=[14, 14], attention_bias=True, use_qk_norm=True)
    config = tf.InternVLConfig(text_config={**TINY, "model_type": "qwen2"}, vision_config=vision,
                               image_token_id=CONTEXT, image_seq_length=4, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.InternVLForConditionalGeneration(config).eval()
    with torch.no_grad():  # (HF starts norms, scales and the class token plainly: make them matter)
        for name, p in model.named_parameters():
            if "vision_tower" in name or "projector" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
            if "linear_2" in name:
                p.normal_(0, 0.02)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_image_tokenizer(out_dir, {START: "<img>", END: "</img>", CONTEXT: "<IMG_CONTEXT>"}, TEMPLATE)
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "GotOcr2ImageProcessor", "size": {"height": TILE, "width": TILE}, "resample": 3,
        "max_patches": MAX_TILES, "min_patches": 1, "crop_to_patches": False,
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225],
    }))
    return out_dir


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    return build_tiny_internvl(tmp_path_factory.mktemp("internvl") / "m")


def picture(seed: int, size):
    g = torch.Generator().manual_seed(seed)
    return PIL.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


SIZES = [(70, 90), (200, 60), (56, 56), (30, 41), (150, 100)]


def test_tiles_match_hf(internvl):
    """HF's GotOcr2 processor (PIL backend) as InternVL's processor calls it (`crop_to_patches`):
    the same tiles and thumbnail, to 1e-6; each image's token count its tiles' and the frame's."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
        get_optimal_tiled_canvas,
    )

    llm = LLM(str(internvl), dtype="float32")
    ours, v = llm.engine.image_processor, llm.engine.arch.vision
    theirs = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, image_mean=[0.485, 0.456, 0.406],
                                      image_std=[0.229, 0.224, 0.225])
    counts = set()
    for i, size in enumerate(SIZES):
        image = picture(i, size)
        got = ours(image)
        want = theirs(image, crop_to_patches=True, max_patches=MAX_TILES, return_tensors="pt")
        assert want["num_patches"].tolist() == [got.values.shape[0]]
        torch.testing.assert_close(got.values, want["pixel_values"], rtol=0, atol=1e-6)
        assert tile_grid((size[1], size[0]), (TILE, TILE), 1, MAX_TILES) == get_optimal_tiled_canvas(
            (size[1], size[0]), (TILE, TILE), 1, MAX_TILES)
        assert v.image_tokens(got) == 4 * got.values.shape[0]
        assert llm.engine.image_token.count(got) == 4 * got.values.shape[0] + 2
        counts.add(got.values.shape[0])
    assert len(counts) >= 3 and 1 in counts  # (one tile, and several with a thumbnail)


def test_tower_and_greedy_tokens_match_hf(internvl):
    """The tower's embeddings equal HF's `get_image_features`; greedy tokens equal HF's (float64)
    whole and in chunks of 8 through the images, beside a text-only request, with the prefix cache."""
    import transformers as tf

    hf = tf.InternVLForConditionalGeneration.from_pretrained(internvl, dtype=torch.float64).eval()
    llm = LLM(str(internvl), dtype="float32", max_num_seqs=4)
    processor = llm.engine.image_processor
    pixels = [processor(picture(i, size)) for i, size in enumerate(SIZES[:3])]
    got = llm.engine.runner.model.vision(pixels)
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=torch.cat([p.values for p in pixels]).double(),
                                          vision_feature_layer=-1, vision_feature_select_strategy="default")
    want = out.pooler_output if hasattr(out, "pooler_output") else out
    torch.testing.assert_close(torch.cat(got).double(), want.reshape(-1, want.shape[-1]), rtol=1e-4, atol=1e-4)

    prompts = [([1, 40, CONTEXT, 41, 42], [(0, (200, 60))]),
               ([1, CONTEXT, 50, CONTEXT, 51], [(1, (70, 90)), (2, (56, 56))]),
               ([1, 90, 91, 92], [])]
    want_tokens = []
    for ids, images in prompts:
        ps = [processor(picture(s, size)) for s, size in images]
        n = iter(p.values.shape[0] * 4 for p in ps)
        full = [t for tok in ids for t in ([START, *[CONTEXT] * next(n), END] if tok == CONTEXT else [tok])]
        x = torch.tensor([full])
        extra = {"pixel_values": torch.cat([p.values for p in ps]).double()} if ps else {}
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=PARAMS.max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        want_tokens.append(gen[0, x.shape[1]:].tolist())
    requests = [ImagePrompt(ids, tuple(picture(s, size) for s, size in images)) if images else ids
                for ids, images in prompts]
    outs = llm.generate(requests, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_tokens
    assert outs[0].prompt_token_ids.count(START) == 1 and outs[1].prompt_token_ids.count(END) == 2
    chunked = LLM(str(internvl), dtype="float32", max_num_seqs=4, prefill_mode="chunked", max_num_batched_tokens=8,
                  enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in chunked.generate(requests, PARAMS, use_tqdm=False)] == want_tokens
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": picture(0, (200, 60))},
                                                   {"type": "text", "text": "w7"}]}], PARAMS, use_tqdm=False)[0]
    i, n = chat.prompt_token_ids.index(START), 4 * processor(picture(0, (200, 60))).values.shape[0]
    assert chat.prompt_token_ids[i + 1 : i + 1 + n] == [CONTEXT] * n and chat.prompt_token_ids[i + 1 + n] == END
    by_hand = [*chat.prompt_token_ids[:i], CONTEXT, *chat.prompt_token_ids[i + 2 + n :]]
    again = llm.generate(ImagePrompt(by_hand, (picture(0, (200, 60)),)), PARAMS, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == chat.outputs[0].token_ids


def test_a_hub_config():
    """InternVL3-1B-hf's shape: InternViT-300M (LayerNorm, biased q/k/v, no q/k norm) over Qwen2.5-0.5B."""
    from conveyor.models.arch import ArchConfig, UnsupportedModelError

    cfg = {"architectures": ["InternVLForConditionalGeneration"], "downsample_ratio": 0.5, "image_seq_length": 256,
           "image_token_id": 151667, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
           "vision_feature_select_strategy": "default",
           "text_config": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
                           "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
                           "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                           "vocab_size": 151674, "max_position_embeddings": 32768, "tie_word_embeddings": True},
           "vision_config": {"attention_bias": True, "hidden_act": "gelu", "hidden_size": 1024,
                             "image_size": [448, 448], "intermediate_size": 4096, "layer_norm_eps": 1e-6,
                             "layer_scale_init_value": 0.1, "model_type": "internvl_vision", "norm_type": "layer_norm",
                             "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": [14, 14],
                             "use_mean_pooling": True, "use_qk_norm": False}}
    arch = ArchConfig.from_hf(cfg)
    v = arch.vision
    assert arch.family == "qwen2" and arch.attention_bias and arch.tie_word_embeddings
    assert v is not None and v.style == "internvl" and v.pooled_tokens == 256 and v.feature_layers == (24,)
    assert v.attention_bias and not v.qk_norm and v.image_size == 448 and v.num_patches == 1024
    with pytest.raises(UnsupportedModelError, match="downsample_ratio"):
        ArchConfig.from_hf({**cfg, "downsample_ratio": 0.25})
