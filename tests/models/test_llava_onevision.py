"""LLaVA-OneVision's images against HF transformers' `LlavaOnevisionForConditionalGeneration` and its
image processor on the same random weights: LLaVA-NeXT's tiles over a SigLIP tower, the grid's
features scaled down where they exceed `anyres_max_N`'s budget, the token count that follows, and
greedy tokens whole and in chunks."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import LLM, ImagePrompt, SamplingParams
from conveyor.models.vision import VisionArch
from tests.conftest import TINY
from tests.models.test_llava_next import hf_tiled_tokens

PIL = pytest.importorskip("PIL.Image")

IMAGE_TOKEN = 383
TILE, PATCH = 28, 14  # 4 patches a tile
PINS = [[28, 28], [28, 56], [56, 28], [56, 56], [84, 84]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SIZES = [(30, 25), (70, 90), (50, 20), (90, 90)]  # (width, height): from one tile to 3x3


def build_tiny_onevision(out, tile: int = TILE, pins=PINS, seed: int = 23, **tokens):
    """A random-weight `LlavaOnevisionForConditionalGeneration` (a SigLIP tower of 2 layers at
    `tile` pixels in 14-pixel patches, conftest's TINY text model as Qwen2, `anyres_max_2`) and
    its image processor's config, saved to `out`; `tokens`: more config (the video token)."""
    import transformers as tf

    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=tile, patch_size=PATCH)
    config = tf.LlavaOnevisionConfig(text_config={**TINY, "model_type": "qwen2"}, vision_config=vision,
                                     image_token_index=IMAGE_TOKEN, image_grid_pinpoints=pins,
                                     vision_aspect_ratio="anyres_max_2", vision_feature_layer=-1,
                                     vision_feature_select_strategy="full", tie_word_embeddings=False, **tokens)
    torch.manual_seed(seed)
    model = tf.LlavaOnevisionForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "projector" in name or "image_newline" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "LlavaOnevisionImageProcessor", "do_resize": True,
        "size": {"height": tile, "width": tile}, "do_center_crop": None, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "resample": 3, "do_pad": True, "image_grid_pinpoints": pins,
    }))
    return out


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    return build_tiny_onevision(tmp_path_factory.mktemp("onevision") / "m")


def picture(seed: int, size):
    g = torch.Generator().manual_seed(seed)
    return PIL.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


def test_tiles_and_the_token_count_match_hf(onevision):
    """HF's processor's tiles; the token count with the grid scaled down past `anyres_max_2`'s
    budget or not (HF's model checks it against its features in the greedy test)."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from conveyor.models.vision import _unpadded

    llm = LLM(str(onevision), dtype="float64", num_kv_blocks=128)
    cfg = json.loads((onevision / "preprocessor_config.json").read_text())
    cfg.pop("image_processor_type")
    theirs = LlavaOnevisionImageProcessorPil(**cfg)
    v: VisionArch = llm.engine.arch.vision
    assert v.style == "llava_onevision" and v.max_tiles == 2 and v.tokens_per_image == 4
    scaled = []
    for i, size in enumerate(SIZES):
        image = picture(i, size)
        got = llm.engine.image_processor(image)
        want = theirs(image, return_tensors="np", do_pad=False)
        assert got.size == tuple(want["image_sizes"][0])
        torch.testing.assert_close(got.values, torch.from_numpy(want["pixel_values"][0]), rtol=0, atol=1e-6)
        rows, cols = v.grid_shape(got.size)
        grid = _unpadded(got.size, rows * 2, cols * 2)
        scaled.append(v.scaled(grid) != grid)
        height, width = v.scaled(grid)
        assert v.image_tokens(got) == 4 + height * width + height
        assert v.image_tokens(got.whole_only()) == 4 + 1 and got.whole_only().digest != got.digest
    assert any(scaled) and not all(scaled)


def test_greedy_tokens_match_hf(onevision):
    """Prompts of pictures from one tile to a scaled-down 3x3 grid, two in one prompt (each then
    its whole-image tile alone and a newline, as HF's processor has it), and one of text, whole
    and in chunks: HF's greedy tokens, its model accepting conveyor's counts."""
    from transformers import LlavaOnevisionForConditionalGeneration

    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(onevision, dtype=torch.float64).eval()
    llm = LLM(str(onevision), dtype="float64", num_kv_blocks=256)
    prompts = [ImagePrompt([1, 40, IMAGE_TOKEN, 41], (picture(0, SIZES[0]),)),
               ImagePrompt([1, IMAGE_TOKEN, 50, IMAGE_TOKEN, 51], (picture(1, SIZES[1]), picture(2, SIZES[2]))),
               ImagePrompt([1, 60, 61, IMAGE_TOKEN], (picture(3, SIZES[3]),)),
               [1, 70, 71, 72]]
    # (HF's model reads several images of a prompt untiled, by `batch_num_images`)
    want = hf_tiled_tokens(hf, llm, prompts, batch_num_images=lambda spans: torch.tensor([len(spans)]))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    chunked = LLM(str(onevision), dtype="float64", num_kv_blocks=256, prefill_mode="chunked",
                  max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, PARAMS, use_tqdm=False)] == want
