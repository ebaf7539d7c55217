"""LLaVA-OneVision's videos against HF transformers' `LlavaOnevisionForConditionalGeneration` on
the same random weights: each frame read by the SigLIP tower at its square, its features pooled
to half a side (bilinear: 3x3 patches to 2x2 here, the odd side rounded up) and the frames
followed by one newline (`get_video_features`); greedy tokens over prompts with a video, a video
beside an image, and text, whole and in chunks that cut through the video, and from the prefix
cache; a file's frames spread evenly (at most 32), the chat and HTTP forms."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from conveyor import LLM, ImagePrompt, SamplingParams, Video
from conveyor.sampling_params import InvalidRequestError
from conveyor.video import VideoSampling, sample_indices
from tests.conftest import save_image_tokenizer

PIL = pytest.importorskip("PIL.Image")

IMAGE, VIDEO = 383, 382
SIDE, PATCH = 42, 14  # 3x3 patches a frame, pooled to 2x2: 4 tokens a frame
PINS = [[42, 42], [42, 84], [84, 42], [84, 84]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image> "
            "{% elif p['type'] == 'video' %}<video> {% else %}{{ p['text'] }}{% endif %}{% endfor %}"
            "{% endif %} {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    from tests.models.test_llava_onevision import build_tiny_onevision

    out = build_tiny_onevision(tmp_path_factory.mktemp("onevision_video") / "m", SIDE, PINS, seed=29,
                               video_token_index=VIDEO)
    save_image_tokenizer(out, {IMAGE: "<image>", VIDEO: "<video>"}, TEMPLATE)
    (out / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "LlavaOnevisionVideoProcessor", "size": {"height": SIDE, "width": SIDE},
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 3,
    }))
    return out


def frames(seed: int, n: int, size=(60, 45)) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()


def picture(seed: int, size=(70, 50)):
    return PIL.fromarray(frames(seed, 1, size)[0], "RGB")


def test_frames_processing_and_tower_match_hf(onevision):
    """Each frame resized to the tower's square and normalized as an image of that size is
    (HF's video processor does so through torchvision, not installed here); the video's
    embeddings are HF's `get_video_features` (frames x 4 pooled, then the newline)."""
    from transformers import LlavaOnevisionForConditionalGeneration

    llm = LLM(str(onevision), dtype="float64", num_kv_blocks=128)
    processor, v = llm.engine.image_processor, llm.engine.arch.vision
    assert v.reads_videos and v.video_token_id == VIDEO and v.pooled_side == 2
    clip = frames(1, 5)
    pixels = processor.video(Video(clip))
    assert pixels.values.shape == (5, 3, SIDE, SIDE) and pixels.fps
    for k in range(5):  # (the image processor's resize at the tower's square, without tiles)
        one = processor.frames(PIL.fromarray(clip[k]))
        torch.testing.assert_close(pixels.values[k], one.values, rtol=0, atol=0)
    assert v.image_tokens(pixels) == 5 * 4 + 1 == llm.engine.image_token.count(pixels)
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(onevision, dtype=torch.float64).eval()
    with torch.no_grad():
        want = hf.model.get_video_features(pixels.values[None].double(), vision_feature_layer=-1,
                                           vision_feature_select_strategy="full")
    want = want.pooler_output if hasattr(want, "pooler_output") else want
    got = llm.engine.runner.model.vision([pixels])[0]
    torch.testing.assert_close(got, want.reshape(-1, got.shape[-1]), rtol=1e-9, atol=1e-9)


def hf_greedy(hf, llm, prompt) -> list[int]:
    """HF's greedy tokens (10) for `prompt` as conveyor expands it, its images' tiles and its
    video's frames given to HF's model."""
    _, ids, spans = llm.engine.prepare_prompt(prompt)
    x = torch.tensor([ids])
    extra = {}
    images = [s.pixels for s in spans if not s.pixels.fps]
    videos = [s.pixels for s in spans if s.pixels.fps]
    if images:
        extra |= {"pixel_values": torch.stack([p.values for p in images]).double(),
                  "image_sizes": torch.tensor([p.size for p in images])}
    if videos:
        extra["pixel_values_videos"] = torch.stack([p.values for p in videos]).double()
    gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                      eos_token_id=None, pad_token_id=0, **extra)
    return gen[0, x.shape[1]:].tolist()


