"""Qwen2-Audio (conveyor/audio.py, conveyor/models/qwen_audio.py) against HF transformers on the
same random weights: Whisper's log-mel features and mel filters, the audio tower's embeddings for
clips of several lengths in one batch (only the positions their tokens read, against HF's 1500),
and greedy tokens over prompts with one and two clips, whole and in chunks that cut through a
clip, beside text-only requests; audio files read (WAV's PCM and float forms, stereo, resampled),
the prompt's forms (vLLM's dict, chat parts: OpenAI's `input_audio`, `audio_url`), and the errors
a request with audio can meet."""

from __future__ import annotations

import base64
import io
import json
import math
import wave

import numpy as np
import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.audio import Audio, AudioFeatures, audio_tokens, decode_audio, mel_filters, resample
from conveyor.multimodal import ImagePrompt
from conveyor.sampling_params import InvalidRequestError
from tests.conftest import TINY, save_image_tokenizer

BOS, EOS, AUDIO = 378, 379, 380  # <|audio_bos|>, <|audio_eos|>, <|AUDIO|>
RATE = 16000
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TEMPLATE = ("{% set n = namespace(k=0) %}{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'audio' %}"
            "{% set n.k = n.k + 1 %}w7 {{ n.k }} <|audio_bos|><|AUDIO|><|audio_eos|> {% else %}{{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}w9 {% endif %}")


def build_tiny_qwen2_audio(out_dir, seed: int = 3):
    """A random-weight `Qwen2AudioForConditionalGeneration`: a Whisper encoder of 2 layers, 32
    wide, over 128 mel bins and HF's 1500 positions, conftest's TINY as its Qwen2 text model, a
    word-level tokenizer with the audio tokens and a chat template, and Whisper's
    `preprocessor_config.json`."""
    import transformers as tf

    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 max_source_positions=1500)
    config = tf.Qwen2AudioConfig(audio_config=audio, text_config={**TINY, "model_type": "qwen2"},
                                 audio_token_index=AUDIO)
    torch.manual_seed(seed)
    model = tf.Qwen2AudioForConditionalGeneration(config).eval()
    with torch.no_grad():  # (HF starts norms at one and biases at zero: make them matter)
        for name, p in model.named_parameters():
            if "audio_tower" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
            if "multi_modal_projector" in name:
                p.normal_(0, 0.05)  # (embeddings of about the tokens' size: neither drowns the other)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_image_tokenizer(out_dir, {BOS: "<|audio_bos|>", EOS: "<|audio_eos|>", AUDIO: "<|AUDIO|>"}, TEMPLATE)
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": RATE,
        "hop_length": 160, "n_fft": 400, "chunk_length": 30, "padding_value": 0.0}))
    return out_dir


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory):
    return build_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio") / "m")


