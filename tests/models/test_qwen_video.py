"""Videos for Qwen2-VL and Qwen2.5-VL (conveyor/video.py, `ImageProcessor.video`, the tower's frame
groups, M-RoPE's time positions) against HF transformers on the same random weights: the
tower's embeddings of videos beside images (`get_video_features`), the 3D positions of prompts
with videos (`get_rope_index`, and Qwen's own rule where transformers 5 departs from it), greedy
tokens over prompts with videos, images and text, whole and in chunks that cut through a
video; the frames a file gives (HF's `sample_frames` rule), and the chat and HTTP forms."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from conveyor import LLM
from conveyor.multimodal import ImagePrompt
from conveyor.sampling_params import InvalidRequestError
from conveyor.video import Video, VideoSampling, sample_indices
from tests.models.test_qwen2_vl import (
    END,
    MERGE,
    PAD,
    PARAMS,
    PATCH,
    START,
    VIDEO,
    VIDEO_MAX,
    hf_class,
    picture,
)

pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    from tests.models.test_qwen2_vl import build_tiny_qwen_vl

    return build_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_vl_video") / "m")


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    from tests.models.test_qwen2_vl import build_tiny_qwen_vl

    return build_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl_video") / "m", "qwen2_5_vl", seed=6)


def frames(seed: int, n: int, size=(100, 75)) -> np.ndarray:
    """`n` random RGB frames of `size` (width, height): `[n, height, width, 3]` uint8."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    from tests.models.test_qwen2_vl import QWEN3_SEED, build_tiny_qwen_vl

    return build_tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_vl_video") / "m", "qwen3_vl", seed=QWEN3_SEED)


