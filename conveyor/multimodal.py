"""Images in prompts: reading them, making them pixels, and their place among the tokens.

A prompt with images is an `ImagePrompt` (or vLLM's dict form, `{"prompt": ..., "multi_modal_data":
{"image": ...}}`). Its text holds one placeholder token (LLaVA's `<image>`, Gemma 3's
`<start_of_image>`) where each image goes; the engine expands each into as many image tokens as
the image has embeddings (`ImageSpan`; LLaVA-NeXT's count grows with the image's size, Gemma 3's
are framed by its begin/end-of-image tokens), as HF's processor and vLLM do, so the prompt's
length, the KV blocks it takes and the scheduler's budgets count them as the tokens they are. A
step that computes some of those positions takes their embeddings from the vision side
(conveyor/models/vision.py) in place of the token's (the runner encodes an image once, at the
first chunk that reaches it, or takes it from its encoder cache by digest, and keeps its
embeddings until the prefill has passed it). The prefix cache keys each block by the images it
holds too (`Pixels.digest`), so two prompts of the same text and different images share no
block past the first image.

An image is a PIL image, encoded bytes (PNG, JPEG...), a `data:image/...;base64,` URL, an
`http(s)://` URL (fetched, with a time and size limit), or a local file's path or `file://` URL
(only under `allowed_local_media_path`). `ImageProcessor` makes it what the tower reads as HF's
image processor does (pad to square, resize by the shortest edge, center crop, rescale,
normalize; LLaVA-NeXT's tiles), from the checkpoint's `preprocessor_config.json`. A video (Qwen2-VL's
and Qwen2.5-VL's, `conveyor.video.Video`) stands among the images where its video token is, and
is made pixels by `ImageProcessor.video`: one span of each frame group's tokens.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import io
import json
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.audio import Audio, AudioFeatures, as_audio, audio_tokens, load_audio
from conveyor.sampling_params import InvalidRequestError
from conveyor.video import DEFAULT_FPS, Video, VideoSampling, as_video, load_video, video_size

if TYPE_CHECKING:  # (numpy and torch load where pixels are made: the scheduler reads spans only)
    import numpy as np
    import torch

    from conveyor.models.vision import VisionArch

# CLIP's normalization (OpenAI's), what an image processor uses where its config is silent.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # (InternVL's)
IMAGENET_STD = (0.229, 0.224, 0.225)
FETCH_TIMEOUT_S = 10.0
MAX_IMAGE_BYTES = 32 << 20


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt (text or token ids) with `images` in the order of its image tokens; a video
    among them (`conveyor.video.Video`) goes where its video token is, in the order of those."""

    prompt: str | list[int]
    images: tuple[Any, ...]
    processor_kwargs: dict[str, Any] | None = None  # vLLM's `mm_processor_kwargs` (`ImageProcessor.overridden`)


@dataclass(frozen=True)
class ImageToken:
    """The token a prompt places an image with: its text (LLaVA's `<image>`, Gemma 3's
    `<start_of_image>`, Qwen's `<|image_pad|>`), its id, and how many tokens it becomes with an
    image (at least: a LLaVA-NeXT image's count grows with its size; a Qwen-VL image's is one a
    `side` x `side` block of its pixels, `count`)."""

    text: str
    id: int
    per_image: int
    side: int = 0
    breaks: bool = False  # (Pixtral's: a break or end token after each row)
    per_tile: int = 0  # (InternVL's: each tile's tokens; `per_image` is one tile's with the frame)
    temporal: int = 2  # (a Qwen-VL video's: its frames read this many at a time)
    video: str | None = None  # the token that places a video (`<|video_pad|>`); None: no videos
    per_frame: int = 0  # (LLaVA-OneVision's video: each frame's tokens, a newline after the last)
    audio: str | None = None  # (Qwen2-Audio's: what a chat message holds where a clip goes; `text` is its token)

    def count(self, image: Any) -> int:
        """The tokens `image` becomes: exact for a Qwen-VL, Pixtral or InternVL image made
        pixels (or a video), or an audio clip made features, else `per_image`."""
        if getattr(image, "frames", 0):
            return audio_tokens(image.frames)
        values = getattr(image, "values", None)
        if self.per_frame and values is not None and getattr(image, "fps", None):
            return values.shape[0] * self.per_frame + 1
        if self.per_tile and values is not None:
            return self.per_image + (values.shape[0] - 1) * self.per_tile
        if self.side and values is not None:
            groups = values.shape[0] // self.temporal if getattr(image, "fps", None) else 1
            return groups * (values.shape[-2] // self.side) * (values.shape[-1] // self.side + self.breaks)
        return self.per_image


@dataclass(frozen=True)
class Pixels:
    """An image made ready for the tower (`ImageProcessor`): `[channels, size, size]` float32
    (LLaVA-NeXT's: `[1 + tiles, channels, size, size]`), a digest of its values (the prefix
    cache's key for it), and the picture's size (height, width) it was made from. A video's
    (`ImageProcessor.video`): `[frames, channels, height, width]`, and `fps`, its frames' rate."""

    values: torch.Tensor
    digest: bytes
    size: tuple[int, int] | None = None
    fps: float | None = None  # (a video's; None: an image)
    times: tuple[float, ...] = ()  # (a video's: each frame group's time, seconds; Qwen3-VL's timestamps)
    frames: int = 0  # (an audio clip's, `conveyor.audio.AudioFeatures`: its own feature frames; 0: not audio)
    embeds: bool = False  # a prompt given as embeddings (`values` `[tokens, hidden]`): no tower reads it

    def frame_group(self, k: int, temporal: int) -> Pixels:
        """A video's frame group `k` as a video of its own (Qwen3-VL places each apart)."""
        values = self.values[k * temporal : (k + 1) * temporal]
        return Pixels(values, hashlib.sha256(self.digest + b"group%d" % k).digest(), self.size, self.fps,
                      self.times[k : k + 1])

    def whole_only(self) -> Pixels:
        """A tiled image's whole-image tile alone (LLaVA-OneVision reads each image of a prompt
        of several so), under a digest of its own."""
        return Pixels(self.values[:1], hashlib.sha256(self.digest + b"whole").digest(), self.size)


@dataclass(frozen=True)
class ImageSpan:
    """One image's place in a sequence: `length` image tokens from `offset`; `bidirectional`:
    they see each other both ways (Gemma 3), so a step computes them together."""

    offset: int
    length: int
    pixels: Pixels = field(repr=False)
    bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length


def as_image_prompt(prompt: Any) -> Any:
    """vLLM's dict prompt (`{"prompt" | "prompt_token_ids": ..., "multi_modal_data": {"image": one
    or a list}}`) as an `ImagePrompt`; a dict without images as its text or ids; anything else
    as it is."""
    if not isinstance(prompt, dict) or "prompt_embeds" in prompt:  # (embeddings: `Engine.prepare_prompt`)
        return prompt
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
    if unknown:
        raise InvalidRequestError(f"a prompt dict has no field {sorted(unknown)[0]!r}", param="prompt")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InvalidRequestError("a prompt dict has one of 'prompt' and 'prompt_token_ids'", param="prompt")
    text = prompt["prompt"] if "prompt" in prompt else [int(t) for t in prompt["prompt_token_ids"]]
    data = prompt.get("multi_modal_data") or {}
    other = set(data) - {"image", "video", "audio"}
    if other:
        raise InvalidRequestError(f"multi_modal_data: conveyor reads images, videos and audio, not {sorted(other)[0]!r}",
                                  param="multi_modal_data")
    images = data.get("image")
    images = () if images is None else tuple(images) if isinstance(images, list | tuple) else (images,)
    videos = data.get("video")
    if videos is not None:  # (one video, or a list of them: a list of arrays, or of (frames, metadata))
        one = not isinstance(videos, list) or not videos or not _is_video(videos[0])
        images += tuple(as_video(v) for v in ([videos] if one else videos))
    clips = data.get("audio")
    if clips is not None:  # (one clip, or a list of them: vLLM's (samples, rate) pairs, arrays, files)
        one = not isinstance(clips, list) or (bool(clips) and isinstance(clips[0], int | float))
        images += tuple(as_audio(c) for c in ([clips] if one else clips))
    return ImagePrompt(text, images, prompt.get("mm_processor_kwargs")) if images else text


PAN_AND_SCAN = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                "pan_and_scan_min_ratio_to_activate")  # (Gemma 3's processor's options)