@pytest.fixture(scope="module")
def hf_model(qwen2_audio):
    import transformers as tf

    return tf.Qwen2AudioForConditionalGeneration.from_pretrained(qwen2_audio, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(qwen2_audio):
    return LLM(model=str(qwen2_audio), dtype="float32", num_kv_blocks=256, block_size=16, seed=0)


def clip(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    """A random clip: a few tones and noise, at most 0.5 loud."""
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tones = sum(g.uniform(0.05, 0.15) * np.sin(2 * np.pi * g.uniform(100, 3000) * t) for _ in range(3))
    return (tones + 0.02 * g.standard_normal(t.shape)).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = RATE, width: int = 2) -> bytes:
    """A PCM WAV file of `samples` ([n] or [n, channels], in [-1, 1))."""
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    scale = 1 << (8 * width - 1)
    ints = np.clip(np.round(samples * scale), -scale, scale - 1).astype(np.int64)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    else:
        raw = b"".join(int(v).to_bytes(width, "little", signed=True) for v in ints.reshape(-1)) if width == 3 else \
            ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


def hf_inputs(samples: list[np.ndarray]):
    """HF's processor's audio inputs: features padded to 30 s and the mask of each clip's frames."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128)
    out = fe(samples, sampling_rate=RATE, return_attention_mask=True, padding="max_length", return_tensors="pt")
    return out["input_features"], out["attention_mask"]


def prompt_ids(llm, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text)


# -- features ------------------------------------------------------------------------------

def test_mel_filters_are_hfs():
    from transformers.audio_utils import mel_filter_bank

    hf = mel_filter_bank(num_frequency_bins=201, num_mel_filters=128, min_frequency=0.0, max_frequency=8000.0,
                         sampling_rate=RATE, norm="slaney", mel_scale="slaney")
    np.testing.assert_allclose(mel_filters(201, 128, RATE), hf, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seconds", [0.0201, 0.5, 3.3, 29.99, 31.0])
def test_features_are_whispers(seconds):
    x = clip(seconds, seed=int(seconds * 10))
    ref, mask = hf_inputs([x])
    values, frames = AudioFeatures()(x)
    assert frames == int(mask.sum())  # the clip's own frames, as HF's mask counts them
    assert values.shape[1] <= 3000
    torch.testing.assert_close(values, ref[0, :, : values.shape[1]], rtol=0, atol=1e-5)
    assert audio_tokens(frames) == (((frames - 1) // 2 + 1) - 2) // 2 + 1


def test_a_clip_too_short_for_a_token_is_refused():
    with pytest.raises(InvalidRequestError, match="too short"):
        AudioFeatures()(np.zeros(320, np.float32))


# -- reading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_wav_pcm_of_each_width_reads_back(width):
    x = clip(0.25, seed=width) * 0.9
    samples, rate = decode_audio(wav_bytes(x, width=width))
    assert rate == RATE and samples.dtype == np.float32
    np.testing.assert_allclose(samples, x, atol=2.0 / (1 << (8 * width - 1)))


def test_wav_float_and_stereo():
    import struct

    x = np.stack([clip(0.1, 1), clip(0.1, 2)], axis=1)
    data = x.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 2, 22050, 22050 * 8, 8, 32)
    riff = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    samples, rate = decode_audio(b"RIFF" + struct.pack("<I", len(riff)) + riff)
    assert rate == 22050 and samples.shape == x.shape
    np.testing.assert_array_equal(samples, x)


def test_other_formats_through_soundfile(llm):
    """A FLAC file (lossless) gives the WAV file's tokens; an MP3 file is read (lossy: its tokens
    are not compared); without soundfile, a non-WAV file's error names it."""
    soundfile = pytest.importorskip("soundfile")
    x = clip(1.0, seed=12) * 0.9
    flac, mp3 = io.BytesIO(), io.BytesIO()
    soundfile.write(flac, x, RATE, format="FLAC", subtype="PCM_16")
    soundfile.write(mp3, x, RATE, format="MP3")
    samples, rate = decode_audio(mp3.getvalue())
    assert rate == RATE and abs(len(samples) - len(x)) < 2000
    text = "user: w5 <|audio_bos|> <|AUDIO|> <|audio_eos|> w8"
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"audio": Audio(data)}}
                         for data in (wav_bytes(x), flac.getvalue())], PARAMS)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_resample_keeps_a_tone():
    for given in (8000, 22050, 44100, 48000):
        t = np.arange(given) / given
        x = np.sin(2 * np.pi * 440 * t).astype(np.float32)
        y = resample(x, given, RATE)
        assert len(y) == RATE
        ref = np.sin(2 * np.pi * 440 * np.arange(RATE) / RATE)
        assert np.abs(y[400:-400] - ref[400:-400]).max() < 1e-3, given  # (the ends meet silence)


def test_resample_drops_what_the_lower_rate_cannot_hold():
    given = 48000
    t = np.arange(given) / given
    x = np.sin(2 * np.pi * 12000 * t).astype(np.float32)  # (above 16 kHz's 8 kHz Nyquist frequency)
    y = resample(x, given, RATE)
    assert np.abs(y[400:-400]).max() < 0.01


# -- the tower -------------------------------------------------------------------------------

def test_tower_embeddings_are_hfs(qwen2_audio, hf_model, llm):
    clips = [clip(s, seed=k) for k, s in enumerate((0.7, 2.05, 4.0))]
    features, mask = hf_inputs(clips)
    with torch.no_grad():
        lengths, tokens = hf_model.model.audio_tower._get_feat_extract_output_lengths(mask.sum(-1))
        keys = torch.arange(1500)[None, :] < lengths[:, None]
        bias = torch.zeros(len(clips), 1, 1500, 1500).masked_fill(~keys[:, None, None, :], float("-inf"))
        hidden = hf_model.model.audio_tower(features, attention_mask=bias).last_hidden_state
        ref = hf_model.model.multi_modal_projector(hidden)
    processor = llm.engine.image_processor
    pixels = [processor.audio(Audio(c, RATE)) for c in clips]
    got = llm.engine.runner.model.vision(pixels)  # (the three in one batch)
    for k, (g, n) in enumerate(zip(got, tokens.tolist(), strict=True)):
        assert g.shape == (n, TINY["hidden_size"])
        torch.testing.assert_close(g, ref[k, :n], rtol=1e-4, atol=1e-4)
    assert [p.values.shape[1] for p in pixels] < [3000] * 3  # (only the frames their tokens read)


