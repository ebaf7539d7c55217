"""Medusa heads (`speculative_method="medusa"`): small heads over the model's last hidden state,
each guessing one token further ahead, all from one row at once.

Medusa (Cai et al., 2024, arXiv:2401.10774) puts K heads beside the model's LM head. Head j is
a few residual blocks and an LM head of its own:

    x = h[i]                                  the model's hidden state at i (after its final norm)
    x = x + SiLU(W_b x (+ c_b))               for each of the head's blocks b
    guess for t[i + j + 2] = argmax(lm_head_j(x))                 j = 0 .. K - 1

h[i] is the state at the last position the model has computed, whose own LM head gave t[i + 1]
(the step's input): head 0 guesses the first draft, t[i + 2]. The guesses are a chain, each
head's top token (vLLM's Medusa proposer); Medusa's tree of several candidates a head, verified
with tree attention, is not built. No head reads another's guess, so a round is one pass over
the heads, with no cache.

Checkpoints load in FasterDecoding's names (`medusa_lm_head.safetensors` or `.pt`: head j's
blocks `j.b.linear.weight` / `.bias`, its LM head `j.L.weight` after its L blocks; config
`medusa_num_heads`, `medusa_num_layers`) and vLLM's (`blocks.j.layers.b.weight`,
`lm_heads.j.weight`, perhaps under `medusa_heads.`; config `num_heads`, `num_hidden_layers`,
`medusa_fc_bias`, `original_lm_head` for one LM head shared by all, `truncated_vocab_size`
with a `token_map` of the draft vocabulary's ids in the model's).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.arch import ArchConfig, UnsupportedModelError

# FasterDecoding's names: a block's linear, or the head's LM head (its last index).
_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_HEAD = re.compile(r"(\d+)\.(\d+)\.weight")
# vLLM's.
_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_VLLM_HEAD = re.compile(r"lm_heads\.(\d+)\.weight")


@dataclasses.dataclass(frozen=True)
class MedusaSpec:
    """What a checkpoint's config and tensors say about its heads."""

    num_heads: int  # K: the most guesses a round
    num_blocks: int  # residual blocks a head
    hidden_size: int
    draft_vocab: int  # each LM head's rows (the model's vocabulary, or the truncated one)
    fc_bias: bool
    shared_head: bool  # one LM head for every head (vLLM's `original_lm_head`)


