"""Whisper (conveyor/models/whisper.py) against HF transformers on the same random weights: greedy
tokens of several requests at once (different clips and decoder prompts, some joining while others
decode), the features of Whisper's 80 mel bins, and what a Whisper engine refuses."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.sampling_params import InvalidRequestError, WhisperRules
from conveyor.transcribe import split, srt, verbose_json, vtt
from tests.conftest import save_image_tokenizer
from tests.models.test_qwen2_audio import RATE, clip

SOT, EN, FR, TRANSCRIBE, TRANSLATE, PREV, NO_SPEECH, NO_TS = 370, 371, 372, 373, 374, 376, 377, 383
STAMP = NO_TS + 1  # <|0.00|>, then 1500 more 20 ms apart, as Whisper's vocabulary ends
VOCAB = STAMP + 1501
SPECIALS = {SOT: "<|startoftranscript|>", EN: "<|en|>", FR: "<|fr|>", TRANSCRIBE: "<|transcribe|>",
            TRANSLATE: "<|translate|>", NO_TS: "<|notimestamps|>", PREV: "<|startofprev|>",
            NO_SPEECH: "<|nospeech|>", **{STAMP + i: f"<|{i * 0.02:.2f}|>" for i in range(1501)}}
SUPPRESS, BEGIN_SUPPRESS = [5, 6, 7, 9], [8, 2]  # (generation_config.json's: never drawn; not drawn first)
RULES = WhisperRules(suppress=tuple(SUPPRESS), begin_suppress=tuple(BEGIN_SUPPRESS), end=2)
FULL = SamplingParams(max_tokens=60, temperature=0.0, skip_special_tokens=True, whisper=RULES)
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def build_tiny_whisper(out_dir, seed: int = 5):
    """A random-weight `WhisperForConditionalGeneration`: an encoder of 2 layers and a decoder
    of 2, 32 wide, 80 mel bins, 64 decoder positions, a word-level tokenizer with Whisper's task
    and timestamp tokens, Whisper's `preprocessor_config.json` and a generation_config.json with
    Whisper's keys (tokens suppressed, the first timestamp at most 1 s)."""
    import transformers as tf

    config = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=80, encoder_layers=2, encoder_attention_heads=2,
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
        model.model.decoder.embed_tokens.weight[STAMP:] *= 0.5  # (1501 timestamps would crowd out the words)
    g = model.generation_config
    g.no_timestamps_token_id, g.prev_sot_token_id, g.is_multilingual = NO_TS, PREV, True
    g.lang_to_id, g.task_to_id = {"<|en|>": EN, "<|fr|>": FR}, {"transcribe": TRANSCRIBE, "translate": TRANSLATE}
    g.suppress_tokens, g.begin_suppress_tokens, g.max_initial_timestamp_index = SUPPRESS, BEGIN_SUPPRESS, 50
    g._from_model_config = False  # (else HF's loading makes it again from config.json)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_image_tokenizer(out_dir, SPECIALS, "", vocab_size=VOCAB)
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
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
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


@pytest.mark.parametrize(("mode", "kept"), [("recompute", 0), ("recompute", 8192), ("swap", 8192)])
def test_cross_blocks_count_in_the_cache_and_survive_preemption(whisper, hf_whisper, mode, kept):
    """A request's cross-attention keys and values take 94 blocks of the cache (1500 encoder
    positions, 16 a block) beside its own: a cache of 192 runs two requests at once, and decoding
    preempts one, whose cross blocks are written again (recompute: its clip's encoder output
    from the encoder cache, or without one encoded again) or swapped out and back; every request
    still gives HF's tokens."""
    clips = [clip(1.0 + k, seed=60 + k) for k in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2 * 94 + 4, block_size=16, preemption_mode=mode,
              encoder_cache_tokens=kept, **({"num_swap_blocks": 256} if mode == "swap" else {}))
    engine = llm.engine
    assert engine.scheduler.block_manager.cross_pages == 94
    tok = engine.tokenizer
    want = [hf_greedy(hf_whisper, c, tok.encode(PROMPT, add_special_tokens=False), 40) for c in clips]
    for k, c in enumerate(clips):
        engine.add_request(str(k), {"prompt": PROMPT, "multi_modal_data": {"audio": (c, RATE)}}, params)
    done, most = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0].token_ids
        most = max(most, len(engine.scheduler.running))
        engine.scheduler.check_integrity()
    assert done == dict(enumerate(want))
    assert most == 2 and engine.scheduler.num_preemptions > 0
    encoded = engine.runner.images_encoded
    assert encoded > 4 if not kept else encoded == 4  # (swapped back, or kept: not encoded again)
    assert engine.scheduler.block_manager.num_free_blocks == 2 * 94 + 4


