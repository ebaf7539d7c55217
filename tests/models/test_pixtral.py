"""Pixtral's vision side (conveyor/models/pixtral_vision.py) against HF transformers on the same
random weights: Mistral 3 (`Mistral3ForConditionalGeneration`: the patches RMS-normed and merged
2x2) and Pixtral-12B's LLaVA form (`LlavaForConditionalGeneration` over a Pixtral tower): the
image processing, the span's tokens (rows of `[IMG]`, each ending with `[IMG_BREAK]`, the last
with `[IMG_END]`), the tower's embeddings, and greedy tokens whole and in chunks."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.multimodal import ImagePrompt, pixtral_size
from tests.conftest import TINY, save_image_tokenizer

PIL = pytest.importorskip("PIL.Image")

IMG, BREAK, END = 10, 12, 13
LONGEST = 112
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}[IMG] "
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
STYLES = {"mistral3": 14, "pixtral_llava": 16}  # each form's patch (Mistral 3 merges 2x2: 28-pixel tokens)


def build_tiny(out_dir, form: str = "mistral3", seed: int = 3):
    """A random-weight Mistral 3 (a Pixtral tower of 3 layers, 14-pixel patches merged 2x2) or a
    Pixtral-12B-form LLaVA (16-pixel patches, LLaVA's projector) over conftest's TINY Mistral, a
    word-level tokenizer with `[IMG]` (10), `[IMG_BREAK]` (12) and `[IMG_END]` (13), and a
    `preprocessor_config.json` whose `longest_edge` is 112 pixels."""
    import transformers as tf

    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=2, patch_size=STYLES[form], image_size=LONGEST, hidden_act="silu")
    text = {**TINY, "model_type": "mistral", "sliding_window": None}
    if form == "mistral3":
        config = tf.Mistral3Config(text_config=text, vision_config=vision, image_token_index=IMG,
                                   spatial_merge_size=2, vision_feature_layer=-1, tie_word_embeddings=False)
        cls = tf.Mistral3ForConditionalGeneration
    else:
        config = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMG,
                                vision_feature_layer=-1, vision_feature_select_strategy="full")
        cls = tf.LlavaForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # (HF starts norms at one: make them matter; the projection's output small)
        for name, p in model.named_parameters():
            if "vision_tower" in name or "projector" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
            if "linear_2" in name:
                p.normal_(0, 0.02)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_image_tokenizer(out_dir, {IMG: "[IMG]", BREAK: "[IMG_BREAK]", END: "[IMG_END]"}, TEMPLATE)
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": LONGEST},
        "patch_size": {"height": STYLES[form], "width": STYLES[form]}, "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }))
    return out_dir


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("mistral3") / "m")


@pytest.fixture(scope="module")
def pixtral_llava(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("pixtral") / "m", "pixtral_llava", seed=4)


def picture(seed: int, size):
    """A random RGB picture of `size` (width, height)."""
    g = torch.Generator().manual_seed(seed)
    return PIL.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


SIZES = [(70, 90), (200, 140), (56, 56), (30, 41), (90, 40)]


def side_of(form: str) -> int:
    return STYLES[form] * (2 if form == "mistral3" else 1)


@pytest.mark.parametrize("form", list(STYLES))
def test_image_processing_and_the_span(form, request):
    """HF's Pixtral image processor (PIL backend; its patch the model's patch x merge, as HF's
    processor passes it): scaled into `longest_edge`, sides up to whole tokens; and the span's
    tokens as HF's processor writes them."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    path = request.getfixturevalue(form)
    llm = LLM(str(path), dtype="float32")
    v, ours = llm.engine.arch.vision, llm.engine.image_processor
    side = side_of(form)
    theirs = PixtralImageProcessorPil(size={"longest_edge": LONGEST}, patch_size={"height": side, "width": side})
    for i, size in enumerate(SIZES):
        image = picture(i, size)
        got = ours(image)
        h, w = pixtral_size(size[1], size[0], LONGEST, side)
        assert got.values.shape == (3, h, w) and h <= LONGEST + side and w <= LONGEST + side
        want = theirs(image, return_tensors="pt")
        assert want["image_sizes"][0].tolist() == [h, w]
        torch.testing.assert_close(got.values, want["pixel_values"][0, :, :h, :w], rtol=0, atol=1e-6)
        rows, cols = h // side, w // side
        layout = v.image_layout(got)
        assert len(layout) == v.image_tokens(got) == rows * (cols + 1) == llm.engine.image_token.count(got)
        assert layout[cols] == (BREAK if rows > 1 else END) and layout[-1] == END and layout.count(IMG) == rows * cols


def hf_model(path, form):
    import transformers as tf

    cls = tf.Mistral3ForConditionalGeneration if form == "mistral3" else tf.LlavaForConditionalGeneration
    return cls.from_pretrained(path, dtype=torch.float64).eval()


def hf_inputs(pixels):
    """HF's batch of images: padded to the largest at the bottom and right, with their sizes."""
    h = max(p.values.shape[1] for p in pixels)
    w = max(p.values.shape[2] for p in pixels)
    batch = torch.zeros(len(pixels), 3, h, w, dtype=torch.float64)
    for i, p in enumerate(pixels):
        batch[i, :, : p.values.shape[1], : p.values.shape[2]] = p.values
    return batch, torch.tensor([list(p.values.shape[1:]) for p in pixels])


