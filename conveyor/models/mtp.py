"""DeepSeek-V3's multi-token prediction (MTP) layer as a speculative drafter.

DeepSeek-V3 was trained with one extra layer beside its 61 (`model.layers.61.*` in its
checkpoint, `num_nextn_predict_layers: 1`; DeepSeek-V3 report, section 2.2): it reads the main
model's final hidden state at position i and the embedding of token i + 1, and predicts token
i + 2. As a drafter (vLLM's and SGLang's `mtp`), the row at position i is

    x = eh_proj([enorm(embed(t[i+1])), hnorm(h[i])])   a decoder layer (MLA + MoE) over x
    guess for t[i+2] = argmax(shared_head.head(shared_head.norm(layer output)))

where `h[i]` is the target's hidden state (after its final norm, as vLLM feeds it); for more
guesses than one, the layer runs again on its own guess with its own output in place of `h`.
It keeps a one-layer latent cache of its own over the target's blocks
(conveyor/runner/mtp.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.arch import ArchConfig, UnsupportedModelError
from conveyor.models.attention import AttentionMetadata, TorchPagedAttention
from conveyor.models.llama import DecoderLayer, RMSNorm, Rotary


class SharedHead(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)


class MTPLayer(nn.Module):
    """One MTP layer; parameter names are the checkpoint's under `model.layers.{L}.` (its decoder
    layer's as `layers.0.*`, so the loader's fusing and renaming apply)."""

    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        h = arch.hidden_size
        # The layer's own shape: one sparse layer (the loader reads `arch` and `lm_head`).
        self.arch = dataclasses.replace(arch, num_layers=1, first_k_dense_replace=0)
        self.lm_head = None
        self.embed_tokens = nn.Embedding(arch.vocab_size, h)
        self.enorm = RMSNorm(h, arch.rms_norm_eps)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(self.arch, TorchPagedAttention(), 0)])
        self.shared_head = SharedHead(arch)
        self.rotary = Rotary(arch, max_positions)

    def forward(self, input_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer's output `[T, hidden]` (before `shared_head.norm`: what the next guess reads)."""
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(input_ids)), self.hnorm(previous)), dim=-1))
        layer = self.layers[0]
        return layer(x, self.rotary(positions, x.dtype), kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.shared_head.norm(hidden), self.shared_head.head.weight)

    def guess(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy guesses (token ids) after the rows `hidden`."""
        return self.pick(self.compute_logits(hidden))

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy guesses of `compute_logits`'s rows."""
        return logits.argmax(dim=-1)

    def spread(self, logits: torch.Tensor) -> torch.Tensor:
        """`compute_logits`'s rows over the model's vocabulary (the layer's is the model's)."""
        return logits

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the layer reads them: as they are."""
        return features

    @property
    def feature_width(self) -> int:
        return self.arch.hidden_size


def mtp_tensors(tensors: Iterator[tuple[str, torch.Tensor]], arch: ArchConfig,
                into: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less its first MTP layer's, which go `into` (renamed for
    `MTPLayer`: `layers.{L}.x` as `x`, its decoder layer's as `layers.0.x`)."""
    prefix = f"layers.{arch.num_layers}."
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    for name, tensor in tensors:
        bare = name.removeprefix("model.")
        if bare.startswith(prefix):
            rest = bare[len(prefix):]
            into[rest if rest.startswith(own) else f"layers.0.{rest}"] = tensor
        else:
            yield name, tensor


def build_mtp(arch: ArchConfig, tensors: dict[str, torch.Tensor], max_positions: int, dtype: torch.dtype,
              device: torch.device) -> MTPLayer:
    from conveyor.models.loader import load_weights

    if not tensors:
        raise UnsupportedModelError(
            f"speculative_method='mtp' needs the checkpoint's multi-token-prediction layer "
            f"(model.layers.{arch.num_layers}.*, num_nextn_predict_layers >= 1); this one has none"
        )
    with torch.device("meta"):
        layer = MTPLayer(arch, max_positions)
    layer = layer.to_empty(device=device).to(dtype)
    layer.rotary = Rotary(arch, max_positions).to(device)
    load_weights(layer, ((n, t.to(dtype)) for n, t in tensors.items()))  # type: ignore[arg-type]
    layer.eval()
    layer.requires_grad_(False)
    return layer
