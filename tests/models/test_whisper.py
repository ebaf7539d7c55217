"""Whisper (conveyor/models/whisper.py) against HF transformers on the same random weights: greedy
tokens of several requests at once (different clips and decoder prompts, some joining while others
decode), the features of Whisper's 80 mel bins, and what a Whisper engine refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.sampling_params import InvalidRequestError
from tests.conftest import save_image_tokenizer
from tests.models.test_qwen2_audio import RATE, clip

SOT, EN, FR, TRANSCRIBE, TRANSLATE, NO_TS, PREV = 370, 371, 372, 373, 374, 375, 376
SPECIALS = {SOT: "<|startoftranscript|>", EN: "<|en|>", FR: "<|fr|>", TRANSCRIBE: "<|transcribe|>",
            TRANSLATE: "<|translate|>", NO_TS: "<|notimestamps|>", PREV: "<|startofprev|>"}
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def build_tiny_whisper(out_dir, seed: int = 5):
    """A random-weight `WhisperForConditionalGeneration`: an encoder of 2 layers and a decoder
    of 2, 32 wide, 80 mel bins, 64 decoder positions, a word-level tokenizer with Whisper's task
    tokens, and Whisper's `preprocessor_config.json`."""
    import transformers as tf

    config = tf.WhisperConfig(vocab_size=384, num_mel_bins=80, encoder_layers=2, encoder_attention_heads=2,
                              decoder_layers=2, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                              d_model=32, max_source_positions=1500, max_target_positions=64,
                              decoder_start_token_id=SOT, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = tf.WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # (HF starts norms at one and biases at zero: make them matter)
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif "embed_positions" not in name:
                p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_image_tokenizer(out_dir, SPECIALS, "")
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, "sampling_rate": RATE,
        "hop_length": 160, "n_fft": 400, "chunk_length": 30}))
    return out_dir


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return build_tiny_whisper(tmp_path_factory.mktemp("whisper") / "m")


@pytest.fixture(scope="module")
def hf_whisper(whisper):
    import transformers as tf

    return tf.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()


