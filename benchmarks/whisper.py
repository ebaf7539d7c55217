"""Whisper: transcribing many clips at once against one at a time, and against HF transformers'
batched `generate` on the same weights.

A random-weight Whisper of whisper-base's shape (512 wide, 6 encoder and 6 decoder layers, 8 heads,
80 mel bins, a vocabulary of 51,865), float32. `--batch` clips of `--seconds` each, each decoded
greedily for `--max-tokens` tokens after the 4-token task prompt, no early end. Runs, in turns after
a warm-up, `--rounds` rounds:

  conveyor   all the requests in one `LLM.generate` (continuous batching: the clips encoded in
             one batch, the decodes side by side)
  one        the same requests one `LLM.generate` each, in turn
  hf         HF's `generate` over the batch (its encoder once over all clips, then the decoder
             with its KV cache; GenerationMixin's greedy loop, none of Whisper's own rules but
             with `--timestamps`)

With `--timestamps`, every run decodes by Whisper's timestamp rules (the prompt without
`<|notimestamps|>`; OpenAI's rules with the blank and the end not drawn first: conveyor's
`WhisperRules` in its sampler, HF's `SuppressTokensAtBegin` and `WhisperTimeStamp` logits
processors in its `generate`), every request for exactly its tokens (the end held back until
then, `min_tokens` / `min_new_tokens`), and one more run is timed:

  plain      conveyor's requests without the rules (the task prompt with `<|notimestamps|>`):
             what the rules cost a step

Every run starts with the encoder cache emptied (`LLM.reset_mm_cache`): each encodes its clips.
With `--words`, after the rounds, word timestamps' alignment pass (`Engine.cross_weights`: the
clips' encoder outputs from the encoder cache after a batch's transcription, `align`, or with
the cache emptied the encoder again, `align cold`; the decoder over each clip's prompt and
answer, the alignment heads' attention
kept; OpenAI's heads, the second half's) is timed over the batch's answers, `--rounds` times,
against conveyor's batch.

With `--varied`, request k asks for `max_tokens * (k + 1) / batch` tokens (answers of different
lengths, as a batch of real clips has): conveyor's finished requests leave the batch, while HF's
static batch decodes until the longest is done (what it must do without per-request ends).
The figure is each run's wall time and its ratio to conveyor's in the same round.

    python benchmarks/whisper.py --batch 8 --seconds 10 --max-tokens 64 --rounds 3
    python benchmarks/whisper.py --batch 8 --seconds 10 --max-tokens 128 --rounds 3 --varied
    python benchmarks/whisper.py --batch 8 --seconds 10 --max-tokens 64 --rounds 3 --timestamps
    python benchmarks/whisper.py --batch 8 --seconds 10 --max-tokens 64 --rounds 3 --words
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from conveyor import LLM, SamplingParams
from conveyor.sampling_params import WhisperRules

SHAPE = dict(vocab_size=51865, num_mel_bins=80, encoder_layers=6, encoder_attention_heads=8, decoder_layers=6,
             decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, d_model=512,
             max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50258, eos_token_id=50257,
             bos_token_id=50257, pad_token_id=50257)
PROMPT = [50258, 50259, 50359, 50363]  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
STAMP, END, BLANK = 50364, 50257, 220  # <|0.00|>, <|endoftext|>, " "
RATE = 16000


def build(folder: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    tf.WhisperForConditionalGeneration(tf.WhisperConfig(**SHAPE)).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def main() -> None:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--varied", action="store_true", help="request k asks max_tokens * (k + 1) / batch tokens")
    ap.add_argument("--timestamps", action="store_true", help="every run by Whisper's timestamp rules")
    ap.add_argument("--words", action="store_true", help="time word timestamps' alignment pass too")
    args = ap.parse_args()
    lengths = [max(1, args.max_tokens * (k + 1) // args.batch) if args.varied else args.max_tokens
               for k in range(args.batch)]
    g = np.random.default_rng(0)
    t = np.arange(int(args.seconds * RATE)) / RATE
    clips = [(0.1 * np.sin(2 * np.pi * g.uniform(100, 3000) * t) + 0.02 * g.standard_normal(t.shape)).astype(np.float32)
             for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "whisper")
        # Each request's cross-attention keys and values take 94 blocks of the cache (1500 encoder
        # positions; 36.9 MB at whisper-base's shape in float32) beside its own: room for all of them.
        need = args.batch * (94 + -(-(4 + args.max_tokens) // 16)) * 2 * 6 * 16 * 512 * 4
        # The encoder cache keeps every clip's encoder output (1500 rows each) for `--words`' pass.
        llm = LLM(str(path), kv_cache_memory=max(256 << 20, need + (16 << 20)),
                  encoder_cache_tokens=max(8192, 1500 * args.batch))
        hf = tf.WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        fe = tf.WhisperFeatureExtractor(feature_size=80)
        features = fe(clips, sampling_rate=RATE, return_tensors="pt")["input_features"]
        plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        prompt, params, processors = PROMPT, plain, None
        if args.timestamps:
            from transformers.generation.logits_process import (
                LogitsProcessorList,
                SuppressTokensAtBeginLogitsProcessor,
                WhisperTimeStampLogitsProcessor,
            )

            prompt = PROMPT[:-1]
            rules = WhisperRules(begin_suppress=(BLANK, END), timestamp_begin=STAMP, end=END, max_initial_timestamp=50)
            params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, whisper=rules) for n in lengths]
            config = tf.GenerationConfig(no_timestamps_token_id=STAMP - 1, eos_token_id=END, max_initial_timestamp_index=50)
            processors = LogitsProcessorList([SuppressTokensAtBeginLogitsProcessor([BLANK, END], len(prompt)),
                                              WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt))])
        requests = [{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (c, RATE)}} for c in clips]
        plain_requests = [{"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (c, RATE)}} for c in clips]

        def untimed() -> list[list[int]]:
            return [list(o.outputs[0].token_ids) for o in llm.generate(plain_requests, plain, use_tqdm=False)]

        def batched() -> list[list[int]]:
            return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]

        def one() -> list[list[int]]:
            return [list(llm.generate([r], [p], use_tqdm=False)[0].outputs[0].token_ids)
                    for r, p in zip(requests, params, strict=True)]

        def theirs() -> list[list[int]]:
            with torch.inference_mode():
                out = tf.GenerationMixin.generate(
                    hf, input_features=features, decoder_input_ids=torch.tensor([prompt] * args.batch),
                    max_new_tokens=max(lengths), min_new_tokens=max(lengths), do_sample=False,
                    logits_processor=processors)
            return [row[:n] for row, n in zip(out[:, len(prompt):].tolist(), lengths, strict=True)]

        runs = {"conveyor": batched, "one": one, "hf": theirs}
        if args.timestamps:
            runs["plain"] = untimed
        mine, ref = batched(), theirs()  # (warm-up, and the two agree on greedy tokens)
        same = mine == ref
        stamps = sum(t >= STAMP for row in mine for t in row)
        one()
        if args.timestamps:
            untimed()
        times: dict[str, list[float]] = {n: [] for n in runs}
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                llm.reset_mm_cache()  # (every run encodes its clips, as HF's does)
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
        told = f"{lengths[0]}-{lengths[-1]} tokens" if args.varied else f"{args.max_tokens} tokens each"
        timed = f", by the timestamp rules ({stamps} of {sum(lengths)} tokens timestamps)" if args.timestamps else ""
        print(f"{args.batch} clips of {args.seconds:g} s, {told}{timed}, {args.rounds} rounds, "
              f"torch threads {torch.get_num_threads()}; greedy tokens equal to HF's: {same}")
        print(f"{'run':9} {'median s':>9} {'vs conveyor':>14}")
        for name, ts in times.items():
            ratios = [a / b for a, b in zip(ts, times["conveyor"], strict=True)]
            print(f"{name:9} {statistics.median(ts):9.3f} {min(ratios):6.2f}-{max(ratios):.2f}x")
        if args.words:
            heads = [(layer, h) for layer in range(3, 6) for h in range(8)]
            clips_read = [llm.engine.prepare_prompt(r)[2][0].pixels for r in plain_requests]  # (conveyor's features)
            values, digests = [p.values for p in clips_read], [p.digest for p in clips_read]
            tokens = [[*prompt, *row] for row in mine]
            took: dict[str, list[float]] = {"align": [], "align cold": []}
            for _ in range(args.rounds):
                llm.reset_mm_cache()
                batched()  # (the clips' encoder outputs in the encoder cache, as after a transcription)
                for name in took:
                    if name == "align cold":
                        llm.reset_mm_cache()
                    start = time.perf_counter()
                    llm.engine.cross_weights(values, tokens, heads, digests)
                    took[name].append(time.perf_counter() - start)
            for name, ts in took.items():
                share = [t / c for t, c in zip(ts, times["conveyor"], strict=True)]
                how = "the encoder's outputs from its cache" if name == "align" else "the encoder again"
                print(f"{name:10} {statistics.median(ts):8.3f} {min(share):6.2f}-{max(share):.2f}x "
                      f"(word timestamps' pass over the {args.batch} answers, {how})")


if __name__ == "__main__":
    main()
