"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (conveyor/models/qwen_vision.py) against HF transformers on
the same random weights: the image processing (`smart_resize`, HF's patches), the vision tower's
embeddings (Qwen2.5-VL's windows, Qwen3-VL's learned positions and DeepStack rows), M-RoPE's 3D
positions (`get_rope_index` and the decode delta), and greedy tokens over prompts with images of
several sizes, whole and in chunks that cut through an image, beside text-only requests."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.multimodal import ImageProcessor, ImagePrompt, smart_resize
from conveyor.sampling_params import InvalidRequestError
from tests.conftest import TINY, save_image_tokenizer

PIL = pytest.importorskip("PIL.Image")

START, END, PAD = 378, 379, 380  # <|vision_start|>, <|vision_end|>, <|image_pad|>
PATCH, MERGE = 14, 2
PATCHES = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16}  # (Qwen3-VL's are 16 pixels)
STYLES = list(PATCHES)
QWEN3_SEED = 4  # (a seed whose greedy tokens vary, and change without M-RoPE or DeepStack)
MAX_PIXELS = 28 * 28 * 40  # (small: a large picture is scaled down to at most 40 tokens)
VIDEO_MAX = 28 * 28 * 12  # (a video's frames: at most 12 tokens each frame group)
VIDEO = 381  # <|video_pad|>
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|> {% elif p['type'] == 'video' %}"
            "<|vision_start|><|video_pad|><|vision_end|> {% else %}{{ p['text'] }}{% endif %}{% endfor %}"
            "{% endif %} {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def hf_class(style: str):
    import transformers as tf

    return {"qwen2_vl": tf.Qwen2VLForConditionalGeneration, "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
            "qwen3_vl": tf.Qwen3VLForConditionalGeneration, "qwen3_vl_moe": tf.Qwen3VLMoeForConditionalGeneration}[style]


def build_tiny_qwen_vl(out_dir, style: str = "qwen2_vl", seed: int = 1):
    """A random-weight `Qwen2VLForConditionalGeneration` (or Qwen2.5-VL's: 56-pixel windows, the
    second of 3 blocks attending whole; or Qwen3-VL's: a Qwen3 text model, a 4x4 grid of learned
    positions, DeepStack from the first two blocks), the text model of conftest's TINY with M-RoPE
    sections (2, 3, 3), a word-level tokenizer with the vision tokens and a chat template, and a
    `preprocessor_config.json` with a small `max_pixels` (and a `video_preprocessor_config.json`:
    at most 12 tokens a frame group, Qwen3-VL's 96 tokens' worth of pixels a video, 4 frames a
    second sampled from a file)."""
    import transformers as tf

    text = {**TINY, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}
    ids = dict(image_token_id=PAD, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if style == "qwen2_vl":
        vision = dict(depth=3, embed_dim=32, hidden_size=TINY["hidden_size"], num_heads=2, patch_size=PATCH,
                      spatial_merge_size=MERGE, temporal_patch_size=2)
        config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    elif style == "qwen2_5_vl":
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=TINY["hidden_size"], num_heads=2,
                      patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    else:  # (the mixture: 4 experts of 16, the top 2 a token)
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=TINY["hidden_size"], num_heads=2,
                      patch_size=16, spatial_merge_size=MERGE, temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 1])
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) if style == "qwen3_vl_moe" else {}
        make = tf.Qwen3VLMoeConfig if moe else tf.Qwen3VLConfig
        config = make(text_config={**text, "head_dim": 16, **moe}, vision_config=vision, **ids)
    torch.manual_seed(seed)
    model = hf_class(style)(config).eval()
    with torch.no_grad():  # (HF starts norms at one and biases at zero: make them matter)
        for name, p in model.named_parameters():
            if "visual" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
            if "merger.mlp.2" in name or ("merger" in name and "linear_fc2" in name):
                p.normal_(0, 0.01)  # (embeddings of about the tokens' size: neither drowns the other)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_image_tokenizer(out_dir, {START: "<|vision_start|>", END: "<|vision_end|>", PAD: "<|image_pad|>",
                                   VIDEO: "<|video_pad|>"}, TEMPLATE)
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": MAX_PIXELS,
        "patch_size": PATCHES[style], "merge_size": MERGE, "temporal_patch_size": 2,
        **({"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if style.startswith("qwen3") else
           {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}),
    }))
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen2VLVideoProcessor", "size": {
            "shortest_edge": 56 * 56, "longest_edge": VIDEO_MAX * 8 if style.startswith("qwen3") else VIDEO_MAX},
        "patch_size": PATCHES[style], "merge_size": MERGE, "temporal_patch_size": 2, "fps": 4.0, "min_frames": 4,
        "max_frames": 16}))
    return out_dir


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return build_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_vl") / "m")


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    return build_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "m", "qwen2_5_vl", seed=6)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return build_tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_vl") / "m", "qwen3_vl", seed=QWEN3_SEED)


