"""The cost model: how long one step takes on some hardware, from the step's shape alone.

A step is summarised by a `StepShape` (tokens, sequences, attention work, swapped blocks).
`RooflineCostModel` prices each part of the forward pass as max(compute time, memory time),
the roofline, with efficiency factors for what real kernels reach:

    linear layers   FLOPs 2 x layer_params x tokens       bytes: the layer weights, once
    experts         a mixture of experts' routed experts: of E experts a layer, a step of T
                    tokens sending each to k reads the ones chosen, E (1 - (1 - k/E)^T) of them
                    expected under uniform routing, each a roofline of its own over its share
                    of the T k rows (a grouped GEMM); the rest of the layer is `linear`
    LM head         FLOPs 2 x vocab x hidden x sampled    bytes: the head weights, once
    attention       FLOPs 4 x layers x q_heads x head_dim x (query, key) pairs (causal in
                    a prompt); bytes: every context token's K and V, at its own efficiency.
                    Latent attention (MLA): a prompt's pairs at (nope + rope + v) / 2 for
                    head_dim, a decode's at (2 rank + rope) / 2 (`ModelShape.attention_dims`),
                    and bytes of one latent and rotary key a token
    skinny steps    up to `skinny_rows` rows stream the weights through a matrix-vector style
                    kernel, once per `skinny_pass_rows` rows, at its own efficiencies
                    (`gemv_mbu`, `gemv_mfu`)
    overheads       per step + per sequence + per token (launches, sampling, the scheduler),
                    and per step of more than `skinny_rows` rows (`gemm_overhead_s`: a CPU
                    GEMM library packing the weights each call)
    host            `host_s` a step: the engine's host work between two runner steps
                    (scheduling, outputs), which a calibrated CPU serializes with the steps
    swap            blocks x block bytes / host link bandwidth
    allreduce       tensor parallelism over n devices (`tensor_parallel`): each prices 1/n of
                    the weights, heads and LM head above, and a step adds 2 all-reduces a
                    layer (latency + 2 (n-1)/n x tokens x hidden bytes / link bandwidth) and
                    the gather of the sampled rows' logits
    all_to_all      data-parallel attention with expert-parallel experts over d devices
                    (`dp_attention`): each device prices its 1/d of the step's sequences and
                    tokens over whole weights, 1/d of the experts the whole step's tokens
                    chose, and two all-to-alls a sparse layer (latency + its tokens x k x
                    (d-1)/d x hidden bytes / link bandwidth, each way)
    pipeline_send   pipeline parallelism over p stages (`pipeline_parallel`): the layers split
                    into p consecutive stages (as evenly as whole layers go), and a batch
                    crosses p - 1 links between them (latency + tokens x hidden bytes / the
                    link's bandwidth). `stage_times` gives each stage's share: its layers'
                    part of everything per layer, the LM head on the last stage, the step's
                    fixed costs (scheduling, launches, host) on the first; `step_time` is a
                    batch's way through them all
    after idle      a step that starts after the device sat idle for `idle_threshold_s` or
                    more costs `idle_cost_s` seconds more, and `idle_factor` times its price
                    more (a calibrated CPU: caches and clocks gone cold while the server
                    waited for requests; `calibrate` fits the fixed cost, the factor is kept
                    for older calibrations; both 0 on the GPU catalog)

Any object with `step_time(shape) -> float` can replace it (a profiled table, say).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

from conveyor.core.scheduler import SchedulerOutput
from conveyor.sim.hardware import Hardware
from conveyor.sim.models import ModelShape


@dataclass(slots=True)
class StepShape:
    num_seqs: int = 0
    num_tokens: int = 0
    num_sampled: int = 0
    prefill_pairs: int = 0  # (query, key) pairs of prefill attention, causal
    prefill_context: int = 0  # context tokens whose K/V prefill attention reads
    decode_seqs: int = 0
    decode_context: int = 0  # context tokens whose K/V decode attention reads
    swap_blocks: int = 0  # blocks copied out plus in
    idle_before_s: float = 0.0  # how long the device sat idle before the step (set by the simulator)
    # The same three for a layer that attends within a window (`of`'s `window`; 0: as above).
    window_prefill_pairs: int = 0
    window_prefill_context: int = 0
    window_decode_context: int = 0
    # Sequences of several rows that the CPU runner runs as one-token decodes side by side (a
    # speculative step's guesses; spans of up to `of`'s `chain_span` rows): with the decodes,
    # they keep a step in the fused native call (conveyor/runner/model_runner.py: `_chains`).
    chained_seqs: int = 0
    disk_blocks: int = 0  # KV offloading's disk tier: blocks written to and read from disk

    @classmethod
    def of(cls, out: SchedulerOutput, window: int = 0, chain_span: int = 0) -> StepShape:
        """The step's shape; with `window`, also what a sliding layer's attention reads: each
        query the last `window` positions up to its own, the context those span."""
        s = cls(swap_blocks=len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
                + len(out.blocks_to_store) + len(out.blocks_to_load),  # (KV offloading's copies: the same link)
                disk_blocks=len(out.disk_writes) + len(out.disk_reads))
        for item in out.scheduled:
            n = len(item.token_ids)
            start = item.start_pos
            ctx = start + n
            s.num_seqs += 1
            s.num_tokens += n
            s.num_sampled += item.sample + item.num_draft  # (a draft's position samples too)
            if n == 1:
                s.decode_seqs += 1
                s.decode_context += ctx
                s.window_decode_context += min(ctx, window) if window else ctx
            else:
                s.chained_seqs += bool(item.num_draft) or n <= chain_span
                pairs = n * start + n * (n + 1) // 2
                s.prefill_pairs += pairs
                s.prefill_context += ctx
                s.window_prefill_pairs += window_pairs(start, n, window) if window else pairs
                s.window_prefill_context += min(ctx, window + n - 1) if window else ctx
        return s


def window_pairs(start: int, n: int, window: int) -> int:
    """(query, key) pairs of `n` queries at positions start.. each seeing its last `window`
    positions (its own included): the sum of min(q + 1, window)."""
    first, last = start + 1, start + n  # each query's count before the cap: q + 1
    if last <= window:
        return (first + last) * n // 2
    if first >= window:
        return window * n
    return (first + window) * (window - first + 1) // 2 + window * (last - window)


class CostModel(Protocol):
    def step_time(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class CostParams:
    """What the hardware reaches of its peaks, and the fixed costs; `calibrate` fits them.

    The GPU defaults are assumptions, not measurements: large bf16 GEMMs commonly reach 60-75%
    of the datasheet peak, streaming kernels 80-90% of the memory bandwidth and paged attention
    somewhat less; the step and sequence overheads are of the order of a Python scheduler with
    CUDA graphs. docs/simulation.md shows what changes when they do. An efficiency may exceed 1
    a little where the measured peak (a calibrated CPU's) is below what some shape reaches.
    """

    mfu: float = 0.65  # linear layers: share of peak FLOP/s
    attn_mfu: float = 0.45  # attention: share of peak FLOP/s
    mbu: float = 0.85  # weights streamed by matrix-matrix kernels: share of memory bandwidth
    kv_mbu: float = 0.7  # K/V read by attention: share of memory bandwidth
    gemv_mbu: float | None = None  # weights streamed by a skinny (matrix-vector) kernel; None: mbu
    gemv_mfu: float | None = None  # share of peak FLOP/s that skinny kernel reaches; None: mfu
    skinny_rows: int = 1  # steps of up to this many rows use the skinny kernel (CPU runner: 16)
    skinny_pass_rows: int = 1  # rows per pass of that kernel over the weights (CPU runner: 8)
    step_overhead_s: float = 2e-3
    seq_overhead_s: float = 1e-5
    token_overhead_s: float = 0.0
    # The CPU runner runs a decode-only step of up to `fused_rows` rows in one native call
    # (FusedDecode); every other step pays `unfused_overhead_s` more, its per-layer Python.
    fused_rows: int = 0
    unfused_overhead_s: float = 0.0
    # A step after an idle period of at least `idle_threshold_s` costs `idle_factor` times its
    # price more (calibrations before the ninth session) and `idle_cost_s` seconds more (fitted
    # by `calibrate` since; docs/simulation.md, "Idle before a step" and "A fixed wake-up cost").
    idle_factor: float = 0.0
    idle_threshold_s: float = 0.05
    idle_cost_s: float = 0.0
    # Host time between two runner steps of a served run (scheduler, outputs), measured by
    # `calibrate` in its closed-loop served part; charged to every step that computes.
    host_s: float = 0.0
    # A step of more than `skinny_rows` rows takes the matrix-matrix path; on a CPU its GEMM
    # library packs every weight matrix a call, a fixed cost beside the roofline's time
    # (fitted by `calibrate` since the tenth session; docs/simulation.md, "Calibration in
    # slices, a fixed cost for the matrix path, balanced weights").
    gemm_overhead_s: float = 0.0
    # Tensor parallelism's all-reduces (assumptions, not measurements): a fixed latency each
    # (NCCL's small-message all-reduce within an NVLink machine is of the order of 10 us) and
    # the share of the link's bandwidth a ring all-reduce reaches.
    allreduce_latency_s: float = 10e-6
    link_efficiency: float = 0.8
    # Pipeline parallelism's sends between stages (an assumption): a fixed latency each.
    send_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        for name in ("mfu", "attn_mfu", "mbu", "kv_mbu", "gemv_mbu", "gemv_mfu"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= 1.5:
                raise ValueError(f"{name}={v} must be in (0, 1.5]")
        if not 0 < self.link_efficiency <= 1:
            raise ValueError(f"link_efficiency={self.link_efficiency} must be in (0, 1]")
        if min(self.step_overhead_s, self.seq_overhead_s, self.token_overhead_s, self.unfused_overhead_s,
               self.gemm_overhead_s, self.allreduce_latency_s, self.send_latency_s) < 0:
            raise ValueError("overheads must be >= 0")
        if self.skinny_rows < 1 or self.skinny_pass_rows < 1:
            raise ValueError("skinny_rows and skinny_pass_rows must be at least 1")
        if self.fused_rows < 0:
            raise ValueError("fused_rows must be >= 0")
        if min(self.idle_factor, self.idle_threshold_s, self.idle_cost_s, self.host_s) < 0:
            raise ValueError("idle_factor, idle_threshold_s, idle_cost_s and host_s must be >= 0")

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostParams:
        integers = ("skinny_rows", "skinny_pass_rows", "fused_rows")
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {
            k: None if v is None else int(v) if k in integers else float(v) for k, v in d.items() if k in names
        }
        return cls(**kw)


class RooflineCostModel:
    def __init__(self, hardware: Hardware, model: ModelShape, params: CostParams | None = None,
                 dtype_bytes: int | None = None, block_size: int = 16, tensor_parallel: int = 1,
                 pipeline_parallel: int = 1, pipeline_link_bandwidth: float | None = None,
                 dp_attention: bool = False, fp8: bool = False, expert_bytes: float | None = None,
                 block_share: float = 1.0) -> None:
        """`tensor_parallel`: the devices one step runs on (Megatron-LM's split, as vLLM's -tp):
        each computes 1/n of the layers' weights, of the LM head (split by vocabulary) and of
        the attention heads, holds its share of the K/V (`ModelShape.kv_share`), and the step
        adds two all-reduces of its `[tokens, hidden]` activations a layer (a ring: each device
        sends and receives 2 (n-1)/n of them) and a gather of the sampled rows' logits.
        `pipeline_parallel`: stages of consecutive layers (each of `tensor_parallel` devices),
        their activations sent from one to the next over `pipeline_link_bandwidth` bytes/s (by
        default the devices' own link: stages within one machine).
        `dp_attention`: the `tensor_parallel` devices instead run attention data-parallel and
        the routed experts expert-parallel (SGLang's DP attention with EP): a step's shape is
        the whole group's, its sequences and tokens spread evenly; each device prices its share
        of them (`local_shape`: the busiest one's, rounded up) over whole weights for all but
        the experts, holds 1/n of the experts whole and computes the rows routed to them from
        every device's tokens, and each sparse layer sends a device's rows to their experts
        and back (two all-to-alls). `fp8`: the layers' weights (not the embeddings, LM head or
        K/V) in FP8, one byte each, multiplied at the hardware's FP8 rate where it has one
        (`Hardware.fp8_flops`; else at its 16-bit rate: a weight-only kernel). `expert_bytes`:
        a routed expert weight's bytes (MXFP4: 4.25 bits), multiplied at the 16-bit rate (the
        value decoded in the kernel: no FP4 tensor cores before Blackwell). `block_share`: the
        share of the layers whose K/V a block holds (a hybrid cache's page: its `page_layers`
        of them), what a swapped block moves."""
        if not 1 <= pipeline_parallel <= model.num_layers:
            raise ValueError(f"{model.name}: pipeline_parallel_size={pipeline_parallel} must be in "
                             f"[1, its {model.num_layers} layers]")
        self.pipeline_parallel = pipeline_parallel
        base, extra = divmod(model.num_layers, pipeline_parallel)  # vLLM's split: the first stages one more
        self.stage_layers = [base + (k < extra) for k in range(pipeline_parallel)]
        link_bw = pipeline_link_bandwidth or hardware.peer_bandwidth
        self._send_fixed_s = (params or CostParams()).send_latency_s
        self._send_token_s = model.hidden_size * (dtype_bytes or hardware.dtype_bytes) / link_bw
        self.hardware = hardware
        self.model = model
        self.params = params or CostParams()
        self.dtype_bytes = dtype_bytes or hardware.dtype_bytes
        self.dp_size = tensor_parallel if dp_attention else 1
        if dp_attention and pipeline_parallel > 1:
            raise ValueError("dp_attention with pipeline parallelism is not modelled")
        if self.dp_size > 1 and model.num_experts % self.dp_size:
            raise ValueError(f"{model.name}: expert parallelism over {self.dp_size} devices must divide its "
                             f"{model.num_experts} experts")
        self.tensor_parallel = n = 1 if dp_attention else tensor_parallel
        if n > 1:
            model.check_tensor_parallel(n)
        p, m, b = self.params, model, self.dtype_bytes
        # Constants of the formulas, folded once: a step is priced in a dozen float operations.
        self.fp8 = fp8
        w = 1 if fp8 else b  # a layer weight's bytes
        layer_peak = hardware.fp8_flops if fp8 and hardware.fp8_flops else hardware.peak_flops
        flops = layer_peak * p.mfu
        bw = hardware.mem_bandwidth * p.mbu
        gemv_bw = hardware.mem_bandwidth * (p.gemv_mbu if p.gemv_mbu is not None else p.mbu)
        dense = m.dense_params / n  # a dense model's layer_params; a mixture's without its routed experts
        self._lin_flop_s = 2 * dense / flops  # seconds per token
        self._lin_mem_s = dense * w / bw  # seconds per step
        self._lin_gemv_s = dense * w / gemv_bw  # seconds per skinny pass
        gemv_flops = layer_peak * (p.gemv_mfu if p.gemv_mfu is not None else p.mfu)
        self._lin_gemv_flop_s = 2 * dense / gemv_flops  # per token, skinny kernel
        e = m.expert_params / n  # one expert's: the same four constants
        if expert_bytes is None:
            self._expert = (2 * e / flops, e * w / bw, 2 * e / gemv_flops, e * w / gemv_bw)
        else:  # weights decoded to 16-bit in the kernel
            flops16 = hardware.peak_flops * p.mfu
            gemv16 = hardware.peak_flops * (p.gemv_mfu if p.gemv_mfu is not None else p.mfu)
            self._expert = (2 * e / flops16, e * expert_bytes / bw, 2 * e / gemv16, e * expert_bytes / gemv_bw)
        head = m.head_params / n  # (16-bit: FP8 leaves the LM head as it is)
        head_flops = hardware.peak_flops * p.mfu
        head_gemv_flops = hardware.peak_flops * (p.gemv_mfu if p.gemv_mfu is not None else p.mfu)
        self._head_gemv_flop_s = 2 * head / head_gemv_flops
        self._skinny, self._pass = p.skinny_rows, p.skinny_pass_rows
        self._head_flop_s = 2 * head / head_flops  # per sampled row
        self._head_mem_s = head * b / bw
        self._head_gemv_s = head * b / gemv_bw
        per_pair = 4 * m.num_layers * m.num_heads / n / (hardware.peak_flops * p.attn_mfu)
        prefill_dim, decode_dim = m.attention_dims  # head_dim both, unless latent attention
        self._attn_flop_s = per_pair * decode_dim
        self._attn_prefill_flop_s = per_pair * prefill_dim
        kv = m.kv_bytes_per_token(b) * m.kv_share(n)  # one device's
        self._kv_mem_s = kv / (hardware.mem_bandwidth * p.kv_mbu)  # per context token
        self._swap_s = kv * block_share * block_size / hardware.host_bandwidth  # per block (the devices swap at once)
        self._disk_s = kv * block_share * block_size / hardware.disk_bandwidth  # per block, as the runner: serial
        link = hardware.peer_bandwidth * p.link_efficiency
        # Per step: 2 all-reduces a layer, a fixed latency each and 2 (n-1)/n of the rows' bytes
        # over the link; the logits' gather (float32 rows of the vocabulary), the same way.
        self._ar_fixed_s = 2 * m.num_layers * p.allreduce_latency_s if n > 1 else 0.0
        self._ar_token_s = 2 * m.num_layers * 2 * (n - 1) / n * m.hidden_size * b / link if n > 1 else 0.0
        self._gather_row_s = (n - 1) / n * m.vocab_size * 4 / link if n > 1 else 0.0
        # Expert parallelism's all-to-alls: a device's rows (k copies of a token, those bound
        # for other devices' experts, (d-1)/d of them under uniform routing) out and back.
        d = self.dp_size
        self._a2a_fixed_s = 2 * m.num_sparse_layers * p.allreduce_latency_s if d > 1 and m.num_experts else 0.0
        self._a2a_token_s = (2 * m.num_sparse_layers * m.experts_per_token * (d - 1) / d * m.hidden_size * b / link
                             if d > 1 and m.num_experts else 0.0)
    def _linear(self, tokens: int) -> float:
        if tokens <= self._skinny:
            return max(self._lin_gemv_flop_s * tokens, self._lin_gemv_s * -(-tokens // self._pass))
        return max(self._lin_flop_s * tokens, self._lin_mem_s)

    def experts_touched(self, tokens: int) -> float:
        """Experts a sparse layer reads for `tokens` tokens, expected under uniform routing."""
        m = self.model
        return m.num_experts * (1 - (1 - m.experts_per_token / m.num_experts) ** tokens)

    def _experts(self, tokens: int) -> float:
        """The routed experts of all sparse layers: each expert read runs its share of rows
        (under expert parallelism, a device reads its 1/d of the experts the group's tokens chose)."""
        touched = self.experts_touched(tokens)
        rows = tokens * self.model.experts_per_token / touched
        touched /= self.dp_size
        flop_s, mem_s, gemv_flop_s, gemv_s = self._expert
        if rows <= self._skinny:
            one = max(gemv_flop_s * rows, gemv_s * math.ceil(rows / self._pass))
        else:
            one = max(flop_s * rows, mem_s)
        return self.model.num_sparse_layers * touched * one

    def head_time(self, rows: int) -> float:
        """The LM head over `rows` rows (what a Medusa round's heads are priced as)."""
        return self._head(rows)

    def _head(self, rows: int) -> float:
        if rows <= self._skinny:
            return max(self._head_gemv_flop_s * rows, self._head_gemv_s * -(-rows // self._pass))
        return max(self._head_flop_s * rows, self._head_mem_s)

    # The parts a layer split prices by its share of the layers; the rest sit on one stage.
    LAYER_PARTS = ("linear", "experts", "attn_prefill", "attn_decode", "allreduce", "all_to_all")

    def local_shape(self, s: StepShape) -> StepShape:
        """Under `dp_attention`, the busiest device's share of the group's step: each count
        divided by the devices, rounded up (itself otherwise)."""
        d = self.dp_size
        if d == 1:
            return s

        def share(x: int) -> int:
            return -(-x // d)

        return StepShape(share(s.num_seqs), share(s.num_tokens), share(s.num_sampled), share(s.prefill_pairs),
                         share(s.prefill_context), share(s.decode_seqs), share(s.decode_context),
                         share(s.swap_blocks), s.idle_before_s, share(s.window_prefill_pairs),
                         share(s.window_prefill_context), share(s.window_decode_context), share(s.chained_seqs),
                         share(s.disk_blocks))

    def breakdown(self, s: StepShape) -> dict[str, float]:
        """Seconds per part of the step (with pipeline stages, of a batch's way through them
        all); `step_time` is their sum."""
        p = self.params
        whole, s = s, self.local_shape(s)
        busy = s.num_tokens > 0
        parts = {
            "linear": self._linear(s.num_tokens) if busy else 0.0,
            "experts": self._experts(whole.num_tokens) if busy and self.model.num_experts else 0.0,
            "all_to_all": self._a2a_fixed_s + self._a2a_token_s * s.num_tokens if busy else 0.0,
            "lm_head": self._head(s.num_sampled) if s.num_sampled else 0.0,
            "attn_prefill": self._attn_prefill(s),
            "attn_decode": max(self._attn_flop_s, self._kv_mem_s) * self._by_window(s.decode_context,
                                                                                   s.window_decode_context),
            "swap": self._swap_s * s.swap_blocks,
            "disk": self._disk_s * s.disk_blocks,
            "allreduce": self._ar_fixed_s + self._ar_token_s * s.num_tokens
            + (p.allreduce_latency_s + self._gather_row_s * s.num_sampled if s.num_sampled else 0.0)
            if busy and self.tensor_parallel > 1 else 0.0,
            "overhead": p.step_overhead_s + p.seq_overhead_s * s.num_seqs + p.token_overhead_s * s.num_tokens
            + (0.0 if self.fused(s) else p.unfused_overhead_s)
            + (p.gemm_overhead_s if self.matrix_path(s) else 0.0) if busy else 0.0,
        }
        cold = busy and (p.idle_factor or p.idle_cost_s) and s.idle_before_s >= p.idle_threshold_s
        parts["after_idle"] = p.idle_factor * sum(parts.values()) + p.idle_cost_s if cold else 0.0
        parts["host"] = p.host_s if busy else 0.0
        sends = self.pipeline_parallel - 1
        parts["pipeline_send"] = sends * (self._send_fixed_s + self._send_token_s * s.num_tokens) if busy else 0.0
        return parts

    def _by_window(self, full: float, windowed: float) -> float:
        """A per-layer quantity over all layers, the sliding ones' within their window."""
        slide = self.model.sliding_share
        return full if not slide else (1 - slide) * full + slide * windowed

    def _attn_prefill(self, s: StepShape) -> float:
        full = max(self._attn_prefill_flop_s * s.prefill_pairs, self._kv_mem_s * s.prefill_context)
        if not self.model.sliding_share:
            return full
        windowed = max(self._attn_prefill_flop_s * s.window_prefill_pairs, self._kv_mem_s * s.window_prefill_context)
        return self._by_window(full, windowed)

    def stage_times(self, s: StepShape) -> tuple[list[float], float]:
        """Each pipeline stage's seconds of compute for this batch, and the seconds of one send
        from a stage to the next (one stage without pipeline parallelism: `step_time`, 0).
        The logits' gather of tensor parallelism goes with the LM head, on the last stage;
        `step_time` is the stages' sum and the p - 1 sends."""
        parts = self.breakdown(s)
        n = self.pipeline_parallel
        if n == 1:
            return [sum(parts.values())], 0.0
        gather = (self.params.allreduce_latency_s + self._gather_row_s * s.num_sampled
                  if s.num_sampled and s.num_tokens and self.tensor_parallel > 1 else 0.0)
        layered = sum(parts[k] for k in self.LAYER_PARTS) - gather
        fixed = sum(v for k, v in parts.items() if k not in self.LAYER_PARTS and k not in ("lm_head", "pipeline_send"))
        layers = self.model.num_layers
        times = [layered * count / layers for count in self.stage_layers]
        times[0] += fixed
        times[-1] += parts["lm_head"] + gather
        return times, parts["pipeline_send"] / (n - 1)

    def fused(self, s: StepShape) -> bool:
        """Whether the runner takes its fused decode path for this step (never for a mixture of
        experts: the native call has no router)."""
        return (s.decode_seqs + s.chained_seqs == s.num_seqs and s.num_tokens <= self.params.fused_rows
                and not self.model.num_experts)

    def matrix_path(self, s: StepShape) -> bool:
        """Whether the step's linear layers take the matrix-matrix path (more rows than the
        skinny kernel takes), which pays `gemm_overhead_s`."""
        return s.num_tokens > self.params.skinny_rows

    def step_time(self, s: StepShape) -> float:
        return sum(self.breakdown(s).values())

    def runner_time(self, s: StepShape) -> float:
        """The runner's part of the step's price: `step_time` less the host's time between
        steps, what a timed `runner.execute` measures."""
        return self.step_time(s) - (self.params.host_s if s.num_tokens > 0 else 0.0)
