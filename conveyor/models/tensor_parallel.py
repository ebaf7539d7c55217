"""Tensor parallelism's split of the weights (Megatron-LM, Shoeybi et al. 2019; vLLM's -tp).

Each of `size` ranks holds a slice of every layer: whole attention heads (its share of the
query heads and of the KV heads, so its KV cache holds only those) and a slice of the MLP's
inner width (of each expert's, in a mixture). The projections into a slice (q/k/v, gate/up)
are split by output rows, the projections out of it (o_proj, down_proj) by input columns, so
each rank's attention and MLP give a partial sum of the layer's output and one all-reduce
after each (`DecoderLayer.reduce`) gives every rank the whole residual stream. Embeddings,
norms, the router and the LM head are whole on every rank.

The split is applied to the checkpoint's HF-named tensors as they stream in: a rank never
holds more than one whole tensor at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from conveyor.config import ConfigError
from conveyor.models.arch import ArchConfig
from conveyor.models.lora import LoRAWeights
from conveyor.models.vision import VISION_PREFIXES

# Out features split. Latent attention's heads come out of `q_proj` / `q_b_proj` and `kv_b_proj`;
# its latent (`q_a_proj`, `kv_a_proj_with_mqa` and their norms) is computed whole on every rank.
ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "q_b_proj", "kv_b_proj")
COLUMN_SPLIT = ("o_proj", "down_proj", "w2")  # in features split


def shard_arch(arch: ArchConfig, size: int) -> ArchConfig:
    """The shape one rank's model has: 1/size of the heads and of the MLP widths. Latent
    attention splits its heads and keeps the latent whole: each rank caches all of it (as
    vLLM's tensor-parallel MLA does)."""
    if size == 1:
        return arch
    widths = {
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "intermediate_size": arch.intermediate_size,
    }
    if arch.num_experts:
        widths["moe_intermediate_size"] = arch.moe_intermediate_size
        if arch.shared_expert_intermediate_size:
            widths["shared_expert_intermediate_size"] = arch.shared_expert_intermediate_size
    bad = [f"{name}={value}" for name, value in widths.items() if value % size]
    if bad:
        raise ConfigError(
            f"tensor_parallel_size={size} must divide the model's {', '.join(bad)}: each rank takes whole heads "
            "and an equal share of the MLP"
        )
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // size,
        num_kv_heads=arch.num_kv_heads // size,
        intermediate_size=arch.intermediate_size // size,
        moe_intermediate_size=arch.moe_intermediate_size // size,
        shared_expert_intermediate_size=arch.shared_expert_intermediate_size // size,
    )


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, size: int,
                 qkv: tuple[int, int] | None = None) -> torch.Tensor:
    """Rank `rank`'s slice of the HF-named `tensor` (itself if every rank holds it whole).
    Rows are the last-but-one dimension (a bias's only one), columns the last; a stacked
    `experts.gate_up_proj` splits its gate and its up halves apart, and a checkpoint's fused
    `qkv_proj` (Phi-3) its q, k and v rows, `qkv` = (q rows, k rows) long."""
    if size == 1:
        return tensor
    parts = name.split(".")
    proj = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]  # "experts.gate_up_proj": stacked
    if proj == "sinks":  # gpt-oss: one a query head
        return tensor.chunk(size, dim=0)[rank].contiguous()
    if proj == "gate_up_proj_bias":  # gpt-oss's experts `[E, 2I]`, gates then ups (as the loader puts them)
        gate, up = tensor.chunk(2, dim=-1)
        return torch.cat((gate.chunk(size, dim=-1)[rank], up.chunk(size, dim=-1)[rank]), dim=-1).contiguous()
    if proj == "down_proj_bias" or (proj in COLUMN_SPLIT and parts[-1] == "bias"):
        # A bias after the split joins the partial sums once: on rank 0.
        return tensor if rank == 0 else torch.zeros_like(tensor)
    if proj == "qkv_proj":
        if qkv is None:
            raise ValueError(f"{name}: a fused qkv_proj splits by the q and k widths (qkv=)")
        dim = 0 if tensor.dim() == 1 else -2
        q, kv = qkv
        return torch.cat([p.chunk(size, dim=dim)[rank] for p in tensor.split([q, kv, kv], dim=dim)], dim=dim).contiguous()
    if proj == "gate_up_proj":
        gate, up = tensor.chunk(2, dim=-2)
        return torch.cat((gate.chunk(size, dim=-2)[rank], up.chunk(size, dim=-2)[rank]), dim=-2).contiguous()
    if proj in ROW_SPLIT:
        dim = 0 if tensor.dim() == 1 else -2
        return tensor.chunk(size, dim=dim)[rank].contiguous()
    if proj in COLUMN_SPLIT:
        return tensor.chunk(size, dim=-1)[rank].contiguous()
    return tensor


def shard_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], rank: int, size: int, arch: ArchConfig | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor's slice for rank `rank`; `arch` (the whole model's) gives a fused qkv_proj's widths."""
    qkv = None if arch is None else (arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim)
    for name, tensor in tensors:  # (a vision side is whole on every rank: rank 0 runs it)
        yield name, tensor if name.startswith(VISION_PREFIXES) else shard_tensor(name, tensor, rank, size, qkv)


def shard_lora(weights: LoRAWeights, arch: ArchConfig, rank: int, size: int) -> LoRAWeights:
    """Rank `rank`'s part of an adapter laid out for the whole model `arch`: a projection into a
    slice (q/k/v, gate/up) keeps the whole `A` and its slice's columns of `B^T`; a projection out
    of one (o_proj, down_proj) its slice's rows of `A^T` and the whole `B`, so its delta is a
    partial sum that the layer's all-reduce completes, as the base projection's is."""
    if size == 1:
        return weights
    q, kv, i = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    widths = {"qkv_proj": [q, kv, kv], "gate_up_proj": [i, i]}

    def columns(b_t: torch.Tensor, parts: list[int]) -> torch.Tensor:
        return torch.cat([piece.chunk(size, dim=1)[rank] for piece in b_t.split(parts, dim=1)], dim=1).contiguous()

    layers = []
    for layer in weights.layers:
        out = {}
        for module, (a_t, b_t) in layer.items():
            if module in widths:
                out[module] = (a_t, columns(b_t, widths[module]))
            else:  # o_proj, down_proj: the input is split
                out[module] = (a_t.chunk(size, dim=0)[rank].contiguous(), b_t)
        layers.append(out)
    return LoRAWeights(weights.name, weights.path, weights.rank, layers)
