"""Gemma 3's images (conveyor/models/vision.py, `open_ranges` in conveyor/models/attention.py)
against HF transformers' `Gemma3ForConditionalGeneration` on the same random weights: the
pooled SigLIP features, each image's tokens seeing each other both ways (in the sliding layers
within the window, as HF masks them), the begin/end-of-image frame around them, and chunks that
never end inside an image."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import LLM, ImagePrompt, SamplingParams
from conveyor.sampling_params import InvalidRequestError
from tests.conftest import TINY, triton_interpreted
from tests.models.test_gemma import GEMMA3_ROPE, SHAPE

PIL = pytest.importorskip("PIL.Image")

GAP, BOI, EOI, IMAGE = 380, 381, 382, 383  # "\n\n", <start_of_image>, <end_of_image>, <image_soft_token>
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}{{ '<start_of_image>' }}"
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}"
            "{% if add_generation_prompt %}model: {% endif %}")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A random-weight Gemma 3 with a SigLIP tower of 56-pixel images in 14-pixel patches (a
    4x4 grid) kept whole (`mm_tokens_per_image=16`: 16 image tokens, more than the sliding
    window of 6), a word-level tokenizer with its four image tokens and a chat template."""
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("gemma3v") / "m"
    text = tf.Gemma3TextConfig(**{**TINY, **SHAPE, "sliding_window_pattern": 2, "rope_parameters": GEMMA3_ROPE})
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=56, patch_size=14)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=16,
                             boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE)
    torch.manual_seed(12)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.normal_(0, 0.3)
            elif "vision_tower" in name or "projector" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, GAP)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken("\n\n", normalized=False)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<start_of_image>", "<end_of_image>",
                                                                  "<image_soft_token>")])
    assert [tok.token_to_id(t) for t in ("\n\n", "<start_of_image>", "<end_of_image>", "<image_soft_token>")] == [
        GAP, BOI, EOI, IMAGE]
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>", chat_template=TEMPLATE).save_pretrained(out)
    return out


def picture(seed: int, size=(64, 48)):
    g = torch.Generator().manual_seed(seed)
    return PIL.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


PROMPTS = [
    ([1, 40, BOI, 41, 42], [0]),
    ([1, BOI, 50, 51, 52, BOI, 53], [1, 2]),
    ([1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, BOI, 71], [3]),
    ([1, 90, 91, 92, 93, 94, 95, 96], []),
]


def requests():
    return [ImagePrompt(ids, tuple(picture(s) for s in seeds)) if seeds else ids for ids, seeds in PROMPTS]


def logprobs(out):
    """The log-probability of each output token."""
    return [lp.logprob for lp in out.outputs[0].logprobs]


def hf_tokens(path, llm):
    """HF's greedy tokens and their log-probabilities for the prompts as conveyor expands them
    (its `token_type_ids`: the image tokens, which HF masks both ways)."""
    from transformers import Gemma3ForConditionalGeneration

    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
    out = []
    for prompt in requests():
        _, ids, _ = llm.engine.prepare_prompt(prompt)
        x = torch.tensor([ids])
        extra = {}
        if isinstance(prompt, ImagePrompt):
            extra = {"pixel_values": torch.stack([llm.engine.image_processor(im).values for im in prompt.images]).double(),
                     "token_type_ids": (x == IMAGE).long()}
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                          **extra)
        tokens = gen.sequences[0, x.shape[1]:].tolist()
        lps = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(gen.logits, tokens, strict=True)]
        out.append((tokens, lps))
    return out


@pytest.mark.parametrize("options", [
    {},
    {"prefill_mode": "chunked", "max_num_batched_tokens": 20, "enable_prefix_caching": True},
    {"hybrid_kv_cache": True},
])
def test_greedy_tokens_match_hf(gemma3, options):
    """Prompts of one and two images and one of text, batched together: HF's greedy tokens whole,
    in chunks of 20 (cut before each image, which runs whole), and with the hybrid KV cache."""
    llm = LLM(str(gemma3), dtype="float64", num_kv_blocks=128, **options)
    want = hf_tokens(gemma3, llm)
    runs = [llm.generate(requests(), PARAMS, use_tqdm=False)]
    if options.get("enable_prefix_caching"):  # again, from the cache (a hit may end inside an image)
        runs.append(llm.generate(requests(), PARAMS, use_tqdm=False))
        assert any(o.num_cached_tokens for o in runs[-1])
    for outs in runs:
        for out, (tokens, lps) in zip(outs, want, strict=True):
            assert out.outputs[0].token_ids == tokens
            assert logprobs(out) == pytest.approx(lps, abs=1e-5)  # (float32 logprobs)