# -- greedy tokens ---------------------------------------------------------------------------

def hf_greedy(hf_model, ids: list[int], clips: list[np.ndarray], n: int = 10) -> list[int]:
    kwargs = {}
    if clips:
        features, mask = hf_inputs(clips)
        kwargs = {"input_features": features, "feature_attention_mask": mask}
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


def expanded(ids: list[int], clips: list[np.ndarray]) -> list[int]:
    frames = [math.ceil(min(len(c), 30 * RATE) / 160) for c in clips]
    it = iter(frames)
    out: list[int] = []
    for t in ids:
        out.extend([AUDIO] * audio_tokens(next(it)) if t == AUDIO else [t])
    return out


PROMPTS = [
    ("user: w5 w6 <|audio_bos|> <|AUDIO|> <|audio_eos|> w8 w9 w10", (1.3,)),
    ("user: w11 <|audio_bos|> <|AUDIO|> <|audio_eos|> w12 <|audio_bos|> <|AUDIO|> <|audio_eos|> w13", (0.9, 2.5)),
    ("user: w20 w21 w22 w23", ()),
]


def test_greedy_tokens_are_hfs_whole_and_in_chunks(qwen2_audio, hf_model):
    cases = [(text, [clip(s, seed=10 * i + k) for k, s in enumerate(secs)]) for i, (text, secs) in enumerate(PROMPTS)]
    refs = []
    for text, clips in cases:
        ids = LLM_TOKENS(qwen2_audio, text)
        refs.append(hf_greedy(hf_model, expanded(ids, clips), clips))
    assert len({tuple(r) for r in refs}) > 1  # (the tokens vary: the test can tell prompts apart)
    for chunk in (None, 16):  # (16: a chunk boundary cuts through each clip's tokens)
        kwargs = {"max_num_batched_tokens": chunk, "prefill_mode": "chunked"} if chunk else {}
        llm = LLM(model=str(qwen2_audio), dtype="float32", num_kv_blocks=256, block_size=16, seed=0, **kwargs)
        prompts = [{"prompt": text, "multi_modal_data": {"audio": [(c, RATE) for c in clips]}} if clips else text
                   for text, clips in cases]
        outs = llm.generate(prompts, PARAMS)
        assert [o.outputs[0].token_ids for o in outs] == refs, chunk


def LLM_TOKENS(folder, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


def test_clip_without_audio_changes_the_answer(llm):
    x = clip(1.5, seed=7)
    text = "user: w5 <|audio_bos|> <|AUDIO|> <|audio_eos|> w8"
    with_clip = llm.generate([{"prompt": text, "multi_modal_data": {"audio": (x, RATE)}}], PARAMS)[0]
    other = llm.generate([{"prompt": text, "multi_modal_data": {"audio": (clip(1.5, seed=8), RATE)}}], PARAMS)[0]
    assert len(with_clip.prompt_token_ids) == len(prompt_ids(llm, text)) - 1 + audio_tokens(math.ceil(len(x) / 160))
    assert with_clip.outputs[0].token_ids != other.outputs[0].token_ids


# -- the prompt's forms ----------------------------------------------------------------------

def test_forms_of_a_clip_agree(llm, tmp_path):
    """Samples with their rate, a WAV file's bytes, a data URL, a local file, and the same clip at
    another rate (resampled) give the same tokens (the resampled clip: the same up to the
    resampler's error)."""
    x = clip(1.0, seed=11) * 0.9
    data = wav_bytes(x, width=4)  # (32-bit PCM: the samples to within 5e-10)
    path = tmp_path / "a.wav"
    path.write_bytes(data)
    url = "data:audio/wav;base64," + base64.b64encode(data).decode()
    text = "user: w5 <|audio_bos|> <|AUDIO|> <|audio_eos|> w8"
    local = LLM(model=llm.engine.config.model.model, dtype="float32", num_kv_blocks=64, block_size=16, seed=0,
                allowed_local_media_path=str(tmp_path))
    forms = [(x, RATE), Audio(data), url, str(path), x]  # (a bare array: at the model's rate)
    outs = local.generate([{"prompt": text, "multi_modal_data": {"audio": f}} for f in forms], PARAMS)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert ImagePrompt  # (the engine's own form holds `Audio`s among its items)


def test_chat_with_input_audio_parts(llm):
    x = clip(1.2, seed=5)
    b64 = base64.b64encode(wav_bytes(x)).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "w5 w6 "}, {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
        {"type": "text", "text": "w8"}]}]
    out = llm.chat(messages, PARAMS)[0]
    text = "user: w5 w6 w7 1 <|audio_bos|><|AUDIO|><|audio_eos|> w8 w9 "
    direct = llm.generate([{"prompt": text, "multi_modal_data": {"audio": Audio(wav_bytes(x))}}], PARAMS)[0]
    assert out.prompt_token_ids == direct.prompt_token_ids
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}}
    again = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w5 w6 "}, url,
                                                   {"type": "text", "text": "w8"}]}], PARAMS)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