def test_the_triton_backend_gives_hfs_tokens(whisper, hf_whisper):
    """On a GPU Whisper attends in the Triton kernels (the prompt's self-attention in the prefill
    kernel, each row's cross-attention over its cross blocks in the decode kernel): here under
    Triton's interpreter, the same greedy tokens as HF's."""
    pytest.importorskip("triton")
    from conveyor.kernels.triton_attention import TritonPagedAttention, triton_available

    if not triton_available():
        pytest.skip("triton cannot run here")
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
    llm.engine.runner.model.backend = TritonPagedAttention()
    clips = [clip(2.0, seed=41), clip(5.0, seed=42)]
    want = [hf_greedy(hf_whisper, c, llm.engine.tokenizer.encode(PROMPT, add_special_tokens=False), 5) for c in clips]
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": (c, RATE)}} for c in clips],
                        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_a_cache_too_small_for_the_cross_blocks_is_refused(whisper):
    from conveyor.config import ConfigError

    with pytest.raises(ConfigError, match="94 blocks for the cross-attention"):
        LLM(model=str(whisper), dtype="float32", num_kv_blocks=94, block_size=16)
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=95, block_size=16)  # (one block of its own)
    assert llm.engine.max_model_len == 16


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

    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
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
            LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, **bad)
    assert not llm.engine.config.cache.enable_prefix_caching
    # a clip too short for Qwen2-Audio's one token is still Whisper's to read (padded to 30 s); an empty one is not
    assert llm.transcribe((clip(0.01, 1), RATE), language="en", temperature=(0.0,)).seconds == 0.01
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.transcribe((np.zeros(0, np.float32), RATE), language="en")
    # a checkpoint without timestamp tokens or alignment heads: timestamps and words refused by name
    decoding = llm.engine.image_processor.whisper
    llm.engine.image_processor = dataclasses.replace(
        llm.engine.image_processor, whisper=dataclasses.replace(decoding, timestamp_begin=None, heads=()))
    with pytest.raises(InvalidRequestError, match="no timestamp tokens"):
        llm.transcribe((clip(1.0, 1), RATE), language="en", timestamps=True)
    with pytest.raises(InvalidRequestError, match="alignment heads"):
        llm.transcribe((clip(1.0, 1), RATE), language="en", words=True)