def test_greedy_tokens_match_hf_with_videos(onevision):
    """A video, a video beside a tiled image, and text: HF's greedy tokens, whole, in chunks of
    7 that cut through the video, and again from the prefix cache."""
    from transformers import LlavaOnevisionForConditionalGeneration

    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(onevision, dtype=torch.float64).eval()
    llm = LLM(str(onevision), dtype="float64", num_kv_blocks=256)
    prompts = [ImagePrompt([1, 40, VIDEO, 41], (Video(frames(2, 6)),)),
               ImagePrompt([1, IMAGE, 50, VIDEO, 51, 52], (picture(3), Video(frames(4, 3)))),
               [1, 70, 71, 72]]
    want = [hf_greedy(hf, llm, p) for p in prompts]
    assert llm.engine.prepare_prompt(prompts[0])[1].count(VIDEO) == 6 * 4 + 1
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    chunked = LLM(str(onevision), dtype="float64", num_kv_blocks=256, prefill_mode="chunked",
                  max_num_batched_tokens=7, enable_prefix_caching=True)
    first = chunked.generate(prompts, PARAMS, use_tqdm=False)
    again = chunked.generate(prompts, PARAMS, use_tqdm=False)  # (from the prefix cache)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again] == want
    assert again[0].num_cached_tokens >= 16


def test_video_files_chat_and_errors(onevision, tmp_path):
    """A file's frames: every one up to 32, else 32 spread evenly (vLLM's loader), or
    `mm_processor_kwargs`' `num_frames`; the chat's video part; clear errors that leave the
    engine serving."""
    from tests.models.test_qwen_video import encode_video, smooth

    assert sample_indices(20, 0.0, VideoSampling(max_frames=32, rule="uniform")) == list(range(20))
    spread = sample_indices(100, 25.0, VideoSampling(max_frames=32, rule="uniform"))
    assert spread == [int(i) for i in np.linspace(0, 99, 32)] and spread[0] == 0 and spread[-1] == 99
    llm = LLM(str(onevision), dtype="float32", num_kv_blocks=256)
    clip = smooth(40)
    data = encode_video(clip, 10.0, tmp_path / "clip.avi")
    pixels = llm.engine.image_processor.video(Video(data))
    assert pixels.values.shape[0] == 32
    ids = [1, 40, VIDEO, 41]
    url = "data:video/x-msvideo;base64," + base64.b64encode(data).decode()
    out = llm.generate(ImagePrompt(ids, (Video(url),)), PARAMS, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(VIDEO) == 32 * 4 + 1
    eight = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": data},
                          "mm_processor_kwargs": {"num_frames": 8}}, PARAMS, use_tqdm=False)[0]
    assert eight.prompt_token_ids.count(VIDEO) == 8 * 4 + 1  # (vLLM's num_frames: 8 spread evenly)
    with pytest.raises(InvalidRequestError, match="'fps' is not an option"):  # (its processor samples by count)
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": data}, "mm_processor_kwargs": {"fps": 1}},
                     PARAMS, use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": [{"type": "video", "video": frames(5, 4)},
                                                  {"type": "text", "text": "w7 w8"}]}], PARAMS, use_tqdm=False)[0]
    assert chat.prompt_token_ids.count(VIDEO) == 4 * 4 + 1
    with pytest.raises(InvalidRequestError, match="1 video tokens for 2 videos"):
        llm.generate(ImagePrompt(ids, (Video(frames(1, 2)), Video(frames(2, 2)))), PARAMS, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        llm.generate(ImagePrompt(ids, (Video(b"not a video"),)), PARAMS, use_tqdm=False)
    assert llm.generate([1, 5, 6], PARAMS, use_tqdm=False)[0].outputs[0].token_ids  # (serving goes on)


def test_video_url_served_over_http(onevision, tmp_path):
    """`/v1/chat/completions` with a `video_url` part: `LLM.chat`'s tokens, the video's tokens
    counted in `usage`."""
    import httpx

    from tests.models.test_qwen_video import encode_video, smooth
    from tests.server.conftest import ServerProcess

    data = encode_video(smooth(12), 6.0, tmp_path / "clip.avi")
    url = "data:video/x-msvideo;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "w41 w42"}]}]
    want = LLM(str(onevision), dtype="float64", num_kv_blocks=128).chat(messages, PARAMS, use_tqdm=False)[0]
    server = ServerProcess(["--model", str(onevision), "--dtype", "float64", "--num-kv-blocks", "128"],
                           tmp_path / "server.log")
    body = {"model": str(onevision), "max_tokens": PARAMS.max_tokens, "temperature": 0.0, "ignore_eos": True}
    try:
        server.wait_ready()
        with httpx.Client(timeout=60.0) as client:
            r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": messages})
            assert r.status_code == 200, r.text
        got = r.json()
        assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids) > 12 * 4
        assert got["choices"][0]["message"]["content"].strip() == want.outputs[0].text.strip()
    finally:
        server.stop()
