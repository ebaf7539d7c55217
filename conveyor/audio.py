"""Audio in prompts (Qwen2-Audio's): reading it, resampling it, making it log-mel features, and
how many tokens it becomes.

An audio clip is an `Audio`: its samples (a float array, mono or `[samples, channels]`, with
their `sampling_rate`; vLLM's `multi_modal_data={"audio": (samples, rate)}`), or its file (bytes,
a `data:audio/...;base64,` URL, an http(s) URL, or a local path under `allowed_local_media_path`).
WAV files (PCM of 8 to 32 bits or IEEE floats) are read here; other formats (MP3, FLAC, OGG)
through `soundfile` (`pip install soundfile`, the `audio` extra). Channels are averaged to one,
and the samples resampled to the feature extractor's rate (16 kHz) by a Kaiser-windowed sinc
(`resample`).

`AudioFeatures` is Whisper's feature extractor as Qwen2-Audio's processor runs it: the clip cut
to its first 30 seconds and padded with silence to them, a 400-sample Hann STFT every 160
samples, the power spectrum through 128 Slaney mel filters, log10, floored 8 below its maximum,
then `(x + 4) / 4`. Of the 3000 frames, `ceil(samples / 160)` are the clip's; the tower's two
convolutions halve them, its average pool halves them again (`audio_tokens`), so a second of
audio is 25 tokens and the longest clip 750. Only the frames the tower's outputs at those tokens
depend on are kept (`AudioFeatures.__call__`): the rest is padding that the tower's attention
masks out.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.sampling_params import InvalidRequestError

if TYPE_CHECKING:
    import numpy as np

MAX_AUDIO_BYTES = 64 << 20


@dataclass(frozen=True)
class Audio:
    """An audio clip in a prompt: `source` is its samples (a float or integer array, with
    `sampling_rate`) or its file (bytes, a URL or a path; `sampling_rate` then unused)."""

    source: Any
    sampling_rate: int | None = None

    def __post_init__(self) -> None:
        rate = self.sampling_rate
        if rate is not None and not (isinstance(rate, int | float) and rate > 0):
            raise InvalidRequestError(f"an audio's sampling rate must be a positive number, not {rate!r}",
                                      param="audio")


def as_audio(item: Any) -> Audio:
    """A prompt's audio as an `Audio`: one as it is, vLLM's `(samples, sampling_rate)` pair,
    anything else its source (an array without a rate is taken at the model's rate)."""
    if isinstance(item, Audio):
        return item
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], int | float):
        return Audio(item[0], int(item[1]))
    return Audio(item)


def load_audio(audio: Audio, rate: int, allowed_local_media_path: str | None = None,
               domains: frozenset[str] | None = None) -> np.ndarray:
    """The clip's samples, mono float32 at `rate`; InvalidRequestError if it cannot be read."""
    import numpy as np

    from conveyor.multimodal import image_bytes

    source = audio.source
    if isinstance(source, bytes | bytearray | str | Path):
        data = image_bytes(source, allowed_local_media_path, MAX_AUDIO_BYTES, "audio", domains)
        samples, given = decode_audio(data)
    else:
        try:
            samples = np.asarray(source.numpy() if hasattr(source, "numpy") else source)
        except Exception as e:
            raise InvalidRequestError(f"an audio is its samples, bytes, a URL or a path, not {type(source).__name__} "
                                      f"({e})", param="audio") from None
        if samples.dtype.kind not in "fiu" or samples.ndim not in (1, 2):
            raise InvalidRequestError(f"an audio's samples are a 1-D (or [samples, channels]) array of numbers, "
                                      f"not {samples.ndim}-D of {samples.dtype}", param="audio")
        if samples.dtype.kind in "iu":  # (integers: PCM, scaled to [-1, 1))
            samples = _pcm(samples)
        given = int(audio.sampling_rate or rate)
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    samples = samples.astype(np.float32, copy=False)
    if not np.isfinite(samples).all():
        raise InvalidRequestError("an audio's samples hold NaN or infinity", param="audio")
    return resample(samples, given, rate)


def _pcm(samples: np.ndarray) -> np.ndarray:
    import numpy as np

    info = np.iinfo(samples.dtype)
    middle = (int(info.max) + int(info.min) + 1) // 2  # (0 for signed, 128 for 8-bit unsigned)
    return ((samples.astype(np.float64) - middle) / (int(info.max) - middle + 1)).astype(np.float32)


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """An audio file's samples (`[samples]` or `[samples, channels]`, float32) and rate: a WAV
    file read here, any other format through soundfile."""
    if data[:4] in (b"RIFF", b"RF64") and data[8:12] == b"WAVE":
        return _read_wav(data)
    try:
        import soundfile
    except ImportError:
        raise InvalidRequestError("this audio is not a WAV file; other formats (MP3, FLAC, OGG) need soundfile: "
                                  "pip install soundfile", param="audio") from None
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=False)
    except Exception as e:  # (soundfile raises its own kinds for a file it cannot read)
        raise InvalidRequestError(f"the audio cannot be read: {e}", param="audio") from None
    return samples, int(rate)


