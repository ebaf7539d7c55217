"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) over a flat token batch.

Each token's router picks `num_experts_per_tok` of the layer's experts; the step's
(token, expert) assignments are sorted by expert, so every expert runs once, over exactly the
rows sent to it, and the weighted outputs are summed back into their tokens. This is where
batching an MoE differs from a dense model: a decode step of B tokens reads only the experts
its tokens chose (about `E (1 - (1 - k/E)^B)` of the `E`), so a small batch streams a fraction
of the weights and a large one all of them, each expert then over `B k / E` rows on average.

The arithmetic follows transformers' modules, so float64 outputs are HF's: the router's
softmax in float32, its top-k renormalized where the model says so, and each token's expert
outputs added in ascending expert order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.arch import ArchConfig


class Experts(nn.Module):
    """The routed experts' weights, stacked as transformers >= 5 keeps them: `gate_up_proj`
    `[E, 2I, hidden]` (each expert's gate rows, then its up rows) and `down_proj` `[E, hidden, I]`."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.intermediate = i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    # Set by prepare_for_inference (CPU float32): the native kernels the dense MLP uses, the
    # skinny GEMV for an expert's few rows of a decode step, SiLU × up in one pass; and
    # torch's grouped GEMM, all experts in one call, past `loop_max_rows` rows a step.
    skinny: Callable[..., torch.Tensor] | None = None
    skinny_max_rows = 0
    native_silu_mul: Callable[..., torch.Tensor] | None = None
    grouped_mm: Callable[..., torch.Tensor] | None = None
    loop_max_rows = 8

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native_silu_mul is not None:
            return self.native_silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.shape[0] <= self.skinny_max_rows:
            return self.skinny(x, weight)
        return F.linear(x, weight)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`rows` `[n, hidden]` grouped by expert, `counts[e]` of them for expert e; returns each
        row through its expert, in the same order."""
        grouped = self.grouped_mm
        if grouped is not None and rows.shape[0] > self.loop_max_rows:
            # One call a projection: the weights' transposed views, the groups' ends as offsets.
            ends = counts.cumsum(0).to(torch.int32)
            act = self._act(grouped(rows, self.gate_up_proj.transpose(1, 2), offs=ends))
            return grouped(act, self.down_proj.transpose(1, 2), offs=ends)
        outs = []
        start = 0
        for e, n in enumerate(counts.tolist()):  # the step's one host sync a layer
            if not n:
                continue
            act = self._act(self._linear(rows[start : start + n], self.gate_up_proj[e]))
            outs.append(self._linear(act, self.down_proj[e]))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class SparseMoE(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a gated shared expert; replaces a layer's MLP.

    Parameter names are HF's (`gate` is the router, `experts.*`, `shared_expert*`)."""

    def __init__(self, arch: ArchConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        # Qwen's routers hand back their weights in the model's dtype; Mixtral's stay float32
        # and the product with the expert outputs is rounded once (the same in float32).
        self.weights_in_model_dtype = arch.family != "mixtral"
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = Experts(arch)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False) if shared_expert is not None else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts `[T, k]` and their weights `[T, k]`."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        chosen = experts.flatten()
        order = chosen.argsort(stable=True)  # assignments grouped by expert, tokens ascending
        tokens = order // self.top_k
        counts = torch.bincount(chosen, minlength=self.num_experts)
        out = self.experts(x.index_select(0, tokens), counts)
        out = (out * weights.flatten()[order].unsqueeze(1)).to(x.dtype)
        y = torch.zeros_like(x).index_add_(0, tokens, out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
