"""Bidirectional encoders: BERT and RoBERTa (XLM-RoBERTa is RoBERTa's shape), as embedding
models and as sequence classifiers / cross-encoders (ms-marco-MiniLM, bge-reranker).

Over the same flat token batch as the decoders (conveyor/models/llama.py), with the same call:
`model(input_ids, positions, kv_caches, meta)` gives the hidden states `[T, hidden]`. Every
token attends to every token of its own prompt, so a prompt is computed whole in one step and
no K/V is kept (`kv_caches` is empty): the engine schedules an encoder's prompts unchunked and
without the prefix cache. The sequences of a step are read from the attention metadata (a
one-token prompt is a "decode" row, attending to itself; the others are prefill spans).

Segments: a pair `[CLS] A [SEP] B [SEP]` puts B in segment 1, as BERT's tokenizers write
`token_type_ids`; here the segment is read from the tokens (after a prompt's first
`sep_token_id`), since requests carry token ids only. Post-norm layers (LayerNorm after each
residual add), GELU, biases everywhere: HF's arithmetic, so float64 outputs are HF's.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.arch import ArchConfig, UnsupportedModelError
from conveyor.models.attention import AttentionMetadata

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class EncoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        h, i = arch.hidden_size, arch.intermediate_size
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        self.qkv_proj = nn.Linear(h, 3 * h)
        self.o_proj = nn.Linear(h, h)
        self.attention_norm = nn.LayerNorm(h, eps=arch.rms_norm_eps)
        self.up_proj = nn.Linear(h, i)
        self.down_proj = nn.Linear(i, h)
        self.output_norm = nn.LayerNorm(h, eps=arch.rms_norm_eps)
        self.act = ACTIVATIONS[arch.hidden_act]

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]], singles: int) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(x.shape[-1], dim=-1)
        out = torch.empty_like(v)
        out[:singles] = v[:singles]  # a one-token prompt attends to itself alone
        for a, b in spans:
            heads = [t[a:b].view(b - a, self.num_heads, self.head_dim).transpose(0, 1) for t in (q, k, v)]
            attn = F.scaled_dot_product_attention(*heads)  # no mask: every token sees its whole prompt
            out[a:b] = attn.transpose(0, 1).reshape(b - a, -1)
        x = self.attention_norm(x + self.o_proj(out))
        return self.output_norm(x + self.down_proj(self.act(self.up_proj(x))))


class _EncoderModel(nn.Module):
    """What the runner asks of an encoder beside its forward pass and `classify`: no LM head,
    no fused decode, one rank; and each step's prompts as spans of rows, each whole."""

    lm_head = None
    fused_decode = None
    gemv = None

    @property
    def tensor_parallel(self) -> bool:
        return False

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise UnsupportedModelError("an encoder has no LM head: it generates nothing")

    @staticmethod
    def prompts(meta: AttentionMetadata, positions: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
        """The step's prompts: the rows of each of more than one token, and how many one-token
        prompts lead the batch (the metadata's "decodes")."""
        singles = meta.num_decodes
        if any(p.start_pos for p in meta.prefills) or (singles and bool((positions[:singles] != 0).any())):
            raise RuntimeError("an encoder computes each prompt whole, in one step")
        return [(p.token_start, p.token_end) for p in meta.prefills], singles


class Encoder(_EncoderModel):
    """BERT / RoBERTa with an optional classification head (`arch.labels`): BERT's pooler
    (dense + tanh over the pooled state) then `classifier`; RoBERTa's `classifier.dense` +
    tanh then `classifier.out_proj`. Parameter names follow HF's with the prefix dropped and
    q/k/v fused (see `load_encoder_weights`)."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        h = arch.hidden_size
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, h)
        self.position_embeddings = nn.Embedding(arch.max_position_embeddings + arch.position_offset, h)
        self.token_type_embeddings = nn.Embedding(max(arch.type_vocab_size, 1), h)
        self.embed_norm = nn.LayerNorm(h, eps=arch.rms_norm_eps)
        self.layers = nn.ModuleList([EncoderLayer(arch) for _ in range(arch.num_layers)])
        # RoBERTa's classifier.dense; a token classifier has none
        self.pooler = nn.Linear(h, h) if arch.labels and not arch.token_classifier else None
        self.score = nn.Linear(h, arch.num_labels) if arch.labels else None
        self.sep_token_id = arch.sep_token_id  # set from the tokenizer by the engine when the config lacks it

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        spans, singles = self.prompts(meta, positions)
        x = self.embed_tokens(input_ids) + self.position_embeddings(positions + self.arch.position_offset)
        x = x + self.token_type_embeddings(self._segments(input_ids, spans))
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, spans, singles)
        return x

    def _segments(self, input_ids: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Each token's segment: 1 after its prompt's first separator (a pair's second text)."""
        types = torch.zeros_like(input_ids)
        if self.arch.type_vocab_size < 2 or self.sep_token_id is None:
            return types
        is_sep = input_ids == self.sep_token_id
        for a, b in spans:
            seps = is_sep[a:b].nonzero()
            if len(seps):
                types[a + int(seps[0]) + 1 : b] = 1
        return types

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The classifier's logits `[rows, num_labels]` over pooled states (the first token's,
        as BERT and RoBERTa classify; every token's for a token classifier), float32 at least."""
        if self.score is None:
            raise UnsupportedModelError("this model has no classification head")
        x = pooled.to(self.embed_tokens.weight.dtype)
        logits = self.score(x if self.pooler is None else torch.tanh(self.pooler(x)))
        return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


_LAYER_NAMES = {
    "attention.output.dense": "o_proj",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "up_proj",
    "output.dense": "down_proj",
    "output.LayerNorm": "output_norm",
}
_QKV = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}
_TOP_NAMES = {
    "embeddings.word_embeddings": "embed_tokens",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embed_norm",
    "pooler.dense": "pooler",  # BERT's
    "classifier.dense": "pooler",  # RoBERTa's
    "classifier.out_proj": "score",
    "classifier": "score",
}


