"""Audio in prompts: what the audio side costs beside text of the same length, and what reading
only the positions a clip's tokens depend on saves against HF's tower, which reads 30 seconds
whatever the clip.

A random-weight Qwen2-Audio (transformers' `Qwen2AudioForConditionalGeneration`) with a Whisper
encoder of whisper-small's shape (768 wide, 12 layers, 12 heads, 128 mel bins) and a text model of
SmolLM2-135M's shape (Qwen2's q/k/v biases), in float32.

Engine runs: the same `--batch` requests (one clip of `--seconds` and 20 words each, greedy,
`--max-tokens` each, no early end), in turns after a warm-up round each (images.py's `in_turns`):

  audio      each prompt with its clip (features made and the tower run for every one: no
             encoder cache)
  text       the same prompts with the audio tokens as ordinary tokens (same length, no tower)
  encoder    the audio prompts on an engine whose encoder cache holds their clips

Encoder budget runs (`--budget N ...`): `--batch` text requests (20 words, 64 outputs) decode;
after 4 steps `--batch` requests with a clip each (and 20 words, 16 outputs) arrive at once. An
engine with no budget encodes every clip in the step that admits them, and the text requests'
decodes wait for it; `max_num_encoder_input_tokens=N` encodes at most N clip tokens a step. Each
engine runs the same arrivals `--rounds` times, in turns after a warm-up; the figures are the text
requests' longest gap between two tokens, the clip requests' mean and longest time to first token,
and the whole run's time, each the median over the rounds.

Tower runs (`--tower`): one clip of each length through conveyor's tower (the positions its tokens
read) and through HF's `Qwen2AudioEncoder` and projector on the same weights (all 1500 positions,
the padding masked), alternately, `--rounds` times each; the figure is conveyor's time over HF's.

    python benchmarks/audio.py --batch 8 --seconds 5 --rounds 3
    python benchmarks/audio.py --tower 1 5 15 30 --rounds 5
    python benchmarks/audio.py --budget 0 125 250 --batch 8 --seconds 5 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from images import in_turns, report

from conveyor import LLM, SamplingParams
from conveyor.audio import Audio, audio_tokens

TEXT = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
            model_type="qwen2")
AUDIO = dict(num_mel_bins=128, encoder_layers=12, encoder_attention_heads=12, encoder_ffn_dim=3072, d_model=768,
             max_source_positions=1500)
AUDIO_TOKEN = 49151
RATE = 16000


def build(folder: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen2AudioConfig(audio_config=AUDIO, text_config=TEXT, audio_token_index=AUDIO_TOKEN)
    tf.Qwen2AudioForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def clips(n: int, seconds: float) -> list[np.ndarray]:
    g = np.random.default_rng(1)
    t = np.arange(int(seconds * RATE)) / RATE
    return [(0.1 * np.sin(2 * np.pi * g.uniform(100, 3000) * t) + 0.02 * g.standard_normal(t.shape)).astype(np.float32)
            for _ in range(n)]


def engine_runs(path: str, args: argparse.Namespace) -> None:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    plain = LLM(path, kv_cache_memory=512 << 20, max_model_len=1024, enable_prefix_caching=False,
                encoder_cache_tokens=0)
    encoder = LLM(path, kv_cache_memory=512 << 20, max_model_len=1024, enable_prefix_caching=False,
                  encoder_cache_tokens=args.batch * 800)
    samples = clips(args.batch, args.seconds)
    per = audio_tokens(int(np.ceil(len(samples[0]) / 160)))
    words = [[100 + 20 * i + j for j in range(20)] for i in range(args.batch)]
    with_audio = [{"prompt_token_ids": [1, AUDIO_TOKEN, *w], "multi_modal_data": {"audio": Audio(c, RATE)}}
                  for w, c in zip(words, samples, strict=True)]
    as_text = [[1, *([500 + i] * per), *w] for i, w in enumerate(words)]
    runs = {
        "audio": lambda: plain.generate(with_audio, params, use_tqdm=False),
        "text": lambda: plain.generate(as_text, params, use_tqdm=False),
        "encoder": lambda: encoder.generate(with_audio, params, use_tqdm=False),
    }
    times, ratios = in_turns(runs, args.rounds, args.max_tokens, "text")
    print(f"{args.batch} requests of {len(as_text[0])} prompt tokens ({per} of a {args.seconds:g} s clip) and "
          f"{args.max_tokens} outputs, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    report(times, ratios, "text")


def budget_runs(path: str, args: argparse.Namespace) -> None:
    samples = clips(args.batch, args.seconds)
    per = audio_tokens(int(np.ceil(len(samples[0]) / 160)))
    engines = {n: LLM(path, kv_cache_memory=512 << 20, max_model_len=1024, enable_prefix_caching=False,
                      encoder_cache_tokens=0, max_num_encoder_input_tokens=n or None).engine for n in args.budget}
    text_params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    clip_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def once(engine: Any) -> tuple[float, float, float, float]:
        for i in range(args.batch):
            engine.add_request(f"t{i}", [1, *range(100 + 20 * i, 120 + 20 * i)], text_params, stream=True)
        start = time.perf_counter()
        seen: dict[str, list[float]] = {}
        added: dict[str, float] = {}
        steps = 0
        while engine.has_unfinished_requests() or steps < 4:
            if steps == 4:
                for i, c in enumerate(samples):
                    added[f"a{i}"] = time.perf_counter()
                    engine.add_request(f"a{i}", {"prompt_token_ids": [1, AUDIO_TOKEN, *range(300 + 20 * i, 320 + 20 * i)],
                                                 "multi_modal_data": {"audio": Audio(c, RATE)}}, clip_params, stream=True)
            for out in engine.step():
                got = seen.setdefault(out.request_id, [])
                got.extend([time.perf_counter()] * (len(out.outputs[0].token_ids) - len(got)))
            steps += 1
        total = time.perf_counter() - start
        gaps = [b - a for rid, ts in seen.items() if rid.startswith("t") for a, b in itertools.pairwise(ts)]
        ttft = [seen[rid][0] - t for rid, t in added.items()]
        return max(gaps), statistics.mean(ttft), max(ttft), total

    for engine in engines.values():
        once(engine)  # (warm-up)
    got: dict[int, list[tuple[float, float, float, float]]] = {n: [] for n in args.budget}
    for r in range(args.rounds):
        for n in (args.budget if r % 2 == 0 else list(reversed(args.budget))):
            got[n].append(once(engines[n]))
    print(f"{args.batch} text requests decoding, {args.batch} clips of {args.seconds:g} s ({per} tokens each) arriving "
          f"at step 4; {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    print(f"{'budget':>8} {'text max gap s':>15} {'clip TTFT mean s':>17} {'clip TTFT max s':>16} {'total s':>8}")
    for n, runs in got.items():
        cols = [statistics.median(x) for x in zip(*runs, strict=True)]
        print(f"{n or 'none':>8} {cols[0]:15.3f} {cols[1]:17.3f} {cols[2]:16.3f} {cols[3]:8.2f}")


def tower_runs(path: str, args: argparse.Namespace) -> None:
    import transformers as tf

    hf = tf.Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, kv_cache_memory=64 << 20, max_model_len=1024)
    ours = llm.engine.runner.model.vision
    processor = llm.engine.image_processor
    fe = tf.WhisperFeatureExtractor(feature_size=128)
    print(f"tower alone: conveyor's (the positions a clip's tokens read) against HF's (1500), {args.rounds} "
          f"rounds, torch threads {torch.get_num_threads()}")
    print(f"{'clip s':>6} {'tokens':>6} {'conveyor ms':>11} {'HF ms':>8} {'ratio':>12}")
    for seconds in args.tower:
        x = clips(1, seconds)[0]
        pixels = processor.audio(Audio(x, RATE))
        inputs = fe([x], sampling_rate=RATE, return_attention_mask=True, padding="max_length", return_tensors="pt")
        lengths, tokens = hf.model.audio_tower._get_feat_extract_output_lengths(inputs["attention_mask"].sum(-1))
        keys = torch.arange(1500)[None, :] < lengths[:, None]
        bias = torch.zeros(1, 1, 1500, 1500).masked_fill(~keys[:, None, None, :], float("-inf"))

        def theirs(features: torch.Tensor = inputs["input_features"], bias: torch.Tensor = bias,
                   n: int = int(tokens[0])) -> torch.Tensor:
            with torch.inference_mode():
                h = hf.model.audio_tower(features, attention_mask=bias).last_hidden_state
                return hf.model.multi_modal_projector(h)[0, :n]

        def mine(pixels: Any = pixels) -> torch.Tensor:
            return ours([pixels])[0]

        torch.testing.assert_close(mine(), theirs(), rtol=1e-3, atol=1e-3)  # (and warm)
        spent: dict[str, list[float]] = {"mine": [], "theirs": []}
        for r in range(args.rounds):
            for name, run in ((("mine", mine), ("theirs", theirs)) if r % 2 == 0 else (("theirs", theirs), ("mine", mine))):
                start = time.perf_counter()
                run()
                spent[name].append(time.perf_counter() - start)
        ratios = [a / b for a, b in zip(spent["mine"], spent["theirs"], strict=True)]
        print(f"{seconds:6g} {int(tokens[0]):6d} {1e3 * statistics.median(spent['mine']):11.1f} "
              f"{1e3 * statistics.median(spent['theirs']):8.1f} {min(ratios):5.2f}-{max(ratios):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tower", type=float, nargs="*", help="clip lengths (s): time the tower alone against HF's")
    ap.add_argument("--budget", type=int, nargs="*", help="encoder budgets (0: none): clips arriving among decodes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build(Path(tmp) / "qwen2_audio"))
        if args.tower:
            tower_runs(path, args)
        elif args.budget:
            budget_runs(path, args)
        else:
            engine_runs(path, args)


if __name__ == "__main__":
    main()
