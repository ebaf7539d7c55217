"""Images in prompts: what the vision side costs beside text of the same length, and what the
prefix cache gives back for an image seen before.

A random-weight LLaVA (transformers' `LlavaForConditionalGeneration`) with a CLIP ViT-B/16
tower at 224 pixels (196 image tokens an image, 11 of its 12 layers read) and a text model of
SmolLM2-135M's shape, in float32. The same `--batch` requests (one picture and 20 words each,
greedy, `--max-tokens` each, no early end) run as:

  images     each prompt with its picture (the tower encodes every one: no encoder cache)
  text       the same prompts with the image tokens as ordinary tokens (same length, no tower)
  encoder    the image prompts on an engine whose encoder cache holds their pictures
             (`encoder_cache_tokens`; no prefix cache): the tower skipped, the prompts computed
  cached     the image prompts again on an engine with the prefix cache that has seen them

in turns (A B C, then C B A ...), after a warm-up round each; the figure is the batch's wall
time and its ratio to the text run in the same turn.

    python benchmarks/images.py --batch 16 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from conveyor import LLM, ImagePrompt, SamplingParams

TEXT = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
            model_type="llama")
VISION = dict(model_type="clip_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, image_size=224, patch_size=16)
IMAGE_TOKEN = 49151


def build(folder: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlavaConfig(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE_TOKEN)
    tf.LlavaForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def pictures(n: int) -> list:
    from PIL import Image

    g = torch.Generator().manual_seed(1)
    return [Image.fromarray(torch.randint(0, 256, (240, 320, 3), generator=g, dtype=torch.uint8).numpy(), "RGB")
            for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build(Path(tmp) / "llava"))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        plain = LLM(path, kv_cache_memory=512 << 20, max_model_len=1024, enable_prefix_caching=False,
                    encoder_cache_tokens=0)
        encoder = LLM(path, kv_cache_memory=512 << 20, max_model_len=1024, enable_prefix_caching=False,
                      encoder_cache_tokens=args.batch * 256)
        cached = LLM(path, kv_cache_memory=512 << 20, max_model_len=1024, enable_prefix_caching=True)
        per = plain.engine.arch.vision.tokens_per_image  # type: ignore[attr-defined]
        images = pictures(args.batch)
        words = [[100 + 20 * i + j for j in range(20)] for i in range(args.batch)]
        with_images = [ImagePrompt([1, IMAGE_TOKEN, *w], (im,)) for w, im in zip(words, images, strict=True)]
        as_text = [[1, *([500 + i] * per), *w] for i, w in enumerate(words)]  # the same length, no tower
        runs = {
            "images": lambda: plain.generate(with_images, params, use_tqdm=False),
            "text": lambda: plain.generate(as_text, params, use_tqdm=False),
            "encoder": lambda: encoder.generate(with_images, params, use_tqdm=False),
            "cached": lambda: cached.generate(with_images, params, use_tqdm=False),
        }
        # (the warm-up is also the cached engine's first sight of the images)
        times, ratios = in_turns(runs, args.rounds, args.max_tokens, "text")
        print(f"{args.batch} requests of {len(as_text[0])} prompt tokens ({per} of an image) and {args.max_tokens} "
              f"outputs, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
        report(times, ratios, "text")


def in_turns(runs: dict[str, Callable[[], list[Any]]], rounds: int, max_tokens: int, baseline: str
             ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each run once to warm up, then `rounds` turns (in order, then reversed, ...): each run's
    wall times, and their ratios to `baseline`'s in the same turn; every request must give
    `max_tokens` outputs."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    ratios: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        turn = {}
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            start = time.perf_counter()
            outs = runs[name]()
            turn[name] = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        for name in runs:
            times[name].append(turn[name])
            ratios[name].append(turn[name] / turn[baseline])
    return times, ratios


def report(times: dict[str, list[float]], ratios: dict[str, list[float]], baseline: str) -> None:
    print(f"{'run':8} {'median s':>9} {'vs ' + baseline:>14}")
    for name in times:
        print(f"{name:8} {statistics.median(times[name]):9.3f} {min(ratios[name]):6.2f}-{max(ratios[name]):.2f}x")


if __name__ == "__main__":
    main()