@pytest.fixture(scope="module")
def qwen3_vl_moe(tmp_path_factory):
    return build_tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_vl_moe") / "m", "qwen3_vl_moe", seed=QWEN3_SEED)


def picture(seed: int, size):
    """A random RGB picture of `size` (width, height)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return PIL.fromarray(pixels.numpy(), "RGB")


def hf_processor(style: str = "qwen2_vl"):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if style.startswith("qwen3") else {}
    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=MAX_PIXELS, patch_size=PATCHES[style], **norm)


def hf_patches(values: torch.Tensor, patch: int = PATCH) -> torch.Tensor:
    """Our image `[C, H, W]` in HF's patch layout `[patches, C * 2 * patch * patch]` (its `patchify`)."""
    c, h, w = values.shape
    gh, gw = h // patch, w // patch
    x = values.reshape(c, gh // MERGE, MERGE, patch, gw // MERGE, MERGE, patch).permute(1, 4, 2, 5, 0, 3, 6)
    x = x[:, :, :, :, :, None].expand(*x.shape[:5], 2, *x.shape[5:])
    return x.reshape(gh * gw, c * 2 * patch * patch)


def hf_grid(pixels, patch: int) -> torch.Tensor:
    return torch.tensor([[1, p.values.shape[1] // patch, p.values.shape[2] // patch] for p in pixels])


SIZES = [(70, 90), (200, 140), (300, 200), (56, 56), (30, 41), (90, 400)]


@pytest.mark.parametrize("style", ["qwen2_vl", "qwen3_vl"])
def test_image_processing_matches_hf(style, request):
    """HF's Qwen2-VL image processor (PIL backend; Qwen3-VL's 16-pixel patches and 0.5 mean and
    spread): `smart_resize` (rounding, scaled up to the least area, down to the most), rescale and
    normalize; the same patches in HF's layout."""
    from conveyor.models.arch import ArchConfig

    path = request.getfixturevalue(style)
    arch = ArchConfig.from_hf(json.loads((path / "config.json").read_text()))
    v, patch = arch.vision, PATCHES[style]
    assert v is not None and v.is_qwen and arch.mrope_section == (2, 3, 3)
    assert arch.mrope_interleaved == (style == "qwen3_vl") and arch.qk_norm == (style == "qwen3_vl")
    ours, theirs = ImageProcessor.from_folder(path, v), hf_processor(style)
    factor = 2 * patch
    for i, size in enumerate(SIZES):
        image = picture(i, size)
        want = theirs(image, return_tensors="pt")
        got = ours(image)
        h, w = smart_resize(size[1], size[0], factor, 56 * 56, MAX_PIXELS)
        assert got.values.shape == (3, h, w) and got.size == (size[1], size[0])
        assert want["image_grid_thw"][0].tolist() == [1, h // patch, w // patch]
        assert v.image_tokens(got) == h * w // factor**2 <= 40
        torch.testing.assert_close(hf_patches(got.values, patch), want["pixel_values"], rtol=0, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="200 times"):
        ours(picture(0, (1000, 4)))


@pytest.mark.parametrize("style", STYLES[:3])
def test_vision_tower_matches_hf(style, request):
    """The tower's embeddings of images of several sizes in one call (Qwen2.5-VL's windows
    cut unevenly at the edges; Qwen3-VL's learned grid resampled to each, and its DeepStack rows
    beside the embeddings) equal HF's `get_image_features`."""
    path, patch = request.getfixturevalue(style), PATCHES[style]
    hf = hf_class(style).from_pretrained(path, dtype=torch.float64).eval()
    llm = LLM(str(path), dtype="float32")
    processor = llm.engine.image_processor
    pixels = [processor(picture(i, size)) for i, size in enumerate(SIZES[:4])]
    got = llm.engine.runner.model.vision(pixels)
    with torch.no_grad():
        out = hf.model.get_image_features(torch.cat([hf_patches(p.values, patch) for p in pixels]).double(),
                                          hf_grid(pixels, patch))
    width = TINY["hidden_size"]
    want = out.pooler_output
    deep = [d if isinstance(d, tuple | list) else torch.split(d, [g.shape[0] for g in got])
            for d in getattr(out, "deepstack_features", None) or []]
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == (w.shape[0], width * (1 + len(deep)))
        torch.testing.assert_close(g[:, :width].double(), w, rtol=1e-4, atol=1e-4)
        for j, d in enumerate(deep):  # (DeepStack's rows, in the order of their blocks)
            torch.testing.assert_close(g[:, width * (j + 1) : width * (j + 2)].double(), d[k], rtol=1e-4, atol=1e-4)
    assert len(deep) == (2 if style.startswith("qwen3") else 0)


def expanded(ids, images, processor, vision):
    """The prompt with each <|image_pad|> repeated as its image's tokens, and its images' pixels."""
    pixels = [processor(im) for im in images]
    counts = iter(vision.image_tokens(p) for p in pixels)
    return [t for tok in ids for t in ([tok] * next(counts) if tok == PAD else [tok])], pixels


def test_mrope_positions_match_hf(qwen2_vl):
    """`mrope_positions` over a prompt of two images and text, and past it (decodes), equals
    HF's `get_rope_index` and its `rope_deltas`."""
    import transformers as tf

    from conveyor.models.qwen_vision import mrope_positions
    from conveyor.multimodal import expand_image_tokens

    hf = tf.Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl).eval()
    from conveyor.models.arch import ArchConfig

    v = ArchConfig.from_hf(json.loads((qwen2_vl / "config.json").read_text())).vision
    processor = ImageProcessor.from_folder(qwen2_vl, v)
    pixels = [processor(picture(1, (200, 140))), processor(picture(2, (70, 90)))]
    ids = [1, 5, START, PAD, END, 6, 7, START, PAD, END, 8]
    full, spans = expand_image_tokens(ids, PAD, pixels, [v.image_tokens(p) for p in pixels])
    x = torch.tensor([full])
    grid = torch.tensor([[1, p.values.shape[1] // PATCH, p.values.shape[2] // PATCH] for p in pixels])
    want, delta = hf.model.get_rope_index(x, (x == PAD).int(), image_grid_thw=grid)
    n = len(full)
    got = mrope_positions(torch.arange(n + 5), spans, [v.mrope_grid(p) for p in pixels])
    assert got[:n].tolist() == want[:, 0].T.tolist()
    extra = torch.arange(n, n + 5) + int(delta)  # (what follows the prompt: its index plus the delta)
    assert got[n:].tolist() == extra[:, None].repeat(1, 3).tolist()
    # a chunk from the middle of the first image on: the same rows
    torch.testing.assert_close(mrope_positions(torch.arange(7, 30), spans, [v.mrope_grid(p) for p in pixels]),
                               got[7:30])


def hf_tokens(path, style, prompts, processor, vision):
    dtype = torch.float32 if style.endswith("moe") else torch.float64  # (HF's grouped experts take no float64)
    hf = hf_class(style).from_pretrained(path, dtype=dtype).eval()
    patch = PATCHES[style]
    out = []
    for ids, images in prompts:
        full, pixels = expanded(ids, images, processor, vision)
        x = torch.tensor([full])
        extra = {}
        if pixels:
            extra = {"pixel_values": torch.cat([hf_patches(p.values, patch) for p in pixels]).to(dtype),
                     "image_grid_thw": hf_grid(pixels, patch),
                     "mm_token_type_ids": (x == PAD).int()}
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=PARAMS.max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        out.append(gen[0, x.shape[1]:].tolist())
    return out


PROMPTS = [
    ([1, 40, START, PAD, END, 41, 42, 43], [(0, (200, 140))]),
    ([1, START, PAD, END, 50, 51, START, PAD, END, 52, 53], [(1, (70, 90)), (2, (300, 200))]),  # two images
    ([1, 90, 91, 92, 93], []),  # text only, beside the others
    ([1, 60, 61, 62, 63, 64, 65, START, PAD, END], [(3, (90, 400))]),  # ends with its image
]


def requests():
    return [ImagePrompt(ids, tuple(picture(s, size) for s, size in images)) if images else ids
            for ids, images in PROMPTS]


@pytest.mark.parametrize("style", STYLES)
def test_greedy_matches_hf(style, request):
    """Greedy tokens equal HF's (float64) for prompts with images of several sizes, with the
    whole prompt in one step and in chunks of 16 that cut through images, with the prefix
    cache on (each decode turns by the prompt's M-RoPE delta; Qwen3-VL's DeepStack rows join
    the first layers' outputs in whichever chunk computes them)."""
    path = request.getfixturevalue(style)
    llm = LLM(str(path), dtype="float32", max_num_seqs=4)
    vision = llm.engine.arch.vision
    want = hf_tokens(path, style, [(ids, [picture(s, size) for s, size in images]) for ids, images in PROMPTS],
                     llm.engine.image_processor, vision)
    got = [o.outputs[0].token_ids for o in llm.generate(requests(), PARAMS)]
    assert got == want
    chunked = LLM(str(path), dtype="float32", max_num_seqs=4, prefill_mode="chunked", max_num_batched_tokens=16,
                  enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in chunked.generate(requests(), PARAMS)] == want
    again = chunked.generate(requests()[:1], PARAMS)[0]  # (from the prefix cache: the same positions)
    assert again.outputs[0].token_ids == want[0] and again.num_cached_tokens > 0


def test_chat_places_images(qwen2_vl):
    """`LLM.chat` with an image part: the template's <|vision_start|><|image_pad|><|vision_end|>,
    the pad expanded to the image's tokens; the same tokens as the prompt written by hand."""
    llm = LLM(str(qwen2_vl), dtype="float32")
    image = picture(4, (200, 140))
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                  {"type": "text", "text": "w7 w8"}]}], PARAMS)[0]
    n = llm.engine.arch.vision.image_tokens(llm.engine.image_processor(image))
    assert n == 35 and out.prompt_token_ids.count(PAD) == n
    i = out.prompt_token_ids.index(START)
    assert out.prompt_token_ids[i + n + 1] == END
    ids = out.prompt_token_ids[: i + 2] + out.prompt_token_ids[i + n + 1 :]
    by_hand = llm.generate(ImagePrompt(ids, (image,)), PARAMS)[0]
    assert by_hand.outputs[0].token_ids == out.outputs[0].token_ids


def test_reads_transformers_4_config(tmp_path):
    """Hub configs of transformers 4's form (text keys at the top, `rope_scaling` of type
    "mrope", `in_chans`): Qwen2-VL-2B's and Qwen2.5-VL-3B's shapes; Qwen3-VL-2B's and a
    Qwen3-VL-MoE's."""
    from conveyor.models.arch import ArchConfig, UnsupportedModelError

    text = {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
            "num_attention_heads": 12, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 32768, "tie_word_embeddings": True, "bos_token_id": 151643,
            "eos_token_id": 151645, "image_token_id": 151655, "vision_start_token_id": 151652,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    cfg = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", **text,
           "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                             "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}
    arch = ArchConfig.from_hf(cfg)
    v = arch.vision
    assert arch.family == "qwen2" and arch.attention_bias and arch.tie_word_embeddings and arch.rope_scaling is None
    assert arch.mrope_section == (16, 24, 24) and arch.rope_theta == 1e6 and arch.head_dim == 128
    assert v is not None and v.style == "qwen2_vl" and v.intermediate_size == 5120 and v.window_size == 0
    cfg25 = {**cfg, "architectures": ["Qwen2_5_VLForConditionalGeneration"], "hidden_size": 2048,
             "num_attention_heads": 16, "vision_config": {
                 "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                 "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                 "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "temporal_patch_size": 2}}
    v25 = ArchConfig.from_hf(cfg25).vision
    assert v25 is not None and v25.style == "qwen2_5_vl" and v25.window_size == 112
    assert v25.full_attention_layers == (7, 15, 23, 31) and v25.text_hidden_size == 2048
    # Qwen3-VL-2B-Instruct's shape (transformers 4.57's form): a nested text config whose
    # `rope_scaling` carries the interleaved sections, a tower of 24 blocks with DeepStack.
    cfg3 = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
            "tie_word_embeddings": True, "text_config": {
                "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16,
                "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_theta": 5000000,
                "max_position_embeddings": 262144, "vocab_size": 151936, "model_type": "qwen3_vl_text",
                "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}},
            "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
                              "hidden_size": 1024, "in_channels": 3, "intermediate_size": 4096, "num_heads": 16,
                              "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
                              "spatial_merge_size": 2, "temporal_patch_size": 2}}
    arch3 = ArchConfig.from_hf(cfg3)
    v3 = arch3.vision
    assert arch3.family == "qwen3" and arch3.qk_norm and arch3.mrope_interleaved and arch3.mrope_section == (24, 20, 20)
    assert arch3.rope_scaling is None and arch3.rope_theta == 5e6 and arch3.tie_word_embeddings
    assert v3 is not None and v3.deepstack_layers == (5, 11, 17) and v3.position_embeddings == 2304
    assert v3.patch_size == 16 and v3.intermediate_size == 4096
    moe = ArchConfig.from_hf({**cfg3, "architectures": ["Qwen3VLMoeForConditionalGeneration"],
                              "text_config": {**cfg3["text_config"], "num_experts": 128, "num_experts_per_tok": 8,
                                              "moe_intermediate_size": 768, "decoder_sparse_step": 1}})
    assert moe.family == "qwen3_moe" and moe.num_experts == 128 and moe.norm_topk_prob
    with pytest.raises(UnsupportedModelError, match="deepstack"):
        ArchConfig.from_hf({**cfg3, "vision_config": {**cfg3["vision_config"], "deepstack_visual_indexes": [30]}})
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        ArchConfig.from_hf({**cfg, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 16]}})
    with pytest.raises(UnsupportedModelError, match="output width"):
        ArchConfig.from_hf({**cfg, "vision_config": {**cfg["vision_config"], "hidden_size": 1024}})


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_with_images(qwen2_5_vl, mode):
    """Six prompts with images in a KV cache too small for all at once: a request computed again
    after a preemption takes the same 3D positions (and a swapped one keeps its delta), so each
    gives the tokens it gives alone."""
    prompts = [ImagePrompt([1, 40 + i, START, PAD, END, 50, 51], (picture(20 + i, (120 + 10 * i, 90)),))
               for i in range(6)]
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(qwen2_5_vl), dtype="float64", num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, long, use_tqdm=False)]
    tight = LLM(str(qwen2_5_vl), dtype="float64", num_kv_blocks=12, preemption_mode=mode, num_swap_blocks=64)
    outs = tight.generate(prompts, long, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("style", ["qwen2_vl", "qwen3_vl"])
def test_two_tensor_parallel_ranks_equal_one(style, request):
    """Under tensor parallelism rank 0 encodes the images and sends their embeddings (Qwen3-VL's
    DeepStack rows beside them) and the step's M-RoPE positions: two ranks give one's tokens."""
    path = request.getfixturevalue(style)
    one = LLM(str(path), dtype="float64", num_kv_blocks=128).generate(requests(), PARAMS, use_tqdm=False)
    two = LLM(str(path), dtype="float64", num_kv_blocks=128, tensor_parallel_size=2, num_threads=1)
    assert [o.outputs[0].token_ids for o in two.generate(requests(), PARAMS, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in one]


def test_served_over_http(qwen2_vl, tmp_path):
    """`/v1/chat/completions` with an `image_url` data URL gives `LLM.chat`'s tokens and counts
    the image's tokens (as many as its size makes) in `usage`; `/v1/embeddings` of the same
    messages gives `LLM.embed`'s vector of the rendered prompt with its image; `/tokenize` gives
    the template's tokens, the image as its one placeholder (vLLM's)."""
    import base64
    import io

    import httpx

    from tests.server.conftest import ServerProcess

    image = picture(9, (250, 120))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "w41 w42"}]}]
    from conveyor.llm import chat_prompt

    llm = LLM(str(qwen2_vl), dtype="float64", num_kv_blocks=128)
    want = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    rendered = chat_prompt(llm.engine.tokenizer, messages, add_generation_prompt=False, image_token=llm.engine.image_token)
    vector = llm.embed(rendered, use_tqdm=False)[0]
    del llm
    server = ServerProcess(["--model", str(qwen2_vl), "--dtype", "float64", "--num-kv-blocks", "128"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        with httpx.Client(timeout=60.0) as client:
            r = client.post(server.url + "/v1/chat/completions", json={
                "model": str(qwen2_vl), "messages": messages, "max_tokens": PARAMS.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "logprobs": True})
            assert r.status_code == 200, r.text
            got = r.json()
            r = client.post(server.url + "/v1/embeddings", json={"model": str(qwen2_vl), "messages": messages})
            assert r.status_code == 200, r.text
            embedded = r.json()
            r = client.post(server.url + "/tokenize", json={"model": str(qwen2_vl), "messages": messages,
                                                            "add_generation_prompt": False})
            assert r.status_code == 200, r.text
            tokenized = r.json()
            item = {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                {"type": "input_text", "text": "w41 w42"}]}
            inputs = []
            for kwargs in (None, {"max_pixels": 28 * 28 * 8}):  # (the Responses API's mm_processor_kwargs)
                r = client.post(server.url + "/v1/responses", json={
                    "model": str(qwen2_vl), "input": [item], "max_output_tokens": 2, "store": False,
                    **({"mm_processor_kwargs": kwargs} if kwargs else {})})
                assert r.status_code == 200, r.text
                inputs.append(r.json()["usage"]["input_tokens"])
        assert inputs[0] == len(want.prompt_token_ids) and inputs[1] <= inputs[0] - 40 + 8
        assert embedded["data"][0]["embedding"] == pytest.approx(vector.outputs.embedding, abs=1e-9)
        assert embedded["usage"]["prompt_tokens"] == len(vector.prompt_token_ids) > 40
        assert tokenized["tokens"] == rendered.prompt and tokenized["tokens"].count(PAD) == 1
        names = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "<|vision_start|>": START, "<|vision_end|>": END,
                 "<|image_pad|>": PAD, "<|video_pad|>": VIDEO}
        tokens = [int(e["token"].removeprefix("token_id:")) if e["token"].startswith("token_id:")
                  else names.get(e["token"]) or int(e["token"][1:]) for e in got["choices"][0]["logprobs"]["content"]]
        assert tokens == want.outputs[0].token_ids
        assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids) > 40
    finally:
        server.stop()


