"""Qwen2.5-VL's vision tower at growing image sizes: attention within windows against the
same tower attending over the whole image in every block.

An image becomes as many patches as its size gives (a 14-pixel patch, 4 patches a token), so a
tower that attends over the whole image costs the square of its patches in every block. Qwen2.5-VL
attends within windows of 112 pixels (8x8 patches) in all blocks but four of 32 (`window_size`,
`fullatt_block_indexes`). This runs conveyor's tower (conveyor/models/qwen_vision.py, random
weights) of Qwen2.5-VL's form, scaled down (`--hidden` wide, `--depth` blocks, a whole-image
block every `--full-every`), on square pictures of each `--sizes`, as Qwen2.5-VL has it and
with every block attending over the whole image (the same weights), in turns (A B, then B A),
after a warm-up; the figure is each image's median time and the ratio of the two.

    python benchmarks/qwen_vision.py --sizes 224 448 672 896 1344 --rounds 3

`--engine` measures the text side instead: a random Qwen2-VL (`Qwen2VLForConditionalGeneration`)
whose text model has SmolLM2-135M's shape (M-RoPE sections 8, 12, 12 of its 64-dim heads) and a
small tower, `--batch` requests of one 224-pixel picture (64 tokens) and 20 words each, greedy,
`--max-tokens` outputs, no early end, run as:

  images    the image prompts on an engine whose encoder cache holds their pictures (the tower
            skipped): every decode turns at its index plus its prompt's M-RoPE delta
  text      the same prompts with the image tokens as ordinary tokens (same length)
  modules   the text prompts on an engine with the fused native decode off (every layer a
            torch module: the path a step with 3D positions takes)

in turns after a warm-up; the figure is the batch's wall time and its ratio to the text run.

    python benchmarks/qwen_vision.py --engine --batch 16 --rounds 3

`--video` measures videos on the same model: `--batch` requests of a video of `--frames`
224-pixel frames (upscaled to 336 pixels by Qwen2-VL's video bounds: 144 tokens a two-frame
group) and 20 words each, run as:

  video     the video prompts, frames given, encoder cache off (the tower reads every group)
  cached    the same on an engine whose encoder cache holds them (the tower skipped)
  file      the same videos as MJPG files at 2 frames a second (decoded by OpenCV, all frames
            kept by the 2-a-second sampling), encoder cache off
  text      the same prompts with the video tokens as ordinary tokens (same length)

in turns after a warm-up; the figure is the batch's wall time and its ratio to the text run.

    python benchmarks/qwen_vision.py --video --batch 8 --frames 8 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from images import in_turns, report

from conveyor.models.qwen_vision import QwenVision
from conveyor.models.vision import VisionArch
from conveyor.multimodal import ImageProcessor

TEXT = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 100000.0})
TOWER = dict(depth=4, embed_dim=320, hidden_size=576, num_heads=5, patch_size=14, spatial_merge_size=2)
IMAGE_TOKEN = 49151


def engine_runs(args: argparse.Namespace) -> None:
    import transformers as tf
    from PIL import Image

    from conveyor import LLM, ImagePrompt, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen2_vl"
        torch.manual_seed(0)
        config = tf.Qwen2VLConfig(text_config=TEXT, vision_config=TOWER, image_token_id=IMAGE_TOKEN,
                                  vision_start_token_id=49148, vision_end_token_id=49149, video_token_id=49150)
        tf.Qwen2VLForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        common = dict(kv_cache_memory=512 << 20, max_model_len=1024, enable_prefix_caching=False)
        warm = LLM(str(folder), encoder_cache_tokens=args.batch * 256, **common)
        plain = LLM(str(folder), encoder_cache_tokens=0, **common)
        modules = LLM(str(folder), encoder_cache_tokens=0, **common)
        modules.engine.runner.model.fused_decode = None  # (every step through the modules)
        g = torch.Generator().manual_seed(1)
        pictures = [Image.fromarray(torch.randint(0, 256, (224, 224, 3), generator=g, dtype=torch.uint8).numpy())
                    for _ in range(args.batch)]
        words = [[100 + 20 * i + j for j in range(20)] for i in range(args.batch)]
        with_images = [ImagePrompt([1, 49148, IMAGE_TOKEN, 49149, *w], (im,))
                       for w, im in zip(words, pictures, strict=True)]
        per = warm.engine.arch.vision.image_tokens(warm.engine.image_processor(pictures[0]))  # type: ignore[attr-defined]
        as_text = [[1, 49148, *([500 + i] * per), 49149, *w] for i, w in enumerate(words)]
        runs = {
            "images": lambda: warm.generate(with_images, params, use_tqdm=False),
            "text": lambda: plain.generate(as_text, params, use_tqdm=False),
            "modules": lambda: modules.generate(as_text, params, use_tqdm=False),
        }
        # (the warm-up is also the encoder cache's first sight of the pictures)
        times, ratios = in_turns(runs, args.rounds, args.max_tokens, "text")
        print(f"{args.batch} requests of {len(as_text[0])} prompt tokens ({per} of an image) and {args.max_tokens} "
              f"outputs, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
        report(times, ratios, "text")


def video_runs(args: argparse.Namespace) -> None:
    import cv2
    import numpy as np
    import transformers as tf

    from conveyor import LLM, ImagePrompt, SamplingParams, Video

    video_token = 49150
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen2_vl"
        torch.manual_seed(0)
        config = tf.Qwen2VLConfig(text_config=TEXT, vision_config=TOWER, image_token_id=IMAGE_TOKEN,
                                  vision_start_token_id=49148, vision_end_token_id=49149, video_token_id=video_token)
        tf.Qwen2VLForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        common = dict(kv_cache_memory=512 << 20, max_model_len=2048, enable_prefix_caching=False)
        warm = LLM(str(folder), encoder_cache_tokens=args.batch * 4096, **common)
        plain = LLM(str(folder), encoder_cache_tokens=0, **common)
        g = torch.Generator().manual_seed(1)
        clips = [torch.randint(0, 256, (args.frames, 224, 224, 3), generator=g, dtype=torch.uint8).numpy()
                 for _ in range(args.batch)]
        files = []
        for i, clip in enumerate(clips):
            path = Path(tmp) / f"clip{i}.avi"
            writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 2.0, (224, 224))
            for frame in clip:
                writer.write(np.ascontiguousarray(frame[..., ::-1]))
            writer.release()
            files.append(path.read_bytes())
        words = [[100 + 20 * i + j for j in range(20)] for i in range(args.batch)]
        head = [1, 49148, video_token, 49149]
        given = [ImagePrompt([*head, *w], (Video(c),)) for w, c in zip(words, clips, strict=True)]
        as_files = [ImagePrompt([*head, *w], (Video(f),)) for w, f in zip(words, files, strict=True)]
        vision = warm.engine.arch.vision  # type: ignore[attr-defined]
        per = vision.image_tokens(warm.engine.image_processor.video(Video(clips[0])))  # type: ignore[union-attr]
        as_text = [[1, 49148, *([500 + i] * per), 49149, *w] for i, w in enumerate(words)]
        start = time.perf_counter()
        for f in files:
            plain.engine.image_processor.video(Video(f))  # type: ignore[union-attr]
        decode_ms = (time.perf_counter() - start) / len(files) * 1e3
        runs = {
            "video": lambda: plain.generate(given, params, use_tqdm=False),
            "cached": lambda: warm.generate(given, params, use_tqdm=False),
            "file": lambda: plain.generate(as_files, params, use_tqdm=False),
            "text": lambda: plain.generate(as_text, params, use_tqdm=False),
        }
        times, ratios = in_turns(runs, args.rounds, args.max_tokens, "text")
        print(f"{args.batch} requests of {len(as_text[0])} prompt tokens (a video of {args.frames} frames: {per} "
              f"tokens) and {args.max_tokens} outputs, {args.rounds} rounds, torch threads {torch.get_num_threads()}; "
              f"a file decoded, sampled and resized in {decode_ms:.1f} ms")
        report(times, ratios, "text")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 672, 896, 1344])
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--full-every", type=int, default=8, help="a whole-image block every this many (Qwen2.5-VL: 8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine", action="store_true", help="the text side's decodes (see above)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--video", action="store_true", help="videos on the text side (see above)")
    ap.add_argument("--frames", type=int, default=8)
    args = ap.parse_args()
    if args.video:
        video_runs(args)
        return
    if args.engine:
        engine_runs(args)
        return
    cfg = {"vision_config": {"depth": args.depth, "hidden_size": args.hidden, "intermediate_size": args.hidden * 8 // 3,
                             "num_heads": args.heads, "out_hidden_size": 896, "window_size": 112,
                             "fullatt_block_indexes": list(range(args.full_every - 1, args.depth, args.full_every))}}
    windowed = VisionArch.from_qwen_vl(cfg, 896, "qwen2_5_vl")
    torch.manual_seed(0)
    tower = QwenVision(windowed).eval()
    whole = dataclasses.replace(windowed, window_size=0)
    processor = dataclasses.replace(ImageProcessor._qwen(None, windowed), max_pixels=max(args.sizes) ** 2)  # (unscaled)
    params = sum(p.numel() for p in tower.parameters())
    print(f"tower: {args.depth} blocks {args.hidden} wide ({params / 1e6:.1f}M weights), whole-image blocks "
          f"{list(windowed.full_attention_layers)}, float32, torch threads {torch.get_num_threads()}")
    print(f"{'pixels':>7} {'patches':>8} {'tokens':>7} {'windowed ms':>12} {'whole ms':>9} {'whole/windowed':>15}")
    from PIL import Image

    for side in args.sizes:
        g = torch.Generator().manual_seed(side)
        picture = Image.fromarray(torch.randint(0, 256, (side, side, 3), generator=g, dtype=torch.uint8).numpy())
        pixels = processor(picture).values
        times: dict[str, list[float]] = {"windowed": [], "whole": []}
        configs = {"windowed": windowed, "whole": whole}
        with torch.inference_mode():
            for name in configs:  # warm-up
                tower.config = configs[name]
                tower([pixels])
            for r in range(args.rounds):
                for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
                    tower.config = configs[name]
                    start = time.perf_counter()
                    out = tower([pixels])[0]
                    times[name].append(time.perf_counter() - start)
        patches = pixels.shape[1] * pixels.shape[2] // 14**2
        a, b = statistics.median(times["windowed"]), statistics.median(times["whole"])
        print(f"{side:>7} {patches:>8} {out.shape[0]:>7} {a * 1e3:12.1f} {b * 1e3:9.1f} {b / a:14.2f}x")


if __name__ == "__main__":
    main()