def ranked_tokens(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's `width` likeliest ids, best first (`[rows, width]`): a token tree's candidates.
    The first is the row's argmax (the first of equal logits), the guess a chain would make."""
    top = logits.argmax(dim=-1, keepdim=True)
    if width > 1:
        top = torch.cat((top, logits.scatter(-1, top, float("-inf")).topk(width - 1, dim=-1).indices), dim=-1)
    return top


class MedusaHeads(nn.Module):
    """The K heads; `forward` gives every head's greedy guess for each row."""

    token_map: torch.Tensor | None  # the draft vocabulary's ids in the model's (a truncated one)

    def __init__(self, spec: MedusaSpec) -> None:
        super().__init__()
        h = spec.hidden_size
        self.spec = spec
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(h, h, bias=spec.fc_bias) for _ in range(spec.num_blocks))
            for _ in range(spec.num_heads)
        )
        self.lm_heads = nn.ModuleList(
            nn.Linear(h, spec.draft_vocab, bias=False) for _ in range(1 if spec.shared_head else spec.num_heads)
        )
        self.token_map = None

    def forward(self, hidden: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """The first `count` heads' guesses (all: None) for each row of `hidden` `[N, hidden]`,
        as the model's token ids `[N, count]`."""
        ids = torch.stack([self.logits(j, hidden).argmax(dim=-1) for j in range(count or self.spec.num_heads)], dim=1)
        return ids if self.token_map is None else self.token_map[ids]

    def ranked(self, hidden: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Head j's `widths[j]` likeliest tokens for each row, best first, side by side: the
        model's token ids `[N, sum(widths)]` (a token tree's candidates at each depth)."""
        ids = torch.cat([ranked_tokens(self.logits(j, hidden), w) for j, w in enumerate(widths)], dim=1)
        return ids if self.token_map is None else self.token_map[ids]

    def logits(self, j: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head j's logits over its vocabulary for each row of `hidden`."""
        x = hidden
        for linear in cast(nn.ModuleList, self.blocks[j]):
            x = x + F.silu(linear(x))
        return self.lm_heads[0 if self.spec.shared_head else j](x)


def read_medusa(folder: Path, target: ArchConfig) -> tuple[MedusaSpec, dict[str, torch.Tensor]]:
    """The heads in `folder` (config.json and their tensors), checked against `target`; the
    tensors renamed as `MedusaHeads`' parameters (and `token_map`)."""
    from conveyor.models.loader import ModelLoadError, iter_head_tensors

    try:
        cfg: dict[str, Any] = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"speculative_model: cannot read {folder / 'config.json'}: {e}") from e
    raw = {n.removeprefix("medusa_heads."): t for n, t in iter_head_tensors(folder)}
    blocks: dict[tuple[int, int, str], torch.Tensor] = {}
    heads: dict[int, torch.Tensor] = {}
    last_index: dict[int, int] = {}  # FasterDecoding: a head's LM head is at its last index
    token_map = raw.pop("token_map", None)
    for name, t in raw.items():
        if m := _VLLM_BLOCK.fullmatch(name) or _BLOCK.fullmatch(name):
            blocks[(int(m[1]), int(m[2]), m[3])] = t
        elif m := _VLLM_HEAD.fullmatch(name):
            heads[int(m[1])] = t
        elif m := _HEAD.fullmatch(name):
            heads[int(m[1])] = t
            last_index[int(m[1])] = int(m[2])
        else:
            raise UnsupportedModelError(f"speculative_model {folder}: {name!r} is no Medusa head's tensor "
                                        "(FasterDecoding's `j.b.linear.*` / `j.L.weight`, vLLM's `blocks.*` / "
                                        "`lm_heads.*`)")

    def count(keys: tuple[str, str], found: int) -> int:  # FasterDecoding's key, vLLM's, or the tensors'
        return next((int(cfg[k]) for k in keys if cfg.get(k)), found)

    num_heads = count(("medusa_num_heads", "num_heads"), 1 + max([j for j, _, _ in blocks] + list(heads), default=-1))
    num_blocks = count(("medusa_num_layers", "num_hidden_layers"), 1 + max((b for _, b, _ in blocks), default=-1))
    shared = bool(cfg.get("original_lm_head", False))
    if not heads:
        raise UnsupportedModelError(f"speculative_model {folder}: Medusa heads without an LM head")
    hidden = int(next(iter(heads.values())).shape[1])
    if hidden != target.hidden_size:
        raise UnsupportedModelError(f"speculative_model {folder}: Medusa heads {hidden} wide over a model "
                                    f"{target.hidden_size} wide (they read its last hidden state)")
    draft_vocab = int(next(iter(heads.values())).shape[0])
    if token_map is not None:
        token_map = token_map.long().flatten()
        if token_map.numel() != draft_vocab or bool((token_map < 0).any()) or bool(
                (token_map >= target.vocab_size).any()):
            raise UnsupportedModelError(f"speculative_model {folder}: its token_map does not map {draft_vocab} "
                                        f"draft tokens into the model's vocabulary of {target.vocab_size}")
    elif draft_vocab != target.vocab_size:
        raise UnsupportedModelError(f"speculative_model {folder}: Medusa heads over {draft_vocab} tokens, not the "
                                    f"model's {target.vocab_size}, and no token_map between them")
    fc_bias = any(kind == "bias" for _, _, kind in blocks)
    spec = MedusaSpec(num_heads, num_blocks, hidden, draft_vocab, fc_bias, shared)
    renamed: dict[str, torch.Tensor] = {}
    for (j, b, kind), t in blocks.items():
        if j >= num_heads or b >= num_blocks:
            raise UnsupportedModelError(f"speculative_model {folder}: a block {b} of head {j}, where its config "
                                        f"has {num_heads} heads of {num_blocks} blocks")
        renamed[f"blocks.{j}.{b}.{kind}"] = t
    for j, t in heads.items():
        if j in last_index and last_index[j] != num_blocks:
            raise UnsupportedModelError(f"speculative_model {folder}: head {j}'s LM head at index {last_index[j]}, "
                                        f"after {num_blocks} blocks")
        if shared and j > 0:
            continue  # (vLLM reads the first as the one head)
        if j >= (1 if shared else num_heads):
            raise UnsupportedModelError(f"speculative_model {folder}: an LM head for head {j} of {num_heads}")
        renamed[f"lm_heads.{j}.weight"] = t
    if token_map is not None:
        renamed["token_map"] = token_map
    return spec, renamed


def build_medusa(spec: MedusaSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> MedusaHeads:
    """The heads with their weights; every parameter must be in `tensors`, in its shape."""
    from conveyor.models.loader import ModelLoadError

    tensors = dict(tensors)
    token_map = tensors.pop("token_map", None)
    heads = MedusaHeads(spec).to(device=device, dtype=dtype)
    params = dict(heads.named_parameters())
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ModelLoadError(f"speculative_model: the Medusa heads lack {', '.join(missing[:4])}"
                             f"{' ...' if len(missing) > 4 else ''}")
    with torch.no_grad():
        for name, t in tensors.items():
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ModelLoadError(f"speculative_model: {name} of shape {tuple(t.shape)}, not {tuple(p.shape)}")
            p.copy_(t.to(dtype))
    if token_map is not None:
        heads.token_map = token_map.to(device)
    if device.type == "cpu" and dtype == torch.float32:  # the model's native GEMV for the few rows a round
        from conveyor.kernels import skinny_linear
        from conveyor.models.llama import use_cpu_kernels

        use_cpu_kernels(heads, skinny_linear(), None)
    heads.eval()
    heads.requires_grad_(False)
    return heads
