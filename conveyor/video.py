"""Videos in prompts (the Qwen-VLs' and LLaVA-OneVision's): reading them, choosing their frames,
making them pixels.

A video is a `Video`: its frames (an array `[frames, height, width, 3]` of uint8, as vLLM's
`multi_modal_data={"video": ...}` takes them, or a list of images in any form an image may be),
or its file (bytes, a `data:video/...;base64,` URL, an http(s) URL or a local path under
`allowed_local_media_path`), decoded with OpenCV (`pip install opencv-python-headless`, the
`video` extra; vLLM's default video loader too) and sampled as Qwen's processors sample: `fps`
frames a second (2), at least `min_frames` (4) and at most `max_frames` (768), an even count
(`sample_indices`); LLaVA-OneVision's at most 32 frames spread evenly from the first to the last
(vLLM's video loader's default; HF's processor samples none). Frames given as frames are taken
as they are, all of them.

The processor (`ImageProcessor.video`) resizes every frame to one size, that of Qwen2-VL's
`smart_resize` for the first frame within the video's own bounds on the area (its
`video_preprocessor_config.json`, else 128 to 768 tokens' worth of pixels a frame), capped so
that the whole video stays within 90% of 128,000 tokens' worth (qwen-vl-utils' rule), and repeats
the last frame to an even count: the tower reads the frames two at a time (its patch convolution
spans two frames), so a video of T frames of h x w tokens is T/2 x h x w tokens. LLaVA-OneVision's
resizes every frame to the tower's square and reads each as an image, its features pooled to half
a side.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.sampling_params import InvalidRequestError

if TYPE_CHECKING:
    import numpy as np

DEFAULT_FPS = 2.0  # frames a second that Qwen's tools sample at: the rate of frames given as frames
MAX_VIDEO_BYTES = 256 << 20


@dataclass(frozen=True)
class Video:
    """A video in a prompt: `source` is its frames (an array `[frames, height, width, 3]` of uint8,
    or a list of images) or its file (bytes, a URL or a path), and `fps` the rate of its frames:
    for frames, the rate they were taken at (2 where not given); for a file, in place of what
    the file says."""

    source: Any
    fps: float | None = None

    def __post_init__(self) -> None:
        if self.fps is not None and not (isinstance(self.fps, int | float) and self.fps > 0):
            raise InvalidRequestError(f"a video's fps must be a positive number, not {self.fps!r}", param="video")


def as_video(item: Any) -> Video:
    """A prompt's video as a `Video`: one as it is, vLLM's `(frames, metadata)` pair with the
    metadata's `fps`, anything else its source."""
    if isinstance(item, Video):
        return item
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict):
        return Video(item[0], item[1].get("fps"))
    return Video(item)


@dataclass(frozen=True)
class VideoSampling:
    """How a video file's frames are chosen: HF's `Qwen2VLVideoProcessor.sample_frames` with
    `fps` (`rule` "qwen2"), `Qwen3VLVideoProcessor`'s ("qwen3"), or at most `max_frames` spread
    evenly whatever the rate ("uniform": vLLM's loader, LLaVA-OneVision's)."""

    fps: float = DEFAULT_FPS
    min_frames: int = 4
    max_frames: int = 768
    multiple: int = 2  # (the tower's temporal patch: an even count)
    rule: str = "qwen2"
    num_frames: int | None = None  # (a count asked for, in place of `fps`'s: `mm_processor_kwargs`)


def sample_indices(total: int, native_fps: float, sampling: VideoSampling) -> list[int]:
    """The frames to keep of a file of `total` frames at `native_fps`: `sampling.fps` a second,
    between its least and most, spread evenly; Qwen2-VL's floored to a multiple of
    `sampling.multiple` and from the first frame on in equal steps, Qwen3-VL's any count from
    the first frame to the last (rounded); "uniform": every frame, or `max_frames` from the
    first to the last (truncated, as vLLM's OpenCV loader takes them). A `num_frames` asked for
    is that many (Qwen2-VL's rounded to a multiple), as HF's processors take it."""
    asked = sampling.num_frames
    if asked is not None and sampling.rule != "uniform":  # (Qwen2-VL's: a multiple of the temporal patch)
        asked = asked if sampling.rule == "qwen3" else round(asked / sampling.multiple) * sampling.multiple
        if asked > total:
            raise InvalidRequestError(f"num_frames={sampling.num_frames}: the video has {total} frames",
                                      param="mm_processor_kwargs")
    if sampling.rule == "uniform":
        import numpy as np

        most = sampling.max_frames if asked is None else asked
        if total <= most:
            return list(range(total))
        return [int(i) for i in np.linspace(0, total - 1, most, dtype=int)]
    if sampling.rule == "qwen3":
        import numpy as np

        count = asked if asked is not None else min(max(int(total / native_fps * sampling.fps), sampling.min_frames),
                                                    sampling.max_frames, total)
        return [int(i) for i in np.linspace(0, total - 1, count).round()]  # (HF's, numpy's rounding)
    m = sampling.multiple
    most = math.floor(min(sampling.max_frames, total) / m) * m
    if asked is not None:
        n = asked
    else:
        n = math.floor(min(max(total / native_fps * sampling.fps, sampling.min_frames), most, total) / m) * m
    if n <= 0:
        raise InvalidRequestError(f"the video has {total} frames: fewer than the {m} a video needs", param="video")
    step = total / n
    return [int(i * step) for i in range(n)]  # (HF's `torch.arange(0, total, total / n).int()`)


