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
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from conveyor.models.qwen_vision import QwenVision
from conveyor.models.vision import VisionArch
from conveyor.multimodal import ImageProcessor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 672, 896, 1344])
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--full-every", type=int, default=8, help="a whole-image block every this many (Qwen2.5-VL: 8)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
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