def hf_video_patches(values: torch.Tensor, patch: int = PATCH, t: int = 2) -> torch.Tensor:
    """Our video `[T, C, H, W]` in HF's patch layout `[T/t * patches, C * t * patch * patch]`."""
    n, c, h, w = values.shape
    gh, gw = h // patch, w // patch
    x = values.reshape(n // t, t, c, gh // MERGE, MERGE, patch, gw // MERGE, MERGE, patch)
    return x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(n // t * gh * gw, c * t * patch * patch)


def grid_thw(p, patch: int = PATCH) -> list[int]:
    t = p.values.shape[0] // 2 if p.fps else 1
    return [t, p.values.shape[-2] // patch, p.values.shape[-1] // patch]


def test_video_processing(qwen2_vl):
    """A video's frames: one size for all (`smart_resize` of the first within the video's
    bounds), each frame as the image processor makes a picture of that size, the last repeated
    to an even count; the whole video's cap lowers each frame's most when there are many frames."""
    from PIL import Image

    from conveyor.multimodal import smart_resize

    llm = LLM(str(qwen2_vl), dtype="float32")
    processor, vision = llm.engine.image_processor, llm.engine.arch.vision
    clip = frames(0, 5, (300, 200))
    got = processor.video(Video(clip, fps=3.0))
    h, w = smart_resize(200, 300, 28, 56 * 56, VIDEO_MAX)
    assert got.values.shape == (6, 3, h, w) and got.fps == 3.0 and got.size == (200, 300)
    torch.testing.assert_close(got.values[5], got.values[4])  # (the last frame, repeated)
    for k in (0, 4):  # each frame as a picture resized to (h, w)
        still = processor(Image.fromarray(clip[k]).resize((w, h), resample=3))
        torch.testing.assert_close(got.values[k], still.values, rtol=0, atol=1e-6)
    assert vision.image_tokens(got) == 3 * (h // 28) * (w // 28) <= 3 * 12
    assert vision.time_positions(got) == [0, 1, 2]  # (Qwen2-VL: one a frame group)
    # A video of many frames: each frame's most is its share of 90% of max_video_tokens.
    capped = processor.__class__(**{**processor.__dict__, "max_video_tokens": 40, "video_max_pixels": 28 * 28 * 40})
    many = capped.video(Video(frames(1, 8, (300, 200))))
    share = max(int(40 * 28 * 28 * 0.9) * 2 // 8, int(56 * 56 * 1.05))
    assert many.values.shape[-2:] == smart_resize(200, 300, 28, 56 * 56, share)
    with pytest.raises(InvalidRequestError, match="one size"):
        processor.video(Video([clip[0], clip[1][:50]]))
    with pytest.raises(InvalidRequestError, match="fps"):
        Video(clip, fps=0)
    with pytest.raises(InvalidRequestError, match=r"\[frames, height, width, 3\]"):
        processor.video(Video(clip[0]))


def test_sample_indices_follow_hf_rule():
    """A file's frames: `fps` a second, at least `min_frames`, at most `max_frames` and the
    file's, an even count, spread evenly (HF's `Qwen2VLVideoProcessor.sample_frames` with `fps`)."""
    s = VideoSampling(fps=2.0, min_frames=4, max_frames=768)
    assert sample_indices(300, 30.0, s) == [int(i * 15) for i in range(20)]  # 10 s at 2 a second
    assert sample_indices(95, 30.0, s) == [int(i * 95 / 6) for i in range(6)]  # 6.33 -> 6
    assert sample_indices(10, 30.0, s) == [0, 2, 5, 7]  # (at least 4)
    assert sample_indices(5, 30.0, s) == [0, 1, 2, 3]  # (at least 4, an even count)
    assert len(sample_indices(30_000, 30.0, VideoSampling(max_frames=16))) == 16
    # Qwen3-VL's: int(seconds x fps) frames from the first to the last, any count (numpy's rounding)
    q3 = VideoSampling(fps=2.0, rule="qwen3")
    assert sample_indices(95, 30.0, q3) == [0, 19, 38, 56, 75, 94]  # int(6.33) = 6 over [0, 94]
    assert sample_indices(200, 30.0, q3) == np.linspace(0, 199, 13).round().astype(int).tolist()
    assert sample_indices(10, 30.0, q3) == [0, 3, 6, 9] and sample_indices(3, 30.0, q3) == [0, 1, 2]
    with pytest.raises(InvalidRequestError, match="fewer than"):
        sample_indices(1, 30.0, s)


@pytest.mark.parametrize("style", ["qwen2_vl", "qwen2_5_vl"])
def test_tower_embeds_videos_as_hf(style, request):
    """A video's embeddings (each frame group read as one, Qwen2.5-VL's windows within each
    frame group) beside an image's in one call equal HF's `get_video_features` and
    `get_image_features`."""
    path = request.getfixturevalue(style)
    hf = hf_class(style).from_pretrained(path, dtype=torch.float64).eval()
    llm = LLM(str(path), dtype="float32")
    processor = llm.engine.image_processor
    video, image = processor.video(Video(frames(2, 6, (160, 120)))), processor(picture(3, (200, 140)))
    got = llm.engine.runner.model.vision([image, video])
    with torch.no_grad():
        want_video = hf.model.get_video_features(hf_video_patches(video.values).double(),
                                                 torch.tensor([grid_thw(video)])).pooler_output
        from tests.models.test_qwen2_vl import hf_patches

        want_image = hf.model.get_image_features(hf_patches(image.values).double(),
                                                 torch.tensor([grid_thw(image)])).pooler_output
    want_video = torch.cat(list(want_video)) if isinstance(want_video, tuple | list) else want_video
    want_image = torch.cat(list(want_image)) if isinstance(want_image, tuple | list) else want_image
    assert got[1].shape[0] == 3 * (video.values.shape[-2] // 28) * (video.values.shape[-1] // 28)
    torch.testing.assert_close(got[1].double(), want_video, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0].double(), want_image, rtol=1e-4, atol=1e-4)


def qwen_rule(ids: list[int], grids: list[tuple[list[int], int, int]]) -> list[list[int]]:
    """Qwen's own rope index (transformers 4's `get_rope_index`, vLLM's): each text run from one
    past the largest position so far; a span's tokens at its first position plus its frame
    group's time, row and column."""
    out: list[list[int]] = []
    spans = iter(grids)
    i = 0
    nxt = 0
    while i < len(ids):
        if ids[i] in (PAD, VIDEO):
            times, h, w = next(spans)
            for t in times:
                out.extend([nxt + t, nxt + r, nxt + c] for r in range(h) for c in range(w))
            i += len(times) * h * w
            nxt = max(max(p) for p in out) + 1
        else:
            out.append([nxt] * 3)
            nxt += 1
            i += 1
    return out


def test_mrope_positions_of_videos(qwen2_5_vl):
    """A prompt with an image and videos: HF's `get_rope_index` (with `second_per_grid_ts`)
    where Qwen's rule and transformers 5's agree (a video's last time before its larger side),
    and Qwen's rule where they part (transformers 5 goes on from the larger side after a
    video, into the video's own times; its decode delta then jumps); past the prompt, each
    row's index plus the delta."""
    import transformers as tf

    from conveyor.models.qwen_vision import mrope_positions
    from conveyor.multimodal import expand_image_tokens

    hf = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl).eval()
    llm = LLM(str(qwen2_5_vl), dtype="float32")
    processor, v = llm.engine.image_processor, llm.engine.arch.vision
    assert v.tokens_per_second == 4  # (HF's default: the tiny config names none)
    image = processor(picture(1, (200, 140)))
    for fps, agree in ((16.0, True), (2.0, False)):  # time a group: 4 * 2 / fps positions
        video = processor.video(Video(frames(4, 6, (160, 120)), fps=fps))
        pixels = [image, video]
        ids = [1, 5, START, PAD, END, 6, START, PAD, END, 7, 8]  # (the video's placeholder, as the engine makes it)
        full, spans = expand_image_tokens(ids, PAD, pixels, [v.image_tokens(p) for p in pixels],
                                          layouts=[None, [VIDEO] * v.image_tokens(video)])
        grids = [v.mrope_grid(p) for p in pixels]
        assert grids[1][0] == [int(k * 8 / fps) for k in range(3)]
        n = len(full)
        got = mrope_positions(torch.arange(n + 3), spans, grids)
        assert got[:n].tolist() == qwen_rule(full, grids)
        x = torch.tensor([full])
        want, delta = hf.model.get_rope_index(x, (x == PAD).int() + 2 * (x == VIDEO).int(),
                                              image_grid_thw=torch.tensor([grid_thw(image)]),
                                              video_grid_thw=torch.tensor([grid_thw(video)]),
                                              second_per_grid_ts=torch.tensor([2 / fps]))
        assert (got[:n].tolist() == want[:, 0].T.tolist()) == agree
        if agree:
            assert got[n:].tolist() == [[p + int(delta)] * 3 for p in range(n, n + 3)]
        # a chunk from the middle of the video on: the same rows
        assert spans[1].offset < 45 < spans[1].end
        assert mrope_positions(torch.arange(45, n), spans, grids).tolist() == got[45:n].tolist()


def video_prompts():
    """Prompts with videos (given as frames at 16 a second: time positions that both rules
    place alike), an image, and text only, beside each other."""
    return [
        ImagePrompt([1, 40, START, VIDEO, END, 41, 42], (Video(frames(5, 6), fps=16.0),)),
        ImagePrompt([1, START, PAD, END, 50, START, VIDEO, END, 51, 52],
                    (picture(6, (70, 90)), Video(frames(7, 5, (130, 90)), fps=16.0))),
        [1, 90, 91, 92, 93],
        ImagePrompt([1, 60, START, VIDEO, END, 61, START, VIDEO, END],
                    (Video(frames(8, 4), fps=16.0), Video(frames(9, 2, (60, 160)), fps=16.0))),
    ]


def hf_video_tokens(path, style, llm_outputs, processor):
    """HF's greedy tokens for our prompts (their token ids as the engine expanded them), given
    the same pixels: the image's and videos' patches, grids and, for Qwen2.5-VL, each video's
    seconds a frame group."""
    hf = hf_class(style).from_pretrained(path, dtype=torch.float64).eval()
    out = []
    for prompt, o in zip(video_prompts(), llm_outputs, strict=True):
        x = torch.tensor([o.prompt_token_ids])
        extra = {}
        if isinstance(prompt, ImagePrompt):
            from tests.models.test_qwen2_vl import hf_patches

            images = [processor(p) for p in prompt.images if not isinstance(p, Video)]
            videos = [processor.video(p) for p in prompt.images if isinstance(p, Video)]
            extra["mm_token_type_ids"] = (x == PAD).int() + 2 * (x == VIDEO).int()
            if images:
                extra |= {"pixel_values": torch.cat([hf_patches(p.values) for p in images]).double(),
                          "image_grid_thw": torch.tensor([grid_thw(p) for p in images])}
            extra |= {"pixel_values_videos": torch.cat([hf_video_patches(p.values) for p in videos]).double(),
                      "video_grid_thw": torch.tensor([grid_thw(p) for p in videos])}
            if style == "qwen2_5_vl":
                extra["second_per_grid_ts"] = torch.tensor([2 / p.fps for p in videos])
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=PARAMS.max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        out.append(gen[0, x.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("style", ["qwen2_vl", "qwen2_5_vl"])
def test_greedy_matches_hf_with_videos(style, request):
    """Greedy tokens equal HF's (float64) for prompts with videos (an odd frame count padded;
    two videos of other sizes; one beside an image), the whole prompt in one step and in chunks
    of 16 that cut through videos with the prefix cache on; the video tokens are HF's count."""
    path = request.getfixturevalue(style)
    llm = LLM(str(path), dtype="float32", max_num_seqs=4)
    outs = llm.generate(video_prompts(), PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids.count(VIDEO) for o in outs] == [3 * 12, 3 * 8, 0, 2 * 12 + 1 * 12]
    want = hf_video_tokens(path, style, outs, llm.engine.image_processor)
    assert [o.outputs[0].token_ids for o in outs] == want
    other = ImagePrompt([1, 40, START, VIDEO, END, 41, 42], (Video(frames(11, 6), fps=16.0),))
    assert llm.generate(other, PARAMS, use_tqdm=False)[0].outputs[0].token_ids != want[0]  # (the video is read)
    chunked = LLM(str(path), dtype="float32", max_num_seqs=4, prefill_mode="chunked", max_num_batched_tokens=16,
                  enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in chunked.generate(video_prompts(), PARAMS, use_tqdm=False)] == want
    again = chunked.generate(video_prompts()[:1], PARAMS, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want[0] and again.num_cached_tokens > 0


def test_dict_prompts_chat_and_errors(qwen2_vl):
    """vLLM's dict form (`multi_modal_data={"video": frames}`, a list of videos, `(frames,
    metadata)`), the chat's `video` part, and clear errors: video tokens that do not pair with
    the videos, a model that reads no videos, a bad part."""
    llm = LLM(str(qwen2_vl), dtype="float32")
    clip = frames(5, 6)
    ids = [1, 40, START, VIDEO, END, 41, 42]
    want = llm.generate(ImagePrompt(ids, (Video(clip),)), PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    as_dict = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": clip}}, PARAMS, use_tqdm=False)
    assert as_dict[0].outputs[0].token_ids == want
    pair = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": [(clip, {"fps": 2.0})]}}, PARAMS,
                        use_tqdm=False)
    assert pair[0].outputs[0].token_ids == want
    chat = llm.chat([{"role": "user", "content": [{"type": "video", "video": clip},
                                                  {"type": "text", "text": "w7 w8"}]}], PARAMS, use_tqdm=False)[0]
    assert chat.prompt_token_ids.count(VIDEO) == 36 and START in chat.prompt_token_ids
    with pytest.raises(InvalidRequestError, match="1 video tokens for 2 videos"):
        llm.generate(ImagePrompt(ids, (Video(clip), Video(clip))), PARAMS, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="video"):
        llm.generate(ImagePrompt([1, 40, 41], (Video(clip),)), PARAMS, use_tqdm=False)
    assert llm.generate([1, 5, 6], PARAMS, use_tqdm=False)[0].outputs[0].token_ids  # (serving goes on)


def test_models_without_videos_refuse_them(tmp_path):
    """A LLaVA model (no video side) refuses a video in a prompt and in a chat part."""
    from tests.models.test_llava import build_tiny_llava

    path = build_tiny_llava(tmp_path / "llava")
    llm = LLM(str(path), dtype="float32")
    with pytest.raises(InvalidRequestError, match="reads no videos"):
        llm.generate({"prompt_token_ids": [1, 5], "multi_modal_data": {"video": frames(0, 4)}}, PARAMS)
    with pytest.raises(InvalidRequestError, match="reads no videos"):
        llm.chat([{"role": "user", "content": [{"type": "video", "video": frames(0, 4)}]}], PARAMS)


def encode_video(clip: np.ndarray, fps: float, path) -> bytes:
    """`clip` as an MJPG AVI file at `fps` (OpenCV's wheels write it without outside codecs;
    skipped without OpenCV, the `video` extra)."""
    cv2 = pytest.importorskip("cv2")
    _, h, w, _ = clip.shape
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    assert writer.isOpened()
    for f in clip:
        writer.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    writer.release()
    return path.read_bytes()


def smooth(n: int, size=(112, 84)) -> np.ndarray:
    """`n` frames of gradients that change frame by frame (JPEG keeps them near)."""
    y, x = np.mgrid[0 : size[1], 0 : size[0]]
    return np.stack([np.stack([(x * 2 + 9 * k) % 256, (y * 3 + 5 * k) % 256, (x + y + 17 * k) % 256], -1)
                     for k in range(n)]).astype(np.uint8)


def test_video_files_are_decoded_and_sampled(qwen2_vl, tmp_path):
    """A video file (bytes, a data URL, a local path under the allowed one) is decoded and its
    frames sampled at the processor's rate (4 a second here): 3 s at 10 frames a second keeps
    12 frames, each nearest the frame written at its index (JPEG); the sampled rate is the video's time a group."""
    from conveyor.video import load_video

    clip = smooth(30)
    data = encode_video(clip, 10.0, tmp_path / "clip.avi")
    got, fps, _ = load_video(Video(data), VideoSampling(fps=4.0, max_frames=16))
    keep = sample_indices(30, 10.0, VideoSampling(fps=4.0, max_frames=16))
    assert len(got) == len(keep) == 12 and fps == pytest.approx(4.0)
    for f, k in zip(got, keep, strict=True):  # (each kept frame is nearest the frame written there)
        assert int(np.argmin([np.abs(f.astype(int) - c.astype(int)).mean() for c in clip])) == k
    llm = LLM(str(qwen2_vl), dtype="float32", allowed_local_media_path=str(tmp_path))
    url = "data:video/x-msvideo;base64," + base64.b64encode(data).decode()
    ids = [1, 40, START, VIDEO, END, 41]
    by_url = llm.generate(ImagePrompt(ids, (Video(url),)), PARAMS, use_tqdm=False)[0]
    by_path = llm.generate(ImagePrompt(ids, (Video(str(tmp_path / "clip.avi")),)), PARAMS, use_tqdm=False)[0]
    frames_given = llm.generate(ImagePrompt(ids, (Video(np.stack(got), fps=fps),)), PARAMS, use_tqdm=False)[0]
    assert by_url.outputs[0].token_ids == by_path.outputs[0].token_ids == frames_given.outputs[0].token_ids
    assert by_url.prompt_token_ids.count(VIDEO) == 6 * 12
    with pytest.raises(InvalidRequestError, match="cannot be read"):
        llm.generate(ImagePrompt(ids, (Video(b"not a video"),)), PARAMS, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="outside the allowed"):
        llm.generate(ImagePrompt(ids, (Video("/etc/passwd"),)), PARAMS, use_tqdm=False)


def test_video_url_served_over_http(qwen2_vl, tmp_path):
    """`/v1/chat/completions` with a `video_url` part (a data URL of a video file) gives
    `LLM.chat`'s tokens and counts the video's tokens in `usage`, with the request's
    `mm_processor_kwargs` too; a bad video or option, or a video over `--limit-mm-per-prompt`, is a
    400 and the server serves on."""
    import httpx

    from tests.server.conftest import ServerProcess

    data = encode_video(smooth(20), 8.0, tmp_path / "clip.avi")
    url = "data:video/x-msvideo;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "w41 w42"}]}]
    llm = LLM(str(qwen2_vl), dtype="float64", num_kv_blocks=128)
    want = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    four = llm.chat(messages, PARAMS, use_tqdm=False, mm_processor_kwargs={"num_frames": 4})[0]
    del llm
    server = ServerProcess(["--model", str(qwen2_vl), "--dtype", "float64", "--num-kv-blocks", "128",
                            "--limit-mm-per-prompt", '{"video": 1}'], tmp_path / "server.log")
    body = {"model": str(qwen2_vl), "max_tokens": PARAMS.max_tokens, "temperature": 0.0, "ignore_eos": True}
    try:
        server.wait_ready()
        with httpx.Client(timeout=60.0) as client:
            r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": messages})
            assert r.status_code == 200, r.text
            got = r.json()
            twice = [{"role": "user", "content": [messages[0]["content"][0], *messages[0]["content"]]}]
            r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": twice})
            assert r.status_code == 400 and "at most 1 a prompt" in r.json()["error"]["message"]
            bad = [{"role": "user", "content": [{"type": "video_url", "video_url": {
                "url": "data:video/mp4;base64," + base64.b64encode(b"nothing").decode()}}]}]
            r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": bad})
            assert r.status_code == 400 and "video" in r.json()["error"]["message"]
            again = client.post(server.url + "/v1/chat/completions", json={**body, "messages": messages})
            assert again.status_code == 200
            r = client.post(server.url + "/v1/chat/completions",
                            json={**body, "messages": messages, "mm_processor_kwargs": {"num_frames": 4}})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(four.prompt_token_ids) < len(want.prompt_token_ids)
            assert r.json()["choices"][0]["message"]["content"].strip() == four.outputs[0].text.strip()
            r = client.post(server.url + "/v1/chat/completions",
                            json={**body, "messages": messages, "mm_processor_kwargs": {"do_resize": False}})
            assert r.status_code == 400 and "do_resize" in r.json()["error"]["message"]
        assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids) > 5 * 12  # (2.5 s: 10 frames)
        text = want.outputs[0].text.strip()  # (the word tokenizer's leading space is the server's to keep)
        assert got["choices"][0]["message"]["content"].strip() == text
        assert again.json()["choices"][0]["message"]["content"].strip() == text
    finally:
        server.stop()


def test_hf_video_preprocessor_config_is_read(tmp_path):
    """`video_preprocessor_config.json`'s bounds, rate and frame counts reach the processor;
    without one, Qwen2-VL's video defaults (128 to 768 tokens' worth a frame, 2 a second)."""
    from conveyor.models.vision import VisionArch
    from conveyor.multimodal import ImageProcessor

    v = VisionArch.from_qwen_vl({"vision_config": {"hidden_size": 64, "embed_dim": 32, "num_heads": 2}}, 64,
                                "qwen2_vl")
    plain = ImageProcessor.from_folder(None, v)
    assert (plain.video_min_pixels, plain.video_max_pixels) == (128 * 28 * 28, 768 * 28 * 28)
    assert plain.sampling == VideoSampling(fps=2.0, min_frames=4, max_frames=768)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 1000, "max_pixels": 9000, "fps": 1.0, "max_frames": 64, "cap_pixels_per_frame": False}))
    read = ImageProcessor.from_folder(tmp_path, v)
    assert (read.video_min_pixels, read.video_max_pixels, read.cap_pixels_per_frame) == (1000, 9000, False)
    assert read.sampling == VideoSampling(fps=1.0, min_frames=4, max_frames=64)


def test_qwen3_video_processing_and_layout(qwen3_vl):
    """Qwen3-VL's video: its bounds are the whole video's pixels (each frame's cap its share),
    each frame group's time is the mean of its frames' (HF's timestamps), and each group stands
    apart in the prompt after its time in text, between a vision start and end, in place of
    the template's start, video pad and end."""
    from conveyor.video import video_size

    llm = LLM(str(qwen3_vl), dtype="float32")
    processor, vision = llm.engine.image_processor, llm.engine.arch.vision
    assert processor.sampling.rule == "qwen3" and processor.max_video_tokens == 768 and vision.timestamps
    video = processor.video(Video(frames(3, 5, (100, 75)), fps=2.0))
    most = 5 * max(min(768 * 32 * 32, VIDEO_MAX * 8 // 5), int(56 * 56 * 1.05))
    assert video.values.shape[-2:] == video_size(5, 75, 100, 2, 32, 56 * 56, most) == (64, 96)
    assert video.values.shape[0] == 6 and video.times == (0.25, 1.25, 2.0)  # (frames at 0, 0.5 .. 2 s; the last twice)
    assert video_size(4, 20, 700, 2, 32, 3136, 10**6) == (32, 1120)  # (a side under 32 scaled up first)
    out = llm.generate(ImagePrompt([1, 40, START, VIDEO, END, 41], (Video(frames(3, 5, (100, 75)), fps=2.0),)),
                       PARAMS, use_tqdm=False)[0]
    stamp = [llm.tokenizer.encode(f"<{t:.1f} seconds>", add_special_tokens=False) for t in video.times]
    group = [START, *[VIDEO] * 6, END]
    assert out.prompt_token_ids == [1, 40, *stamp[0], *group, *stamp[1], *group, *stamp[2], *group, 41]


def test_qwen3_greedy_matches_hf_with_videos(qwen3_vl):
    """Qwen3-VL's greedy tokens equal HF's (float64) for prompts with videos (their groups apart,
    each an image's positions; DeepStack's rows at each group's tokens) beside an image and
    text, whole and in chunks of 16 with the prefix cache."""
    from tests.models.test_qwen2_vl import hf_patches

    llm = LLM(str(qwen3_vl), dtype="float32", max_num_seqs=4)
    processor = llm.engine.image_processor
    outs = llm.generate(video_prompts(), PARAMS, use_tqdm=False)
    hf = hf_class("qwen3_vl").from_pretrained(qwen3_vl, dtype=torch.float64).eval()
    want = []
    for prompt, o in zip(video_prompts(), outs, strict=True):
        x = torch.tensor([o.prompt_token_ids])
        extra = {}
        if isinstance(prompt, ImagePrompt):
            images = [processor(p) for p in prompt.images if not isinstance(p, Video)]
            videos = [processor.video(p) for p in prompt.images if isinstance(p, Video)]
            extra = {"mm_token_type_ids": (x == PAD).int() + 2 * (x == VIDEO).int(),
                     "pixel_values_videos": torch.cat([hf_video_patches(p.values, 16) for p in videos]).double(),
                     "video_grid_thw": torch.tensor([grid_thw(p, 16) for p in videos])}
            if images:
                extra |= {"pixel_values": torch.cat([hf_patches(p.values, 16) for p in images]).double(),
                          "image_grid_thw": torch.tensor([grid_thw(p, 16) for p in images])}
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=PARAMS.max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        want.append(gen[0, x.shape[1]:].tolist())
    assert [o.outputs[0].token_ids for o in outs] == want
    other = ImagePrompt([1, 40, START, VIDEO, END, 41, 42], (Video(frames(11, 6), fps=16.0),))
    assert llm.generate(other, PARAMS, use_tqdm=False)[0].outputs[0].token_ids != want[0]  # (the video is read)
    chunked = LLM(str(qwen3_vl), dtype="float32", max_num_seqs=4, prefill_mode="chunked", max_num_batched_tokens=16,
                  enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in chunked.generate(video_prompts(), PARAMS, use_tqdm=False)] == want


def test_sample_indices_with_num_frames():
    """`num_frames` asked for (vLLM's `mm_processor_kwargs`): Qwen2-VL's rounded to an even count
    over `arange(0, total, total / n)`, Qwen3-VL's that many from first to last, LLaVA-OneVision's
    at most that many; more than the video has is refused (HF's processors raise)."""
    assert sample_indices(95, 30.0, VideoSampling(num_frames=7)) == [int(i * 95 / 8) for i in range(8)]  # 7 -> 8
    assert sample_indices(95, 30.0, VideoSampling(num_frames=5, rule="qwen3")) == [0, 24, 47, 70, 94]
    assert sample_indices(10, 0.0, VideoSampling(max_frames=32, num_frames=4, rule="uniform")) == [0, 3, 6, 9]
    assert sample_indices(3, 0.0, VideoSampling(max_frames=32, num_frames=8, rule="uniform")) == [0, 1, 2]
    with pytest.raises(InvalidRequestError, match="num_frames=12: the video has 10 frames"):
        sample_indices(10, 30.0, VideoSampling(num_frames=12))


def test_mm_processor_kwargs(qwen2_vl, tmp_path):
    """vLLM's `mm_processor_kwargs`, per request (the dict prompt, `LLM.chat`) and for the engine
    (a JSON object's text, as the command line gives it): `fps` and `num_frames` choose a file's
    frames, `max_pixels` bounds images and frames alike, `images_kwargs` / `videos_kwargs` one kind;
    a request's go over the engine's. Bad options are refused by name and the engine serves on."""
    from conveyor.config import ConfigError
    from tests.conftest import build_tiny_model

    data = encode_video(smooth(30), 10.0, tmp_path / "clip.avi")  # 3 s: the folder's 4 a second keeps 12
    ids = [1, 40, START, VIDEO, END, 41, START, PAD, END]
    image = picture(3, (150, 120))
    llm = LLM(str(qwen2_vl), dtype="float32")

    def counts(kwargs, engine=llm):
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"video": data, "image": image}}
        _, _, spans = engine.engine.prepare_prompt({**prompt, "mm_processor_kwargs": kwargs} if kwargs else prompt)
        return [(s.pixels.values.shape[0] if s.pixels.fps else 0, s.length) for s in spans]  # (frames, tokens)

    (frames12, video12), (_, image_tokens) = counts(None)
    assert frames12 == 12 and image_tokens > 8
    assert counts({"fps": 2})[0][0] == 6 and counts({"num_frames": 7})[0][0] == 8  # (7 rounded to even)
    small = counts({"max_pixels": 28 * 28 * 8})
    assert small[1][1] <= 8 and small[0][1] <= 8 * 6 < video12
    only_images = counts({"images_kwargs": {"max_pixels": 28 * 28 * 8}})
    assert only_images[0] == (frames12, video12) and only_images[1][1] <= 8
    assert counts({"videos_kwargs": {"fps": 2}}) == [(6, video12 // 2), (0, image_tokens)]
    by_prompt = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": data, "image": image},
                              "mm_processor_kwargs": {"fps": 2}}, PARAMS, use_tqdm=False)[0]
    engine_wide = LLM(str(qwen2_vl), dtype="float32", mm_processor_kwargs='{"fps": 2}')
    assert counts(None, engine_wide)[0][0] == 6 and counts({"num_frames": 4}, engine_wide)[0][0] == 4
    assert engine_wide.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": data, "image": image}},
                                PARAMS, use_tqdm=False)[0].outputs[0].token_ids == by_prompt.outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": [{"type": "video", "video": data}, {"type": "text", "text": "w7"}]}],
                    PARAMS, use_tqdm=False, mm_processor_kwargs={"num_frames": 4})[0]
    assert chat.prompt_token_ids.count(VIDEO) == video12 // 3
    for bad, match in [({"do_resize": False}, "'do_resize' is not an option"), ({"fps": 0}, "positive"),
                       ({"num_frames": 2.5}, "whole number"), ({"fps": 2, "num_frames": 4}, "give one"),
                       ({"min_pixels": 10**6, "max_pixels": 10**5}, "more than max_pixels"),
                       ({"images_kwargs": {"fps": 2}}, "'fps' is not an option of this model's image"),
                       ({"num_frames": 40}, "the video has 30 frames")]:
        with pytest.raises(InvalidRequestError, match=match):
            counts(bad)
    with pytest.raises(ConfigError, match="not JSON"):
        LLM(str(qwen2_vl), dtype="float32", mm_processor_kwargs="{fps: 2}")
    with pytest.raises(ConfigError, match="reads no images"):
        LLM(str(build_tiny_model(tmp_path / "text", "llama")), dtype="float32", mm_processor_kwargs={"fps": 2})
    assert llm.generate([1, 5, 6], PARAMS, use_tqdm=False)[0].outputs[0].token_ids  # (serving goes on)


def test_limit_mm_per_prompt(qwen2_vl, tmp_path):
    """vLLM's `limit_mm_per_prompt`: a prompt with more images or videos than the engine takes is
    refused by name before its media are read (0 refuses the kind), from `LLM.generate`, `LLM.chat`
    and the JSON text the command line gives; bad limits are a ConfigError; the engine serves on."""
    from conveyor.config import ConfigError

    llm = LLM(str(qwen2_vl), dtype="float32", limit_mm_per_prompt='{"image": 1, "video": 0}')
    one = ImagePrompt([1, 40, START, PAD, END, 41], (picture(1, (60, 60)),))
    assert llm.generate(one, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    two = ImagePrompt([1, START, PAD, END, START, PAD, END], (picture(1, (60, 60)), picture(2, (60, 60))))
    with pytest.raises(InvalidRequestError, match="holds 2 images: this engine takes at most 1"):
        llm.generate(two, PARAMS, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="takes no videos"):
        llm.chat([{"role": "user", "content": [{"type": "video", "video": b"never decoded"}]}], PARAMS, use_tqdm=False)
    assert llm.generate(one, PARAMS, use_tqdm=False)[0].outputs[0].token_ids  # (serving goes on)
    assert LLM(str(qwen2_vl), dtype="float32", limit_mm_per_prompt={"video": {"count": 2}}).engine \
        .image_processor.max_videos == 2
    # every kind at 0: text only, the tower not loaded (vLLM's); one kind at 0: the tower still read
    text_only = LLM(str(qwen2_vl), dtype="float32", limit_mm_per_prompt={"image": 0, "video": 0})
    assert text_only.engine.runner.model.vision is None and llm.engine.runner.model.vision is not None
    words = [1, 40, 41, 42]
    assert (text_only.generate([words], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate([words], PARAMS, use_tqdm=False)[0].outputs[0].token_ids)
    with pytest.raises(InvalidRequestError, match="reads text only"):
        text_only.generate(one, PARAMS, use_tqdm=False)
    assert LLM(str(qwen2_vl), dtype="float32", limit_mm_per_prompt={"image": 0}).engine.runner.model.vision is not None
    for bad, match in [({"audio": 1}, "reads no audio"), ({"speech": 1}, "not 'speech'"), ({"image": -1}, "count of 0 or more"), ("[1]", "an object")]:
        with pytest.raises(ConfigError, match=match):
            LLM(str(qwen2_vl), dtype="float32", limit_mm_per_prompt=bad)