# -- errors ----------------------------------------------------------------------------------

def test_bad_audio_requests_get_clear_errors_and_the_engine_serves_on(llm, qwen2_audio):
    text = "user: w5 <|audio_bos|> <|AUDIO|> <|audio_eos|> w8"
    x = clip(1.0, seed=3)
    bad = [
        ({"prompt": text, "multi_modal_data": {"audio": [(x, RATE), (x, RATE)]}}, "2 clips"),
        ({"prompt": text, "multi_modal_data": {"audio": (np.zeros(100, np.float32), RATE)}}, "too short"),
        ({"prompt": text, "multi_modal_data": {"audio": b"not audio at all"}}, "soundfile|cannot be read"),
        ({"prompt": text, "multi_modal_data": {"audio": (np.full(RATE, np.nan, np.float32), RATE)}}, "NaN"),
        ({"prompt": text, "multi_modal_data": {"audio": (x, -5)}}, "positive"),
        ({"prompt": text, "multi_modal_data": {"audio": (x, RATE), "image": b"x"}}, "not images"),
        ({"prompt": text, "multi_modal_data": {"audio": "/etc/passwd"}}, "allowed_local_media_path"),
    ]
    for prompt, match in bad:
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate([prompt], PARAMS)
    ok = llm.generate([{"prompt": text, "multi_modal_data": {"audio": (x, RATE)}}], PARAMS)[0]
    assert len(ok.outputs[0].token_ids) == 10
    one = LLM(model=str(qwen2_audio), dtype="float32", num_kv_blocks=64, block_size=16,
              limit_mm_per_prompt={"audio": 1})
    with pytest.raises(InvalidRequestError, match="holds 2 audio clips: this engine takes at most 1"):
        one.generate([{"prompt": text + text, "multi_modal_data": {"audio": [(x, RATE)] * 2}}], PARAMS)
    from conveyor.config import ConfigError

    with pytest.raises(ConfigError, match="reads no images"):
        LLM(model=str(qwen2_audio), dtype="float32", num_kv_blocks=64, limit_mm_per_prompt={"image": 1})


def test_a_text_model_refuses_audio(tiny_models):
    from conveyor.multimodal import chat_images

    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", num_kv_blocks=32, block_size=16)
    with pytest.raises(InvalidRequestError, match="reads no audio"):
        llm.generate([{"prompt_token_ids": [5, 6], "multi_modal_data": {"audio": (clip(1.0, 1), RATE)}}], PARAMS)
    part = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    with pytest.raises(InvalidRequestError, match="reads no audio"):
        chat_images([{"role": "user", "content": [part]}], "", None)