def load_encoder_weights(model: Encoder, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """HF's tensors (with or without the `bert.` / `roberta.` prefix; old checkpoints'
    LayerNorm `gamma` / `beta`) into `model`, checked complete. An embedding model's pooler
    (BertModel keeps one) is not used, and skipped."""
    from conveyor.models.loader import ModelLoadError

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    h = model.arch.hidden_size
    for name, tensor in tensors:
        for prefix in ("bert.", "roberta."):
            name = name.removeprefix(prefix)
        module, _, leaf = name.rpartition(".")
        leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
        if leaf not in ("weight", "bias"):
            continue  # buffers (position_ids)
        row = 0
        if module.startswith("encoder.layer."):
            index, _, rest = module.removeprefix("encoder.layer.").partition(".")
            if rest in _QKV:
                target, row = f"layers.{index}.qkv_proj", _QKV[rest] * h
            elif rest in _LAYER_NAMES:
                target = f"layers.{index}.{_LAYER_NAMES[rest]}"
            else:
                raise ModelLoadError(f"unexpected encoder tensor {name!r}")
        elif module in _TOP_NAMES:
            target = _TOP_NAMES[module]
        elif module.startswith("lm_head") or module.startswith("cls."):
            continue  # a masked-LM head: not what an embedding or a classifier reads
        else:
            raise ModelLoadError(f"unexpected encoder tensor {name!r}")
        key = f"{target}.{leaf}"
        p = params.get(key)
        if p is None:
            if target == "pooler" and model.pooler is None:
                continue  # an embedding model's pooler
            raise ModelLoadError(f"no parameter for {name!r}")
        rows = tensor.shape[0]
        if p.shape[1:] != tensor.shape[1:] or row + rows > p.shape[0]:
            raise ModelLoadError(f"{name}: tensor of shape {tuple(tensor.shape)} does not fit {tuple(p.shape)}")
        with torch.no_grad():
            p[row : row + rows].copy_(tensor)
        loaded.add(f"{key}@{row}")
    expected = set()
    for key in params:
        starts = [0, h, 2 * h] if ".qkv_proj." in key else [0]
        expected |= {f"{key}@{r}" for r in starts}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _rotary_pair(arch: ArchConfig, max_positions: int, device: torch.device | None) -> tuple[nn.Module, nn.Module]:
    """The global layers' rotary table and the local ones' (their own base, unscaled, where
    the model has one), float32, on `device`."""
    from conveyor.models.llama import Rotary

    local = arch.local_rope if arch.local_rope_theta else arch
    return Rotary(arch, max_positions).to(device), Rotary(local, max_positions).to(device)


def build_encoder(
    arch: ArchConfig, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> Encoder | ModernBert | GemmaEncoder:
    weights = ((n, t.to(dtype)) for n, t in tensors)
    model: Encoder | ModernBert | GemmaEncoder
    if arch.family in ("modernbert", "gemma3_encoder"):  # rotary tables made again in float32 on the device
        rotary = ModernBert(arch, arch.max_position_embeddings) if arch.family == "modernbert" \
            else GemmaEncoder(arch, arch.max_position_embeddings)
        rotary = rotary.to(device=device, dtype=dtype)
        rotary.rotaries(arch.max_position_embeddings, device)
        if isinstance(rotary, ModernBert):
            load_modernbert_weights(rotary, weights)
        else:
            load_gemma_encoder_weights(rotary, weights)
        model = rotary
    else:
        with torch.device("meta"):
            plain = Encoder(arch)
        model = plain.to_empty(device=device).to(dtype)
        load_encoder_weights(model, weights)
    model.eval()
    model.requires_grad_(False)
    return model


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
                            singles: int, window: int | None, scale: float | None = None) -> torch.Tensor:
    """Each prompt's rows (`spans`) attending to every row of it, or to `window` rows either side
    where set; the `singles` one-token prompts leading the batch, each to itself. q `[T, heads,
    d]`, k and v `[T, kv_heads, d]` (grouped-query heads share theirs); `scale`: SDPA's default
    when None."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    out[:singles] = v[:singles].repeat_interleave(group, dim=1) if group > 1 else v[:singles]
    for a, b in spans:
        mask = None
        if window is not None and b - a > window + 1:
            pos = torch.arange(b - a, device=q.device)
            mask = (pos[:, None] - pos[None, :]).abs() <= window
        out[a:b] = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), attn_mask=mask, scale=scale,
            enable_gqa=group > 1,
        ).transpose(0, 1)
    return out


# -- ModernBERT ------------------------------------------------------------------------------
class _ModernLayer(nn.Module):
    """Pre-norm (none before the first layer's attention), rotary positions, a GeGLU MLP; its
    attention spans the whole prompt (a global layer) or `window` tokens either side (local)."""

    def __init__(self, arch: ArchConfig, index: int) -> None:
        super().__init__()
        h, i = arch.hidden_size, arch.intermediate_size
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        self.attn_norm = nn.LayerNorm(h, eps=arch.rms_norm_eps, bias=False) if index else None
        self.qkv_proj = nn.Linear(h, 3 * h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.LayerNorm(h, eps=arch.rms_norm_eps, bias=False)
        self.up_proj = nn.Linear(h, 2 * i, bias=False)  # the input and its gate
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = ACTIVATIONS[arch.hidden_act]
        every = arch.global_attn_every or 1
        self.window = None if index % every == 0 else arch.sliding_window  # tokens either side

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]], singles: int,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from conveyor.models.llama import apply_rope

        normed = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = self.qkv_proj(normed).split(x.shape[-1], dim=-1)
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q, k = apply_rope(q.view(shape), rope), apply_rope(k.view(shape), rope)
        out = bidirectional_attention(q, k, v.view(shape), spans, singles, self.window)
        x = x + self.o_proj(out.reshape(x.shape[0], -1))
        gate_in, gate = self.up_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(self.act(gate_in) * gate)


class ModernBert(_EncoderModel):
    """ModernBERT (Warner et al. 2024): the embeddings' norm, pre-norm layers with rotary
    positions (global layers at `rope_theta`, local ones at `local_rope_theta`), local layers
    attending within a window, a final norm. A classifier's head: dense, activation, norm, then
    `score` (classes), over the pooled state (its `classifier_pooling`) or every token."""

    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        super().__init__()
        h = arch.hidden_size
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=arch.rms_norm_eps, bias=False)
        self.layers = nn.ModuleList([_ModernLayer(arch, i) for i in range(arch.num_layers)])
        self.final_norm = nn.LayerNorm(h, eps=arch.rms_norm_eps, bias=False)
        self.pooler = nn.Linear(h, h, bias=arch.classifier_bias) if arch.labels else None  # head.dense
        self.head_norm = nn.LayerNorm(h, eps=arch.rms_norm_eps, bias=False) if arch.labels else None
        self.head_act = ACTIVATIONS[arch.classifier_act]
        self.score = nn.Linear(h, arch.num_labels) if arch.labels else None
        self.sep_token_id = None
        self.rotaries(max_positions)

    def rotaries(self, max_positions: int, device: torch.device | None = None) -> None:
        """The global and the local layers' rotary tables, in float32 (as the reference computes
        them: made again after the model moves to a half-precision dtype)."""
        self.rotary, self.local_rotary = _rotary_pair(self.arch, max_positions, device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        spans, singles = self.prompts(meta, positions)
        x = self.embed_norm(self.embed_tokens(input_ids))
        tables = {}
        for layer in self.layers:
            assert isinstance(layer, _ModernLayer)
            key = layer.window is None
            if key not in tables:
                rotary = self.rotary if key else self.local_rotary
                tables[key] = rotary(positions, x.dtype)
            x = layer(x, spans, singles, tables[key])
        return self.final_norm(x)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.score is None or self.pooler is None or self.head_norm is None:
            raise UnsupportedModelError("this model has no classification head")
        x = self.head_norm(self.head_act(self.pooler(pooled.to(self.embed_tokens.weight.dtype))))
        logits = self.score(x)
        return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


_MODERN_LAYER_NAMES = {"attn_norm": "attn_norm", "attn.Wqkv": "qkv_proj", "attn.Wo": "o_proj",
                       "mlp_norm": "mlp_norm", "mlp.Wi": "up_proj", "mlp.Wo": "down_proj"}
_MODERN_TOP_NAMES = {"embeddings.tok_embeddings": "embed_tokens", "embeddings.norm": "embed_norm",
                     "final_norm": "final_norm", "head.dense": "pooler", "head.norm": "head_norm",
                     "classifier": "score"}


def load_modernbert_weights(model: ModernBert, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    from conveyor.models.loader import ModelLoadError

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors:
        name = name.removeprefix("model.")
        module, _, leaf = name.rpartition(".")
        if module.startswith("layers."):
            index, _, rest = module.removeprefix("layers.").partition(".")
            if rest not in _MODERN_LAYER_NAMES:
                raise ModelLoadError(f"unexpected ModernBERT tensor {name!r}")
            target = f"layers.{index}.{_MODERN_LAYER_NAMES[rest]}"
        elif module in _MODERN_TOP_NAMES:
            target = _MODERN_TOP_NAMES[module]
        elif module in ("decoder", "head.dense", "head.norm") or module.startswith("head."):
            continue  # a masked-LM's head (or an embedding model's unused one)
        else:
            raise ModelLoadError(f"unexpected ModernBERT tensor {name!r}")
        key = f"{target}.{leaf}"
        p = params.get(key)
        if p is None:
            if target in ("pooler", "head_norm") and model.pooler is None:
                continue
            raise ModelLoadError(f"no parameter for {name!r}")
        if p.shape != tensor.shape:
            raise ModelLoadError(f"{name}: tensor of shape {tuple(tensor.shape)} does not fit {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(tensor)
        loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


# -- Gemma 3 as an encoder (EmbeddingGemma) ---------------------------------------------------
class _GemmaEncoderLayer(nn.Module):
    """Gemma 3's layer (conveyor/models/llama.py's arithmetic: (1 + w) norms around each
    sublayer, q/k norms, GELU-gated MLP) with bidirectional attention over the whole prompt
    (a global layer) or `window` tokens either side (a sliding one)."""

    def __init__(self, arch: ArchConfig, index: int) -> None:
        from conveyor.models.llama import MLP, GemmaRMSNorm

        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.scale = arch.attention_scale
        self.window = arch.layer_windows[index] or None
        self.local = bool(self.window) and arch.local_rope_theta > 0
        self.input_layernorm = GemmaRMSNorm(h, arch.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, arch.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, arch.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, arch.rms_norm_eps)
        self.q_proj = nn.Linear(h, arch.num_heads * d, bias=arch.attention_bias)
        self.k_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.attention_bias)
        self.v_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.attention_bias)
        self.o_proj = nn.Linear(arch.num_heads * d, h, bias=arch.attention_bias)
        self.q_norm = GemmaRMSNorm(d, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, arch.rms_norm_eps)
        self.mlp = MLP(h, arch.intermediate_size, arch.hidden_act)

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]], singles: int,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from conveyor.models.llama import apply_rope

        normed = self.input_layernorm(x)
        t = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(normed).view(t, self.num_heads, self.head_dim)), rope)
        k = apply_rope(self.k_norm(self.k_proj(normed).view(t, self.num_kv_heads, self.head_dim)), rope)
        v = self.v_proj(normed).view(t, self.num_kv_heads, self.head_dim)
        out = bidirectional_attention(q, k, v, spans, singles, self.window, self.scale)
        x = x + self.post_attention_layernorm(self.o_proj(out.reshape(t, -1)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaEncoder(_EncoderModel):
    """EmbeddingGemma: Gemma 3's body with bidirectional attention (`Gemma3TextModel` with
    `use_bidirectional_attention`): the embedding scaled by sqrt(hidden), sliding layers within
    their window either side at the local RoPE base, global ones over the whole prompt, the
    final norm; pooled and projected by its sentence-transformers modules (mean, two Dense)."""

    def __init__(self, arch: ArchConfig, max_positions: int) -> None:
        from conveyor.models.llama import GemmaRMSNorm

        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList([_GemmaEncoderLayer(arch, i) for i in range(arch.num_layers)])
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.score = None
        self.sep_token_id = None
        self.rotaries(max_positions)

    def rotaries(self, max_positions: int, device: torch.device | None = None) -> None:
        """Rotary tables in float32 (made again after the model moves to its dtype)."""
        self.rotary, self.local_rotary = _rotary_pair(self.arch, max_positions, device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        from conveyor.models.llama import _rounded

        spans, singles = self.prompts(meta, positions)
        x = self.embed_tokens(input_ids)
        x = x * _rounded(self.arch.hidden_size**0.5, x.dtype)
        ropes = {False: self.rotary(positions, x.dtype), True: self.local_rotary(positions, x.dtype)}
        for layer in self.layers:
            assert isinstance(layer, _GemmaEncoderLayer)
            x = layer(x, spans, singles, ropes[layer.local])
        return self.norm(x)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        raise UnsupportedModelError("this model has no classification head")


def load_gemma_encoder_weights(model: GemmaEncoder, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """HF's names, with or without the `model.` prefix (the attention's held by the layer, the
    MLP's gate and up fused, gate first); every parameter once."""
    from conveyor.models.loader import ModelLoadError

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors:
        name = name.removeprefix("model.").replace(".self_attn.", ".")  # (the layer holds its attention's)
        if name.startswith("lm_head.") or "rotary_emb" in name:
            continue
        rows = slice(None)
        for half, proj in enumerate(("mlp.gate_proj.", "mlp.up_proj.")):
            if proj in name:
                name = name.replace(proj, "mlp.gate_up_proj.")
                rows = slice(half * tensor.shape[0], (half + 1) * tensor.shape[0])
        p = params.get(name)
        if p is None:
            raise ModelLoadError(f"unexpected Gemma tensor {name!r}")
        if p[rows].shape != tensor.shape:
            raise ModelLoadError(f"{name}: tensor of shape {tuple(tensor.shape)} does not fit {tuple(p.shape)}")
        with torch.no_grad():
            p[rows].copy_(tensor)
        loaded.add(f"{name}@{rows.start}")
    missing = sorted({f"{n}@{None if 'gate_up' not in n else r}" for n, p in params.items()
                      for r in ((0, p.shape[0] // 2) if "gate_up" in n else (None,))} - loaded)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
