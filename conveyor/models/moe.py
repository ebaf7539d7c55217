"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) over a flat token batch.

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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.models.arch import DEEPSEEK_STYLE_MOE, ArchConfig


class Experts(nn.Module):
    """The routed experts' weights, stacked as transformers >= 5 keeps them: `gate_up_proj`
    `[E, 2I, hidden]` (each expert's gate rows, then its up rows) and `down_proj` `[E, hidden, I]`;
    gpt-oss's biases `[E, 2I]` and `[E, hidden]` and its clamped SwiGLU."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.intermediate = i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if arch.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, h)) if arch.expert_bias else None
        self.limit, self.alpha = arch.swiglu_limit, arch.swiglu_alpha

    # Set by prepare_for_inference (CPU float32): the native kernels the dense MLP uses, the
    # skinny GEMV for an expert's few rows of a decode step, SiLU × up in one pass; and
    # torch's grouped GEMM, all experts in one call, past `loop_max_rows` rows a step.
    skinny: Callable[..., torch.Tensor] | None = None
    skinny_max_rows = 0
    native_silu_mul: Callable[..., torch.Tensor] | None = None
    grouped_mm: Callable[..., torch.Tensor] | None = None
    loop_max_rows = 8
    # quantization="int8" (`quantize_int8`): each expert's two projections as `Int8Linear`s, and
    # the native weight-only int8 product for a decode step's few rows.
    int8: list[tuple[Any, Any]] | None = None
    q8: Callable[..., torch.Tensor] | None = None
    q8_max_rows = 0

    def quantize_int8(self, q8: Callable[..., torch.Tensor] | None, q8_max_rows: int) -> None:
        """Each expert's weights in int8 (per output row, as the dense projections' are, without
        their smoothing: an expert sees only its tokens), the float copies dropped. Its few rows
        of a decode step take the native weight-only product `q8`; more rows fbgemm's int8 GEMM
        over rows quantized on their own scales (the same whatever else is in the batch)."""
        from conveyor.models.quantize import Int8Linear

        b1, b2 = self.gate_up_proj_bias, self.down_proj_bias
        self.int8 = [(Int8Linear(self.gate_up_proj[e], None if b1 is None else b1[e]),
                      Int8Linear(self.down_proj[e], None if b2 is None else b2[e]))
                     for e in range(self.gate_up_proj.shape[0])]
        empty = torch.empty(0, dtype=self.gate_up_proj.dtype)
        self.gate_up_proj = nn.Parameter(empty, requires_grad=False)
        self.down_proj = nn.Parameter(empty.clone(), requires_grad=False)
        self.gate_up_proj_bias = self.down_proj_bias = None
        self.q8, self.q8_max_rows = q8, q8_max_rows

    def _int8_linear(self, x: torch.Tensor, linear: Any) -> torch.Tensor:
        if self.q8 is not None and x.shape[0] <= self.q8_max_rows:
            y = self.q8(x, linear.qweight, linear.wscale, linear.inv_smooth)
            return y if linear.bias is None else y.add_(linear.bias)
        return linear(x)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native_silu_mul is not None and not self.limit:
            return self.native_silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        if self.limit:  # gpt-oss
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return F.silu(gate) * up

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.shape[0] <= self.skinny_max_rows:
            return self.skinny(x, weight)
        return F.linear(x, weight)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`rows` `[n, hidden]` grouped by expert, `counts[e]` of them for expert e; returns each
        row through its expert, in the same order."""
        if self.int8 is not None:
            return self._forward_int8(rows, counts)
        grouped = self.grouped_mm
        if grouped is not None and rows.shape[0] > self.loop_max_rows:
            # One call a projection: the weights' transposed views, the groups' ends as offsets.
            ends = counts.cumsum(0).to(torch.int32)
            gate_up = grouped(rows, self.gate_up_proj.transpose(1, 2), offs=ends)
            if self.gate_up_proj_bias is not None and self.down_proj_bias is not None:
                n = rows.shape[0]
                gate_up = gate_up + self.gate_up_proj_bias.repeat_interleave(counts, dim=0, output_size=n)
                out = grouped(self._act(gate_up), self.down_proj.transpose(1, 2), offs=ends)
                return out + self.down_proj_bias.repeat_interleave(counts, dim=0, output_size=n)
            return grouped(self._act(gate_up), self.down_proj.transpose(1, 2), offs=ends)
        outs = []
        start = 0
        b1, b2 = self.gate_up_proj_bias, self.down_proj_bias
        for e, n in enumerate(counts.tolist()):  # the step's one host sync a layer
            if not n:
                continue
            gate_up = self._linear(rows[start : start + n], self.gate_up_proj[e])
            out = self._linear(self._act(gate_up if b1 is None else gate_up + b1[e]), self.down_proj[e])
            outs.append(out if b2 is None else out + b2[e])
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _forward_int8(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        assert self.int8 is not None
        outs = []
        start = 0
        for e, n in enumerate(counts.tolist()):
            if not n:
                continue
            gate_up, down = self.int8[e]
            x = rows[start : start + n]
            outs.append(self._int8_linear(self._act(self._int8_linear(x, gate_up)), down))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class GroupedRouter(nn.Module):
    """DeepSeek's router, in float32 whatever the model's dtype (as HF's): each token's scores
    (softmax or sigmoid), its experts chosen among the `topk_group` best of `n_group` groups,
    with V3's learned bias (`e_score_correction_bias`) steering the choice and not the weights,
    which are the scores of the chosen, scaled by `routed_scaling_factor`."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        e = arch.num_experts
        self.weight = nn.Parameter(torch.empty(e, arch.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(e)) if arch.topk_method == "noaux_tc" else None
        self.top_k, self.norm_topk_prob, self.scale = arch.num_experts_per_tok, arch.norm_topk_prob, arch.routed_scaling_factor
        self.sigmoid, self.method = arch.scoring_func == "sigmoid", arch.topk_method
        self.groups, self.topk_group = arch.n_group, arch.topk_group

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if self.method != "greedy":
            grouped = choice.view(x.shape[0], self.groups, -1)
            # V2 ranks a group by its best expert, V3 by its best two.
            best = grouped.amax(dim=-1) if self.method == "group_limited_greedy" else grouped.topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_group, dim=-1)[1], 1.0).bool()
            fill = 0.0 if self.method == "group_limited_greedy" else float("-inf")
            choice = grouped.masked_fill(~keep[..., None], fill).view_as(choice)
        experts = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scale


class SparseMoE(nn.Module):
    """Router, routed experts and a shared expert (Qwen2-MoE's behind a sigmoid gate, DeepSeek's
    ungated); replaces a layer's MLP.

    Parameter names are HF's (`gate` is the router, `experts.*`, `shared_expert*`; DeepSeek's
    `shared_experts` are loaded as `shared_expert`)."""

    def __init__(self, arch: ArchConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        # Qwen's routers hand back their weights in the model's dtype; Mixtral's and DeepSeek's
        # stay float32 and the product with the expert outputs is rounded once (the same in float32).
        self.weights_in_model_dtype = arch.family in ("qwen2_moe", "qwen3_moe")
        self.gate: nn.Module = (GroupedRouter(arch) if arch.family in DEEPSEEK_STYLE_MOE
                                else nn.Linear(arch.hidden_size, arch.num_experts, bias=arch.expert_bias))
        # gpt-oss: the softmax of each token's top k logits (in the model's dtype), not the top k
        # of a softmax over all.
        self.softmax_of_top_k = arch.family == "gpt_oss"
        self.experts = Experts(arch)
        self.shared_expert = shared_expert
        gated = shared_expert is not None and arch.shared_expert_gated
        self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False) if gated else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts `[T, k]` and their weights `[T, k]`."""
        if isinstance(self.gate, GroupedRouter):
            return self.gate(x)
        if self.softmax_of_top_k:
            top, experts = self.gate(x).topk(self.top_k, dim=-1)
            return experts, torch.softmax(top, dim=-1, dtype=top.dtype)
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
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            y = y + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared)
        return y