def processor_kwargs(value: Any) -> dict[str, Any] | None:
    """`mm_processor_kwargs` as given (`json_object`)."""
    return json_object(value, "mm_processor_kwargs", "of the processor's options")


def json_object(value: Any, param: str, shape: str) -> dict[str, Any] | None:
    """An option that is an object, as given: a dict, a JSON object's text (the command
    line's), or None; InvalidRequestError naming `param` (an object `shape`) for anything else."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param} is not JSON: {e}", param=param) from None
        if isinstance(parsed, dict):
            return parsed
    raise InvalidRequestError(f"{param} is an object {shape}", param=param)


def _is_video(item: Any) -> bool:
    """Whether a list's first item is a video (its frames, a file, a `Video`), not a video's first frame."""
    if isinstance(item, Video) or (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict)):
        return True
    return getattr(item, "ndim", 0) == 4 or isinstance(item, list | str | bytes | Path)


def load_image(source: Any, allowed_local_media_path: str | None = None, domains: frozenset[str] | None = None
               ) -> Any:
    """A PIL image (RGB) from what `ImagePrompt.images` may hold; InvalidRequestError if it
    cannot be read."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover (a dependency)
        raise InvalidRequestError("images need Pillow: pip install pillow", param="image") from None
    if isinstance(source, Image.Image):
        image = source
    else:
        data = image_bytes(source, allowed_local_media_path, domains=domains)
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except Exception as e:  # (PIL raises many kinds for a file it cannot read)
            raise InvalidRequestError(f"the image cannot be read: {e}", param="image") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def image_bytes(source: Any, allowed_local_media_path: str | None = None, max_bytes: int = MAX_IMAGE_BYTES,
                kind: str = "image", domains: frozenset[str] | None = None) -> bytes:
    """The encoded bytes of an image (or a video: `kind`) given as bytes, a data URL, an
    http(s) URL (only of a host among `domains`, where given) or a local path."""
    param = f"{kind}_url"
    if isinstance(source, bytes | bytearray):
        return bytes(source)
    if isinstance(source, Path):
        source = str(source)
    if not isinstance(source, str):
        held = "a PIL image" if kind == "image" else "its frames"
        raise InvalidRequestError(f"an {kind} is {held}, bytes, a URL or a path, not {type(source).__name__}",
                                  param=kind)
    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        if not head.endswith(";base64"):
            example = "data:image/png;base64,..." if kind == "image" else "data:video/mp4;base64,..."
            raise InvalidRequestError(f"a data URL of an {kind} must be base64 ({example})", param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"the {kind}'s data URL is not valid base64", param=param) from None
    if source.startswith(("http://", "https://")):
        return _fetch(source, max_bytes, kind, domains)
    path = Path(source.removeprefix("file://"))
    if allowed_local_media_path is None:
        raise InvalidRequestError(
            f"local {kind} files are read only under allowed_local_media_path (--allowed-local-media-path)",
            param=param,
        )
    root = Path(allowed_local_media_path).resolve()
    full = path.resolve()
    if not full.is_relative_to(root):
        raise InvalidRequestError(f"{source!r} is outside the allowed local media path", param=param)
    try:
        return full.read_bytes()
    except OSError as e:
        raise InvalidRequestError(f"the {kind} file cannot be read: {e.strerror}", param=param) from None


def _fetch(url: str, max_bytes: int = MAX_IMAGE_BYTES, kind: str = "image", domains: frozenset[str] | None = None
           ) -> bytes:
    _check_domain(url, kind, domains)
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
            _check_domain(response.geturl(), kind, domains)  # (a redirect may not leave the allowed hosts)
            data = response.read(max_bytes + 1)
    except InvalidRequestError:
        raise
    except Exception as e:  # (URLError, HTTPError, a timeout, a reset)
        raise InvalidRequestError(f"the {kind} at {url} cannot be fetched: {e}", param=f"{kind}_url") from None
    if len(data) > max_bytes:
        raise InvalidRequestError(f"the {kind} at {url} is larger than {max_bytes >> 20} MiB", param=f"{kind}_url")
    return data