def _read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A WAV file's samples: PCM of 8, 16, 24 or 32 bits, or IEEE floats of 32 or 64
    (WAVE_FORMAT_EXTENSIBLE's too)."""
    import numpy as np

    fmt: tuple[int, int, int, int] | None = None
    payload = None
    at = 12
    while at + 8 <= len(data):
        chunk, size = data[at : at + 4], struct.unpack("<I", data[at + 4 : at + 8])[0]
        body = data[at + 8 : at + 8 + size]
        if chunk == b"fmt " and len(body) >= 16:
            tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == 0xFFFE and len(body) >= 26:  # (WAVE_FORMAT_EXTENSIBLE: the sub-format's tag)
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, channels, rate, bits)
        elif chunk == b"data":
            payload = body
            break
        at += 8 + size + (size & 1)
    if fmt is None or payload is None:
        raise InvalidRequestError("the WAV file has no fmt or data chunk", param="audio")
    tag, channels, rate, bits = fmt
    if channels < 1 or rate < 1:
        raise InvalidRequestError(f"the WAV file says {channels} channels at {rate} Hz", param="audio")
    width = bits // 8
    usable = len(payload) - len(payload) % (width * channels or 1)
    payload = payload[:usable]
    if tag == 3 and bits in (32, 64):
        samples = np.frombuffer(payload, dtype="<f4" if bits == 32 else "<f8").astype(np.float32)
    elif tag == 1 and bits in (8, 16, 32):
        dtype: Any = {8: np.uint8, 16: "<i2", 32: "<i4"}[bits]
        samples = _pcm(np.frombuffer(payload, dtype=dtype))
    elif tag == 1 and bits == 24:  # (three bytes a sample: widened to 32 bits)
        raw = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 3)
        wide = (raw[:, 0].astype(np.int32) | (raw[:, 1].astype(np.int32) << 8) | (raw[:, 2].astype(np.int32) << 16))
        samples = (((wide ^ 0x800000) - 0x800000) / float(1 << 23)).astype(np.float32)
    else:
        raise InvalidRequestError(f"WAV format {tag} of {bits} bits is not read (PCM of 8-32 bits and "
                                  "IEEE floats are)", param="audio")
    return (samples.reshape(-1, channels) if channels > 1 else samples), int(rate)


def resample(samples: np.ndarray, given: int, rate: int, zeros: int = 16, beta: float = 8.6) -> np.ndarray:
    """`samples` at `given` Hz resampled to `rate` Hz: band-limited interpolation by a sinc of
    `zeros` zero crossings a side under a Kaiser window (cut off below the lower Nyquist
    frequency), evaluated at each output sample's place; `ceil(len * rate / given)` samples."""
    import numpy as np

    if given == rate or samples.size == 0:
        return samples
    g = math.gcd(int(given), int(rate))
    up, down = int(rate) // g, int(given) // g
    cutoff = min(1.0, up / down)  # (of the input's Nyquist frequency)
    half = math.ceil(zeros / cutoff)  # input samples a side
    n_out = math.ceil(len(samples) * up / down)
    padded = np.concatenate([np.zeros(half, np.float32), samples, np.zeros(half + 1, np.float32)])
    taps = np.arange(-half + 1, half + 1)
    # Output sample k lies at input place k * down / up: its fraction repeats every `up` samples,
    # so each of the `up` phases' filters is made once.
    dist = (np.arange(up) * down % up / up)[:, None] - taps[None, :]
    window = np.i0(beta * np.sqrt(np.clip(1.0 - (dist / half) ** 2, 0.0, None))) / np.i0(beta)
    table = (cutoff * np.sinc(cutoff * dist) * window).astype(np.float32)
    out = np.empty(n_out, np.float32)
    step = 1 << 14
    for lo in range(0, n_out, step):
        k = np.arange(lo, min(n_out, lo + step))
        base = k * down // up
        out[k] = np.einsum("kt,kt->k", padded[base[:, None] + taps[None, :] + half], table[k % up])
    return out


def hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels every 200 Hz), logarithmic above."""
    import numpy as np

    freq = np.asarray(freq, dtype=np.float64)
    mels = 3.0 * freq / 200.0
    above = freq >= 1000.0
    mels[above] = 15.0 + np.log(freq[above] / 1000.0) * 27.0 / np.log(6.4)
    return mels


def mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    import numpy as np

    mels = np.asarray(mels, dtype=np.float64)
    freq = 200.0 * mels / 3.0
    above = mels >= 15.0
    freq[above] = 1000.0 * np.exp(np.log(6.4) * (mels[above] - 15.0) / 27.0)
    return freq


def mel_filters(bins: int, filters: int, rate: int, low: float = 0.0, high: float = 8000.0) -> np.ndarray:
    """Triangular filters `[bins, filters]` evenly spaced on Slaney's mel scale from `low` to
    `high` Hz, each scaled to unit area (Slaney's norm), over `bins` STFT bins up to rate / 2."""
    import numpy as np

    edges = mel_to_hertz(np.linspace(hertz_to_mel(np.array([low]))[0], hertz_to_mel(np.array([high]))[0],
                                     filters + 2))
    centers = np.linspace(0, rate // 2, bins)
    gaps = np.diff(edges)
    slopes = edges[None, :] - centers[:, None]
    down = -slopes[:, :-2] / gaps[:-1]
    up = slopes[:, 2:] / gaps[1:]
    bank = np.maximum(0.0, np.minimum(down, up))
    return bank * (2.0 / (edges[2 : filters + 2] - edges[:filters]))[None, :]


def audio_tokens(frames: int) -> int:
    """The tokens a clip of `frames` feature frames becomes: the tower's second convolution
    (stride 2) and its average pool (2) each halve them, rounding as HF's
    `_get_feat_extract_output_lengths` does."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


@dataclass(frozen=True)
class AudioFeatures:
    """Whisper's log-mel feature extractor (`WhisperFeatureExtractor`, Qwen2-Audio's), from a
    checkpoint's `preprocessor_config.json`."""

    feature_size: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> AudioFeatures:
        keys = ("feature_size", "sampling_rate", "hop_length", "n_fft", "chunk_length")
        return cls(**{k: int(cfg[k]) for k in keys if cfg.get(k) is not None})

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def max_frames(self) -> int:
        return self.n_samples // self.hop_length

    @functools.cached_property
    def filters(self) -> Any:
        import torch

        return torch.from_numpy(mel_filters(1 + self.n_fft // 2, self.feature_size, self.sampling_rate)).float()

    def __call__(self, samples: np.ndarray, whole: bool = False) -> tuple[Any, int]:
        """A clip's features `[feature_size, kept frames]` (float32) and how many frames are its
        own (`ceil(samples / hop)`, at most 30 seconds' worth): the frames up to those the
        tower's outputs at the clip's tokens read (`kept_frames`), of the clip padded to 30 s;
        all of them with `whole` (Whisper's encoder reads the padding too)."""
        import numpy as np
        import torch

        n = min(len(samples), self.n_samples)
        frames = math.ceil(n / self.hop_length)
        if whole and n < 1:  # (Whisper reads any clip, padded to 30 s)
            raise InvalidRequestError("the audio is empty", param="audio")
        if not whole and audio_tokens(frames) < 1:
            raise InvalidRequestError(f"the audio is {n} samples, too short for one token (at least "
                                      f"{2 * self.hop_length + 1} at {self.sampling_rate} Hz)", param="audio")
        wave = np.zeros(self.n_samples, np.float32)
        wave[:n] = samples[:n]
        stft = torch.stft(torch.from_numpy(wave), self.n_fft, self.hop_length,
                          window=torch.hann_window(self.n_fft), return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()
        logs = (self.filters.T @ power).clamp(min=1e-10).log10()
        logs = (torch.maximum(logs, logs.max() - 8.0) + 4.0) / 4.0
        return logs[:, : self.max_frames if whole else kept_frames(frames, self.max_frames)].contiguous(), frames

    def digest(self, features: Any, frames: int) -> bytes:
        return hashlib.sha256(features.numpy().tobytes() + b"audio%d" % frames).digest()


def audio_positions(frames: int) -> int:
    """The tower's positions a clip's tokens depend on: up to both its own (`(frames - 1) // 2
    + 1`, the keys its attention reads) and twice its tokens (the pool's pairs)."""
    return max((frames - 1) // 2 + 1, 2 * audio_tokens(frames))


def kept_frames(frames: int, max_frames: int) -> int:
    """The feature frames the tower's outputs at a clip's tokens depend on: each of its
    positions (`audio_positions`) reads three frames of the first convolution's three."""
    return min(max_frames, 2 * audio_positions(frames) + 2)