def test_decodes_take_the_fused_and_graphed_paths(qwen2_vl, monkeypatch):
    """A decode of a sequence with images turns at its index plus the prompt's delta, the same
    for time, row and column: it runs on the fused native decode (CPU, float32) and on the
    graphed decode's fixed buffers (here eagerly: no CUDA), with HF's tokens."""
    from tests.runner.test_cuda_graphs import graphed

    want = [o.outputs[0].token_ids for o in
            LLM(str(qwen2_vl), dtype="float64", num_kv_blocks=128).generate(requests(), PARAMS, use_tqdm=False)]
    llm = LLM(str(qwen2_vl), dtype="float32", num_kv_blocks=128)
    fused = llm.engine.runner.model.fused_decode
    if fused is None:
        pytest.skip("the native CPU kernels are not built here")
    shifted = []  # decode rows whose rotary position is not their place in the cache
    original = type(fused).__call__

    def counting(self, input_ids, positions, kv_caches, meta, *rest):
        shifted.extend(p != c - 1 for p, c in zip(positions.tolist(), meta.decode_context_lens.tolist(), strict=True))
        return original(self, input_ids, positions, kv_caches, meta, *rest)

    monkeypatch.setattr(type(fused), "__call__", counting)
    assert [o.outputs[0].token_ids for o in llm.generate(requests(), PARAMS, use_tqdm=False)] == want
    assert any(shifted) and not all(shifted)  # (the text-only request turns at its own place)
    graph = LLM(str(qwen2_vl), dtype="float64", num_kv_blocks=128)
    sizes = graphed(graph, max_batch=4, capture=False)
    assert [o.outputs[0].token_ids for o in graph.generate(requests(), PARAMS, use_tqdm=False)] == want
    assert sizes  # (decodes of sequences with images went through the fixed buffers)


