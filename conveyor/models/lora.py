"""Low-rank adapters over the running model, many at once (S-LoRA / Punica's idea, vLLM's
multi-LoRA serving).

An adapter adds `scale * B A x` to a projection, `A` `[r, in]` and `B` `[out, r]`. The base
weights are never touched: `attach_lora` wraps each layer's four projections in `LoRALinear`,
which adds the deltas of the step's adapters to the base's output, each to its own rows only.
So one step serves the base model and several adapters side by side, as a batch of one
adapter would (the scheduler holds a step to `max_loras` adapters).

The fused projections take their slices' factors stacked: `qkv_proj`'s `A` is q's, k's and v's
`A` one above the other `[r_q + r_k + r_v, in]`, and its `B` is block-diagonal, so the three
deltas are two matrix products. The scale is folded into `B` when an adapter is loaded.

DoRA (Liu et al. 2024, PEFT's `use_dora`) makes the adapted weight `m * (W + s B A) / |W + s B A|`,
each output row's norm `|.|` over its inputs and `m` the trained magnitude a row. With the
base's bias `b`, the output is `g * (y - b + s B A x) + b`, `y` the base projection's and `g =
m / |W + s B A|` a gain an output row, computed once when the adapter loads from the base
weights (int8 ones dequantized); a slice the adapter does not adapt keeps a gain of 1.

Adapters load from PEFT's layout (`adapter_config.json`, `adapter_model.safetensors` or
`.bin`); what the base model's modules cannot take is refused with the reason.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.lora import LoRARequest
from conveyor.models.arch import ArchConfig, UnsupportedModelError
from conveyor.models.attention import host_longs, to_device
from conveyor.sampling_params import InvalidRequestError

# HF projection -> (the fused module it lives in, its slice there)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.default)?\.weight$"
)
_MAGNITUDE = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_magnitude_vector(?:\.default)?(?:\.weight)?$"
)


def _slices(arch: ArchConfig) -> dict[str, tuple[int, list[int]]]:
    """Each fused module's input width and its slices' output widths."""
    q, kv, h, i = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, arch.intermediate_size
    return {"qkv_proj": (h, [q, kv, kv]), "o_proj": (q, [h]), "gate_up_proj": (h, [i, i]), "down_proj": (i, [h])}


@dataclass(slots=True)
class LoRAWeights:
    """One adapter, ready to apply: per layer, each fused module's `A^T` `[in, R]` and scaled
    `B^T` `[R, out]` (R the slices' ranks together); a module it does not adapt is absent."""

    name: str
    path: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    # DoRA: per layer, each adapted fused module's gain an output row `[out]` (empty: plain LoRA)
    gains: list[dict[str, torch.Tensor]] = field(default_factory=list)


def _refuse(request: LoRARequest, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}", param="lora_request")


def _read_config(request: LoRARequest) -> dict[str, Any]:
    path = Path(request.lora_path) / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise _refuse(request, "no adapter_config.json there (a PEFT adapter folder is expected)") from None
    except (OSError, ValueError) as e:
        raise _refuse(request, f"adapter_config.json cannot be read: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) or config["r"] < 1:
        raise _refuse(request, "adapter_config.json has no positive integer rank 'r'")
    unsupported = [
        ("modules_to_save", "modules_to_save (fully trained modules)"),
        ("rank_pattern", "rank_pattern (ranks per module)"), ("alpha_pattern", "alpha_pattern (alphas per module)"),
    ]
    for key, what in unsupported:
        if config.get(key):
            raise _refuse(request, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise _refuse(request, f"bias={config['bias']!r} is not supported (only 'none')")
    return config


def _read_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    folder = Path(request.lora_path)
    st, pt = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if st.exists():
            from safetensors.torch import load_file

            return load_file(str(st))
        if pt.exists():
            loaded = torch.load(str(pt), map_location="cpu", weights_only=True)
            return dict(loaded)
    except Exception as e:  # a truncated or foreign file: the request's to see
        raise _refuse(request, f"its weights cannot be read: {e}") from None
    raise _refuse(request, "no adapter_model.safetensors or adapter_model.bin there")


def load_adapter(
    request: LoRARequest, arch: ArchConfig, dtype: torch.dtype, device: torch.device, max_rank: int,
    base_weight: Callable[[int, str], torch.Tensor] | None = None,
) -> LoRAWeights:
    """Read and check an adapter and lay it out for `LoRALinear` (see the module docstring).
    A DoRA adapter's gains need the base weights, `base_weight(layer, module)` `[out, in]`;
    without it (a check before serving) only their shapes are checked."""
    config = _read_config(request)
    dora = bool(config.get("use_dora"))
    magnitudes: dict[tuple[int, str], torch.Tensor] = {}
    rank = int(config["r"])
    if rank > max_rank:
        raise _refuse(request, f"its rank {rank} exceeds max_lora_rank={max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(request).items():
        mag = _MAGNITUDE.search(key)
        if mag is not None and mag.group(2) in TARGETS:
            if not dora:
                raise _refuse(request, f"tensor {key!r} is a DoRA magnitude, but use_dora is not set")
            magnitudes[(int(mag.group(1)), mag.group(2))] = tensor
            continue
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise _refuse(request, f"tensor {key!r} adapts no projection of a decoder layer "
                                   f"(supported: {', '.join(TARGETS)})")
        layer = int(m.group(1))
        if layer >= arch.num_layers:
            raise _refuse(request, f"tensor {key!r}: the model has {arch.num_layers} layers")
        if TARGETS[m.group(2)][0] in ("gate_up_proj", "down_proj") and arch.is_sparse_layer(layer):
            raise _refuse(request, f"tensor {key!r}: layer {layer}'s MLP is a mixture of experts, "
                                   "which adapters do not reach here (attention projections only)")
        factors.setdefault((layer, m.group(2)), {})[m.group(3)] = tensor
    if not factors:
        raise _refuse(request, "it holds no LoRA weights")
    shapes = _slices(arch)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(arch.num_layers)]
    gains: list[dict[str, torch.Tensor]] = [{} for _ in range(arch.num_layers)] if dora else []
    if dora and set(magnitudes) != set(factors):
        missing = sorted(set(factors) ^ set(magnitudes))[0]
        raise _refuse(request, f"DoRA: layer {missing[0]} {missing[1]} has "
                               + ("no magnitude vector" if missing in factors else "a magnitude vector but no lora_A/B"))
    for layer in range(arch.num_layers):
        for module, (fan_in, widths) in shapes.items():
            present = [(slot, name) for name, (mod, slot) in TARGETS.items() if mod == module and (layer, name) in factors]
            if not present:
                continue
            a_parts, b_full_rows = [], []
            for slot, name in present:
                ab = factors[(layer, name)]
                if set(ab) != {"A", "B"}:
                    raise _refuse(request, f"layer {layer} {name} has lora_{''.join(ab)} without its pair")
                a, b = ab["A"], ab["B"]
                if a.shape != (rank, fan_in) or b.shape != (widths[slot], rank):
                    raise _refuse(
                        request, f"layer {layer} {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                        f"this model (expected ({rank}, {fan_in}) and ({widths[slot]}, {rank}))",
                    )
                a_parts.append(a)
                b_full_rows.append((slot, b))
            total = rank * len(present)
            b_t = torch.zeros(total, sum(widths), dtype=torch.float64)
            offsets = [sum(widths[:s]) for s in range(len(widths))]
            for j, (slot, b) in enumerate(b_full_rows):  # block-diagonal: slice j's rank feeds slice j's rows
                b_t[j * rank:(j + 1) * rank, offsets[slot]:offsets[slot] + widths[slot]] = b.double().t() * scale
            a_t = torch.cat(a_parts).t()
            layers[layer][module] = (
                a_t.to(device=device, dtype=dtype).contiguous(), b_t.to(device=device, dtype=dtype).contiguous()
            )
            if dora:
                gain = _dora_gain(request, layer, module, present, widths, offsets, a_t, b_t, magnitudes,
                                  base_weight)
                if gain is not None:
                    gains[layer][module] = gain.to(device=device, dtype=dtype).contiguous()
    return LoRAWeights(request.lora_name, request.lora_path, rank, layers, gains)


def _dora_gain(request: LoRARequest, layer: int, module: str, present: list[tuple[int, str]], widths: list[int],
               offsets: list[int], a_t: torch.Tensor, b_t: torch.Tensor, magnitudes: dict[tuple[int, str], torch.Tensor],
               base_weight: Callable[[int, str], torch.Tensor] | None) -> torch.Tensor | None:
    """A fused module's DoRA gain an output row, `m / |W + s B A|` in the adapted slices and 1
    elsewhere (None without the base weights: the magnitudes' shapes only are checked)."""
    for slot, name in present:
        mag = magnitudes[(layer, name)]
        if tuple(mag.shape) not in ((widths[slot],), (widths[slot], 1), (1, widths[slot])):
            raise _refuse(request, f"layer {layer} {name}: its magnitude vector {tuple(mag.shape)} does not fit "
                                   f"this model ({widths[slot]} values expected)")
    if base_weight is None:
        return None
    w = base_weight(layer, module).double()
    merged = w + (a_t.double() @ b_t.double()).t()  # W + s B A over the whole fused width
    norms = torch.linalg.vector_norm(merged, dim=1)
    gain = torch.ones(sum(widths), dtype=torch.float64)
    for slot, name in present:
        rows = slice(offsets[slot], offsets[slot] + widths[slot])
        gain[rows] = magnitudes[(layer, name)].double().reshape(-1) / norms[rows].clamp_min(1e-12)
    return gain


@dataclass(slots=True)
class LoRAStep:
    """The adapters of one step and their rows: `rows` None means every row of the step."""

    groups: list[tuple[LoRAWeights, torch.Tensor | None]]

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """`y` (the base projection of `x`, `bias` included) with each group's delta added to
        its rows; a DoRA adapter's rows scaled by its gains, the bias kept out of them."""
        for weights, rows in self.groups:
            factors = weights.layers[layer].get(module)
            if factors is None:
                continue
            a_t, b_t = factors
            gain = weights.gains[layer].get(module) if weights.gains else None
            if gain is not None:
                part = y if rows is None else y.index_select(0, rows)
                xs = x if rows is None else x.index_select(0, rows)
                if bias is not None:
                    part = part - bias.to(part.dtype)
                part = torch.addmm(part, xs @ a_t, b_t).mul_(gain.to(part.dtype))
                if bias is not None:
                    part = part + bias.to(part.dtype)
                y = part if rows is None else y.index_copy(0, rows, part)
            elif rows is None:
                y = torch.addmm(y, x @ a_t, b_t)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
        return y


class LoRAContext:
    """The step a thread is running, for its `LoRALinear`s to read (engines that share one
    model step from their own threads: each sees only its own step)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current(self) -> LoRAStep | None:
        return getattr(self._local, "step", None)

    @contextmanager
    def use(self, step: LoRAStep | None) -> Iterator[None]:
        self._local.step = step
        try:
            yield
        finally:
            self._local.step = None


class LoRALinear(nn.Module):
    """A projection and the step's adapters' deltas to it (`LoRAStep.apply`). Paths that read
    the base weights directly (the fused CPU decode, the Triton GEMVs, CUDA graphs) serve steps
    without adapters only (`LlamaForCausalLM.forward`, `ModelRunner.submit`)."""

    def __init__(self, base: nn.Module, layer: int, module: str, context: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.module = module
        self.context = context

    @property
    def weight(self) -> Any:
        return self.base.weight

    @property
    def bias(self) -> Any:
        return getattr(self.base, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.context.current()
        return y if step is None else step.apply(self.layer, self.module, x, y, self.bias)


def attach_lora(model: Any) -> LoRAContext:
    """Wrap every decoder layer's projections in `LoRALinear` (once: engines sharing the model
    share its context)."""
    if model.lora is not None:
        return model.lora
    if model.arch.is_mla:
        raise UnsupportedModelError(f"enable_lora: {model.arch.family}'s latent attention takes no adapters yet")
    context = LoRAContext()
    for index, layer in enumerate(model.layers):
        targets = [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj")]
        if not model.arch.is_sparse_layer(index):  # a mixture's experts take no adapter
            targets += [(layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
        for owner, name in targets:
            setattr(owner, name, LoRALinear(getattr(owner, name), index, name, context))
    model.lora = context
    return context


class LoRAManager:
    """The runner's adapters: loaded on first use, the `capacity` most recently used kept
    (`max_cpu_loras`) beside the pinned ones, and each step's groups of rows (`step`).

    A pinned adapter (vLLM's `pin_lora`) is never dropped to make room, and is kept beside
    the `capacity` others, not in their places: pinning cannot leave a step's adapters (at
    most `max_loras` <= `capacity`) too few places, loading each anew at each step. At most
    `capacity` adapters are pinned."""

    def __init__(self, model: Any, max_rank: int, capacity: int, arch: ArchConfig | None = None,
                 shard: tuple[int, int] = (0, 1)) -> None:
        """`arch` and `shard`: a tensor-parallel rank's (the whole model's shape, which adapters
        are checked against, and (rank, size)); each adapter is then cut to the rank's shard."""
        self.context = attach_lora(model)
        self.model = model
        self.arch: ArchConfig = arch or model.arch
        self.shard = shard
        weight = model.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.max_rank = max_rank
        self.capacity = capacity
        self._loaded: OrderedDict[tuple[str, int], LoRAWeights] = OrderedDict()  # by LoRARequest.key
        self.pinned: set[tuple[str, int]] = set()
        self._paths: dict[tuple[str, int], str] = {}  # every adapter ever loaded, removed ones too
        self.num_loads = 0

    @property
    def loaded(self) -> list[str]:
        return [name for name, _ in self._loaded]

    @property
    def loaded_keys(self) -> list[tuple[str, int]]:
        """The loaded adapters' keys, least recently used first."""
        return list(self._loaded)

    def path_of(self, key: tuple[str, int]) -> str:
        return self._loaded[key].path

    def get(self, request: LoRARequest) -> LoRAWeights:
        """The adapter, loaded (and checked) if it is not; raises InvalidRequestError if it
        cannot be, or if its name and id were loaded from another path."""
        weights = self._fetch(request)
        self._trim({request.key})
        return weights

    def _fetch(self, request: LoRARequest) -> LoRAWeights:
        path = self._paths.get(request.key)
        if path is not None and path != request.lora_path:  # (its prompts' cached K/V are another's)
            raise _refuse(request, f"an adapter of that name and id was loaded from {path}; "
                                   "a name and id must stay with one adapter")
        weights = self._loaded.get(request.key)
        if weights is not None:
            self._loaded.move_to_end(request.key)
            return weights
        # (a tensor-parallel rank holds a shard of the base weights: no gains there, DoRA refused)
        weights = load_adapter(request, self.arch, self.dtype, self.device, self.max_rank,
                               self._base_weight if self.shard[1] == 1 else None)
        if weights.gains and self.shard[1] > 1:
            raise _refuse(request, "DoRA under tensor parallelism is not built (a rank holds part of a row's inputs)")
        if self.shard[1] > 1:
            from conveyor.models.tensor_parallel import shard_lora

            weights = shard_lora(weights, self.arch, *self.shard)
        self.num_loads += 1
        self._loaded[request.key] = weights
        self._paths[request.key] = request.lora_path
        return weights

    def _base_weight(self, layer: int, module: str) -> torch.Tensor:
        """A projection's base weight `[out, in]` as it computes (int8 dequantized), for DoRA."""
        block = self.model.layers[layer]
        proj = getattr(block.self_attn if module in ("qkv_proj", "o_proj") else block.mlp, module)
        base = getattr(proj, "base", proj)
        qweight, scale = getattr(base, "qweight", None), getattr(base, "wscale", None)
        if qweight is not None and scale is not None:  # Int8Linear: W * smooth quantized by row
            w = qweight.float() * scale.float()[:, None]
            inv = getattr(base, "inv_smooth", None)
            return w if inv is None else w * inv.float()[None, :]
        weight = getattr(base, "weight", None)
        if weight is None and isinstance(getattr(base, "weight_t", None), torch.Tensor):  # TransposedLinear
            weight = base.weight_t.t()
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise InvalidRequestError(f"DoRA: layer {layer}'s {module} holds no weight matrix to read here",
                                      param="lora_request")
        return weight

    def _trim(self, keep: set[tuple[str, int]]) -> None:
        """Drop the least recently used of the unpinned adapters past `capacity`, but `keep`
        (a step that used a dropped one holds its own reference)."""
        unpinned = [k for k in self._loaded if k not in self.pinned]
        for key in [k for k in unpinned if k not in keep][:max(len(unpinned) - self.capacity, 0)]:
            del self._loaded[key]

    def pin(self, request: LoRARequest) -> None:
        """Keep `request`'s adapter loaded until `remove` (loading it now if it is not), beside
        `capacity` unpinned ones; InvalidRequestError if it cannot be loaded or `capacity`
        adapters are pinned already."""
        if request.key not in self.pinned and len(self.pinned) >= self.capacity:
            raise _refuse(request, f"max_cpu_loras={self.capacity} adapters are pinned already; "
                                   "remove one or raise max_cpu_loras")
        self._fetch(request)
        self.pinned.add(request.key)
        self._trim({request.key})

    def set_pinned(self, keys: set[tuple[str, int]]) -> None:
        """A tensor-parallel worker's copy of rank 0's pinned set (each loaded at its next use)."""
        self.pinned = set(keys)

    def remove(self, key: tuple[str, int]) -> bool:
        """Drop an adapter and its pin; whether it was loaded. A request still running with it
        loads it again at its next step."""
        self.pinned.discard(key)
        return self._loaded.pop(key, None) is not None

    def step(self, requests: Sequence[LoRARequest | None], num_new: Sequence[int]) -> LoRAStep | None:
        """The groups of rows for a step whose items (in row order, `num_new` rows each) run
        these adapters; None when none does."""
        if not any(requests):
            return None
        rows: dict[tuple[str, int], list[int]] = {}
        adapters: dict[tuple[str, int], LoRARequest] = {}
        start = 0
        for request, n in zip(requests, num_new, strict=True):
            if request is not None:
                rows.setdefault(request.key, []).extend(range(start, start + n))
                adapters[request.key] = request
            start += n
        groups: list[tuple[LoRAWeights, torch.Tensor | None]] = []
        for name, picked in rows.items():
            weights = self._fetch(adapters[name])
            if len(picked) == start:
                groups.append((weights, None))
            else:
                groups.append((weights, to_device(host_longs(picked), self.device)))
        self._trim(set(rows))
        return LoRAStep(groups)


def check_adapter(request: LoRARequest, model_path: str | None, max_rank: int | None) -> None:
    """Read and check an adapter as an engine would load it, against the model's shapes read
    from `model_path` (its config only: no weights); InvalidRequestError if it cannot serve.
    A server checks an adapter loaded while it runs this way before any request names it."""
    if model_path is None:
        _read_config(request)
        return
    from conveyor.models.loader import read_arch

    arch = read_arch(Path(model_path))
    load_adapter(request, arch, torch.float32, torch.device("cpu"), max_rank or 1 << 30)
