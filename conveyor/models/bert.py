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


class Encoder(nn.Module):
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
        self.lm_head = None
        self.sep_token_id = arch.sep_token_id  # set from the tokenizer by the engine when the config lacks it
        self.fused_decode = None
        self.gemv = None

    @property
    def tensor_parallel(self) -> bool:
        return False

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        singles = meta.num_decodes
        spans = [(p.token_start, p.token_end) for p in meta.prefills]
        if any(p.start_pos for p in meta.prefills) or (singles and bool((positions[:singles] != 0).any())):
            raise RuntimeError("an encoder computes each prompt whole, in one step")
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

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise UnsupportedModelError("an encoder has no LM head: it generates nothing")


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


def build_encoder(
    arch: ArchConfig, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> Encoder:
    with torch.device("meta"):
        model = Encoder(arch)
    model = model.to_empty(device=device).to(dtype)
    load_encoder_weights(model, ((n, t.to(dtype)) for n, t in tensors))
    model.eval()
    model.requires_grad_(False)
    return model
