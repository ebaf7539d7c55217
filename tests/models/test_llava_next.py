"""LLaVA-NeXT's images (anyres tiles) against HF transformers' `LlavaNextForConditionalGeneration`
and its image processor on the same random weights: the tiles an image is cut into, the token
count that grows with its size, the packed features (the whole image, then the tiles' grid cut
to the picture, a newline a row), and greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import LLM, ImagePrompt, SamplingParams
from conveyor.models.vision import VisionArch
from tests.conftest import TINY

PIL = pytest.importorskip("PIL.Image")

IMAGE_TOKEN = 383
TILE, PATCH = 28, 14  # 4 patches a tile
PINS = [[28, 56], [56, 28], [56, 56], [84, 28]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SIZES = [(70, 90), (50, 20), (20, 50), (20, 80)]  # (width, height): each tiling chosen once


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    import transformers as tf

    out = tmp_path_factory.mktemp("llava_next") / "m"
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=TILE, patch_size=PATCH)
    config = tf.LlavaNextConfig(text_config={**TINY, "model_type": "llama"}, vision_config=vision,
                                image_token_index=IMAGE_TOKEN, image_grid_pinpoints=PINS, vision_feature_layer=-1)
    torch.manual_seed(21)
    model = tf.LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "projector" in name or "image_newline" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "LlavaNextImageProcessor", "do_resize": True, "size": {"shortest_edge": TILE},
        "do_center_crop": True, "crop_size": {"height": TILE, "width": TILE}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "do_pad": True,
        "image_grid_pinpoints": PINS,
    }))
    return out


def picture(seed: int, size):
    g = torch.Generator().manual_seed(seed)
    return PIL.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


def test_tiles_match_hf_and_the_token_count(llava_next):
    """HF's processor's tiles for pictures that choose each tiling, and its processor's count of
    image tokens (what HF's model then checks against its features)."""
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    llm = LLM(str(llava_next), dtype="float64", num_kv_blocks=128)
    ours = llm.engine.image_processor
    cfg = json.loads((llava_next / "preprocessor_config.json").read_text())
    cfg.pop("image_processor_type")
    theirs = LlavaNextImageProcessorPil(**cfg)
    v: VisionArch = llm.engine.arch.vision
    grids = set()
    for i, size in enumerate(SIZES):
        image = picture(i, size)
        got = ours(image)
        want = theirs(image, return_tensors="np", do_pad=False)
        assert got.size == tuple(want["image_sizes"][0])
        tiles = torch.from_numpy(want["pixel_values"][0])
        assert got.values.shape == tiles.shape
        torch.testing.assert_close(got.values, tiles, rtol=0, atol=1e-6)
        grids.add(v.grid_shape(got.size))
        rows, cols = v.grid_shape(got.size)
        assert got.values.shape[0] == 1 + rows * cols
    assert len(grids) == 4


def hf_tiled_tokens(hf, llm, prompts, **more) -> list[list[int]]:
    """HF's greedy tokens (10) for `prompts` as conveyor expands them, each prompt's images' tiles
    padded to the most tiles among them, with their sizes (and `more` inputs for HF's model)."""
    want = []
    for p in prompts:
        _, ids, spans = llm.engine.prepare_prompt(p)
        x = torch.tensor([ids])
        extra = {}
        if spans:
            tiles = [s.pixels.values for s in spans]
            most = max(t.shape[0] for t in tiles)
            padded = torch.stack([torch.cat([t, t.new_zeros(most - t.shape[0], *t.shape[1:])]) for t in tiles])
            extra = {"pixel_values": padded.double(), "image_sizes": torch.tensor([s.pixels.size for s in spans]),
                     **({k: f(spans) for k, f in more.items()})}
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                          eos_token_id=None, pad_token_id=0, **extra)
        want.append(gen[0, x.shape[1]:].tolist())
    return want


def test_greedy_tokens_match_hf(llava_next):
    """Prompts of pictures of every tiling (two in one prompt) and one of text, batched and in
    chunks: HF's greedy tokens, its model accepting conveyor's token counts."""
    from transformers import LlavaNextForConditionalGeneration

    hf = LlavaNextForConditionalGeneration.from_pretrained(llava_next, dtype=torch.float64).eval()
    llm = LLM(str(llava_next), dtype="float64", num_kv_blocks=256)
    prompts = [ImagePrompt([1, 40, IMAGE_TOKEN, 41], (picture(0, SIZES[0]),)),
               ImagePrompt([1, IMAGE_TOKEN, 50, IMAGE_TOKEN, 51], (picture(1, SIZES[1]), picture(2, SIZES[2]))),
               ImagePrompt([1, 60, 61, IMAGE_TOKEN], (picture(3, SIZES[3]),)),
               [1, 70, 71, 72]]
    want = hf_tiled_tokens(hf, llm, prompts)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    chunked = LLM(str(llava_next), dtype="float64", num_kv_blocks=256, prefill_mode="chunked",
                  max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, PARAMS, use_tqdm=False)] == want


def test_a_hub_config():
    """llava-v1.6-mistral-7b-hf's config: Mistral-7B's text model from MistralConfig's defaults,
    the CLIP ViT-L/14 tower, LLaVA-NeXT's five tilings; a 640x480 picture takes the 672x672
    tiling and 576 + 1764 tokens."""
    from conveyor.models.arch import ArchConfig

    hub = {"architectures": ["LlavaNextForConditionalGeneration"],
           "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
           "image_token_index": 32000, "model_type": "llava_next", "projector_hidden_act": "gelu",
           "text_config": {"architectures": ["MistralForCausalLM"], "intermediate_size": 14336,
                           "max_position_embeddings": 32768, "model_type": "mistral", "num_key_value_heads": 8,
                           "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
                           "vocab_size": 32064},
           "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                             "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
           "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
    arch = ArchConfig.from_hf(hub)
    assert (arch.family, arch.hidden_size, arch.num_layers, arch.num_kv_heads, arch.sliding_window) == (
        "mistral", 4096, 32, 8, None)
    v = arch.vision
    assert v is not None and v.grid_shape((480, 640)) == (2, 2)
    # the grid of 48x48 patches holds the picture in 48x36 of them (6 rows of padding above and below)
    assert v.num_tokens((480, 640)) == 576 + 36 * 48 + 36