@pytest.mark.parametrize("form", list(STYLES))
def test_the_tower_matches_hf(form, request):
    """The embeddings of images of several sizes in one call equal HF's `get_image_features` at
    the `[IMG]` places; the break and end places hold those tokens' own embeddings."""
    path = request.getfixturevalue(form)
    hf = hf_model(path, form)
    llm = LLM(str(path), dtype="float32")
    pixels = [llm.engine.image_processor(picture(i, size)) for i, size in enumerate(SIZES[:4])]
    got = llm.engine.runner.model.vision(pixels)
    batch, sizes = hf_inputs(pixels)
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=batch, image_sizes=sizes,
                                          vision_feature_layer=-1, **({} if form == "mistral3" else
                                                                      {"vision_feature_select_strategy": "full"}))
    want = out.pooler_output if hasattr(out, "pooler_output") else out
    table = hf.get_input_embeddings().weight
    for g, w, p in zip(got, want, pixels, strict=True):
        layout = torch.tensor(llm.engine.arch.vision.image_layout(p))
        w = w.reshape(-1, w.shape[-1])
        torch.testing.assert_close(g[layout == IMG].double(), w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(g[layout != IMG].double(), table[layout[layout != IMG]], rtol=1e-6, atol=1e-6)


PROMPTS = [
    ([1, 40, IMG, 41, 42, 43], [(0, (200, 140))]),
    ([1, IMG, 50, 51, IMG, 52, 53], [(1, (70, 90)), (2, (90, 40))]),  # two images
    ([1, 90, 91, 92, 93], []),  # text only, beside the others
]


def requests():
    return [ImagePrompt(ids, tuple(picture(s, size) for s, size in images)) if images else ids
            for ids, images in PROMPTS]


@pytest.mark.parametrize("form", list(STYLES))
def test_greedy_matches_hf(form, request):
    """Greedy tokens equal HF's (float64) with the prompt whole and in chunks of 8 through the
    images' rows and breaks, with the prefix cache on."""
    path = request.getfixturevalue(form)
    hf = hf_model(path, form)
    llm = LLM(str(path), dtype="float32", max_num_seqs=4)
    v = llm.engine.arch.vision
    want = []
    for ids, images in PROMPTS:
        pixels = [llm.engine.image_processor(picture(s, size)) for s, size in images]
        layouts = iter(v.image_layout(p) for p in pixels)
        full = [t for tok in ids for t in (next(layouts) if tok == IMG else [tok])]
        x = torch.tensor([full])
        extra = {}
        if pixels:
            batch, sizes = hf_inputs(pixels)
            extra = {"pixel_values": batch, "image_sizes": sizes}
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=PARAMS.max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        want.append(gen[0, x.shape[1]:].tolist())
    outs = llm.generate(requests(), PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[0].prompt_token_ids.count(END) == 1 and outs[1].prompt_token_ids.count(END) == 2
    chunked = LLM(str(path), dtype="float32", max_num_seqs=4, prefill_mode="chunked", max_num_batched_tokens=8,
                  enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in chunked.generate(requests(), PARAMS, use_tqdm=False)] == want
    again = chunked.generate(requests()[:1], PARAMS, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want[0] and again.num_cached_tokens > 0


def test_chat_and_the_config(mistral3):
    """`LLM.chat` with an image part places `[IMG]` and expands it to the image's rows; a Hub
    config of Mistral Small 3.1's shape reads."""
    from conveyor.models.arch import ArchConfig

    llm = LLM(str(mistral3), dtype="float32")
    image = picture(5, (200, 140))
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                  {"type": "text", "text": "w7 w8"}]}], PARAMS, use_tqdm=False)[0]
    pixels = llm.engine.image_processor(image)
    # (200x140 scaled into 112 pixels: 112x78, then 112x84: 3 rows of 4 tokens of 28 pixels)
    assert out.prompt_token_ids.count(IMG) == 3 * 4 and out.prompt_token_ids.count(BREAK) == 2
    assert llm.engine.arch.vision.image_tokens(pixels) == 3 * 5 and pixels.values.shape[1:] == (84, 112)
    cfg = {"architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10,
           "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
           "vision_feature_layer": -1,
           "text_config": {"head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768, "model_type": "mistral",
                           "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
                           "rms_norm_eps": 1e-5, "rope_theta": 1000000000.0, "sliding_window": None,
                           "vocab_size": 131072, "max_position_embeddings": 131072},
           "vision_config": {"head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
                             "intermediate_size": 4096, "model_type": "pixtral", "num_attention_heads": 16,
                             "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0}}
    arch = ArchConfig.from_hf(cfg)
    v = arch.vision
    assert arch.family == "mistral" and arch.head_dim == 128 and arch.sliding_window is None
    assert v is not None and v.style == "pixtral" and v.merge_size == 2 and v.feature_layers == (24,)
    assert v.projector_eps == 1e-5 and not v.projector_bias and v.patch_size * v.merge_size == 28


def test_two_tensor_parallel_ranks_equal_one(mistral3):
    """Under tensor parallelism rank 0 encodes the images (their spans' break and end rows
    taken from its embedding table) and sends the embeddings: two ranks give one's tokens."""
    one = LLM(str(mistral3), dtype="float64", num_kv_blocks=128).generate(requests(), PARAMS, use_tqdm=False)
    two = LLM(str(mistral3), dtype="float64", num_kv_blocks=128, tensor_parallel_size=2, num_threads=1)
    assert [o.outputs[0].token_ids for o in two.generate(requests(), PARAMS, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in one]