def load_video(video: Video, sampling: VideoSampling, allowed_local_media_path: str | None = None,
               domains: frozenset[str] | None = None) -> tuple[list[np.ndarray], float, list[float]]:
    """A video's frames (`[height, width, 3]` uint8 each, one size), their rate a second, and
    each one's time in the video (seconds); InvalidRequestError if it cannot be read."""
    import numpy as np

    from conveyor.multimodal import image_bytes, load_image

    source = video.source
    if _is_frames(source):
        if hasattr(source, "detach"):  # (a torch tensor)
            source = source.detach().cpu().numpy()
        if isinstance(source, np.ndarray):
            if source.ndim != 4 or source.shape[-1] != 3:
                raise InvalidRequestError(f"a video's frames are an array [frames, height, width, 3], not of shape "
                                          f"{list(source.shape)}", param="video")
            frames = [np.asarray(f, dtype=np.uint8) for f in source]
        else:
            frames = [f.astype(np.uint8) if isinstance(f, np.ndarray)
                      else np.asarray(load_image(f, allowed_local_media_path, domains)) for f in source]
        if not frames:
            raise InvalidRequestError("the video has no frames", param="video")
        if any(f.shape != frames[0].shape or f.ndim != 3 or f.shape[-1] != 3 for f in frames):
            raise InvalidRequestError("a video's frames are RGB pictures of one size", param="video")
        fps = float(video.fps or DEFAULT_FPS)
        return frames, fps, [k / fps for k in range(len(frames))]
    data = image_bytes(source, allowed_local_media_path, MAX_VIDEO_BYTES, "video", domains)

    kept: list[int] = []

    def choose(total: int, native: float) -> list[int]:
        fps = float(video.fps or native)
        if not fps > 0 and sampling.rule != "uniform":  # (an even spread needs no rate)
            raise InvalidRequestError("the video file gives no frame rate: give the Video's fps", param="video")
        kept.extend(sample_indices(total, fps, sampling))
        return kept

    frames, total, native = decode_video(data, choose)
    fps = float(video.fps or native) if float(video.fps or native) > 0 else DEFAULT_FPS
    return frames, len(frames) / total * fps, [k / fps for k in kept[: len(frames)]]


def video_size(num_frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
               max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's frame size (height, width) for a video of `num_frames` of `height` x `width`:
    a side under `factor` scaled up to it, each side rounded to a multiple of `factor`, then
    scaled (aspect kept) so that the frames' pixels together, their count rounded to a multiple
    of `temporal`, lie in `[min_pixels, max_pixels]` (HF's `Qwen3VLVideoProcessor` `smart_resize`)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequestError(f"the video is {width}x{height}: its sides are more than 200 times apart",
                                  param="video")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(num_frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _is_frames(source: Any) -> bool:
    return hasattr(source, "shape") or isinstance(source, list | tuple)


def decode_video(data: bytes, choose: Callable[[int, float], list[int]]) -> tuple[list[np.ndarray], int, float]:
    """The frames `choose(frame count, frame rate)` picks of an encoded video (RGB `[height,
    width, 3]` uint8; only those are converted and kept), its frame count and its frame rate,
    by OpenCV (FFmpeg inside its wheels)."""
    try:
        import cv2
    except ImportError:
        raise InvalidRequestError("decoding a video file needs OpenCV: pip install opencv-python-headless "
                                  "(conveyor's `video` extra), or give the video's frames", param="video") from None
    fd, path = tempfile.mkstemp(suffix=".video")  # (OpenCV reads a file, not bytes)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        capture = cv2.VideoCapture(path)
        try:
            if not capture.isOpened():
                raise InvalidRequestError("the video cannot be read (not a video OpenCV decodes)", param="video")
            total, fps = int(capture.get(cv2.CAP_PROP_FRAME_COUNT)), float(capture.get(cv2.CAP_PROP_FPS) or 0.0)
            if total <= 0:
                raise InvalidRequestError("the video gives no frame count", param="video")
            keep = set(choose(total, fps))
            frames = []
            for i in range(max(keep) + 1):  # (every frame is decoded in turn; the chosen ones kept)
                if not capture.grab():
                    break
                if i in keep:
                    ok, frame = capture.retrieve()
                    if ok:
                        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        finally:
            capture.release()
    finally:
        os.unlink(path)
    if not frames:
        raise InvalidRequestError("the video has no frames that can be decoded", param="video")
    return frames, total, fps