def test_the_frame_around_an_image_and_the_both_way_mask(gemma3):
    """Each `<start_of_image>` becomes "\\n\\n", itself, 16 image tokens, `<end_of_image>`,
    "\\n\\n" (HF's processor's sequence), and without the both-way mask the tokens differ (the
    test above could not pass on a causal mask)."""
    llm = LLM(str(gemma3), dtype="float64", num_kv_blocks=128)
    _, ids, spans = llm.engine.prepare_prompt(ImagePrompt([1, 40, BOI, 41], (picture(0),)))
    assert ids == [1, 40, GAP, BOI, *[IMAGE] * 16, EOI, GAP, 41]
    assert [(s.offset, s.length, s.bidirectional) for s in spans] == [(4, 16, True)]
    assert llm.engine.image_token.per_image == 20
    from conveyor.models import attention

    causal = LLM(str(gemma3), dtype="float64", num_kv_blocks=128)
    keep = attention.open_ranges
    try:
        attention.open_ranges = lambda meta, ranges: None  # type: ignore[assignment]
        import conveyor.runner.model_runner as mr

        mr.open_ranges = attention.open_ranges
        plain = causal.generate(requests(), PARAMS, use_tqdm=False)
    finally:
        attention.open_ranges = keep
        mr.open_ranges = keep
    both = llm.generate(requests(), PARAMS, use_tqdm=False)
    gaps = [abs(a - b) for p, o in zip(plain[:3], both[:3], strict=True)
            for a, b in zip(logprobs(p), logprobs(o), strict=False)]
    assert max(gaps) > 1e-3  # (the text-only prompt is the same either way)
    assert logprobs(plain[3]) == pytest.approx(logprobs(both[3]), abs=1e-6)


def test_chat_and_refusals(gemma3):
    """A chat's image part renders as `<start_of_image>` by the template and gives the same
    tokens as the prompt written out; a chunk budget smaller than an image is refused."""
    llm = LLM(str(gemma3), dtype="float64", num_kv_blocks=128)
    image = picture(4)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "w41 w42"}]}]
    chat = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    written = llm.generate([ImagePrompt("user: <start_of_image>w41 w42 model: ", (image,))], PARAMS,
                           use_tqdm=False)[0]
    assert chat.prompt_token_ids == written.prompt_token_ids
    assert chat.outputs[0].token_ids == written.outputs[0].token_ids
    small = LLM(str(gemma3), dtype="float64", num_kv_blocks=128, prefill_mode="chunked", max_num_batched_tokens=8)
    with pytest.raises(InvalidRequestError, match="16 tokens that a step computes together"):
        small.generate([ImagePrompt([1, BOI], (image,))], PARAMS, use_tqdm=False)
    cfg = json.loads((gemma3 / "config.json").read_text())
    assert cfg["mm_tokens_per_image"] == 16


@pytest.mark.skipif(not triton_interpreted() and not torch.cuda.is_available(),
                    reason="the model on CPU tensors through Triton's interpreter")
def test_triton_backend_masks_images_both_ways(gemma3):
    """On the Triton attention backend (here through its interpreter), a span with image rows is
    computed again under its mask, as a token tree's is: the torch backend's tokens and
    log-probabilities in float32."""
    want = LLM(str(gemma3), dtype="float32", num_kv_blocks=64, enforce_eager=True).generate(requests(), PARAMS,
                                                                                            use_tqdm=False)
    llm = LLM(str(gemma3), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    llm.engine.runner.model._use_triton_attention(torch.float32)
    got = llm.generate(requests(), PARAMS, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-4)


def test_a_hub_config():
    """gemma-3-4b-it's config: a SigLIP tower of 27 layers on 896-pixel images in 14-pixel
    patches (64x64), pooled 4x4 to 256 tokens an image."""
    from conveyor.models.arch import ArchConfig
    from conveyor.models.vision import LlavaVision

    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
           "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    v = ArchConfig.from_hf(hub).vision
    assert v is not None and v.tokens_per_image == 256 and v.bidirectional and v.placeholder_id == 255999
    with torch.device("meta"):
        module = LlavaVision(v)
    assert len(module.vision_tower.vision_model.encoder.layers) == 27 and module.multi_modal_projector.pool == 4


def test_two_tensor_parallel_ranks_equal_one(gemma3):
    """Rank 0's image embeddings and both-way ranges reach the other rank with the step."""
    one = LLM(str(gemma3), dtype="float64", num_kv_blocks=128).generate(requests(), PARAMS, use_tqdm=False)
    two = LLM(str(gemma3), dtype="float64", num_kv_blocks=128, tensor_parallel_size=2, num_threads=1)
    for a, b in zip(two.generate(requests(), PARAMS, use_tqdm=False), one, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-6)


PAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}  # (the pictures here are small)


