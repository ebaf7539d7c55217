"""The vision side of an image-text model (LLaVA's form): a ViT encoder and a projector into
the text model's embedding space.

LLaVA (Liu et al. 2023, "Visual Instruction Tuning"; 1.5: "Improved Baselines with Visual
Instruction Tuning") reads an image as a CLIP ViT's patch features taken from one of its
inner layers (`vision_feature_layer`, -2 by default: the one before last), without the class
token (`vision_feature_select_strategy="default"`; "full" keeps it), through a two-layer MLP
(`multi_modal_projector`: linear, GELU, linear). Each image becomes as many embeddings as it
has patches (576 for a 336-pixel image in 14-pixel patches), and they take the place of the
embeddings of as many image tokens in the prompt (conveyor/multimodal.py). The text model
then runs as it does on text: causal attention over the whole sequence.

The tower is CLIP's (a class token, a LayerNorm before the encoder, quick GELU) or SigLIP's (no
class token, GELU with tanh, biased patch convolution); only the layers up to the deepest
feature layer are built, as vLLM does: a LLaVA never reads the last one. Parameter names are
HF's (`vision_tower.vision_model.*`, `multi_modal_projector.*`).

LLaVA-NeXT (Liu et al. 2024, "LLaVA-NeXT: Improved reasoning, OCR, and world knowledge") reads
the whole image at the tower's size and the tiles of its best tiling (`best_resolution` among
`image_grid_pinpoints`), then packs the features: the whole image's, then the tiles' grid cut to
the picture's part of it, each row ending with a learned newline embedding (`LlavaVision.pack`).
Gemma 3 (Gemma Team 2025) takes the SigLIP tower's last hidden states (after its post-norm),
averages them over square pools to `mm_tokens_per_image`, RMS-norms and projects them
(`_PoolingProjector`); its text model lets an image's tokens see each other both ways.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.audio import audio_tokens

if TYPE_CHECKING:
    from conveyor.models.internvl_vision import InternVLVision
    from conveyor.models.pixtral_vision import PixtralVision
    from conveyor.models.qwen_audio import QwenAudio
    from conveyor.models.qwen_vision import QwenVision

# What transformers' CLIPVisionConfig assumes where a checkpoint's `vision_config` is silent
# (LLaVA-1.5's configs list only what differs), and SigLIP's.
CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
}
SIGLIP_VISION_DEFAULTS: dict[str, Any] = {
    **CLIP_VISION_DEFAULTS, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
}
# ... and Pixtral's (Mistral's ViT: conveyor/models/pixtral_vision.py).
PIXTRAL_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_channels": 3, "image_size": 1024, "patch_size": 16, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
}
# ... and InternViT's (transformers' InternVLVisionConfig).
INTERNVL_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_channels": 3, "image_size": 448, "patch_size": 14, "hidden_act": "gelu", "layer_norm_eps": 1e-6,
    "norm_type": "layer_norm", "attention_bias": False, "use_qk_norm": False, "use_mean_pooling": True,
}
VISION_TOWERS = {"clip_vision_model": CLIP_VISION_DEFAULTS, "siglip_vision_model": SIGLIP_VISION_DEFAULTS,
                 "pixtral": PIXTRAL_VISION_DEFAULTS}

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


# Where a checkpoint keeps its vision side's tensors (transformers 4's and 5's names).
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "image_newline", "model.vision_tower.",
                   "model.multi_modal_projector.", "model.image_newline", "visual.", "model.visual.",
                   "audio_tower.", "model.audio_tower.")
# The Qwen-VL styles (conveyor/models/qwen_vision.py).
QWEN_STYLES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# LLaVA-NeXT's default tilings (height, width), where its config names none.
NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


M = TypeVar("M", bound=nn.Module)


class VisionConfigError(ValueError):
    pass


@dataclass(frozen=True)
class VisionArch:
    """An image-text checkpoint's vision side, from its `config.json`: LLaVA's (`style`
    "llava") or Gemma 3's ("gemma3": the SigLIP tower's last hidden states after its post-norm,
    averaged over square pools to `pooled_tokens`, then an RMS norm and one projection; each
    image's tokens see each other both ways in the text model, and stand between a begin- and an
    end-of-image token)."""

    tower: str  # "clip_vision_model" or "siglip_vision_model"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    feature_layers: tuple[int, ...]  # HF's indices into the hidden states (0: the embeddings)
    select_strategy: str  # "default" drops the class token, "full" keeps it
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    style: str = "llava"
    pooled_tokens: int = 0  # Gemma 3's `mm_tokens_per_image`
    boi_token_id: int | None = None  # Gemma 3's `<start_of_image>`: where a prompt places an image
    eoi_token_id: int | None = None
    # LLaVA-NeXT ("llava_next"): the tilings (height, width) an image may be cut to, in tiles of
    # the tower's size, besides the whole image at that size.
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    # LLaVA-OneVision ("llava_onevision"): LLaVA-NeXT's tiles, the grid's features scaled down
    # (bilinear) where they hold more than `max_tiles` tiles' worth by more than 1.1 in side
    # (`vision_aspect_ratio` "anyres_max_9").
    max_tiles: int = 0
    # Qwen2-VL ("qwen2_vl") and Qwen2.5-VL ("qwen2_5_vl", conveyor/models/qwen_vision.py): an image
    # at its own size; `merge_size` x `merge_size` patches make one token; the patch convolution
    # spans `temporal_patch_size` frames; the tower's 2D RoPE base; Qwen2.5-VL's attention windows
    # (pixels a side) outside the blocks of `full_attention_layers`.
    merge_size: int = 1
    temporal_patch_size: int = 1
    rope_theta: float = 10000.0
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()
    # Qwen3-VL ("qwen3_vl"): a learned square grid of position embeddings (resampled to each
    # image's patches), and the blocks whose outputs, merged, are added to the first text layers'
    # outputs at the image's tokens (DeepStack).
    position_embeddings: int = 0
    deepstack_layers: tuple[int, ...] = ()
    # Qwen-VL's videos: the token a prompt places one with (`<|video_pad|>`), and Qwen2.5-VL's
    # rotary time positions a second of video (`tokens_per_second`; 0: one a frame group, Qwen2-VL's).
    video_token_id: int | None = None
    tokens_per_second: float = 0.0
    vision_start_token_id: int = 151652  # (Qwen3-VL frames each group of a video between these)
    vision_end_token_id: int = 151653
    # Pixtral ("pixtral": conveyor/models/pixtral_vision.py): the tokens that end each row of an
    # image's tokens and the last row (`[IMG_BREAK]`, `[IMG_END]`), and Mistral 3's projector's
    # RMS norm epsilon (its merge_size is 2; Pixtral-12B's, in LLaVA's form, 1).
    break_token_id: int = 12
    end_token_id: int = 13
    projector_eps: float = 1e-5
    # InternVL ("internvl": conveyor/models/internvl_vision.py): InternViT's norms ("layer_norm" or
    # "rms_norm"), q/k/v biases, RMS-normed queries and keys, and whether its last output goes
    # unnormed (`use_mean_pooling`); `pooled_tokens` is then each tile's tokens (256).
    norm_type: str = "layer_norm"
    attention_bias: bool = False
    qk_norm: bool = False
    mean_pooling: bool = True

    @property
    def reads_audio(self) -> bool:
        """Qwen2-Audio's ("qwen2_audio", conveyor/models/qwen_audio.py): its items are audio clips
        (`conveyor.audio`), placed by its audio token (`image_token_id`), not images; and
        Whisper's encoder ("whisper", an encoder-decoder's `ArchConfig.encoder`)."""
        return self.style in ("qwen2_audio", "whisper")

    @property
    def tiled(self) -> bool:
        """LLaVA-NeXT's and LLaVA-OneVision's images: the whole image and its best tiling's tiles."""
        return self.style in ("llava_next", "llava_onevision")

    @property
    def is_qwen(self) -> bool:
        return self.style in QWEN_STYLES

    @property
    def reads_videos(self) -> bool:
        """The Qwen-VLs' and LLaVA-OneVision's videos (`conveyor.video`)."""
        return (self.is_qwen or self.style == "llava_onevision") and self.video_token_id is not None

    @property
    def pooled_side(self) -> int:
        """LLaVA-OneVision: a video frame's features a side once pooled (bilinear, half the
        tower's patches a side, rounded up)."""
        return math.ceil(self.image_size // self.patch_size / 2)

    @property
    def timestamps(self) -> bool:
        """Qwen3-VL: a video's frame groups stand apart in the prompt, each after its time in text."""
        return self.style == "qwen3_vl"

    @property
    def own_size(self) -> bool:
        """Whether images are read at (about) their own size, their token count by their pixels
        (Qwen-VL's, Pixtral's), not at the tower's fixed size."""
        return self.is_qwen or self.style == "pixtral"

    def token_grid(self, pixels: Any) -> tuple[int, int]:
        """Qwen-VL, Pixtral: the rows and columns of image embeddings an image (`Pixels`, made to
        multiples of patch x merge pixels a side) becomes."""
        side = self.patch_size * self.merge_size
        return pixels.values.shape[-2] // side, pixels.values.shape[-1] // side

    def mrope_grid(self, pixels: Any) -> tuple[list[int], int, int]:
        """A Qwen-VL image's or video's (time positions, rows, columns) for M-RoPE."""
        return (self.time_positions(pixels), *self.token_grid(pixels))

    def frame_groups(self, pixels: Any) -> int:
        """A Qwen-VL video's frame groups, the frames the tower reads together (an image's: 1)."""
        return pixels.values.shape[0] // self.temporal_patch_size if getattr(pixels, "fps", None) else 1

    def time_positions(self, pixels: Any) -> list[int]:
        """The rotary time position of each of a video's frame groups (an image's: [0]): one a
        group (Qwen2-VL), or `tokens_per_second` a second of video (Qwen2.5-VL: a group spans
        `temporal_patch_size / fps` seconds), floored."""
        groups = self.frame_groups(pixels)
        if not self.tokens_per_second or groups == 1:
            return list(range(groups))
        interval = self.tokens_per_second * self.temporal_patch_size / pixels.fps
        return [int(k * interval) for k in range(groups)]  # (HF's `(arange * interval).long()`)

    def image_tokens(self, pixels: Any) -> int:
        """The tokens an image (`conveyor.multimodal.Pixels`) becomes (Pixtral's: a break or end
        token after each row; InternVL's: its tiles' tokens; a Qwen-VL video's: each frame
        group's)."""
        if self.reads_audio:  # (a clip: its frames halved twice)
            return audio_tokens(pixels.frames)
        if self.style == "internvl":
            return pixels.values.shape[0] * self.pooled_tokens
        if self.style == "llava_onevision" and getattr(pixels, "fps", None):  # (a video: its frames, a newline)
            return pixels.values.shape[0] * self.pooled_side**2 + 1
        if self.tiled and pixels.values.shape[0] == 1:  # (LLaVA-OneVision's image among others: no tiles)
            return self.tokens_per_image + 1
        if self.own_size:
            h, w = self.token_grid(pixels)
            return self.frame_groups(pixels) * h * (w + (self.style == "pixtral"))
        return self.num_tokens(pixels.size)

    def image_layout(self, pixels: Any) -> list[int] | None:
        """Pixtral: the token ids of an image's span (rows of `[IMG]`, each ending with
        `[IMG_BREAK]`, the last with `[IMG_END]`); None where it is the image token repeated."""
        if self.style != "pixtral":
            return None
        rows, cols = self.token_grid(pixels)
        ids = ([self.image_token_id] * cols + [self.break_token_id]) * rows
        ids[-1] = self.end_token_id
        return ids

    def num_tokens(self, size: tuple[int, int] | None) -> int:
        """The tokens an image of `size` (height, width) becomes: LLaVA-NeXT's depend on it
        (the whole image's, then its tiles' grid without the padding, a newline a row)."""
        if not self.tiled:
            return self.tokens_per_image
        assert size is not None
        rows, cols = self.grid_shape(size)
        side = self.image_size // self.patch_size
        height, width = self.scaled(_unpadded(size, rows * side, cols * side))
        return self.tokens_per_image + height * width + height

    def scaled(self, grid: tuple[int, int]) -> tuple[int, int]:
        """LLaVA-OneVision: the unpadded grid's (height, width) after its scaling down, where it
        holds more than `max_tiles` tiles' worth of features by a ratio over 1.1 (HF's rule)."""
        height, width = grid
        if not self.max_tiles:
            return grid
        side = self.image_size // self.patch_size
        ratio = math.sqrt(height * width / (self.max_tiles * side**2))
        if ratio > 1.1:
            return int(height // ratio), int(width // ratio)
        return grid

    def grid_shape(self, size: tuple[int, int]) -> tuple[int, int]:
        """The tiles (rows, columns) an image of `size` is cut into (`best_resolution`)."""
        h, w = best_resolution(size, self.grid_pinpoints)
        return h // self.image_size, w // self.image_size

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens see each other both ways in the text model (Gemma 3)."""
        return self.style == "gemma3"

    @property
    def placeholder_id(self) -> int:
        """The token a prompt places an image with (LLaVA's `<image>`, Gemma 3's `<start_of_image>`)."""
        return self.boi_token_id if self.boi_token_id is not None else self.image_token_id

    @classmethod
    def from_gemma3(cls, cfg: dict[str, Any], text_hidden_size: int) -> VisionArch:
        v = {**SIGLIP_VISION_DEFAULTS, **dict(cfg.get("vision_config") or {})}
        if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise VisionConfigError(f"Gemma 3's vision tower {v['model_type']!r} is not supported (SigLIP is)")
        if v["hidden_act"] not in ACTIVATIONS:
            raise VisionConfigError(f"activation {v['hidden_act']!r} is not supported; conveyor reads {sorted(ACTIVATIONS)}")
        pooled = int(cfg.get("mm_tokens_per_image", 256))
        side, per_side = v["image_size"] // v["patch_size"], math.isqrt(pooled)
        if per_side * per_side != pooled or side % per_side:
            raise VisionConfigError(f"mm_tokens_per_image={pooled} does not pool a {side}x{side} grid of patches")
        n = v["num_hidden_layers"]
        return cls(
            tower="siglip_vision_model", hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
            num_layers=n, num_heads=v["num_attention_heads"], num_channels=v["num_channels"],
            image_size=v["image_size"], patch_size=v["patch_size"], hidden_act=v["hidden_act"],
            layer_norm_eps=v["layer_norm_eps"], feature_layers=(n,), select_strategy="full", projector_act="gelu",
            projector_bias=False, text_hidden_size=text_hidden_size,
            image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262_144))), style="gemma3",
            pooled_tokens=pooled, boi_token_id=int(cfg.get("boi_token_index", cfg.get("boi_token_id", 255_999))),
            eoi_token_id=int(cfg.get("eoi_token_index", cfg.get("eoi_token_id", 256_000))),
        )

    @classmethod
    def from_internvl(cls, cfg: dict[str, Any], text_hidden_size: int) -> VisionArch:
        """InternVL's (HF's format): InternViT at `image_size` (448) in 14-pixel patches, its last
        layer's patches pixel-shuffled by `downsample_ratio` 0.5 and projected."""
        v = {**INTERNVL_VISION_DEFAULTS, **dict(cfg.get("vision_config") or {})}
        size, patch = v["image_size"], v["patch_size"]
        size = size if isinstance(size, int) else int(size[0]) if size[0] == size[1] else -1
        patch = patch if isinstance(patch, int) else int(patch[0]) if patch[0] == patch[1] else -1
        if size < 0 or patch < 0 or size % patch or (size // patch) % 2:
            raise VisionConfigError("InternViT's tiles are square, of an even number of whole patches a side")
        if float(cfg.get("downsample_ratio", 0.5)) != 0.5:
            raise VisionConfigError(f"downsample_ratio={cfg['downsample_ratio']}: conveyor reads 0.5")
        layer = cfg.get("vision_feature_layer", -1)
        n = int(v["num_hidden_layers"])
        if isinstance(layer, list | tuple) or not -(n + 1) <= int(layer) <= n or int(layer) == 0:
            raise VisionConfigError(f"vision_feature_layer {layer!r}: conveyor reads one of the tower's layers")
        if cfg.get("vision_feature_select_strategy", "default") != "default":
            raise VisionConfigError("InternVL's features drop the class token (vision_feature_select_strategy 'default')")
        if not v.get("use_absolute_position_embeddings", True) or v["norm_type"] not in ("layer_norm", "rms_norm"):
            raise VisionConfigError("InternViT without absolute positions, or with another norm, is not supported")
        for act in (v["hidden_act"], cfg.get("projector_hidden_act", "gelu")):
            if act not in ACTIVATIONS:
                raise VisionConfigError(f"activation {act!r} is not supported; conveyor reads {sorted(ACTIVATIONS)}")
        per_tile = (size // patch // 2) ** 2
        return cls(
            tower="internvl_vision", hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            num_layers=n, num_heads=int(v["num_attention_heads"]), num_channels=int(v["num_channels"]),
            image_size=size, patch_size=patch, hidden_act=v["hidden_act"], layer_norm_eps=float(v["layer_norm_eps"]),
            feature_layers=(int(layer) % (n + 1),), select_strategy="default",
            projector_act=cfg.get("projector_hidden_act", "gelu"), projector_bias=True,
            text_hidden_size=text_hidden_size, image_token_id=int(cfg.get("image_token_id", 151667)), style="internvl",
            pooled_tokens=per_tile, norm_type=v["norm_type"], attention_bias=bool(v["attention_bias"]),
            qk_norm=bool(v["use_qk_norm"]), mean_pooling=bool(v["use_mean_pooling"]),
        )

    @classmethod
    def from_mistral3(cls, cfg: dict[str, Any], text_hidden_size: int, text_eps: float) -> VisionArch:
        """Mistral 3's (Mistral Small 3.1 / 3.2): a Pixtral tower, its patches RMS-normed and merged
        2x2 (`spatial_merge_size`) before LLaVA's projector, unbiased by default."""
        v = cls.from_llava({"vision_feature_layer": -1, "image_token_index": 10, "multimodal_projector_bias": False,
                            **cfg, "vision_feature_select_strategy": "full",
                            "vision_config": {"model_type": "pixtral", **dict(cfg.get("vision_config") or {})}},
                           text_hidden_size)
        if v.tower != "pixtral":
            raise VisionConfigError(f"Mistral 3's vision tower {v.tower!r} is not supported (Pixtral is)")
        return dataclasses.replace(v, merge_size=int(cfg.get("spatial_merge_size", 2)), projector_eps=text_eps)

    @classmethod
    def from_qwen_vl(cls, cfg: dict[str, Any], text_hidden_size: int, style: str) -> VisionArch:
        """Qwen2-VL's (`style` "qwen2_vl": LayerNorm, a plain MLP `mlp_ratio` wide, quick GELU),
        Qwen2.5-VL's ("qwen2_5_vl": RMS norms, a gated MLP, windowed attention) or Qwen3-VL's
        ("qwen3_vl": 16-pixel patches, learned positions, DeepStack) tower, from either
        generation's names (`in_chans` or `in_channels`; the merger's width is the vision
        config's `hidden_size` in Qwen2-VL, `out_hidden_size` after it)."""
        v = dict(cfg.get("vision_config") or {})
        qwen25, qwen3 = style == "qwen2_5_vl", style == "qwen3_vl"
        dim = int(v.get("hidden_size", 1152 if qwen3 else 3584) if qwen25 or qwen3 else v.get("embed_dim", 1280))
        out = int(v.get("out_hidden_size", 3584) if qwen25 or qwen3 else v.get("hidden_size", 3584))
        if out != text_hidden_size:
            raise VisionConfigError(f"the vision side's output width {out} is not the text model's {text_hidden_size}")
        act = v.get("hidden_act", "silu" if qwen25 else "gelu_pytorch_tanh" if qwen3 else "quick_gelu")
        if act not in ACTIVATIONS:
            raise VisionConfigError(f"activation {act!r} is not supported; conveyor reads {sorted(ACTIVATIONS)}")
        heads, depth = int(v.get("num_heads", 16)), int(v.get("depth", 27 if qwen3 else 32))
        if dim % (4 * heads):
            raise VisionConfigError(f"a vision head of {dim // heads} dims cannot turn by row and column halves")
        patch, merge = int(v.get("patch_size", 16 if qwen3 else 14)), int(v.get("spatial_merge_size", 2))
        grid = int(v.get("num_position_embeddings", 2304)) if qwen3 else 0
        if grid and math.isqrt(grid) ** 2 != grid:
            raise VisionConfigError(f"num_position_embeddings={grid} is not a square grid")
        deepstack = tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24))) if qwen3 else ()
        if any(not 0 <= i < depth for i in deepstack):
            raise VisionConfigError(f"deepstack_visual_indexes {list(deepstack)} are not blocks of the {depth}")
        window = int(v.get("window_size", 112)) if qwen25 else 0
        if window and window % (patch * merge):
            raise VisionConfigError(f"window_size={window} is not a whole number of {patch * merge}-pixel blocks")
        rope = v.get("rope_parameters") or {}
        return cls(
            tower=style, hidden_size=dim,
            intermediate_size=(int(v.get("intermediate_size") or (4304 if qwen3 else 3420)) if qwen25 or qwen3
                               else int(dim * v.get("mlp_ratio", 4))),
            num_layers=depth, num_heads=heads, num_channels=int(v.get("in_channels") or v.get("in_chans") or 3),
            image_size=0, patch_size=patch, hidden_act=act, layer_norm_eps=1e-6, feature_layers=(depth,),
            select_strategy="full", projector_act="gelu", projector_bias=True, text_hidden_size=text_hidden_size,
            image_token_id=int(cfg.get("image_token_id", 151655)), style=style, merge_size=merge,
            temporal_patch_size=int(v.get("temporal_patch_size", 2)), rope_theta=float(rope.get("rope_theta", 10000.0)),
            window_size=window,
            full_attention_layers=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))) if qwen25 else (),
            position_embeddings=grid, deepstack_layers=deepstack,
            video_token_id=int(cfg.get("video_token_id", 151656)),
            vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(cfg.get("vision_end_token_id", 151653)),
            tokens_per_second=float(v.get("tokens_per_second", 4)) if qwen25 else 0.0,
        )

    @classmethod
    def from_llava_next(cls, cfg: dict[str, Any], text_hidden_size: int) -> VisionArch:
        v = cls.from_llava(cfg, text_hidden_size)
        pins = tuple((int(p[0]), int(p[1])) for p in (cfg.get("image_grid_pinpoints") or NEXT_PINPOINTS))
        bad = [p for p in pins if p[0] % v.image_size or p[1] % v.image_size]
        if bad:
            raise VisionConfigError(f"image_grid_pinpoints {list(bad[0])} is not a grid of {v.image_size}-pixel tiles")
        return dataclasses.replace(v, style="llava_next", grid_pinpoints=pins)

    @classmethod
    def from_llava_onevision(cls, cfg: dict[str, Any], text_hidden_size: int) -> VisionArch:
        """LLaVA-OneVision's: a SigLIP tower's last layer, every patch (`full`), LLaVA-NeXT's tiles
        with `vision_aspect_ratio` "anyres_max_N"'s scaling down."""
        vision = {"model_type": "siglip_vision_model", **dict(cfg.get("vision_config") or {})}
        v = cls.from_llava_next({"vision_feature_layer": -1, "vision_feature_select_strategy": "full",
                                 "image_token_index": 151646, **cfg, "vision_config": vision}, text_hidden_size)
        aspect = str(cfg.get("vision_aspect_ratio", "anyres_max_9"))
        if not aspect.startswith("anyres_max_") or not aspect.removeprefix("anyres_max_").isdigit():
            raise VisionConfigError(f"vision_aspect_ratio {aspect!r}: conveyor reads 'anyres_max_N'")
        video = cfg.get("video_token_id", cfg.get("video_token_index", 151647))  # (`<video>`)
        return dataclasses.replace(v, style="llava_onevision", max_tiles=int(aspect.removeprefix("anyres_max_")),
                                   video_token_id=None if video is None else int(video))

    @classmethod
    def from_qwen2_audio(cls, cfg: dict[str, Any], text_hidden_size: int) -> VisionArch:
        """Qwen2-Audio's audio side (Whisper's encoder: `audio_config`), in this class's fields:
        the encoder's width, MLP, layers and heads, `num_channels` its mel bins, `image_size`
        its positions (`max_source_positions`), the audio token (`<|AUDIO|>`) as the image token."""
        a = {"num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
             "d_model": 1280, "activation_function": "gelu", "max_source_positions": 1500,
             **dict(cfg.get("audio_config") or {})}
        if a["activation_function"] not in ACTIVATIONS:
            raise VisionConfigError(f"activation {a['activation_function']!r} is not supported")
        if a.get("scale_embedding"):
            raise VisionConfigError("an audio encoder with scaled embeddings is not supported")
        if a["d_model"] % a["encoder_attention_heads"]:
            raise VisionConfigError("the audio encoder's width is not a multiple of its heads")
        return cls(
            tower="qwen2_audio_encoder", hidden_size=a["d_model"], intermediate_size=a["encoder_ffn_dim"],
            num_layers=a["encoder_layers"], num_heads=a["encoder_attention_heads"], num_channels=a["num_mel_bins"],
            image_size=a["max_source_positions"], patch_size=1, hidden_act=a["activation_function"],
            layer_norm_eps=1e-5, feature_layers=(), select_strategy="full", projector_act="", projector_bias=True,
            text_hidden_size=text_hidden_size, image_token_id=int(cfg.get("audio_token_index", 151646)),
            style="qwen2_audio",
        )

    @classmethod
    def from_llava(cls, cfg: dict[str, Any], text_hidden_size: int) -> VisionArch:
        vision = dict(cfg.get("vision_config") or {})
        tower = vision.get("model_type", "clip_vision_model")
        if tower not in VISION_TOWERS:
            raise VisionConfigError(f"vision tower {tower!r} is not supported; conveyor reads {sorted(VISION_TOWERS)}")
        v = {**VISION_TOWERS[tower], **vision}
        layer = cfg.get("vision_feature_layer", -2)
        layers = tuple(layer) if isinstance(layer, list | tuple) else (int(layer),)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise VisionConfigError(f"vision_feature_select_strategy {strategy!r}: conveyor reads 'default' and 'full'")
        for act in (v["hidden_act"], cfg.get("projector_hidden_act", "gelu")):
            if act not in ACTIVATIONS:
                raise VisionConfigError(f"activation {act!r} is not supported; conveyor reads {sorted(ACTIVATIONS)}")
        n = v["num_hidden_layers"]
        bad = [i for i in layers if not -(n + 1) <= i <= n]
        if bad:
            raise VisionConfigError(f"vision_feature_layer {bad[0]} is outside the tower's {n + 1} hidden states")
        token = cfg.get("image_token_index", cfg.get("image_token_id", 10 if tower == "pixtral" else 32000))
        if tower == "pixtral":  # (no class token: every patch is read; its own RoPE base)
            strategy = "full"
            rope = v.get("rope_parameters") or {}
            extra: dict[str, Any] = {"style": "pixtral", "rope_theta": float(rope.get("rope_theta", v.get("rope_theta", 1e4)))}
            if v["hidden_size"] % (4 * v["num_attention_heads"]):
                raise VisionConfigError("a Pixtral head cannot turn by row and column halves")
        else:
            extra = {}
        return cls(
            tower=tower, hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"], num_layers=n,
            num_heads=v["num_attention_heads"], num_channels=v["num_channels"], image_size=v["image_size"],
            patch_size=v["patch_size"], hidden_act=v["hidden_act"], layer_norm_eps=v["layer_norm_eps"],
            feature_layers=tuple(i if i >= 0 else n + 1 + i for i in layers), select_strategy=strategy,
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)), text_hidden_size=text_hidden_size,
            image_token_id=int(token), **extra,
        )

    @property
    def class_token(self) -> bool:
        return self.tower == "clip_vision_model"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """How many embeddings (image tokens in the prompt) one image becomes."""
        if self.pooled_tokens:
            return self.pooled_tokens
        if self.own_size or self.reads_audio:  # (an image's or a clip's own: `image_tokens`; at least one)
            return 1
        return self.num_patches + (self.class_token and self.select_strategy == "full")


