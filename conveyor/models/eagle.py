"""EAGLE draft heads (`speculative_method="eagle"` and `"eagle3"`): one decoder layer that
guesses the next tokens from the target model's own hidden states.

EAGLE (Li et al., 2024, arXiv:2401.15077) drafts at the level of features: the row at
position i reads the target's hidden state at i and the embedding of token i + 1, and its
output stands for the target's hidden state at i + 1, whose token the target's LM head gives:

    EAGLE-1:  x = fc([embed(t[i+1]), h[i]])        h[i]: the target's last hidden state
              out = x + attn(x);  out = out + mlp(post_attention_layernorm(out))
              guess for t[i+2] = argmax(lm_head(out))   (the target's head, no norm)

EAGLE-3 (Li et al., 2025, arXiv:2503.01840) reads three of the target's layers at once and
predicts tokens directly, over a draft vocabulary of its own:

    g[i] = fc([a[i], b[i], c[i]])                  the residual stream entering three layers
    x = [input_layernorm(embed(t[i+1])), hidden_norm(g[i])]   (2 x hidden wide: the
    r = g[i] + attn(x)                              attention's projections read both)
    out = r + mlp(post_attention_layernorm(r))
    guess = d2t-mapped argmax(lm_head(norm(out)))   draft id d is target id d + d2t[d]

For a second guess the layer reads its own `out` in place of the target's state (EAGLE-3's
"training-time test" trains it to). The layers whose streams EAGLE-3 reads are the draft's
`eagle_config.eagle_aux_hidden_state_layer_ids`, by default (2, L // 2, L - 3) of the
target's L (vLLM's and SGLang's choice). Checkpoints load in the two shapes published heads
come in: SafeAILab's (`fc.*`, `layers.0.*` or EAGLE-3's `midlayer.*`, `d2t`, `t2d`, either
in `pytorch_model.bin` or `*.safetensors`) and vLLM's (the same names under `model.`). A head
without `embed_tokens` reads the target's; EAGLE-1's head is always the target's.
The drafter's rounds and the layer's KV cache are MTP's (conveyor/runner/mtp.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.arch import ArchConfig, UnsupportedModelError
from conveyor.models.attention import AttentionMetadata, TorchPagedAttention
from conveyor.models.llama import Attention, DecoderLayer, RMSNorm, Rotary, use_cpu_kernels
from conveyor.models.medusa import ranked_tokens


@dataclasses.dataclass(frozen=True)
class EagleSpec:
    """What a head's config and tensors say about it."""

    method: str  # "eagle" or "eagle3"
    arch: ArchConfig  # the head's one layer (its `hidden_size` is the draft's)
    target_hidden: int  # the width of one target state it reads
    aux_layers: tuple[int, ...]  # EAGLE-3: the target layers whose incoming streams it reads
    draft_vocab: int  # EAGLE-3: its LM head's rows (the target's vocabulary for EAGLE-1)
    fc_bias: bool
    norm_before_residual: bool  # EAGLE-3 variant: the residual is the normed state

    @property
    def feature_width(self) -> int:
        """The width of one row of target states the head reads (before its `fc`)."""
        return self.target_hidden * max(1, len(self.aux_layers))