def test_input_audio_served_over_http(qwen2_audio, tmp_path):
    """`/v1/chat/completions` with OpenAI's `input_audio` part (a WAV file's base64) and vLLM's
    `audio_url` gives `LLM.chat`'s tokens and counts the clip's tokens in `usage`; a clip over
    `--limit-mm-per-prompt`, a file that is no audio, or an image sent to this model is a 400 and
    the server serves on."""
    import httpx

    from tests.server.conftest import ServerProcess

    x = clip(2.0, seed=21)
    b64 = base64.b64encode(wav_bytes(x)).decode()
    part = {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "w41 w42"}]}]
    llm = LLM(str(qwen2_audio), dtype="float32", num_kv_blocks=128)
    want = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    del llm
    server = ServerProcess(["--model", str(qwen2_audio), "--dtype", "float32", "--num-kv-blocks", "128",
                            "--limit-mm-per-prompt", '{"audio": 1}'], tmp_path / "server.log")
    body = {"model": str(qwen2_audio), "max_tokens": PARAMS.max_tokens, "temperature": 0.0, "ignore_eos": True}
    try:
        server.wait_ready()
        with httpx.Client(timeout=60.0) as client:
            r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": messages})
            assert r.status_code == 200, r.text
            got = r.json()
            url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}}
            r = client.post(server.url + "/v1/chat/completions",
                            json={**body, "messages": [{"role": "user", "content": [url, messages[0]["content"][1]]}]})
            assert r.status_code == 200, r.text
            by_url = r.json()
            twice = [{"role": "user", "content": [part, *messages[0]["content"]]}]
            r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": twice})
            assert r.status_code == 400 and "at most 1 a prompt" in r.json()["error"]["message"]
            bad = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
                "data": base64.b64encode(b"nothing").decode(), "format": "mp3"}}]}]
            r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": bad})
            assert r.status_code == 400 and "audio" in r.json()["error"]["message"]
            image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
            r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": image})
            assert r.status_code == 400 and "reads no images" in r.json()["error"]["message"]
            again = client.post(server.url + "/v1/chat/completions", json={**body, "messages": messages})
            assert again.status_code == 200
        assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids) > audio_tokens(200)
        text = want.outputs[0].text.strip()
        for answer in (got, by_url, again.json()):
            assert answer["choices"][0]["message"]["content"].strip() == text
    finally:
        server.stop()


def test_no_audio_reads_text_without_the_tower(qwen2_audio, llm):
    """`limit_mm_per_prompt={"audio": 0}` is vLLM's text-only mode: the tower is not loaded, text
    prompts give the whole model's tokens, and a clip is refused naming the limit."""
    text_only = LLM(model=str(qwen2_audio), dtype="float32", num_kv_blocks=64, block_size=16,
                    limit_mm_per_prompt={"audio": 0})
    assert text_only.engine.runner.model.vision is None and llm.engine.runner.model.vision is not None
    prompts = ["user: w20 w21 w22 w23", "user: w5 w9 w11"]
    assert ([o.outputs[0].token_ids for o in text_only.generate(prompts, PARAMS)]
            == [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)])
    with pytest.raises(InvalidRequestError, match="reads text only: limit_mm_per_prompt"):
        text_only.generate([{"prompt": "user: w5 <|AUDIO|>", "multi_modal_data": {"audio": (clip(1.0, 1), RATE)}}],
                           PARAMS)


def test_encoder_budget_spreads_clips_over_steps(qwen2_audio, llm):
    """`max_num_encoder_input_tokens` of one clip's tokens: each step encodes at most one clip,
    the tokens are the engine's without a budget, and a clip larger than the budget is refused."""
    clips = [clip(1.0, seed=30 + k) for k in range(4)]  # (25 tokens each)
    text = "user: w5 w6 <|audio_bos|> <|AUDIO|> <|audio_eos|> w8"
    prompts = [{"prompt": text, "multi_modal_data": {"audio": (c, RATE)}} for c in clips]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    budgeted = LLM(model=str(qwen2_audio), dtype="float32", num_kv_blocks=256, block_size=16, seed=0,
                   max_num_encoder_input_tokens=30)
    engine = budgeted.engine
    for k, p in enumerate(prompts):
        engine.add_request(f"r{k}", p, PARAMS)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        before = engine.runner.images_encoded
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        assert engine.runner.images_encoded - before <= 1
        steps += 1
    assert [done[f"r{k}"] for k in range(4)] == want
    assert engine.runner.images_encoded == 4
    with pytest.raises(InvalidRequestError, match="no step could encode it"):
        budgeted.generate([{"prompt": text, "multi_modal_data": {"audio": (clip(2.0, 1), RATE)}}], PARAMS)