def _check_domain(url: str, kind: str, domains: frozenset[str] | None) -> None:
    """InvalidRequestError where `url`'s host is not among `domains` (vLLM's
    `allowed_media_domains`: exact host names, any case); None allows every host."""
    if domains is None:
        return
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in domains:
        raise InvalidRequestError(f"the {kind} at {url}: {host!r} is not among the allowed media domains "
                                  "(--allowed-media-domains)", param=f"{kind}_url")


@dataclass(frozen=True)
class ImageProcessor:
    """HF's CLIP/LLaVA image processing: optional pad to a square of the mean color, a resize
    (the shortest edge to `shortest_edge`, or to `height` x `width`) with PIL's filter, a
    center crop, a rescale to [0, 1] and a normalization, in HF's arithmetic (float64 rescale,
    float32 normalize)."""

    shortest_edge: int | None
    resize_to: tuple[int, int] | None  # (height, width)
    crop: tuple[int, int] | None
    resample: int = 3  # PIL's BICUBIC
    rescale: float | None = 1 / 255
    mean: tuple[float, ...] | None = CLIP_MEAN
    std: tuple[float, ...] | None = CLIP_STD
    pad_to_square: bool = False
    grid_pinpoints: tuple[tuple[int, int], ...] = ()  # LLaVA-NeXT's tilings (`_tiles`)
    # Qwen-VL's resize (`smart_resize`): each side to a multiple of `factor` (patch x merge), the
    # area between `min_pixels` and `max_pixels`, the aspect kept as near as may be.
    factor: int = 0
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    # Pixtral's resize (`pixtral_size`): scaled down into `longest_edge`, each side up to a
    # multiple of `factor` (patch x merge).
    longest_edge: int = 0
    # InternVL's tiles (`_internvl_tiles`): between `min_tiles` and `max_tiles` of `resize_to`,
    # and a thumbnail where there is more than one.
    min_tiles: int = 1
    max_tiles: int = 0
    # Qwen-VL's videos (`video`): each frame's area bounds, the cap on the whole video (90% of
    # `max_video_tokens` tokens' worth of pixels), how a file's frames are chosen, and the frames
    # the tower reads at a time.
    video_min_pixels: int = 0  # (0: this model reads no videos)
    video_max_pixels: int = 0
    cap_pixels_per_frame: bool = True
    max_video_tokens: int = 128_000
    sampling: VideoSampling | None = None
    temporal_patch_size: int = 2
    # LLaVA-OneVision's videos: each frame processed by this (the video processor's square and
    # normalization), the frames taken as `sampling` has them.
    frames: ImageProcessor | None = None
    # The most images and videos a prompt may hold (`limit_mm_per_prompt`; None: no limit).
    max_images: int | None = None
    max_videos: int | None = None
    max_audios: int | None = None
    allowed_media_domains: frozenset[str] | None = None  # (the hosts URLs may name; None: any)
    # Gemma 3's pan and scan (`crops`): an image whose aspect passes `pan_min_ratio` also read
    # as 2 to `pan_max_crops` crops of at least `pan_min_crop` pixels a side, where on.
    pan_and_scan: bool | None = None  # (None: not Gemma 3's processing)
    pan_min_crop: int = 256
    pan_max_crops: int = 4
    pan_min_ratio: float = 1.2
    # Qwen2-Audio's clips (`audio`): Whisper's log-mel features (None: this model reads no audio).
    audio_features: AudioFeatures | None = None
    # Whisper's decoding rules and timestamp tokens (`conveyor.transcribe.Decoding`; a Whisper
    # engine's only).
    whisper: Any = None

    @classmethod
    def from_folder(cls, folder: Path | None, vision: VisionArch) -> ImageProcessor:
        """From `preprocessor_config.json` (HF's keys); where there is none, CLIP's processing
        at the tower's image size (SigLIP's for Gemma 3: a bilinear resize to the square, mean
        and spread 0.5)."""
        size = vision.image_size
        cfg: dict[str, Any] = {}
        if vision.reads_audio:  # (Qwen2-Audio's: `WhisperFeatureExtractor`'s keys)
            return cls(None, None, None, audio_features=AudioFeatures.from_config(
                {"feature_size": vision.num_channels, **_preprocessor_config(folder)}))
        if vision.is_qwen:
            return cls._qwen(folder, vision)
        if vision.style == "pixtral":
            return cls._pixtral(folder, vision)
        if vision.style == "internvl":
            return cls._internvl(folder, vision)
        if vision.style == "gemma3":
            cfg = {"size": {"height": size, "width": size}, "do_center_crop": False, "resample": 2,
                   "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
        cfg |= _preprocessor_config(folder)
        processor = cls._from_config(cfg, vision)
        if vision.style == "gemma3":
            processor = dataclasses.replace(
                processor, pan_and_scan=bool(cfg.get("do_pan_and_scan") or False),
                pan_min_crop=int(cfg.get("pan_and_scan_min_crop_size") or 256),
                pan_max_crops=int(cfg.get("pan_and_scan_max_num_crops") or 4),
                pan_min_ratio=float(cfg.get("pan_and_scan_min_ratio_to_activate") or 1.2))
        if vision.reads_videos:  # (LLaVA-OneVision's)
            processor = dataclasses.replace(processor, sampling=VideoSampling(max_frames=32, rule="uniform"),
                                            frames=cls._onevision_frames(folder, vision))
        return processor

    @classmethod
    def _from_config(cls, cfg: dict[str, Any], vision: VisionArch) -> ImageProcessor:
        size = vision.image_size
        resize = cfg.get("size", {"shortest_edge": size}) if cfg.get("do_resize", True) else None
        if isinstance(resize, int):
            resize = {"shortest_edge": resize}
        crop = cfg.get("crop_size", {"height": size, "width": size}) if cfg.get("do_center_crop", True) else None
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=None if resize is None else resize.get("shortest_edge"),
            resize_to=None if resize is None or "height" not in resize else (resize["height"], resize["width"]),
            crop=None if crop is None else (crop["height"], crop["width"]),
            resample=int(cfg.get("resample", 3)),
            **_scaling(cfg),
            pad_to_square=bool(cfg.get("do_pad", False)) and vision.style == "llava",
            grid_pinpoints=tuple((int(p[0]), int(p[1])) for p in cfg.get("image_grid_pinpoints", vision.grid_pinpoints))
            if vision.tiled else (),
        )

    @classmethod
    def _onevision_frames(cls, folder: Path | None, vision: VisionArch) -> ImageProcessor:
        """LLaVA-OneVision's frame processing (HF's `LlavaOnevisionVideoProcessor`): a resize to
        `size` (the tower's square), CLIP's normalization where silent; its config is
        `video_preprocessor_config.json`, else the image processor's (HF's fallback)."""
        size = vision.image_size
        cfg = (_preprocessor_config(folder, "video_preprocessor_config.json") or _preprocessor_config(folder)).copy()
        for key in ("do_pad", "image_grid_pinpoints", "do_center_crop", "crop_size"):  # (an image's, not a frame's)
            cfg.pop(key, None)
        if not isinstance(cfg.get("size"), dict) or "height" not in cfg["size"]:
            cfg["size"] = {"height": size, "width": size}
        return cls._from_config({**cfg, "do_center_crop": False}, dataclasses.replace(vision, style="llava"))

    @classmethod
    def _qwen(cls, folder: Path | None, vision: VisionArch) -> ImageProcessor:
        """Qwen2-VL's processing (HF's `Qwen2VLImageProcessor`): the area's bounds from
        `min_pixels` / `max_pixels` or `size`'s `shortest_edge` / `longest_edge`."""
        from conveyor.models.vision import VisionConfigError

        cfg = _preprocessor_config(folder)
        size: dict[str, Any] = cfg["size"] if isinstance(cfg.get("size"), dict) else {}
        patch, merge = int(cfg.get("patch_size", vision.patch_size)), int(cfg.get("merge_size", vision.merge_size))
        if (patch, merge) != (vision.patch_size, vision.merge_size):
            raise VisionConfigError(f"the processor's patches ({patch}, merged {merge}) are not the model's "
                                    f"({vision.patch_size}, merged {vision.merge_size})")
        factor = patch * merge
        # Videos: `video_preprocessor_config.json` (HF's `Qwen2VLVideoProcessor` keys), else its
        # defaults: 128 to 768 tokens' worth of pixels a frame, 2 frames a second.
        vcfg = _preprocessor_config(folder, "video_preprocessor_config.json")
        vsize: dict[str, Any] = vcfg["size"] if isinstance(vcfg.get("size"), dict) else {}
        temporal = int(vcfg.get("temporal_patch_size", vision.temporal_patch_size))
        qwen3 = vision.style == "qwen3_vl"  # (Qwen3-VL's bounds are the whole video's, its cap a frame's)
        return cls(
            shortest_edge=None, resize_to=None, crop=None, resample=int(cfg.get("resample", 3)),
            **_scaling(cfg),
            factor=factor,
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
                           or 28 * 28 * 1280),
            video_min_pixels=int(vcfg.get("min_pixels") or vsize.get("shortest_edge") or 128 * factor**2),
            video_max_pixels=int(vcfg.get("max_pixels") or vsize.get("longest_edge") or 768 * factor**2),
            cap_pixels_per_frame=bool(vcfg.get("cap_pixels_per_frame", True)),
            max_video_tokens=int(vcfg.get("max_video_tokens", 768 if qwen3 else 128_000)),
            sampling=VideoSampling(fps=float(vcfg.get("fps") or DEFAULT_FPS), min_frames=int(vcfg.get("min_frames", 4)),
                                   max_frames=int(vcfg.get("max_frames", 768)), multiple=temporal,
                                   rule="qwen3" if qwen3 else "qwen2"),
            temporal_patch_size=temporal,
        )

    @classmethod
    def _pixtral(cls, folder: Path | None, vision: VisionArch) -> ImageProcessor:
        """Pixtral's processing (HF's `PixtralImageProcessor`): `size`'s `longest_edge` (1024 by
        default), sides to whole tokens of patch x merge pixels, CLIP's normalization."""
        cfg = _preprocessor_config(folder)
        size: dict[str, Any] = cfg["size"] if isinstance(cfg.get("size"), dict) else {}
        return cls(
            shortest_edge=None, resize_to=None, crop=None, resample=int(cfg.get("resample", 3)),
            **_scaling(cfg),
            factor=vision.patch_size * vision.merge_size, longest_edge=int(size.get("longest_edge") or 1024),
        )

    @classmethod
    def _internvl(cls, folder: Path | None, vision: VisionArch) -> ImageProcessor:
        """InternVL's processing (HF's `GotOcr2ImageProcessor` as InternVL's processor calls it,
        `crop_to_patches` on): tiles of `size` (448), between `min_patches` and `max_patches` (1
        and 12); ImageNet's normalization where the config is silent."""
        cfg = _preprocessor_config(folder)
        size: dict[str, Any] = cfg["size"] if isinstance(cfg.get("size"), dict) else {}
        tile = (int(size.get("height") or vision.image_size), int(size.get("width") or vision.image_size))
        if tile != (vision.image_size, vision.image_size):
            raise InvalidRequestError(f"the processor's tiles {tile} are not the tower's {vision.image_size} pixels")
        return cls(
            shortest_edge=None, resize_to=tile, crop=None, resample=int(cfg.get("resample", 3)),
            **_scaling(cfg, IMAGENET_MEAN, IMAGENET_STD),
            min_tiles=int(cfg.get("min_patches", 1)), max_tiles=int(cfg.get("max_patches", 12)),
        )

    def _internvl_tiles(self, image: Any) -> list[Any]:
        """InternVL's cut (HF's `crop_image_to_patches`): the image resized to the tile grid whose
        aspect is nearest its own (`tile_grid`), cut into tiles row by row, then a thumbnail of
        the whole image where there is more than one tile."""
        assert self.resize_to is not None
        th, tw = self.resize_to
        cols, rows = tile_grid((image.height, image.width), (th, tw), self.min_tiles, self.max_tiles)
        resized = image.resize((tw * cols, th * rows), resample=self.resample)
        tiles = [resized.crop((c * tw, r * th, (c + 1) * tw, (r + 1) * th)) for r in range(rows) for c in range(cols)]
        if len(tiles) > 1:
            tiles.append(image.resize((tw, th), resample=self.resample))
        return tiles

    def __call__(self, image: Any) -> Pixels:
        import numpy as np
        import torch

        if self.grid_pinpoints:
            values = np.stack([self._one(tile) for tile in self._tiles(image)])
        elif self.max_tiles:
            values = np.stack([self._one(tile) for tile in self._internvl_tiles(image)])
        else:
            values = self._one(image)
        tensor = torch.from_numpy(np.ascontiguousarray(values))
        size = (image.height, image.width)
        digest = hashlib.sha256(tensor.numpy().tobytes() + repr(size).encode()).digest()
        return Pixels(tensor, digest, size)

    def audio(self, audio: Audio, allowed_local_media_path: str | None = None, whole: bool = False) -> Pixels:
        """An audio clip made ready for the tower: read, made mono at the features' rate,
        cut to 30 seconds, made log-mel features (`conveyor.audio`; `whole`: all 30 seconds'
        frames, Whisper's encoder's input)."""
        features = self.audio_features
        if features is None:
            raise InvalidRequestError("this model reads no audio (Qwen2-Audio does)", param="audio")
        samples = load_audio(audio, features.sampling_rate, allowed_local_media_path, self.allowed_media_domains)
        values, frames = features(samples, whole)
        return Pixels(values, features.digest(values, frames), frames=frames)

    def video(self, video: Video, allowed_local_media_path: str | None = None) -> Pixels:
        """A video made ready for the tower: its frames (a file's sampled, `load_video`), for
        LLaVA-OneVision each processed as an image at the tower's square (`frames`), for a
        Qwen-VL each resized to the size `smart_resize` gives the first within the video's bounds (the
        most capped so that the whole video stays within 90% of `max_video_tokens`), rescaled and
        normalized, the last repeated to a whole number of `temporal_patch_size` frames:
        `[frames, channels, height, width]`, with the frames' rate."""
        import numpy as np
        import torch
        from PIL import Image

        if self.frames is not None and self.sampling is not None:  # LLaVA-OneVision's: each frame as an image
            frames, fps, times = load_video(video, self.sampling, allowed_local_media_path, self.allowed_media_domains)
            values = np.stack([self.frames._one(Image.fromarray(f)) for f in frames])
            tensor = torch.from_numpy(np.ascontiguousarray(values))
            digest = hashlib.sha256(tensor.numpy().tobytes() + b"video").digest()
            return Pixels(tensor, digest, frames[0].shape[:2], fps, tuple(times))
        if not self.video_min_pixels or self.sampling is None:
            raise InvalidRequestError("this model reads no videos", param="video")
        frames, fps, times = load_video(video, self.sampling, allowed_local_media_path, self.allowed_media_domains)
        height, width = frames[0].shape[:2]
        n, t, most = len(frames), self.temporal_patch_size, self.video_max_pixels
        if self.sampling.rule == "qwen3":  # (the bounds are the whole video's; the cap, each frame's)
            if self.cap_pixels_per_frame:
                most = n * max(min(self.max_video_tokens * self.factor**2, most // n), int(self.video_min_pixels * 1.05))
            h, w = video_size(n, height, width, t, self.factor, self.video_min_pixels, most)
        else:
            if self.cap_pixels_per_frame:  # (qwen-vl-utils' bound on the whole video)
                total = int(self.max_video_tokens * self.factor * self.factor * 0.9)
                most = max(min(most, total * t // n), int(self.video_min_pixels * 1.05))
            h, w = smart_resize(height, width, self.factor, self.video_min_pixels, most)
        pad = -n % t
        frames, times = frames + [frames[-1]] * pad, times + [times[-1]] * pad
        values = np.stack([self._scale(np.asarray(Image.fromarray(f).resize((w, h), resample=self.resample))
                                       .transpose(2, 0, 1)) for f in frames])
        tensor = torch.from_numpy(np.ascontiguousarray(values))
        digest = hashlib.sha256(tensor.numpy().tobytes() + repr((height, width, fps, times)).encode()).digest()
        groups = tuple((times[i] + times[i + t - 1]) / 2 for i in range(0, len(times), t))  # (HF's timestamps)
        return Pixels(tensor, digest, (height, width), fps, groups)

    def _tiles(self, image: Any) -> list[Any]:
        """LLaVA-NeXT's anyres cut (HF's `get_image_patches`): the whole image resized to the
        tile size, then the image scaled into its best tiling (`best_resolution`), centered on
        black, cut into tiles row by row."""
        import numpy as np
        from PIL import Image

        from conveyor.models.vision import best_resolution

        h, w = image.height, image.width
        th, tw = best_resolution((h, w), self.grid_pinpoints)
        if tw / w < th / h:
            nh, nw = min(math.ceil(h * tw / w), th), tw
        else:
            nh, nw = th, min(math.ceil(w * th / h), tw)
        padded = np.zeros((th, tw, 3), dtype=np.uint8)
        top, left = (th - nh) // 2, (tw - nw) // 2
        padded[top : top + nh, left : left + nw] = np.asarray(image.resize((nw, nh), resample=self.resample))
        side = self.crop[0] if self.crop is not None else self.resize_to[0] if self.resize_to else self.shortest_edge
        assert side is not None
        whole = self.resize_to or (self.shortest_edge, self.shortest_edge)
        tiles = [image.resize((whole[1], whole[0]), resample=self.resample)]
        tiles += [Image.fromarray(padded[i : i + side, j : j + side]) for i in range(0, th, side)
                  for j in range(0, tw, side)]
        return tiles

    def _one(self, image: Any) -> Any:
        """One picture through pad, resize, crop, rescale and normalize: `[channels, h, w]` float32."""
        import numpy as np
        from PIL import Image

        if self.pad_to_square and image.width != image.height:
            side = max(image.width, image.height)
            color = tuple(int(m * 255) for m in (self.mean or (0.0, 0.0, 0.0)))
            square = Image.new("RGB", (side, side), color)
            square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image = square
        if self.longest_edge:
            h, w = pixtral_size(image.height, image.width, self.longest_edge, self.factor)
            image = image.resize((w, h), resample=self.resample)
        elif self.factor:
            h, w = smart_resize(image.height, image.width, self.factor, self.min_pixels, self.max_pixels)
            image = image.resize((w, h), resample=self.resample)
        elif self.resize_to is not None:
            image = image.resize((self.resize_to[1], self.resize_to[0]), resample=self.resample)
        elif self.shortest_edge is not None:
            w, h = image.width, image.height
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(self.shortest_edge * long / short)
            size = (self.shortest_edge, new_long) if w <= h else (new_long, self.shortest_edge)
            image = image.resize(size, resample=self.resample)
        array = np.asarray(image).transpose(2, 0, 1)  # [channels, height, width] uint8
        if self.crop is not None:
            array = _center_crop(array, *self.crop)
        return self._scale(array)

    def crops(self, image: Any) -> list[Any]:
        """Gemma 3's pan and scan (HF's `pan_and_scan`): where on and the picture is wider (or
        taller) than `pan_min_ratio` to one, the crops across its long side, as many as its
        aspect rounded (2 to `pan_max_crops`, none narrower than `pan_min_crop`), each
        ceil(side / n) pixels (the last cut at the edge); none otherwise."""
        import numpy as np
        from PIL import Image

        if not self.pan_and_scan:
            return []
        width, height = image.width, image.height
        long, short = (width, height) if width >= height else (height, width)
        if long / short < self.pan_min_ratio:
            return []
        n = min(self.pan_max_crops, max(2, min(math.floor(long / self.pan_min_crop), math.floor(long / short + 0.5))))
        cols, rows = (n, 1) if width >= height else (1, n)
        cw, ch = math.ceil(width / cols), math.ceil(height / rows)
        if min(cw, ch) < self.pan_min_crop:
            return []
        array = np.asarray(image)
        return [Image.fromarray(array[r * ch : (r + 1) * ch, c * cw : (c + 1) * cw]) for r in range(rows)
                for c in range(cols)]

    def check_counts(self, images: int, videos: int, audios: int = 0) -> None:
        """InvalidRequestError where a prompt holds more images, videos or audio clips than
        `limit_mm_per_prompt`."""
        for kind, n, most in (("image", images, self.max_images), ("video", videos, self.max_videos),
                              ("audio", audios, self.max_audios)):
            if most is not None and n > most:
                many = "audio clips" if kind == "audio" else f"{kind}s"
                raise InvalidRequestError(
                    f"the prompt holds {n} {many}: this engine takes at most {most} a prompt (limit_mm_per_prompt)"
                    if most else f"this engine takes no {many} (limit_mm_per_prompt {kind}: 0)", param=kind)

    def limited(self, limits: Any) -> ImageProcessor:
        """This processor with vLLM's `limit_mm_per_prompt` (`{"image": n, "video": n, "audio": n}`,
        a count or `{"count": n}` each; a JSON object's text); InvalidRequestError for anything else."""
        param = "limit_mm_per_prompt"
        limits = json_object(limits, param, '{"image": n, "video": n, "audio": n}')
        if limits is None:
            return self
        counts: dict[str, int] = {}
        for kind, value in limits.items():
            if kind not in ("image", "video", "audio"):
                raise InvalidRequestError(f"limit_mm_per_prompt: conveyor reads images, videos and audio, not {kind!r}",
                                          param=param)
            if (kind == "audio") != (self.audio_features is not None):
                raise InvalidRequestError(f"limit_mm_per_prompt: this model reads no {kind}s" if kind != "audio"
                                          else "limit_mm_per_prompt: this model reads no audio", param=param)
            n = value.get("count") if isinstance(value, dict) else value
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise InvalidRequestError(f"limit_mm_per_prompt: {kind} is a count of 0 or more, not {value!r}",
                                          param=param)
            counts[kind] = n
        return dataclasses.replace(self, max_images=counts.get("image", self.max_images),
                                   max_videos=counts.get("video", self.max_videos),
                                   max_audios=counts.get("audio", self.max_audios))

    def overridden(self, kwargs: Any) -> ImageProcessor:
        """This processor with vLLM's `mm_processor_kwargs` (HF's processor's call options)
        applied: the Qwen-VLs' `min_pixels` and `max_pixels` (images' and video frames' area
        bounds), `fps`, `min_frames`, `max_frames` and `num_frames` (a video file's sampling);
        LLaVA-OneVision's `num_frames` (at most that many, spread evenly). A flat option goes to
        every kind it applies to, as HF's processor routes it; `images_kwargs` and `videos_kwargs`
        hold one kind's. InvalidRequestError names an option this model's processor has not."""
        if not kwargs:
            return self
        param = "mm_processor_kwargs"
        if not isinstance(kwargs, dict):
            raise InvalidRequestError("mm_processor_kwargs is an object of the processor's options", param=param)
        qwen = self.sampling is not None and self.sampling.rule != "uniform"
        image_keys = {"min_pixels", "max_pixels"} if self.factor and not self.longest_edge else set()
        if self.pan_and_scan is not None:
            image_keys = set(PAN_AND_SCAN)
        video_keys = ({"min_pixels", "max_pixels", "fps", "min_frames", "max_frames", "num_frames"} if qwen
                      else {"num_frames"} if self.sampling is not None else set())
        kinds: dict[str, dict[str, Any]] = {"image": {}, "video": {}}
        for key, value in kwargs.items():
            nested = {"images_kwargs": "image", "videos_kwargs": "video"}.get(key)
            if nested is not None:
                if not isinstance(value, dict):
                    raise InvalidRequestError(f"mm_processor_kwargs.{key} is an object", param=param)
                allowed = image_keys if nested == "image" else video_keys
                for k, v in value.items():
                    if k not in allowed:
                        raise InvalidRequestError(f"mm_processor_kwargs.{key}: {k!r} is not an option of this "
                                                  f"model's {nested} processing (it takes {sorted(allowed)})", param=param)
                    kinds[nested][k] = v
                continue
            if key not in image_keys | video_keys:
                raise InvalidRequestError(f"mm_processor_kwargs: {key!r} is not an option of this model's processor "
                                          f"(it takes {sorted(image_keys | video_keys)})", param=param)
            for kind, allowed in (("image", image_keys), ("video", video_keys)):
                if key in allowed:
                    kinds[kind][key] = value
        for opts in kinds.values():
            for k, v in opts.items():
                if k == "do_pan_and_scan":
                    if not isinstance(v, bool):
                        raise InvalidRequestError(f"mm_processor_kwargs: do_pan_and_scan is true or false, not {v!r}",
                                                  param=param)
                    continue
                whole = k not in ("fps", "pan_and_scan_min_ratio_to_activate")
                if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0 or (whole and v != int(v)):
                    raise InvalidRequestError(f"mm_processor_kwargs: {k} is a positive "
                                              f"{'whole number' if whole else 'number'}, not {v!r}", param=param)
            if "fps" in opts and "num_frames" in opts:
                raise InvalidRequestError("mm_processor_kwargs: fps and num_frames are two ways to choose a video's "
                                          "frames: give one", param=param)
        image, video = kinds["image"], kinds["video"]
        out = dataclasses.replace(self, min_pixels=int(image.get("min_pixels", self.min_pixels)),
                                  max_pixels=int(image.get("max_pixels", self.max_pixels)),
                                  video_min_pixels=int(video.get("min_pixels", self.video_min_pixels)),
                                  video_max_pixels=int(video.get("max_pixels", self.video_max_pixels)))
        if self.pan_and_scan is not None and image:
            out = dataclasses.replace(
                out, pan_and_scan=bool(image.get("do_pan_and_scan", self.pan_and_scan)),
                pan_min_crop=int(image.get("pan_and_scan_min_crop_size", self.pan_min_crop)),
                pan_max_crops=int(image.get("pan_and_scan_max_num_crops", self.pan_max_crops)),
                pan_min_ratio=float(image.get("pan_and_scan_min_ratio_to_activate", self.pan_min_ratio)))
        if out.min_pixels > out.max_pixels or out.video_min_pixels > out.video_max_pixels:
            raise InvalidRequestError("mm_processor_kwargs: min_pixels is more than max_pixels", param=param)
        if self.sampling is not None and video.keys() - {"min_pixels", "max_pixels"}:
            s = self.sampling
            sampling = dataclasses.replace(
                s, fps=float(video.get("fps", s.fps)), min_frames=int(video.get("min_frames", s.min_frames)),
                max_frames=int(video.get("max_frames", s.max_frames)),
                # (a rate asked for: the engine's count no longer)
                num_frames=int(video["num_frames"]) if "num_frames" in video else None if "fps" in video else s.num_frames)
            if sampling.min_frames > sampling.max_frames:
                raise InvalidRequestError("mm_processor_kwargs: min_frames is more than max_frames", param=param)
            out = dataclasses.replace(out, sampling=sampling)
        return out

    def _scale(self, array: np.ndarray) -> np.ndarray:
        """A picture `[channels, h, w]` of uint8 rescaled and normalized, as float32."""
        import numpy as np

        values = array.astype(np.float64) * self.rescale if self.rescale is not None else array.astype(np.float64)
        values = values.astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            values = (values - mean) / std
        return values


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image size (height, width) for a picture of `height` x `width`: each side
    rounded to a multiple of `factor`, then scaled (aspect kept) into `[min_pixels, max_pixels]`
    (HF's `smart_resize`)."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequestError(f"the image is {width}x{height}: its sides are more than 200 times apart",
                                  param="image")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _preprocessor_config(folder: Path | None, name: str = "preprocessor_config.json") -> dict[str, Any]:
    """A checkpoint's `preprocessor_config.json` (or `name`; HF's keys), or nothing."""
    if folder is not None and (folder / name).is_file():
        return dict(json.loads((folder / name).read_text()))
    return {}


def _scaling(cfg: dict[str, Any], mean: tuple[float, ...] = CLIP_MEAN, std: tuple[float, ...] = CLIP_STD
             ) -> dict[str, Any]:
    """An `ImageProcessor`'s rescale, mean and spread from a preprocessor config (HF's keys;
    `mean` and `std` where it names none)."""
    normalize = cfg.get("do_normalize", True)
    return {"rescale": float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            "mean": tuple(cfg.get("image_mean", mean)) if normalize else None,
            "std": tuple(cfg.get("image_std", std)) if normalize else None}


@functools.lru_cache(maxsize=256)
def tile_grid(size: tuple[int, int], tile: tuple[int, int], min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """InternVL's tiling (columns, rows) for a picture of `size` (height, width): the grid of
    between `min_tiles` and `max_tiles` tiles whose aspect is nearest the picture's; on a tie, the
    later (larger) grid while the picture's area is more than half of it (HF's
    `get_optimal_tiled_canvas`)."""
    grids = sorted(((w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
                    if min_tiles <= w * h <= max_tiles), key=lambda g: g[0] * g[1])
    height, width = size
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for w, h in grids:
        diff = abs(aspect - w / h)
        if diff < best_diff:
            best, best_diff = (w, h), diff
        elif diff == best_diff and area > 0.5 * tile[0] * tile[1] * w * h:
            best = (w, h)
    return best


def pixtral_size(height: int, width: int, longest_edge: int, side: int) -> tuple[int, int]:
    """Pixtral's image size (height, width) for a picture of `height` x `width`: scaled down
    (aspect kept, floored) to fit `longest_edge`, then each side up to a multiple of `side`
    (HF's `get_resize_output_image_size`)."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return ((height - 1) // side + 1) * side, ((width - 1) // side + 1) * side


def _center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """HF's center crop: the middle `height` x `width`, zero-padded first where the image is smaller."""
    import numpy as np

    _, h, w = array.shape
    if h < height or w < width:
        nh, nw = max(h, height), max(w, width)
        padded = np.zeros((array.shape[0], nh, nw), dtype=array.dtype)
        top, left = (nh - h + 1) // 2, (nw - w + 1) // 2
        padded[:, top : top + h, left : left + w] = array
        array, h, w = padded, nh, nw
    top, left = (h - height) // 2, (w - width) // 2
    return array[:, top : top + height, left : left + width]


def expand_image_tokens(token_ids: list[int], placeholder_id: int, images: list[Pixels], lengths: list[int],
                        image_token_id: int | None = None, before: list[int] | tuple[int, ...] = (),
                        after: list[int] | tuple[int, ...] = (), bidirectional: bool = False,
                        layouts: list[list[int] | None] | None = None,
                        ) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The prompt with each placeholder token replaced by `before`, its image's `lengths[i]`
    image tokens and `after` (LLaVA: the image token repeated; Gemma 3: "\n\n", its begin-of-image
    token, the image tokens, its end-of-image token, "\n\n", as HF's processor writes them),
    and each image's span; InvalidRequestError where the placeholders and the images do not
    pair up. `layouts[i]`, where given, is image i's span's tokens (Pixtral's rows of image
    tokens, each ending with a break token)."""
    image_token_id = placeholder_id if image_token_id is None else image_token_id
    places = [i for i, t in enumerate(token_ids) if t == placeholder_id]
    if len(places) != len(images):
        raise InvalidRequestError(
            f"the prompt has {len(places)} image tokens for {len(images)} images: put one image token "
            "(the model's <image> or <start_of_image>) where each image goes, or send the images as a "
            "chat's content parts", param="image",
        )
    out: list[int] = []
    spans = []
    last = 0
    for i, (place, pixels, length) in enumerate(zip(places, images, lengths, strict=True)):
        out.extend(token_ids[last:place])
        out.extend(before)
        spans.append(ImageSpan(len(out), length, pixels, bidirectional))
        layout = None if layouts is None else layouts[i]
        assert layout is None or len(layout) == length
        out.extend([image_token_id] * length if layout is None else layout)
        out.extend(after)
        last = place + 1
    out.extend(token_ids[last:])
    return out, tuple(spans)


def span_keys(spans: tuple[ImageSpan, ...], block_size: int, block: int) -> bytes:
    """The digests of the images whose tokens fall in block `block` (the prefix cache's extra
    key for it): empty for a block of text only."""
    start, end = block * block_size, (block + 1) * block_size
    return b"".join(s.pixels.digest for s in spans if s.offset < end and s.end > start)


# Content parts that carry an image: OpenAI's chat (`image_url`), its Responses API
# (`input_image`), and vLLM's offline forms (`image`, `image_pil`: the image itself).
IMAGE_PARTS = ("image_url", "input_image", "image", "image_pil")
# ... and a video: vLLM's `video_url` (a URL of its file) and `video` (its frames or file).
VIDEO_PARTS = ("video_url", "video")
# ... and an audio clip: OpenAI's `input_audio` (`{"data": base64, "format": "wav"}`), vLLM's
# `audio_url` and `audio` (its samples or file).
AUDIO_PARTS = ("input_audio", "audio_url", "audio")


def chat_images(messages: list[dict[str, Any]], template: str, token: ImageToken | None
                ) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages as the chat template reads them, and their images (and videos, as `Video`s;
    audio clips, as `Audio`s) in order.

    A message's text parts are joined. Where it has images, a template that renders image
    parts itself (it tests a part's type against "image", as LLaVA's and Qwen-VL's do, or
    "audio", as Qwen2-Audio's) gets the parts as `{"type": "image"}` (`{"type": "video"}`,
    `{"type": "audio"}`) and `{"type": "text", "text": ...}`; any other gets the image (video)
    token once an image, each on its own line, before the message's text (vLLM's "string" form;
    a clip's is "Audio k: " and its tokens, k counting the conversation's clips). `token`: the
    model's (None: it reads no images)."""
    image_token, video_token = (None, None) if token is None else (token.text, token.video)
    audio_token = None if token is None else token.audio
    if audio_token is not None:
        image_token = None  # (an audio model's token places clips)
    images: list[Any] = []
    out: list[dict[str, Any]] = []
    reads_parts = any(f"{q}{kind}{q}" in template for kind in ("image", "audio") for q in "'\"")
    clips = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PARTS:
                if image_token is None:
                    raise InvalidRequestError("this model reads no images", param="messages")
                images.append(_part_image(part, kind))
                parts.append({"type": "image"})
            elif kind in VIDEO_PARTS:
                if video_token is None:
                    raise InvalidRequestError("this model reads no videos", param="messages")
                images.append(Video(_part_image(part, kind)))
                parts.append({"type": "video"})
            elif kind in AUDIO_PARTS:
                if audio_token is None:
                    raise InvalidRequestError("this model reads no audio", param="messages")
                images.append(_part_audio(part, kind))
                parts.append({"type": "audio"})
            elif kind in ("text", "input_text", "output_text") or (isinstance(part, dict) and "text" in part):
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise InvalidRequestError(f"a content part of type {kind!r} is not supported (text, images, "
                                          "videos and audio are)", param="messages")
        text = "".join(p["text"] for p in parts if p["type"] == "text")
        marks: list[str | None] = []
        for p in parts:
            if p["type"] == "audio":
                clips += 1
                marks.append(f"Audio {clips}: {audio_token}")
            elif p["type"] != "text":
                marks.append(image_token if p["type"] == "image" else video_token)
        if not marks:
            content = text
        elif reads_parts:
            content = parts
        else:
            content = "\n".join([*(str(m) for m in marks), text])  # (each checked at its part)
        out.append({**message, "content": content})
    return out, images


def _part_audio(part: dict[str, Any], kind: str) -> Audio:
    value = part.get(kind)
    if kind == "input_audio":  # (OpenAI's: the file's base64, and its format)
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            raise InvalidRequestError('an input_audio content part is {"data": base64, "format": "wav" | "mp3" | ...}',
                                      param="messages")
        try:
            return Audio(base64.b64decode(value["data"], validate=True))
        except (binascii.Error, ValueError):
            raise InvalidRequestError("the input_audio's data is not valid base64", param="messages") from None
    if isinstance(value, dict) and kind == "audio_url":
        value = value.get("url")
    if value is None:
        raise InvalidRequestError(f"an {kind} content part without its audio", param="messages")
    return as_audio(value)


def _part_image(part: dict[str, Any], kind: str) -> Any:
    value = part.get(kind)
    if kind in ("image_url", "input_image", "video_url"):
        if kind == "input_image" and value is None:
            value = part.get("image_url")
        if isinstance(value, dict):
            value = value.get("url")
    if value is None:
        what = "video" if kind in VIDEO_PARTS else "image"
        raise InvalidRequestError(f"a {kind} content part without its {what}", param="messages")
    return value