def hf_greedy(model, samples: np.ndarray, ids: list[int], n: int) -> list[int]:
    """HF's greedy tokens, a step at a time through the model's forward (none of `generate`'s
    Whisper rules: no suppressed tokens, no forced ones)."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=80)
    features = fe(samples, sampling_rate=RATE, return_tensors="pt")["input_features"]
    out = list(ids)
    with torch.no_grad():
        encoded = model.model.encoder(features).last_hidden_state
        for _ in range(n):
            logits = model(encoder_outputs=(encoded,), decoder_input_ids=torch.tensor([out])).logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


def test_greedy_tokens_are_hfs(whisper, hf_whisper):
    clips = [clip(s, seed=40 + k) for k, s in enumerate((1.0, 3.5, 7.0))]
    prompts = [PROMPT, "<|startoftranscript|><|fr|><|translate|><|notimestamps|>", PROMPT + " w30 w31"]
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=64, block_size=16)
    tok = llm.engine.tokenizer
    want = [hf_greedy(hf_whisper, c, tok.encode(p, add_special_tokens=False), 12) for c, p in zip(clips, prompts, strict=True)]
    assert len({tuple(w) for w in want}) == 3  # (the tokens vary: the clip and prompt matter)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"audio": (c, RATE)}} for c, p in zip(clips, prompts, strict=True)],
                        PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == want
    # a request joining while others decode, and the same clip again: the same tokens
    engine = llm.engine
    engine.add_request("a", {"prompt": prompts[0], "multi_modal_data": {"audio": (clips[0], RATE)}}, PARAMS)
    for _ in range(3):
        engine.step()
    engine.add_request("b", {"prompt": prompts[1], "multi_modal_data": {"audio": (clips[1], RATE)}}, PARAMS)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert done == {"a": want[0], "b": want[1]}


def test_features_of_80_bins_are_whispers():
    from transformers import WhisperFeatureExtractor

    from conveyor.audio import AudioFeatures

    x = clip(2.2, seed=3)
    ref = WhisperFeatureExtractor(feature_size=80)(x, sampling_rate=RATE, return_tensors="pt")["input_features"][0]
    values, frames = AudioFeatures(feature_size=80)(x, whole=True)
    assert values.shape == (80, 3000) and frames == 220
    torch.testing.assert_close(values, ref, rtol=0, atol=1e-5)


def test_whisper_refuses_what_it_does_not_run(whisper):
    from conveyor.config import ConfigError

    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=64, block_size=16)
    with pytest.raises(InvalidRequestError, match="one audio clip a request"):
        llm.generate(["<|startoftranscript|>"], PARAMS)
    two = {"prompt": PROMPT, "multi_modal_data": {"audio": [(clip(1.0, 1), RATE), (clip(1.0, 2), RATE)]}}
    with pytest.raises(InvalidRequestError, match="one audio clip a request"):
        llm.generate([two], PARAMS)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)  # (past the decoder's 64 positions)
    out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": (clip(1.0, 1), RATE)}}], long)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64 and out.outputs[0].finish_reason == "length"
    assert llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": (clip(1.0, 1), RATE)}}], PARAMS)
    for bad in ({"speculative_method": "ngram"}, {"quantization": "int8"}):
        with pytest.raises(ConfigError):
            LLM(model=str(whisper), dtype="float32", num_kv_blocks=64, **bad)
    assert not llm.engine.config.cache.enable_prefix_caching


def test_transcriptions_over_http(whisper, tmp_path):
    """`/v1/audio/transcriptions` and `/v1/audio/translations` take OpenAI's multipart form: the
    text is `LLM.generate`'s for the same decoder prompt and clip; a clip over 30 s is read in
    windows whose texts are joined; bad fields are a 400 and the server serves on."""
    import httpx

    from tests.models.test_qwen2_audio import wav_bytes
    from tests.server.conftest import ServerProcess

    x = clip(2.0, seed=50)
    long = np.concatenate([clip(30.0, seed=51), clip(4.0, seed=52)])
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=64, block_size=16)
    full = SamplingParams(max_tokens=60, temperature=0.0, skip_special_tokens=True)
    fr = "<|startoftranscript|><|fr|><|translate|><|notimestamps|>"
    want, translated, first, second, prompted = (o.outputs[0].text.strip() for o in llm.generate([
        {"prompt": PROMPT, "multi_modal_data": {"audio": (x, RATE)}},
        {"prompt": fr, "multi_modal_data": {"audio": (x, RATE)}},
        {"prompt": PROMPT, "multi_modal_data": {"audio": (long[: 30 * RATE], RATE)}},
        {"prompt": PROMPT, "multi_modal_data": {"audio": (long[30 * RATE :], RATE)}},
        {"prompt": "<|startofprev|> w20 w21" + PROMPT, "multi_modal_data": {"audio": (x, RATE)}}], full))
    assert want and prompted != want
    joined = " ".join(t for t in (first, second) if t)
    with torch.no_grad():  # (Whisper's guess: the likelier of the two language tokens after the start)
        import transformers as tf

        hf = tf.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
        features = tf.WhisperFeatureExtractor(feature_size=80)(x, sampling_rate=RATE, return_tensors="pt")
        logits = hf(input_features=features["input_features"], decoder_input_ids=torch.tensor([[SOT]])).logits[0, -1]
    guessed = "en" if logits[EN] >= logits[FR] else "fr"
    detected = llm.generate([{"prompt": f"<|startoftranscript|><|{guessed}|><|transcribe|><|notimestamps|>",
                              "multi_modal_data": {"audio": (x, RATE)}}], full)[0].outputs[0].text.strip()
    del llm, hf
    server = ServerProcess(["--model", str(whisper), "--dtype", "float32", "--num-kv-blocks", "64"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        with httpx.Client(timeout=60.0) as client:
            def post(path: str, audio: bytes, **fields: str) -> httpx.Response:
                return client.post(server.url + path, files={"file": ("a.wav", audio, "audio/wav")},
                                   data={"model": str(whisper), **fields})

            r = post("/v1/audio/transcriptions", wav_bytes(x), language="en")
            assert r.status_code == 200, r.text
            assert r.json() == {"text": want, "language": "en", "usage": {"type": "duration", "seconds": 2}}
            # no language: Whisper's own guess, HF's decoder's likelier language token after the start
            r = post("/v1/audio/transcriptions", wav_bytes(x))
            assert r.status_code == 200 and r.json()["language"] == guessed and r.json()["text"] == detected
            # streamed: OpenAI's delta events, then the whole text
            events = []
            with client.stream("POST", server.url + "/v1/audio/transcriptions",
                               files={"file": ("a.wav", wav_bytes(long), "audio/wav")},
                               data={"model": str(whisper), "language": "en", "stream": "true"}) as s:
                assert s.status_code == 200
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            deltas = "".join(e["delta"] for e in events if e["type"] == "transcript.text.delta")
            assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == joined
            assert deltas.split() == joined.split() and sum(e["type"].endswith("delta") for e in events) > 2
            r = post("/v1/audio/transcriptions", wav_bytes(x), prompt="w20 w21", language="en")
            assert r.status_code == 200 and r.json()["text"] == prompted
            r = post("/v1/audio/transcriptions", wav_bytes(x), response_format="text", language="en")
            assert r.status_code == 200 and r.text == want
            r = post("/v1/audio/translations", wav_bytes(x), language="fr")
            assert r.status_code == 200 and r.json()["text"] == translated
            r = post("/v1/audio/transcriptions", wav_bytes(long), language="en")
            assert r.status_code == 200 and r.json()["text"] == joined
            for fields, match in [({"response_format": "srt"}, "timestamps"), ({"language": "xx"}, "language"),
                                  ({"temperature": "3"}, "temperature"), ({"model": "other"}, "does not exist")]:
                r = post("/v1/audio/transcriptions", wav_bytes(x), **fields)
                assert r.status_code in (400, 404) and match in r.json()["error"]["message"], (fields, r.text)
            r = post("/v1/audio/transcriptions", b"not audio")
            assert r.status_code == 400
            r = client.post(server.url + "/v1/audio/transcriptions", data={"model": str(whisper)})
            assert r.status_code == 400 and "file" in r.json()["error"]["message"]
            assert post("/v1/audio/transcriptions", wav_bytes(x), language="en").json()["text"] == want
    finally:
        server.stop()


def test_llm_transcribe_and_the_command(whisper, tmp_path, capsys):
    """`LLM.transcribe` gives the windows' texts joined, the language given or guessed; the
    `conveyor transcribe` command prints the same."""
    from conveyor.cli import main
    from tests.models.test_qwen2_audio import wav_bytes

    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=64, block_size=16)
    long = np.concatenate([clip(30.0, seed=61), clip(3.0, seed=62)])
    full = SamplingParams(max_tokens=60, temperature=0.0, skip_special_tokens=True)
    windows = [o.outputs[0].text.strip() for o in llm.generate(
        [{"prompt": PROMPT, "multi_modal_data": {"audio": (part, RATE)}} for part in (long[: 30 * RATE], long[30 * RATE :])],
        full)]
    got = llm.transcribe((long, RATE), language="en")
    assert got.text == " ".join(t for t in windows if t) and got.language == "en" and abs(got.seconds - 33.0) < 1e-6
    guessed = llm.transcribe((long, RATE))
    assert guessed.language in ("en", "fr")
    translated = llm.transcribe((long[: 2 * RATE], RATE), language="fr", task="translate")
    want = llm.generate([{"prompt": "<|startoftranscript|><|fr|><|translate|><|notimestamps|>",
                          "multi_modal_data": {"audio": (long[: 2 * RATE], RATE)}}], full)[0].outputs[0].text.strip()
    assert translated.text == want
    with pytest.raises(InvalidRequestError, match="language 'xx'"):
        llm.transcribe((long, RATE), language="xx")
    several = llm.transcribe([(long, RATE), (long[: 2 * RATE], RATE)])  # (all windows and guesses in one batch)
    alone = [guessed, llm.transcribe((long[: 2 * RATE], RATE))]
    assert several == alone
    path = tmp_path / "a.wav"
    path.write_bytes(wav_bytes(long[: 2 * RATE], width=4))
    capsys.readouterr()
    assert main(["transcribe", str(path), "--model", str(whisper), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--language", "fr", "--translate"]) == 0
    assert capsys.readouterr().out.strip() == want
    other = tmp_path / "b.wav"
    other.write_bytes(wav_bytes(long[2 * RATE : 4 * RATE], width=4))
    second = llm.transcribe((long[2 * RATE : 4 * RATE], RATE), language="fr", task="translate").text
    assert main(["transcribe", str(path), str(other), "--model", str(whisper), "--dtype", "float32",
                 "--num-kv-blocks", "64", "--language", "fr", "--translate"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{path}: {want}", f"{other}: {second}"]