def test_transcriptions_over_http(whisper, tmp_path):
    """`/v1/audio/transcriptions` and `/v1/audio/translations` take OpenAI's multipart form and
    answer as `LLM.transcribe` does on the same file (greedy windows: `LLM.generate`'s for the
    same decoder prompt and clip; a 0 temperature falls back, seeded; a clip over 30 s read in
    windows whose texts are joined); verbose_json, srt and vtt are its segments; bad fields are a
    400 and the server serves on."""
    import httpx

    from tests.models.test_qwen2_audio import wav_bytes
    from tests.server.conftest import ServerProcess

    x, long = wav_bytes(clip(2.0, seed=50)), wav_bytes(np.concatenate([clip(30.0, seed=51), clip(4.0, seed=52)]))
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
    samples = (clip(2.0, seed=50), RATE)
    greedy = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": samples}}], FULL)[0].outputs[0].text.strip()
    assert greedy and llm.transcribe(x, language="en", temperature=(0.0,)).text == greedy
    want = llm.transcribe(x, language="en", seed=7)
    assert want.text != greedy  # (the random model's greedy text loops: it falls back to drawn ones)
    translated = llm.transcribe(x, language="fr", task="translate", seed=7).text
    prompted = llm.transcribe(x, language="en", prompt="w20 w21", seed=7).text
    capped = llm.transcribe(x, language="en", seed=7, max_tokens=5, top_k=3).text
    assert len(capped.split()) <= 5
    joined = llm.transcribe(long, language="en", seed=7).text
    streamed = llm.transcribe(long, language="en", temperature=(0.0,)).text  # (a stream does not fall back)
    guessed = llm.transcribe(x, seed=7)
    timed, timed_long = (llm.transcribe(a, language="en", timestamps=True, seed=7) for a in (x, long))
    worded = llm.transcribe(x, language="en", words=True, seed=7)
    assert worded.words and not worded.segments
    assert len(timed_long.segments) > len(timed.segments) > 1 and timed_long.segments[-1].start > 30
    with torch.no_grad():  # (Whisper's guess: the likelier of the two language tokens after the start)
        import transformers as tf

        hf = tf.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
        features = tf.WhisperFeatureExtractor(feature_size=80)(samples[0], sampling_rate=RATE, return_tensors="pt")
        logits = hf(input_features=features["input_features"], decoder_input_ids=torch.tensor([[SOT]])).logits[0, -1]
    assert guessed.language == ("en" if logits[EN] >= logits[FR] else "fr")
    del llm, hf
    server = ServerProcess(["--model", str(whisper), "--dtype", "float32", "--num-kv-blocks", "2048"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        with httpx.Client(timeout=60.0) as client:
            def post(path: str, audio: bytes, **fields: str) -> httpx.Response:
                return client.post(server.url + path, files={"file": ("a.wav", audio, "audio/wav")},
                                   data={"model": str(whisper), "seed": "7", **fields})

            r = post("/v1/audio/transcriptions", x, language="en")
            assert r.status_code == 200, r.text
            assert r.json() == {"text": want.text, "language": "en", "usage": {"type": "duration", "seconds": 2}}
            # no language: Whisper's own guess, HF's decoder's likelier language token after the start
            r = post("/v1/audio/transcriptions", x)
            assert r.status_code == 200 and r.json()["language"] == guessed.language and r.json()["text"] == guessed.text
            # streamed: OpenAI's delta events, then the whole text
            events = []
            with client.stream("POST", server.url + "/v1/audio/transcriptions",
                               files={"file": ("a.wav", long, "audio/wav")},
                               data={"model": str(whisper), "language": "en", "stream": "true"}) as s:
                assert s.status_code == 200
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            deltas = "".join(e["delta"] for e in events if e["type"] == "transcript.text.delta")
            assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == streamed
            assert deltas.split() == streamed.split() and sum(e["type"].endswith("delta") for e in events) > 2
            r = post("/v1/audio/transcriptions", x, language="en", max_completion_tokens="5", top_k="3")
            assert r.status_code == 200 and r.json()["text"] == capped
            r = post("/v1/audio/transcriptions", x, prompt="w20 w21", language="en")
            assert r.status_code == 200 and r.json()["text"] == prompted
            r = post("/v1/audio/transcriptions", x, response_format="text", language="en")
            assert r.status_code == 200 and r.text == want.text
            r = post("/v1/audio/translations", x, language="fr")
            assert r.status_code == 200 and r.json()["text"] == translated
            r = post("/v1/audio/transcriptions", long, language="en")
            assert r.status_code == 200 and r.json()["text"] == joined
            # timestamps: OpenAI's verbose_json, SubRip and WebVTT, `LLM.transcribe`'s segments
            r = post("/v1/audio/transcriptions", x, language="en", response_format="verbose_json",
                     **{"timestamp_granularities[]": "segment"})
            assert r.status_code == 200, r.text
            same_verbose(r.json(), verbose_json(timed, "transcribe") | {"usage": {"type": "duration", "seconds": 2}})
            # words: alone, and with the segments
            r = post("/v1/audio/transcriptions", x, language="en", response_format="verbose_json",
                     **{"timestamp_granularities[]": "word"})
            assert r.status_code == 200, r.text
            assert r.json() == verbose_json(worded, "transcribe", segments=False, words=True) | {
                "usage": {"type": "duration", "seconds": 2}}
            r = post("/v1/audio/transcriptions", x, language="en", response_format="verbose_json",
                     **{"timestamp_granularities[]": ["word", "segment"]})
            assert r.status_code == 200 and r.json()["words"] and r.json()["segments"]
            assert [w["word"] for w in r.json()["words"]] == r.json()["text"].split()
            r = post("/v1/audio/transcriptions", long, language="en", response_format="srt")
            assert r.status_code == 200 and r.text == srt(timed_long.segments)
            r = post("/v1/audio/transcriptions", long, language="en", response_format="vtt")
            assert r.status_code == 200 and r.text == vtt(timed_long.segments) and r.text.startswith("WEBVTT")
            for fields, match in [({"response_format": "srt", "stream": "true"}, "stream"),
                                  ({"response_format": "verbose_json", "timestamp_granularities[]": "char"}, "char"),
                                  ({"timestamp_granularities[]": "segment"}, "verbose_json"),
                                  ({"response_format": "xml"}, "response_format"), ({"language": "xx"}, "language"),
                                  ({"temperature": "3"}, "temperature"), ({"temperature": "hot"}, "temperature"),
                                  ({"seed": "x"}, "seed"), ({"top_k": "1.5"}, "top_k"), ({"top_p": "2"}, "top_p"),
                                  ({"max_completion_tokens": "0"}, "max_tokens"), ({"model": "other"}, "does not exist")]:
                r = post("/v1/audio/transcriptions", x, **fields)
                assert r.status_code in (400, 404) and match in r.json()["error"]["message"], (fields, r.text)
            r = post("/v1/audio/transcriptions", b"not audio")
            assert r.status_code == 400
            r = client.post(server.url + "/v1/audio/transcriptions", data={"model": str(whisper)})
            assert r.status_code == 400 and "file" in r.json()["error"]["message"]
            assert post("/v1/audio/transcriptions", x, language="en").json()["text"] == want.text
    finally:
        server.stop()


def same_verbose(got: dict, want: dict) -> None:
    """Two verbose_json answers alike: the scores to 1e-4 (sums in another batch may round
    apart), all else equal."""
    scores = ("avg_logprob", "compression_ratio", "no_speech_prob")
    got, want = json.loads(json.dumps(got)), json.loads(json.dumps(want))
    for a, b in zip(got["segments"], want["segments"], strict=True):
        assert [a.pop(k) for k in scores] == pytest.approx([b.pop(k) for k in scores], rel=1e-4)
    assert got == want


def test_llm_transcribe_and_the_command(whisper, tmp_path, capsys):
    """`LLM.transcribe` gives the windows' texts joined (greedy: `LLM.generate`'s), the language
    given or guessed; the `conveyor transcribe` command prints the same, in each format."""
    from conveyor.cli import main
    from tests.models.test_qwen2_audio import wav_bytes

    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
    long = np.concatenate([clip(30.0, seed=61), clip(3.0, seed=62)])
    greedy = (0.0,)
    windows = [o.outputs[0].text.strip() for o in llm.generate(
        [{"prompt": PROMPT, "multi_modal_data": {"audio": (long[lo:hi], RATE)}} for lo, hi in split(long, RATE)],
        FULL)]
    got = llm.transcribe((long, RATE), language="en", temperature=greedy)
    assert got.text == " ".join(t for t in windows if t) and got.language == "en" and abs(got.seconds - 33.0) < 1e-6
    guessed = llm.transcribe((long, RATE), temperature=greedy)
    assert guessed.language in ("en", "fr")
    short = (long[: 2 * RATE], RATE)
    translated = llm.transcribe(short, language="fr", task="translate", temperature=greedy)
    want = llm.generate([{"prompt": "<|startoftranscript|><|fr|><|translate|><|notimestamps|>",
                          "multi_modal_data": {"audio": short}}], FULL)[0].outputs[0].text.strip()
    assert translated.text == want
    with pytest.raises(InvalidRequestError, match="language 'xx'"):
        llm.transcribe((long, RATE), language="xx")
    for bad in (2.0, (0.0, 1.5), ()):
        with pytest.raises(InvalidRequestError, match="temperature"):
            llm.transcribe(short, temperature=bad)
    # vLLM's other sampling parameters: each window's request takes them (max_tokens within the room)
    for extra in ({"max_tokens": 5}, {"repetition_penalty": 1.3, "top_k": 3}, {"max_tokens": 10_000}):
        plain = dataclasses.replace(FULL, **extra | {"max_tokens": min(extra.get("max_tokens", 60), 60)})
        want = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": short}}], plain)[0].outputs[0].text
        assert llm.transcribe(short, language="en", temperature=(0.0,), **extra).text == want.strip()
    for bad, match in (({"beam_width": 2}, "beam_width"), ({"top_p": 2.0}, "top_p"), ({"max_tokens": 0}, "max_tokens")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.transcribe(short, **bad)
    several = llm.transcribe([(long, RATE), short], temperature=greedy)  # (all windows and guesses in one batch)
    alone = [guessed, llm.transcribe(short, temperature=greedy)]
    assert several == alone
    path = tmp_path / "a.wav"
    path.write_bytes(wav_bytes(long[: 2 * RATE], width=4))
    capsys.readouterr()
    base = ["--model", str(whisper), "--dtype", "float32", "--num-kv-blocks", "2048", "--seed", "5"]
    assert main(["transcribe", str(path), *base, "--language", "fr", "--translate"]) == 0
    assert capsys.readouterr().out.strip() == llm.transcribe(path.read_bytes(), language="fr", task="translate",
                                                             seed=5).text
    other = tmp_path / "b.wav"
    other.write_bytes(wav_bytes(long[2 * RATE : 4 * RATE], width=4))
    texts = [t.text for t in llm.transcribe([path.read_bytes(), other.read_bytes()], language="fr",
                                            task="translate", seed=5)]
    assert main(["transcribe", str(path), str(other), *base, "--language", "fr", "--translate"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{path}: {texts[0]}", f"{other}: {texts[1]}"]
    timed = llm.transcribe(path.read_bytes(), language="en", timestamps=True, seed=5)
    assert main(["transcribe", str(path), *base, "--language", "en", "--format", "srt"]) == 0
    assert capsys.readouterr().out == srt(timed.segments)
    assert main(["transcribe", str(path), str(other), *base, "--language", "en", "--format", "verbose_json"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"==> {path} <==\n") and f"==> {other} <==" in out
    both = llm.transcribe([path.read_bytes(), other.read_bytes()], language="en", timestamps=True, seed=5)
    same_verbose(json.loads(out.split("\n", 1)[1].split("==>")[0]), verbose_json(both[0], "transcribe"))
    worded = llm.transcribe(path.read_bytes(), language="en", timestamps=True, words=True, seed=5)
    assert main(["transcribe", str(path), *base, "--language", "en", "--format", "verbose_json", "--words"]) == 0
    same_verbose(json.loads(capsys.readouterr().out), verbose_json(worded, "transcribe", words=True))


# -- timestamps, Whisper's rules, windows, formats ------------------------------------------------
def hf_first_pass(model, samples: np.ndarray, n: int, timestamps: bool = True) -> tuple[list[int], list]:
    """HF `generate`'s tokens of a clip's first pass (its prompt left out) and, with timestamps,
    that pass's segments as (start, end, text tokens)."""
    import transformers as tf

    features = tf.WhisperFeatureExtractor(feature_size=80)(samples, sampling_rate=RATE, return_tensors="pt")
    if not timestamps:
        out = model.generate(features["input_features"], language="en", task="transcribe", max_new_tokens=n)
        ids = out[0].tolist()
        return ids[4:] if ids[:4] == [SOT, EN, TRANSCRIBE, NO_TS] else ids, []  # (HF leaves its prompt out)
    out = model.generate(features["input_features"], language="en", task="transcribe", return_timestamps=True,
                         return_segments=True, max_new_tokens=n)
    segments = out["segments"][0]
    first = segments[0]["result"]
    return first.tolist()[3:], [(round(float(s["start"]), 3), round(float(s["end"]), 3),
                                 [t for t in s["tokens"].tolist() if t < STAMP])
                                for s in segments if s["result"] is first]


def hf_processed_logprobs(model, logits: torch.Tensor, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each token's logprob after HF's Whisper processors (begin-suppress, suppress, timestamps,
    in HF's order) at its position, before temperature: OpenAI's whisper's scores."""
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    begin = len(prompt)
    processors = [SuppressTokensAtBeginLogitsProcessor(BEGIN_SUPPRESS, begin), SuppressTokensLogitsProcessor(SUPPRESS),
                  WhisperTimeStampLogitsProcessor(model.generation_config, begin_index=begin)]
    out = []
    for i, tok in enumerate(tokens):
        scores = logits[i : i + 1].clone()
        for p in processors:
            scores = p(torch.tensor([prompt + tokens[:i]]), scores)
        out.append(torch.log_softmax(scores, dim=-1)[0, tok].item())
    return out


def test_timestamps_are_hfs(whisper, hf_whisper):
    """With timestamps, each window's tokens are HF `generate`'s (return_timestamps: OpenAI's
    timestamp rules, the checkpoint's suppressed tokens), its segments HF's where HF closes them
    (its text left open at the window's end one more, ending with the window), the no-speech
    probability and average logprob HF's model's; several clips in one batch as alone."""
    clips = [clip(s, seed=70 + k) for k, s in enumerate((2.0, 3.0, 5.0))]
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
    got = llm.transcribe([(c, RATE) for c in clips], language="en", timestamps=True, temperature=(0.0,))
    assert llm.engine.runner.images_encoded == 3  # (each window's no-speech request hears it in the same encode)
    for x, t in zip(clips, got, strict=True):
        tokens, segments = hf_first_pass(hf_whisper, x, 61)  # (64 positions, 3 of the prompt)
        mine = [(s.start, s.end, [tok for tok in s.tokens if tok < STAMP]) for s in t.segments]
        assert len(segments) >= 2 and mine[: len(segments)] == segments
        # the window's tokens are the segments' in order, each between its two timestamps (one
        # timestamp may close a segment and open the next)
        want, at = tokens[: tokens.index(2)] if 2 in tokens else tokens, 0
        for s in t.segments:
            at -= want[at : at + len(s.tokens)] != list(s.tokens)
            assert want[at : at + len(s.tokens)] == list(s.tokens)
            at += len(s.tokens)
        assert at == len(want)
        assert t.text == " ".join(s.text.strip() for s in t.segments if s.text.strip())
        import transformers as tf

        features = tf.WhisperFeatureExtractor(feature_size=80)(x, sampling_rate=RATE, return_tensors="pt")
        with torch.no_grad():
            logits = hf_whisper(input_features=features["input_features"],
                                decoder_input_ids=torch.tensor([[SOT, EN, TRANSCRIBE, *tokens]])).logits[0].float()
        said = hf_processed_logprobs(hf_whisper, logits[2:], [SOT, EN, TRANSCRIBE], tokens)
        n = len(tokens) - (tokens[-1] == 2)  # (OpenAI's: the end's logprob counts, not as a token)
        assert t.segments[0].avg_logprob == pytest.approx(sum(said) / (n + 1), abs=1e-4)
        assert t.segments[0].no_speech_prob == pytest.approx(torch.softmax(logits[0], -1)[NO_SPEECH].item(), rel=1e-4)
    alone = llm.transcribe((clips[1], RATE), language="en", timestamps=True, temperature=(0.0,))
    assert [s.tokens for s in alone.segments] == [s.tokens for s in got[1].segments]
    assert [s.avg_logprob for s in alone.segments] == pytest.approx([s.avg_logprob for s in got[1].segments], abs=1e-5)


def test_plain_transcripts_follow_generation_config(whisper, hf_whisper):
    """Without timestamps, the text is that of HF `generate`'s tokens: the checkpoint's
    suppressed tokens and those not drawn first apply too."""
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
    clips = [clip(s, seed=80 + k) for k, s in enumerate((1.5, 4.0, 6.0))]
    got = llm.transcribe([(c, RATE) for c in clips], language="en", temperature=(0.0,))
    tok = llm.engine.tokenizer
    for x, t in zip(clips, got, strict=True):
        tokens, _ = hf_first_pass(hf_whisper, x, 60, timestamps=False)
        assert not set(tokens) & set(SUPPRESS) and tokens[0] not in BEGIN_SUPPRESS
        assert t.text == tok.decode([i for i in tokens if i != 2], skip_special_tokens=True).strip()
    # (without the rules, the model's first token would be one never drawn)
    assert hf_greedy(hf_whisper, clips[0], [SOT, EN, TRANSCRIBE, NO_TS], 1)[0] in SUPPRESS


def test_whispers_rules_are_hfs_processors():
    """`WhisperRules`' masks and the sampler's choice of a timestamp over text leave the same
    tokens drawable as HF's suppress, begin-suppress and timestamp processors in HF's order, over
    random outputs so far (text and timestamps mixed) and random logits."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    from conveyor.runner.sampler import Sampler

    vocab, none, end, head = 60, 29, 3, 4
    begin = none + 1
    config = GenerationConfig(no_timestamps_token_id=none, eos_token_id=end, max_initial_timestamp_index=6)
    rules = WhisperRules(suppress=(5, 9), begin_suppress=(11, end), timestamp_begin=begin, end=end,
                         max_initial_timestamp=6)
    hf = [SuppressTokensAtBeginLogitsProcessor([11, end], begin_index=head), SuppressTokensLogitsProcessor([5, 9]),
          WhisperTimeStampLogitsProcessor(config, begin_index=head)]

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.one_of(st.integers(10, 28), st.integers(begin, vocab - 1)), max_size=8),
           st.integers(0, 2**31 - 1), st.floats(0.0, 4.0))
    def check(output: list[int], seed: int, stamp_boost: float) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(1, vocab, generator=g)
        logits[0, begin:] += stamp_boost  # (timestamps often the likelier)
        ids = torch.tensor([[1, 2, 3, 4][:head] + output])
        want = logits.clone()
        for p in hf:
            want = p(ids, want)
        banned, ranges = rules.bans(output, vocab)
        allowed = torch.ones(1, vocab, dtype=torch.bool)
        allowed[0, banned] = False
        for lo, hi in ranges:
            allowed[0, lo:hi] = False
        mine = Sampler._timestamp_or_text(logits.masked_fill(~allowed, float("-inf")), begin, torch.tensor([True]))
        assert torch.equal(torch.isinf(mine), torch.isinf(want)), (output, torch.isinf(mine) ^ torch.isinf(want))
        assert torch.equal(mine[~torch.isinf(mine)], want[~torch.isinf(want)])

    check()


def test_windows_are_cut_in_quiet():
    """A clip over 30 s is cut in the quietest tenth of a second of each window's last second,
    at its middle; the windows cover the clip, each at most 30 s."""
    rate = 16000
    x = clip(65.0, seed=90)
    x[int(29.3 * rate) : int(29.45 * rate)] = 0.0
    cuts = split(x, rate)
    assert cuts[0] == (0, int(29.35 * rate)) and len(cuts) == 3 and cuts[-1][1] == len(x)
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(cuts))
    assert all(hi - lo <= 30 * rate for lo, hi in cuts) and all(hi - lo >= 29 * rate for lo, hi in cuts[:-1])
    assert split(x[: 30 * rate], rate) == [(0, 30 * rate)]
    quiet = int(29.35 * rate)
    assert split(x[: 30 * rate + 320], rate) == [(0, quiet), (quiet, 30 * rate + 320)]  # (past 30 s)
    assert split(x[: 59 * rate], rate)[-1] == (quiet, 59 * rate)
    assert len(split(np.zeros(30 * rate + 100, np.float32), rate)) == 2


def test_subtitle_formats():
    from conveyor.transcribe import Segment, Transcription

    segs = (Segment(0, 0.0, 3.32, " Hello --> there.", (STAMP, 5, STAMP + 166), 0, 0.0, -0.25, 1.1, 0.01),
            Segment(1, 3.32, 3725.5, " Bye.", (STAMP + 166, 6, STAMP + 300), 0, 0.0, -0.25, 1.1, 0.01))
    assert srt(segs) == ("1\n00:00:00,000 --> 00:00:03,320\nHello -> there.\n\n"
                         "2\n00:00:03,320 --> 01:02:05,500\nBye.\n\n")
    assert vtt(segs) == ("WEBVTT\n\n00:00:00.000 --> 00:00:03.320\nHello -> there.\n\n"
                         "00:00:03.320 --> 01:02:05.500\nBye.\n\n")
    out = verbose_json(Transcription("Hello --> there. Bye.", "en", 3725.5, segs), "transcribe")
    assert out["language"] == "english" and out["duration"] == 3725.5 and out["task"] == "transcribe"
    assert out["segments"][1] == {"id": 1, "seek": 0, "start": 3.32, "end": 3725.5, "text": " Bye.",
                                  "tokens": [STAMP + 166, 6, STAMP + 300], "temperature": 0.0, "avg_logprob": -0.25,
                                  "compression_ratio": 1.1, "no_speech_prob": 0.01}


def test_temperature_fallback(whisper, monkeypatch):
    """A temperature of 0 falls back as OpenAI's whisper does: a window whose decode loops (its
    text compresses more than 2.4 times) or is unsure (average logprob under -1) is decoded again
    at 0.2, 0.4 ... 1.0 until one passes (the last kept whatever its scores), unless its
    no-speech probability is over 0.6; each try is the decode that temperature alone gives."""
    import conveyor.transcribe as transcribe

    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
    x = (clip(3.0, seed=95), RATE)

    def tokens(t):
        return [s.tokens for s in t.segments]

    alone = {t: llm.transcribe(x, language="en", timestamps=True, temperature=(t,), seed=3)
             for t in transcribe.FALLBACK}
    first = alone[0.0].segments[0]
    assert first.compression_ratio > 2.4 or first.avg_logprob < -1  # (the random model's greedy decode loops)
    passes = [t for t, r in alone.items() if r.segments[0].compression_ratio <= 2.4 and r.segments[0].avg_logprob >= -1]
    chosen = passes[0] if passes else 1.0
    fell = llm.transcribe(x, language="en", timestamps=True, seed=3)
    assert llm.engine.runner.images_encoded == 1  # (every try hears the clip the encoder cache keeps)
    assert {s.temperature for s in fell.segments} == {chosen} and tokens(fell) == tokens(alone[chosen])
    assert fell.segments[0].avg_logprob == pytest.approx(alone[chosen].segments[0].avg_logprob, abs=1e-5)
    # thresholds never failed, or the window silent: the greedy decode stays
    monkeypatch.setattr(transcribe, "COMPRESSION_MAX", 1e9)
    monkeypatch.setattr(transcribe, "LOGPROB_MIN", -1e9)
    assert tokens(llm.transcribe(x, language="en", timestamps=True, seed=3)) == tokens(alone[0.0])
    monkeypatch.undo()
    monkeypatch.setattr(transcribe, "NO_SPEECH_MAX", 0.0)
    assert tokens(llm.transcribe(x, language="en", timestamps=True, seed=3)) == tokens(alone[0.0])


# -- word timestamps --------------------------------------------------------------------------------
def test_cross_weights_are_hfs(whisper, hf_whisper):
    """The engine's cross-attention probabilities of the alignment heads over a clip's decoder
    tokens equal HF's attentions (eager) on the same weights, several clips at once."""
    import transformers as tf

    hf = tf.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
    fe = tf.WhisperFeatureExtractor(feature_size=80)
    clips = [clip(s, seed=100 + k) for k, s in enumerate((1.0, 4.0))]
    features = [fe(x, sampling_rate=RATE, return_tensors="pt")["input_features"][0] for x in clips]
    tokens = [[SOT, EN, TRANSCRIBE, NO_TS, 70, 80, 90, 2], [SOT, FR, TRANSLATE, NO_TS, 5, 2]]
    heads = [(1, 0), (1, 3), (0, 2)]
    got = llm.engine.cross_weights(features, tokens, heads)
    for f, ids, mine in zip(features, tokens, got, strict=True):
        with torch.no_grad():
            out = hf(input_features=f[None], decoder_input_ids=torch.tensor([ids]), output_attentions=True)
        torch.testing.assert_close(mine, torch.stack([out.cross_attentions[a][0, h] for a, h in heads]),
                                   rtol=0, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="alignment heads"):
        llm.engine.cross_weights(features[:1], tokens[:1], [(2, 0)])


def test_dtw_and_median_filter_are_hfs():
    """The path through a cost matrix and the median filter equal HF's (`_dynamic_time_warping`,
    `_median_filter`, ported from OpenAI's), ties included, over random matrices."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter

    from conveyor.alignment import dtw, median_filter

    @settings(max_examples=150, deadline=None)
    @given(st.integers(1, 9), st.integers(1, 40), st.integers(0, 2**31 - 1), st.booleans())
    def check(n: int, m: int, seed: int, ties: bool) -> None:
        g = np.random.default_rng(seed)
        cost = g.integers(0, 3, (n, m)).astype(np.float64) if ties else g.standard_normal((n, m))
        rows, cols = dtw(cost)
        want_rows, want_cols = _dynamic_time_warping(cost)
        assert rows.tolist() == list(want_rows) and cols.tolist() == list(want_cols)
        x = torch.from_numpy(g.standard_normal((2, n, m)))
        torch.testing.assert_close(median_filter(x, 7), _median_filter(x, 7))

    check()


def test_words_are_split_and_punctuation_merged():
    """Words start at a leading space or a punctuation mark (every character group where a
    language has no spaces); opening marks join the next word, closing ones the word before;
    a word starts at its first token's time and ends at the next word's start."""
    from conveyor.alignment import merge_punctuation, split_words

    pieces = {10: " Hello", 11: ",", 12: " wor", 13: "ld", 14: ' "', 15: "yes", 16: '"', 17: " (", 18: " ok", 19: ")."}

    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids)

    tokens = list(pieces)
    words = split_words(tokens, decode, "en")
    assert [w.word for w in words] == [" Hello", ",", " world", ' "yes', '"', " (", " ok)."]
    assert [w.tokens for w in words][2] == [12, 13]
    merged = merge_punctuation(words)
    assert [w.word for w in merged] == [" Hello,", " world", ' "yes"', " ( ok)."]
    assert [w.tokens for w in merged][3] == [17, 18, 19]
    assert [w.word for w in split_words([12, 13], decode, "ja")] == [" wor", "ld"]


def test_word_timestamps(whisper, hf_whisper):
    """`LLM.transcribe(words=True)`: each window's words and times as OpenAI's whisper aligns them
    (its alignment heads' cross-attention, renormalized over the window's own positions,
    standardized, median-filtered, averaged, walked by HF's dynamic time warping), in the clip's
    time; the words spell the text, in order."""
    import transformers as tf
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter

    def encodes(llm):  # the clips through the encoder, steps and alignment pass alike
        model, counted = llm.engine.runner.model, []
        real = model.encode
        model.encode = lambda features: (counted.append(len(features)), real(features))[1]
        return counted

    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
    counted = encodes(llm)
    long = np.concatenate([clip(30.0, seed=110), clip(5.0, seed=111)])
    got = llm.transcribe((long, RATE), language="en", words=True, temperature=(0.0,))
    assert " ".join(w.word for w in got.words) == got.text and len(got.words) > 10
    assert sum(counted) == 2  # (the alignment pass reads the encoder cache's outputs of the two windows)
    llm.reset_mm_cache()
    assert llm.transcribe((long, RATE), language="en", words=True, temperature=(0.0,)).words == got.words
    assert sum(counted) == 4  # (emptied: the windows encoded again, once)
    bare = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16, encoder_cache_tokens=0)
    counted = encodes(bare)
    assert bare.transcribe((long, RATE), language="en", words=True, temperature=(0.0,)).words == got.words
    assert sum(counted) == 4  # (without it, the pass encodes both windows again: the same words)
    windows = split(long, RATE)
    plain = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": (long[lo:hi], RATE)}} for lo, hi in windows],
                         FULL)
    hf = tf.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    fe = tf.WhisperFeatureExtractor(feature_size=80)
    heads = [(layer, h) for layer in (1,) for h in range(4)]  # (none named: OpenAI's, the second half's heads)
    want = []
    for (lo, hi), out in zip(windows, plain, strict=True):
        text = [t for t in out.outputs[0].token_ids if 4 <= t < SOT]
        ids = [SOT, EN, TRANSCRIBE, NO_TS, *text[:59], 2]  # (at most the decoder's 64 positions)
        with torch.no_grad():
            att = hf(input_features=fe(long[lo:hi], sampling_rate=RATE, return_tensors="pt")["input_features"],
                     decoder_input_ids=torch.tensor([ids]), output_attentions=True).cross_attentions
        w = torch.stack([att[a][0, h] for a, h in heads]).double()[:, :, : int(np.ceil((hi - lo) / 160)) // 2]
        w = w / w.sum(-1, keepdim=True)
        w = (w - w.mean(-2, keepdim=True)) / w.std(-2, keepdim=True, unbiased=False)
        matrix = _median_filter(w, 7).mean(0)[3:-1]
        rows, cols = _dynamic_time_warping(-matrix.numpy())
        times = np.asarray(cols)[np.diff(rows, prepend=-1).astype(bool)] * 0.02
        times = np.concatenate([times, np.full(len(text) + 1 - len(times), times[-1])])  # (tokens past 64: the last)
        want += [(f"w{t}", round(lo / RATE + times[i], 2), round(lo / RATE + times[i + 1], 2))
                 for i, t in enumerate(text)]
    assert [(w.word, w.start, w.end) for w in got.words] == want
    assert all(a.start <= b.start for a, b in itertools.pairwise(got.words))
    timed = llm.transcribe((long, RATE), language="en", words=True, timestamps=True, temperature=(0.0,))
    assert timed.words and timed.segments and " ".join(w.word for w in timed.words) == timed.text


def test_word_timestamps_over_replicas(whisper, tmp_path):
    """Behind replicas (`--data-parallel-size 2`), word timestamps are one replica's pass: the
    same words as `LLM.transcribe`'s."""
    import httpx

    from tests.models.test_qwen2_audio import wav_bytes
    from tests.server.conftest import ServerProcess

    x = wav_bytes(clip(3.0, seed=120))
    llm = LLM(model=str(whisper), dtype="float32", num_kv_blocks=2048, block_size=16)
    want = llm.transcribe(x, language="en", words=True, temperature=0.4, seed=2)
    del llm
    server = ServerProcess(["--model", str(whisper), "--dtype", "float32", "--num-kv-blocks", "2048",
                            "--data-parallel-size", "2"], tmp_path / "server.log")
    try:
        server.wait_ready()
        with httpx.Client(timeout=60.0) as client:
            r = client.post(server.url + "/v1/audio/transcriptions", files={"file": ("a.wav", x, "audio/wav")},
                            data={"model": str(whisper), "language": "en", "response_format": "verbose_json",
                                  "timestamp_granularities[]": "word", "temperature": "0.4", "seed": "2"})
            assert r.status_code == 200, r.text
            assert r.json()["words"] == [dataclasses.asdict(w) for w in want.words] and want.words
    finally:
        server.stop()