class EagleHead(nn.Module):
    """One EAGLE-1 or EAGLE-3 layer; parameter names are the checkpoint's (`midlayer.` read
    as `layers.0.`), with q/k/v and gate/up fused as the loader fuses them."""

    d2t: torch.Tensor  # EAGLE-3: draft token d is the model's d + d2t[d]

    def __init__(self, spec: EagleSpec, max_positions: int, own_embedding: bool) -> None:
        super().__init__()
        arch = spec.arch
        h = arch.hidden_size
        self.spec = spec
        self.arch = arch  # (the runner sizes the layer's cache from it)
        self.lm_head = None  # (the loader's tied-head rule: a checkpoint's stray head is skipped)
        self.eagle3 = spec.method == "eagle3"
        self.feature_width = spec.feature_width
        self.embed_tokens = nn.Embedding(arch.vocab_size, h) if own_embedding else None
        # EAGLE-1: the embedding and the state into one; EAGLE-3: the three streams into one
        # (a head made to read the last state alone has none).
        self.fc: nn.Linear | None = None
        if not self.eagle3:
            self.fc = nn.Linear(2 * h, h, bias=spec.fc_bias)
        elif spec.aux_layers:
            self.fc = nn.Linear(spec.feature_width, h, bias=spec.fc_bias)
        layer = DecoderLayer(arch, TorchPagedAttention(), 0)
        if self.eagle3:  # the attention reads the embedding and the state side by side
            attn = layer.self_attn
            assert isinstance(attn, Attention)
            out_rows = attn.qkv_proj.out_features
            attn.qkv_proj = nn.Linear(2 * h, out_rows, bias=arch.attention_bias)
            self.hidden_norm = RMSNorm(h, arch.rms_norm_eps)
            self.norm = RMSNorm(h, arch.rms_norm_eps)
            self.head = nn.Linear(h, spec.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab, dtype=torch.long))
        else:  # EAGLE-1's layer has no norm before its attention
            del layer.input_layernorm
        self.layers = nn.ModuleList([layer])
        self.rotary = Rotary(arch, max_positions)
        # Set from the target where the checkpoint has none (not parameters of the head).
        self.shared_embedding: torch.Tensor | None = None
        self.target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None  # EAGLE-1: the target's head

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        assert self.shared_embedding is not None
        return F.embedding(input_ids, self.shared_embedding)

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's states as the layer reads them: EAGLE-3's three streams through `fc`."""
        return features if not self.eagle3 or self.fc is None else self.fc(features)

    def forward(self, input_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer's output `[T, hidden]`: what the next guess reads as its state."""
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        rope = self.rotary(positions, previous.dtype)
        e = self.embed(input_ids)
        if self.eagle3:
            normed = self.hidden_norm(previous)
            residual = normed if self.spec.norm_before_residual else previous
            x = torch.cat((layer.input_layernorm(e), normed), dim=-1)
            r = residual + layer.self_attn(x, rope, kv_cache, meta)
        else:  # EAGLE-1's layer has no norm before its attention
            assert self.fc is not None
            x = self.fc(torch.cat((e, previous), dim=-1))
            r = x + layer.self_attn(x, rope, kv_cache, meta)
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft's vocabulary (EAGLE-3's may be the target's in part)."""
        if self.eagle3:
            return self.head(self.norm(hidden))
        assert self.target_logits is not None
        return self.target_logits(hidden)

    def guess(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy guesses, as the target's token ids."""
        return self.pick(self.compute_logits(hidden))

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy guesses of `compute_logits`'s rows, as the target's token ids."""
        return self._target_ids(logits.argmax(dim=-1))

    def spread(self, logits: torch.Tensor) -> torch.Tensor:
        """`compute_logits`'s rows over the target's vocabulary: EAGLE-3's draft tokens at the
        target's ids (`d2t`), -inf at the ids it has none of (a drawn guess is one of its own)."""
        if not self.eagle3:
            return logits
        ids = self._target_ids(torch.arange(logits.shape[-1], device=logits.device))
        full = logits.new_full((*logits.shape[:-1], self.arch.vocab_size), float("-inf"))
        return full.index_copy_(-1, ids, logits)

    def ranked(self, hidden: torch.Tensor, width: int) -> torch.Tensor:
        """Each row's `width` likeliest guesses, best first (`[rows, width]`, the target's token
        ids): a token tree's candidates. The first is `guess`'s (argmax, the first of equals)."""
        return self._target_ids(ranked_tokens(self.compute_logits(hidden), width))

    def top_logprobs(self, hidden: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`ranked`'s guesses (`[rows, width]`, the target's ids) and the log of the head's
        probability of each (its softmax over the draft's vocabulary, in float32 at least): an
        EAGLE-2 tree's candidates and their scores."""
        logits = self.compute_logits(hidden)
        ids = ranked_tokens(logits, width)  # (ranked in the logits' own dtype, as `ranked`)
        logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1).gather(-1, ids)
        return self._target_ids(ids), logp

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids as the target's (EAGLE-3's draft vocabulary through `d2t`)."""
        return ids + self.d2t[ids] if self.eagle3 else ids


def read_eagle(folder: Path, method: str, target: ArchConfig) -> tuple[EagleSpec, dict[str, torch.Tensor]]:
    """The head in `folder` (config.json and its tensors), checked against `target` and the
    `method` asked for; its tensors renamed as `EagleHead`'s parameters."""
    from conveyor.models.loader import ModelLoadError, iter_head_tensors

    try:
        cfg: dict[str, Any] = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"speculative_model: cannot read {folder / 'config.json'}: {e}") from e
    raw = {n.removeprefix("model."): t for n, t in iter_head_tensors(folder)}  # (vLLM's names under `model.`)
    eagle3 = any(n.startswith("midlayer.") or n in ("d2t", "hidden_norm.weight", "layers.0.hidden_norm.weight")
                 for n in raw)
    found = "eagle3" if eagle3 else "eagle"
    tensors = {n.replace("midlayer.", "layers.0."): t for n, t in raw.items()}
    if found != method:
        kind = {"eagle": "EAGLE-1", "eagle3": "EAGLE-3"}[found]
        raise UnsupportedModelError(
            f"speculative_model {folder} is an {kind} head (its tensors), not what speculative_method="
            f"{method!r} reads: use speculative_method={found!r}"
        )
    layers = int(cfg.get("num_hidden_layers", 1))
    if layers != 1:
        raise UnsupportedModelError(f"speculative_model {folder}: an EAGLE head of {layers} layers; one is built")
    shape = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map")}
    shape.setdefault("model_type", "llama")
    if shape["model_type"] not in ("llama", "eagle", "eagle3"):  # (the draft layer is always Llama's)
        raise UnsupportedModelError(f"speculative_model {folder}: an EAGLE head over a {shape['model_type']!r} "
                                    "layer; Llama's is built")
    shape["model_type"] = "llama"
    shape.setdefault("vocab_size", target.vocab_size)
    shape.setdefault("intermediate_size", target.intermediate_size)
    shape.setdefault("rope_theta", target.rope_theta)
    shape.setdefault("max_position_embeddings", target.max_position_embeddings)
    arch = dataclasses.replace(ArchConfig.from_hf(shape), num_layers=1, tie_word_embeddings=False)
    if arch.vocab_size != target.vocab_size:
        raise UnsupportedModelError(f"speculative_model {folder}: a vocabulary of {arch.vocab_size} tokens, "
                                    f"not the model's {target.vocab_size}")
    eagle_cfg = cfg.get("eagle_config") or {}
    aux: tuple[int, ...] = ()
    target_hidden = int(cfg.get("target_hidden_size") or target.hidden_size)
    if target_hidden != target.hidden_size:
        raise UnsupportedModelError(f"speculative_model {folder}: made for a model {target_hidden} wide; "
                                    f"this one is {target.hidden_size}")
    if method == "eagle3" and eagle_cfg.get("use_aux_hidden_state", True):
        L = target.num_layers
        aux = tuple(int(i) for i in eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or (2, L // 2, L - 3))
        if len(aux) != 3 or not all(0 <= i < L for i in aux):
            raise UnsupportedModelError(f"speculative_model {folder}: EAGLE-3 reads three of the model's "
                                        f"{L} layers; its config names {list(aux)}")
    if method == "eagle" and arch.hidden_size != target.hidden_size:
        raise UnsupportedModelError(f"speculative_model {folder}: an EAGLE-1 head {arch.hidden_size} wide over a "
                                    f"model {target.hidden_size} wide (it feeds the model's own LM head)")
    renamed: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name == "t2d" or "rotary_emb" in name:
            continue
        if method == "eagle" and name == "layers.0.input_layernorm.weight":
            continue  # (a checkpoint may keep the norm EAGLE-1's layer does not apply)
        if name == "layers.0.hidden_norm.weight":
            name = "hidden_norm.weight"
        if name == "lm_head.weight":
            if method == "eagle":
                continue  # EAGLE-1 reads the target's head
            name = "head.weight"
        renamed[name] = t
    draft_vocab = arch.vocab_size  # (EAGLE-1 guesses over the model's own head)
    if method == "eagle3":
        if "head.weight" not in renamed:
            raise UnsupportedModelError(f"speculative_model {folder}: an EAGLE-3 head without its lm_head")
        draft_vocab = int(renamed["head.weight"].shape[0])
        if "d2t" not in renamed and draft_vocab != arch.vocab_size:
            raise UnsupportedModelError(f"speculative_model {folder}: a draft vocabulary of {draft_vocab} tokens "
                                        "without its d2t map to the model's")
        renamed.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        d2t = renamed["d2t"].long()
        mapped = torch.arange(draft_vocab) + d2t
        if bool((mapped < 0).any()) or bool((mapped >= arch.vocab_size).any()):
            raise UnsupportedModelError(f"speculative_model {folder}: its d2t maps draft tokens outside the "
                                        f"model's vocabulary of {arch.vocab_size}")
        renamed["d2t"] = d2t
    spec = EagleSpec(method, arch, target_hidden, aux, draft_vocab, "fc.bias" in renamed,
                     bool(cfg.get("norm_before_residual", False)))
    return spec, renamed


def build_eagle(spec: EagleSpec, tensors: dict[str, torch.Tensor], target: Any, max_positions: int,
                dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The head, its weights loaded, reading the `target` model's embedding (and, for
    EAGLE-1, LM head) where its checkpoint has none of its own."""
    from conveyor.models.loader import load_weights

    tensors = dict(tensors)
    d2t = tensors.pop("d2t", None)
    own_embedding = "embed_tokens.weight" in tensors
    with torch.device("meta"):
        head = EagleHead(spec, max_positions, own_embedding)
    head = head.to_empty(device=device).to(dtype)
    head.rotary = Rotary(spec.arch, max_positions).to(device)
    if d2t is not None:
        head.d2t = d2t.to(device)
    load_weights(head, ((n, t.to(dtype)) for n, t in tensors.items()))  # type: ignore[arg-type]
    if not own_embedding:
        weight = target.embed_tokens.weight
        if weight.shape[1] != spec.arch.hidden_size:
            raise UnsupportedModelError(f"an EAGLE head {spec.arch.hidden_size} wide without embeddings of its own "
                                        f"reads the model's, {weight.shape[1]} wide")
        head.shared_embedding = weight
    if spec.method == "eagle":  # (the target's own path: its int8 or native head where it has one)
        head.target_logits = target.compute_logits
    if device.type == "cpu" and dtype == torch.float32:  # the model's native kernels, as its own layers take them
        from conveyor.kernels import skinny_linear

        use_cpu_kernels(head, skinny_linear(), None)
    head.eval()
    head.requires_grad_(False)
    return head