class _Attention(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        d = v.hidden_size
        self.heads = v.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (p(x).view(n, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class VisionRMSNorm(nn.Module):
    """The vision towers' RMS norm (Qwen2.5-VL's, Pixtral's, InternViT's): in float32, the weight
    applied after the cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionMLP(nn.Module):
    """`fc1`, the tower's activation, `fc2` (CLIP's, SigLIP's, Qwen2-VL's, InternViT's)."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = ACTIVATIONS[v.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = _Attention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(v.num_channels, v.hidden_size, v.patch_size, v.patch_size,
                                         bias=not v.class_token)
        if v.class_token:
            self.class_embedding = nn.Parameter(torch.empty(v.hidden_size))
        self.position_embedding = nn.Embedding(v.num_patches + v.class_token, v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if hasattr(self, "class_embedding"):
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class _Encoder(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(v) for _ in range(max(v.feature_layers)))


class _VisionModel(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.embeddings = _Embeddings(v)
        if v.class_token:
            self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)  # (HF's spelling)
        self.encoder = _Encoder(v)
        if v.style == "gemma3":  # (its features are the last hidden states, after this norm)
            self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)


class Tower(nn.Module, Generic[M]):
    """HF's nesting of a tower's modules (`vision_tower.vision_model.*`; transformers 5 writes
    them `vision_tower.*`, which the loader reads as this)."""

    vision_model: M

    def __init__(self, model: M) -> None:
        super().__init__()
        self.vision_model = model


class _Projector(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        width = v.hidden_size * len(v.feature_layers)
        self.linear_1 = nn.Linear(width, v.text_hidden_size, bias=v.projector_bias)
        self.linear_2 = nn.Linear(v.text_hidden_size, v.text_hidden_size, bias=v.projector_bias)
        self.act = ACTIVATIONS[v.projector_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class _PoolingProjector(nn.Module):
    """Gemma 3's: the patches' grid averaged over square pools, a Gemma RMS norm (`1 + w`),
    then one projection (a bare weight, `[vision hidden, text hidden]`)."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.side = v.image_size // v.patch_size
        self.pool = self.side // math.isqrt(v.pooled_tokens)
        self.eps = v.layer_norm_eps
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(v.hidden_size))
        self.mm_input_projection_weight = nn.Parameter(torch.empty(v.hidden_size, v.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)
        weight = self.mm_soft_emb_norm.weight
        assert isinstance(weight, torch.Tensor)
        normed = pooled.float() * torch.rsqrt(pooled.float().pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + weight.float())).to(x.dtype)
        return normed @ self.mm_input_projection_weight


def best_resolution(size: tuple[int, int], pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """HF's `select_best_resolution`: the tiling (height, width) that keeps most of an image of
    `size` (height, width) once scaled into it, the least wasted on a tie."""
    h, w = size
    best, most, waste = pinpoints[0], 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        wasted = pw * ph - kept
        if kept > most or (kept == most and wasted < waste):
            best, most, waste = (ph, pw), kept, wasted
    return best


def _unpadded(size: tuple[int, int], height: int, width: int) -> tuple[int, int]:
    """The part (height, width) of a `height` x `width` grid an image of `size` fills once
    scaled into it and centered (HF's `unpad_image`)."""
    h, w = size
    if w / h > width / height:
        return height - 2 * ((height - int(round(h * (width / w), 7))) // 2), width
    return height, width - 2 * ((width - int(round(w * (height / h), 7))) // 2)


class LlavaVision(nn.Module):
    """Images `[N, channels, size, size]` (as `conveyor.multimodal.ImageProcessor` makes them)
    to embeddings `[N, tokens_per_image, text hidden]` for the text model."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.config = v
        self.vision_tower = Tower(_VisionModel(v))
        self.multi_modal_projector: nn.Module = _PoolingProjector(v) if v.style == "gemma3" else _Projector(v)
        if v.tiled:
            self.image_newline = nn.Parameter(torch.empty(v.text_hidden_size))

    def pack(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """LLaVA-NeXT: an image's tiles' features `[1 + tiles, n, D]` (the whole image first) as
        its embeddings: the whole image's, then the tiles' grid, cut to the image's part of it,
        row by row, each row ending with the newline embedding (HF's `pack_image_features`)."""
        v = self.config
        if features.shape[0] == 1:  # (LLaVA-OneVision's image among others: the whole image, a newline)
            return torch.cat((features[0], self.image_newline[None].to(features.dtype)), dim=0)
        side = v.image_size // v.patch_size
        rows, cols = v.grid_shape(size)
        grid = features[1:].view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        height, width = _unpadded(size, rows * side, cols * side)
        top, left = (rows * side - height) // 2, (cols * side - width) // 2
        grid = grid[:, top : top + height, left : left + width]
        if v.scaled((height, width)) != (height, width):  # LLaVA-OneVision: too many features
            height, width = v.scaled((height, width))
            grid = F.interpolate(grid[None], [height, width], mode="bilinear")[0]
        newline = self.image_newline[:, None, None].expand(-1, height, 1).to(grid.dtype)
        grid = torch.cat((grid, newline), dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat((features[0], grid), dim=0)

    def video(self, features: torch.Tensor) -> torch.Tensor:
        """LLaVA-OneVision: a video's frames' features `[frames, patches, D]` as its embeddings:
        each frame's grid pooled to `pooled_side` a side (bilinear), the frames in turn, then
        one newline embedding (HF's `apply_pooling` and `get_video_features`)."""
        v = self.config
        side = v.image_size // v.patch_size
        grid = features.view(features.shape[0], side, side, -1).permute(0, 3, 1, 2)
        pooled = F.interpolate(grid, size=[v.pooled_side, v.pooled_side], mode="bilinear")
        return torch.cat((pooled.permute(0, 2, 3, 1).flatten(0, 2), self.image_newline[None].to(pooled.dtype)), dim=0)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        v = self.config
        size = (v.num_channels, v.image_size, v.image_size)
        if tuple(pixels.shape[1:]) != size:
            raise ValueError(f"images of shape {tuple(pixels.shape[1:])}, this tower reads {size}")
        model = self.vision_tower.vision_model
        x = model.embeddings(pixels)
        if hasattr(model, "pre_layrnorm"):
            x = model.pre_layrnorm(x)
        kept = {0: x} if 0 in v.feature_layers else {}
        for i, layer in enumerate(model.encoder.layers, start=1):
            x = layer(x)
            if i in v.feature_layers:
                kept[i] = x
        if hasattr(model, "post_layernorm"):  # Gemma 3: the last hidden states, normed
            return self.multi_modal_projector(model.post_layernorm(x))
        features = [kept[i] for i in v.feature_layers]
        if v.class_token and v.select_strategy == "default":
            features = [f[:, 1:] for f in features]
        return self.multi_modal_projector(torch.cat(features, dim=-1))


class ImageEncoder:
    """The vision side beside the text model (`LlamaForCausalLM.vision`): a plain object, not
    a submodule, so the text model's passes (int8, the CPU kernels, the Triton kernels) leave
    its layers as they are."""

    def __init__(self, module: LlavaVision | QwenVision | PixtralVision | InternVLVision | QwenAudio) -> None:
        self.module = module
        self.config: VisionArch = module.config
        weight = next(module.parameters())
        self.device, self.dtype = weight.device, weight.dtype

    @torch.inference_mode()
    def __call__(self, images: list[Any]) -> list[torch.Tensor]:
        """Images (`conveyor.multimodal.Pixels`) to their embeddings, `[tokens, text hidden]`
        each: those of one shape in one batch (LLaVA-NeXT's tiles of each image together;
        Qwen-VL's images of any sizes in one call)."""
        if self.config.reads_audio:  # (clips of any lengths in one batch)
            return list(self.module(images))
        if self.config.own_size or self.config.style == "internvl":
            return list(self.module([image.values.to(self.device, self.dtype) for image in images]))
        if self.config.tiled:
            out = []
            assert isinstance(self.module, LlavaVision)
            for image in images:
                tiles = self.module(image.values.to(self.device, self.dtype))
                out.append(self.module.video(tiles) if image.fps else self.module.pack(tiles, image.size))
            return out
        return list(self.module(torch.stack([image.values for image in images]).to(self.device, self.dtype)))


def load_vision(v: VisionArch, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> ImageEncoder:
    """The vision side from HF-named tensors (`vision_tower.*`, `multi_modal_projector.*`; Qwen-VL's
    `visual.*`); those of layers past the deepest feature layer, the post-norm and SigLIP's
    pooling head are not read."""
    module: LlavaVision | QwenVision | PixtralVision | InternVLVision | QwenAudio
    with torch.device("meta"):
        if v.reads_audio:
            from conveyor.models.qwen_audio import QwenAudio

            module = QwenAudio(v)
        elif v.style == "internvl":
            from conveyor.models.internvl_vision import InternVLVision

            module = InternVLVision(v)
        elif v.is_qwen:
            from conveyor.models.qwen_vision import QwenVision

            module = QwenVision(v)
        elif v.style == "pixtral":
            from conveyor.models.pixtral_vision import PixtralVision

            module = PixtralVision(v)
        else:
            module = LlavaVision(v)
    module = module.to_empty(device=device).to(dtype)
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise VisionConfigError(f"the checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if t.shape != p.shape:
                raise VisionConfigError(f"{name}: tensor of shape {tuple(t.shape)} does not fit {tuple(p.shape)}")
            p.copy_(t)
    module.eval().requires_grad_(False)
    return ImageEncoder(module)