def test_pan_and_scan_crops_match_hf(gemma3):
    """`do_pan_and_scan` (an `mm_processor_kwargs` option, or the folder's): a wide or tall
    picture is also read as crops across its long side, HF's `Gemma3ImageProcessor` crops and
    pixels to 1e-6; a near-square one gets none; the option off, none."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    llm = LLM(str(gemma3), dtype="float64", num_kv_blocks=128)
    theirs = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, resample=2, image_mean=[0.5] * 3,
                                     image_std=[0.5] * 3, pan_and_scan_max_num_crops=4,
                                     pan_and_scan_min_ratio_to_activate=1.2, **PAN)  # (Gemma3Processor's defaults)
    processor = llm.engine.image_processor
    assert processor.pan_and_scan is False and processor.crops(picture(0, (200, 50))) == []
    on = processor.overridden(PAN)
    for seed, size, want_crops in [(0, (200, 50), 4), (1, (50, 130), 3), (2, (80, 75), 0), (3, (250, 40), 4), (4, (90, 70), 2)]:
        image = picture(seed, size)
        crops = on.crops(image)
        want = theirs(image, return_tensors="np")
        assert len(crops) == want["num_crops"][0] == want_crops
        ours = torch.stack([on(image).values, *(on(c).values for c in crops)])
        torch.testing.assert_close(ours, torch.from_numpy(want["pixel_values"]), rtol=0, atol=1e-6)
    for bad, match in [({"do_pan_and_scan": 1}, "true or false"), ({"pan_and_scan_max_num_crops": 1.5}, "whole"),
                       ({"min_pixels": 10}, "not an option")]:
        with pytest.raises(InvalidRequestError, match=match):
            processor.overridden(bad)


def test_pan_and_scan_greedy_tokens_match_hf(gemma3):
    """A prompt whose picture has crops is written as HF's processor writes it ("Here is the
    original image" and the image, "and here are some crops to help you see better" and each
    crop, every one framed as an image), and HF's model given the picture and its crops gives
    the same greedy tokens; from the request's `mm_processor_kwargs` and the engine's alike."""
    from transformers import Gemma3ForConditionalGeneration

    hf = Gemma3ForConditionalGeneration.from_pretrained(gemma3, dtype=torch.float64, attn_implementation="eager").eval()
    llm = LLM(str(gemma3), dtype="float64", num_kv_blocks=256)
    image = picture(5, (180, 60))  # 3 crops
    prompt = {"prompt_token_ids": [1, 40, BOI, 41], "multi_modal_data": {"image": image}, "mm_processor_kwargs": PAN}
    _, ids, spans = llm.engine.prepare_prompt(prompt)
    sequence = "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n"  # (HF's full_image_sequence)
    hf_text = (f"Here is the original image {sequence} and here are some crops to help you see better "
               + " ".join([sequence] * 3))
    assert ids == [1, 40, *llm.tokenizer.encode(hf_text, add_special_tokens=False), 41]
    assert len(spans) == 4 and all(s.length == 16 and s.bidirectional for s in spans)
    x = torch.tensor([ids])
    gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                      eos_token_id=None, pad_token_id=0, token_type_ids=(x == IMAGE).long(),
                      pixel_values=torch.stack([s.pixels.values for s in spans]).double())
    want = gen[0, x.shape[1]:].tolist()
    assert llm.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == want
    engine_wide = LLM(str(gemma3), dtype="float64", num_kv_blocks=256, mm_processor_kwargs=PAN)
    got = engine_wide.generate(ImagePrompt([1, 40, BOI, 41], (image,)), PARAMS, use_tqdm=False)[0]
    assert got.prompt_token_ids == llm.generate(prompt, PARAMS, use_tqdm=False)[0].prompt_token_ids
    assert got.outputs[0].token_ids == want
    plain = llm.generate(ImagePrompt([1, 40, BOI, 41], (image,)), PARAMS, use_tqdm=False)[0]  # (off: no crops)
    assert plain.prompt_token_ids.count(BOI) == 1


def test_pan_and_scan_over_the_chat_api(gemma3):
    """With pan and scan on, the server's front end fetches a data URL's picture but leaves it
    whole for the engine, which crops it: the chat API's prompt is `LLM.chat`'s."""
    import asyncio
    import base64
    import io
    from types import SimpleNamespace

    from conveyor.server.protocol import ChatCompletionRequest
    from conveyor.server.serving import ChatCompletionHandler

    llm = LLM(str(gemma3), dtype="float64", num_kv_blocks=256, mm_processor_kwargs=PAN)
    image = picture(6, (160, 50))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "w41"}]}]
    state = SimpleNamespace(engine=llm.engine, loras={}, model_name="m", tool_parser=None,
                            config=SimpleNamespace(reasoning_parser=None))
    handler = ChatCompletionHandler(state, ChatCompletionRequest.model_validate({"messages": messages}))
    asyncio.run(handler.fetch_images())
    prompt = handler.prompts()[0]
    assert prompt.images == (buf.getvalue(),)  # (fetched, not yet pixels)
    _, ids, spans = llm.engine.prepare_prompt(prompt.engine_prompt)
    assert len(spans) == 4 and ids == llm.chat(messages, PARAMS, use_tqdm=False)[0].prompt_token_ids
