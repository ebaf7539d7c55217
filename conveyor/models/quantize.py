"""int8 weights and activations for float32 on an x86 CPU (`quantization="int8"`).

fbgemm's int8 GEMM runs about four times the float32 GEMM's rate on an AVX2 CPU and reads a
quarter of the weight bytes, but it quantizes activations with one scale per tensor. A language
model's activations have a few channels tens to hundreds of times larger than the rest
(measured on SmolLM2: up to 190x the median channel), and one scale per tensor then rounds every
other channel to a handful of levels. Two exact rescalings fix most of that:

- Smoothing (SmoothQuant, Xiao et al. 2023): input channel j is divided by `s_j` and the
  weight's column j multiplied by it, which leaves `x @ W.T` unchanged and moves the outliers
  into the weights, where per-row int8 scales absorb them. `s_j = amax(x_j)^a / amax(W_j)^(1-a)`,
  with `amax(x_j)` measured on calibration text and `a` chosen per layer from a small grid by
  the error on that text.
- Per-token scales: each row is divided by its own max before the quantization and the output
  multiplied back, so a row of large values does not coarsen the others (and a row's result
  does not depend on the batch: see `Int8Linear`).

What remains is int8 rounding of weights (per output row) and of activations (per row, 8-bit
unsigned with a zero point; 7-bit on CPUs without AVX-512 VNNI, see `seven_bit_activations`);
BENCHMARKS.md measures what it costs against float32.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

ALPHAS = (0.5, 0.65, 0.8)  # smoothing strengths tried per layer
CALIBRATION_ROWS = 256  # activation rows kept per layer to choose its smoothing strength

# A short text to calibrate activations on when the model has a tokenizer: prose, a dialogue
# turn, code and numbers, since each lights up different channels.
CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable metal "
    "type made books cheap enough for merchants, students and clergy to own them. Within fifty "
    "years presses were running in more than two hundred European cities.\n"
    "User: Can you explain what a hash table is, briefly?\n"
    "Assistant: A hash table stores key-value pairs in an array. A hash function maps each key "
    "to an index, so lookups take constant time on average.\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n"
    "Prices rose 3.2% in March, 2.9% in April and 4.1% in May; 17 x 23 = 391.\n"
)


def int8_supported() -> bool:
    """fbgemm's int8 GEMMs are in this torch build (x86 CPUs)."""
    engines = torch.backends.quantized.supported_engines
    return ("fbgemm" in engines or "x86" in engines) and hasattr(torch.ops.quantized, "linear_dynamic")


@functools.cache
def seven_bit_activations() -> bool:
    """Whether activations must be quantized to 7 bits (fbgemm's `reduce_range`) on this CPU.

    Without AVX-512 VNNI, fbgemm multiplies u8 activations by s8 weights with `vpmaddubsw`,
    which adds each pair of products in 16 bits and saturates: with 8-bit activations spanning
    [-1, 1] and weights scaled to their row's max, pairs near the maxima overflow. On an AVX2
    EPYC (no VNNI) that gave a 4.8% relative error on plain Gaussian inputs, 1.4% with 7 bits.
    With VNNI (`vpdpbusd`, 32-bit sums) nothing saturates and 8 bits halve the 7-bit error
    (BENCHMARKS.md, measured on a Zen 4 EPYC). Off Linux the flags are unknown: 7 bits."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_vnni" not in line.split()
    except OSError:
        pass
    return True


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights and int8 activations; float32 in and out.

    `smooth` (the `s` above, or None) is folded into the weight here and divided out of the
    input at each call. The weight is quantized symmetric per output row. Each input row is
    divided by its max |x|, so it spans at most [-1, 1]; two extra input columns hold +1 and -1
    (against zero weights), so fbgemm's per-tensor range is always exactly [-1, 1]. Every row is
    then quantized on its own scale, the same whatever else is in the batch, and the GEMM is
    exact integer arithmetic: a request's output does not depend on the batch it runs in.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        if smooth is not None:
            w = w * smooth
        self.inv_smooth = None if smooth is None else (1.0 / smooth).contiguous()
        self.out_features, self.in_features = w.shape
        w = torch.cat((w, w.new_zeros(w.shape[0], 2)), dim=1)  # the +1 / -1 range columns
        scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # Quantized tensors are deprecated as a user type; fbgemm's packing still takes one.
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(q, None)
        # The same int8 weights unpacked, for the native weight-only path of small decode steps
        # (conveyor/kernels: FusedDecode, the LM head); one more byte per weight.
        self.qweight = q.int_repr()[:, : self.in_features].contiguous()
        self.wscale = scale.float().contiguous()
        self.bias = None if bias is None else bias.detach().float()
        from conveyor.kernels import int8_prepare

        self.prepare = int8_prepare()

    prepare: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # native, set at load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepare is not None and x.dtype == torch.float32 and x.dim() == 2:
            buffer, row_max = self.prepare(x, self.inv_smooth)
        else:
            buffer, row_max = self._prepare(x)
        y = torch.ops.quantized.linear_dynamic(buffer, self.packed, seven_bit_activations()).mul_(row_max)
        return y if self.bias is None else y.add_(self.bias)

    def _prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows scaled into [-1, 1] with the two range columns appended, and each row's max."""
        rows, k = x.shape[0], self.in_features
        buffer = x.new_empty(rows, k + 2)
        scaled = buffer[:, :k]
        if self.inv_smooth is None:
            scaled.copy_(x)
        else:
            torch.mul(x, self.inv_smooth, out=scaled)
        row_max = scaled.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
        scaled.div_(row_max)
        buffer[:, k] = 1.0
        buffer[:, k + 1] = -1.0
        return buffer, row_max