def test_qwen3_vl_moe_reads_either_expert_layout(qwen3_vl_moe, tmp_path):
    """Qwen3-VL-MoE's checkpoints keep each layer's experts stacked `[E, in, out]` (transformers 5
    saves them `[E, out, in]`): the same folder with its experts so transposed gives the same
    tokens, HF's."""
    import shutil

    from safetensors.torch import load_file, save_file

    want = [o.outputs[0].token_ids for o in LLM(str(qwen3_vl_moe), dtype="float32").generate(requests(), PARAMS)]
    other = tmp_path / "hub"
    shutil.copytree(qwen3_vl_moe, other)
    tensors = load_file(other / "model.safetensors")
    stacked = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked and tensors[stacked[0]].shape[1] != tensors[stacked[0]].shape[2]
    save_file({k: v.transpose(1, 2).contiguous() if k in stacked else v for k, v in tensors.items()},
              other / "model.safetensors", metadata={"format": "pt"})
    got = [o.outputs[0].token_ids for o in LLM(str(other), dtype="float32").generate(requests(), PARAMS)]
    assert got == want


def test_the_server_counts_an_image_by_its_size(qwen2_vl):
    """The HTTP layer makes a data URL pixels before the engine sees it, so it counts a Qwen
    image's tokens by its size (`ImageToken.count`): the prompt's length it checks against the
    context is the engine's."""
    import asyncio
    import base64
    import io
    from types import SimpleNamespace

    from conveyor.server.protocol import ChatCompletionRequest
    from conveyor.server.serving import ChatCompletionHandler

    llm = LLM(str(qwen2_vl), dtype="float64", num_kv_blocks=128)
    state = SimpleNamespace(engine=llm.engine, loras={}, model_name="m", tool_parser=None,
                            config=SimpleNamespace(reasoning_parser=None))
    image = picture(41, (250, 120))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "w41 w42"}]}]
    handler = ChatCompletionHandler(state, ChatCompletionRequest.model_validate({"messages": messages}))  # type: ignore[arg-type]
    asyncio.run(handler.fetch_images())
    prompt = handler.prompts()[0]
    out = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    assert prompt.num_tokens == len(out.prompt_token_ids) == len(prompt.token_ids) + 35
    assert llm.engine.image_token.count("not pixels") == 1  # (a local file: at least one, until the engine reads it)