def choose_smoothing(x: torch.Tensor, weight: torch.Tensor, x_absmax: torch.Tensor) -> torch.Tensor:
    """The smoothing vector from ALPHAS whose int8 product is closest to `x @ W.T` on `x`."""
    w = weight.detach().float()
    w_absmax = w.abs().amax(dim=0).clamp_min(1e-5)
    a_max = x_absmax.clamp_min(1e-5)
    reference = x @ w.t()
    best, best_err = None, float("inf")
    for alpha in ALPHAS:
        smooth = (a_max**alpha / w_absmax ** (1 - alpha)).clamp(1e-4, 1e4)
        err = float((Int8Linear(w, None, smooth)(x) - reference).norm())
        if err < best_err:
            best, best_err = smooth, err
    assert best is not None
    return best


class ActivationRecorder:
    """Forward pre-hooks on the given linear layers that keep each input channel's max |x| and
    up to CALIBRATION_ROWS input rows (spread over the text)."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self.absmax: dict[str, torch.Tensor] = {}
        self.rows: dict[str, torch.Tensor] = {}
        self.handles = [layer.register_forward_pre_hook(self._hook(name)) for name, layer in layers.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            amax = x.abs().amax(dim=0)
            self.absmax[name] = amax if name not in self.absmax else torch.maximum(self.absmax[name], amax)
            step = max(1, x.shape[0] // CALIBRATION_ROWS)
            self.rows[name] = x[::step][:CALIBRATION_ROWS].clone()

        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def calibration_ids(encode: Callable[[str], list[int]] | None, vocab_size: int, length: int = 256) -> list[int]:
    """Token ids to calibrate on: CALIBRATION_TEXT through the tokenizer, else fixed random ids."""
    if encode is not None:
        ids = encode(CALIBRATION_TEXT)
        if len(ids) >= 16:
            return ids[:length]
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def quantize_linears(
    model: nn.Module, inputs: dict[str, tuple[torch.Tensor, torch.Tensor]], skip: Sequence[nn.Module] = ()
) -> None:
    """Replace every `nn.Linear` of `model` (except `skip`) by an `Int8Linear`, smoothed when
    `inputs[name]` holds its calibration (absmax, rows)."""
    for module_name, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or any(child is s for s in skip):
                continue
            full = f"{module_name}.{name}" if module_name else name
            smooth = None
            if full in inputs:
                absmax, rows = inputs[full]
                smooth = choose_smoothing(rows, child.weight, absmax)
            setattr(module, name, Int8Linear(child.weight, child.bias, smooth))
