"""The simulated engine: the real `Engine`, `Scheduler` and `BlockManager` on a virtual clock,
with a `SimRunner` that returns each step's duration from a cost model instead of computing it.

Nothing here imports torch or a model. A request ends where the workload says: bench requests
carry `max_tokens=output_len, ignore_eos=True`, and the runner samples a token that is not EOS;
with `--max-tokens-factor` they ask for more and stop on `SIM_STOP_TOKEN` at their length.

Speculative decoding runs with the real scheduler and proposer, but the runner has no model to
agree or disagree with the drafts: it accepts each draft with a given probability
(`acceptance_rate`, independently per position, the model of Leviathan et al. 2023), keeping
them up to the first rejection. A token tree's (`speculative_token_tree`) walk draws, at each
depth, where the model's token sits among the drafter's ranked candidates: the top one with
`acceptance_rate`, the rank-r one with `rank_acceptance[r - 1]`, none with what is left; the
child of that rank, if the tree has it, is kept. (With every sampled token the same, prompt lookup drafts the
full `num_speculative_tokens` from a request's third token on.) With a draft model
(`speculative_model`, a catalog name or config.json), the engine's real drafter runs the
draft's steps on a second runner over the draft's cost model, and a step's time is its draft
steps' and its own.

Pipeline parallelism (`pipeline_parallel_size` p) runs as vLLM's V1 engine does: one
scheduler, up to p batches in flight through p stages of consecutive layers. A batch enters the
first stage once it is free, passes each stage when that stage is free (`stage_times`), and
its tokens come back when it leaves the last; until then its sequences sit out (their next
input is not known yet), while a prompt's next chunk may follow the one in flight.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.config import ConfigError, EngineConfig
from conveyor.core.block_manager import BlockManager, HybridLayout
from conveyor.core.disk_tier import MemoryDiskTier
from conveyor.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from conveyor.core.speculative import DynamicTree, TokenTree
from conveyor.engine import (
    CPU_DEFAULT_KV_BYTES,
    CUDA_RUNTIME_RESERVE,
    Engine,
    hybrid_layout_of,
    plan_cache,
)
from conveyor.runner.base import RunnerOutput
from conveyor.runner.drafter import GREEDY, Drafter
from conveyor.sim.cost import CostModel, CostParams, RooflineCostModel, StepShape
from conveyor.sim.hardware import Hardware
from conveyor.sim.models import ModelShape

DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


# What a simulated request that asks more max_tokens than its answer takes stops on (a stop token
# of its own: a simulated model need not name an EOS); never the token sampled otherwise (>= 1).
SIM_STOP_TOKEN = 0


class SimRunner:
    """The runner interface on a cost model: no tensors, a duration per step."""

    def __init__(self, cost_model: CostModel, token_id: int = 1, acceptance_rate: float | None = None,
                 seed: int = 0, rank_acceptance: Sequence[float] = ()) -> None:
        self.cost_model = cost_model
        self.token_id = token_id
        self.acceptance_rate = acceptance_rate  # speculative decoding: P(a draft is accepted)
        # A token tree's: P(the model's token is the drafter's rank-r candidate), r = 1, 2, ...
        self.rank_acceptance = tuple(rank_acceptance)
        self._rng = random.Random(seed)
        self.busy_s = 0.0  # total simulated compute time
        self.num_steps = 0
        self.idle_s = 0.0  # idle time since the last step that computed (the engine adds to it)
        self.chain_max_span = 0  # as ModelRunner's: spans of up to this many rows priced as chained decodes

    # Prefill/decode disaggregation: simulated K/V have a size, not contents.
    def read_kv(self, block_table: list[int], num_tokens: int, window_tables: Sequence[list[int]] = ()) -> None:
        return None

    def receive_kv(self, swap_table: list[int], data: None, window_tables: Sequence[list[int]] = (),
                   window_start: int = 0) -> None:
        return None

    def kv_mismatch(self, data: object) -> str | None:
        return None

    @property
    def window(self) -> int:
        """The model's sliding window (0: none), for the steps' shapes."""
        model = getattr(self.cost_model, "model", None)
        return model.sliding_window if model is not None else 0

    def kv_bytes(self, num_tokens: int) -> int:
        model, dtype_bytes = getattr(self.cost_model, "model", None), getattr(self.cost_model, "dtype_bytes", 2)
        return 0 if model is None else model.kv_bytes_per_token(dtype_bytes) * num_tokens

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        shape = StepShape.of(scheduler_output, self.window, self.chain_max_span)
        if shape.num_tokens:
            shape.idle_before_s, self.idle_s = self.idle_s, 0.0
        duration = self.cost_model.step_time(shape)
        self.busy_s += duration
        self.num_steps += 1
        return self.result(scheduler_output, duration)

    def result(self, scheduler_output: SchedulerOutput, duration: float) -> RunnerOutput:
        """The step's tokens (and accepted drafts), as if computed in `duration` seconds:
        `SIM_STOP_TOKEN` for the token that reaches a request's `extra["sim_output_len"]` (a
        request asking more `max_tokens` than its answer takes stops on it, `bench_params`),
        else a token that ends nothing."""
        tok = self.token_id
        sampled = {s.seq_id: tok for s in scheduler_output.scheduled if s.sample}
        for s in scheduler_output.scheduled:
            n = s.sampling_params.extra.get("sim_output_len")
            # (the token to sample's placeholder is counted in all_token_ids)
            if s.sample and isinstance(n, int) and len(s.all_token_ids) - s.prompt_len >= n:
                sampled[s.seq_id] = SIM_STOP_TOKEN
        out = RunnerOutput(sampled=sampled, duration_s=duration)
        if self.acceptance_rate is not None:
            rate, draw = self.acceptance_rate, self._rng.random
            for item in scheduler_output.scheduled:
                kept = 0
                if item.tree is None:
                    while kept < item.num_draft and draw() < rate:
                        kept += 1
                else:
                    kept = self._walk(item.tree, item.num_draft)
                if kept:
                    out.accepted[item.seq_id] = [(tok, None)] * kept
        return out

    def _walk(self, tree: Any, num_nodes: int) -> int:
        """How deep a token tree's first `num_nodes` nodes are kept: at each depth the model's
        token is the rank-r candidate with the rate of that rank (or none), and the walk goes on
        while the tree has that child."""
        assert self.acceptance_rate is not None
        rates = (self.acceptance_rate, *self.rank_acceptance)
        node, depth = 0, 0
        while True:
            u, rank = self._rng.random(), 0
            while rank < len(rates) and u >= rates[rank]:
                u -= rates[rank]
                rank += 1
            if rank == len(rates):  # the model's token is none of the ranked candidates
                return depth
            child = next((c for c in tree.children[node] if c <= num_nodes and tree.paths[c - 1][-1] == rank), 0)
            if not child:
                return depth
            node, depth = child, depth + 1


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class SimEngine(Engine):
    """`Engine` whose clock moves only by simulated step times and waits."""

    clock: VirtualClock

    def wait_until(self, t: float) -> None:
        if t > self.clock.now:
            self.runner.idle_s += t - self.clock.now  # type: ignore[attr-defined]
            self.clock.now = t

    def _idle(self, wake_at: float | None) -> None:
        # Nothing schedulable (a dynamic batch's window is open): jump to when something is.
        self.wait_until(wake_at if wake_at is not None else self.clock.now + 1e-3)

    def _after_run(self, start: float, run_out: RunnerOutput) -> float:
        drafts = self.drafter.last_duration_s if self.drafter is not None else 0.0
        self.clock.now = start + drafts + run_out.duration_s
        return self.clock.now

    @property
    def runner_busy_s(self) -> float:
        drafts = self.drafter.runner.busy_s if self.drafter is not None else 0.0  # type: ignore[attr-defined]
        return self.runner.busy_s + drafts  # type: ignore[attr-defined]


@dataclass(slots=True)
class _Batch:
    scheduled: SchedulerOutput
    output: RunnerOutput
    start: float
    done: float  # when it leaves the last stage


class PipelineSimEngine(SimEngine):
    """`SimEngine` over `cost_model.stage_times`' stages, with up to one batch a stage in
    flight. Each `step()` launches a batch if the first stage is free and the scheduler has
    one, else lands the earliest batch (its outputs, at the time it leaves the last stage), or
    moves the clock to when the first stage frees (so arrivals until then join the next one).
    A step's recorded time is its batch's way through the pipeline."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.depth = len(self.runner.cost_model.stage_layers)  # type: ignore[attr-defined]
        self._stage_free = [0.0] * self.depth  # when each stage finishes its last batch
        self._pipe: deque[_Batch] = deque()
        self.scheduler.pipeline_depth = self.depth

    def has_unfinished_requests(self) -> bool:
        return bool(self._pipe) or super().has_unfinished_requests()

    def step(self) -> list[Any]:
        if self._incoming:
            self._admit_incoming()
        outputs = self._step_pipelined()
        return self._merge(outputs) if self._child_of else outputs

    def _step_pipelined(self) -> list[Any]:
        while True:
            now = self.clock.now
            if len(self._pipe) < self.depth and self._stage_free[0] <= now:
                sched_out = self.scheduler.schedule(now)
                if not sched_out.is_empty:
                    self._launch(sched_out, now)
                    continue
                self._nothing_to_run(sched_out, now, idle=not self._pipe)
                return self._land() if self._pipe else []
            if len(self._pipe) == self.depth or self._pipe[0].done <= self._stage_free[0]:
                return self._land()
            self.wait_until(self._stage_free[0])  # the first stage frees before a batch lands
            return []

    def _launch(self, sched_out: SchedulerOutput, start: float) -> None:
        runner = self.runner
        times, send = runner.cost_model.stage_times(StepShape.of(sched_out, runner.window, runner.chain_max_span))  # type: ignore[attr-defined]
        free = self._stage_free
        ready = start
        for k, seconds in enumerate(times):
            free[k] = max(ready, free[k]) + seconds
            ready = free[k] + (send if k + 1 < len(times) else 0.0)  # when the next stage has the activations
        runner.busy_s += sum(times)  # type: ignore[attr-defined]
        runner.num_steps += 1  # type: ignore[attr-defined]
        self._pipe.append(_Batch(sched_out, runner.result(sched_out, ready - start), start, ready))  # type: ignore[attr-defined]

    def _land(self) -> list[Any]:
        batch = self._pipe.popleft()
        self.clock.now = max(self.clock.now, batch.done)
        return self._complete(batch.scheduled, batch.output, batch.start, self.clock.now)


def dtype_bytes_of(config: EngineConfig, hardware: Hardware) -> int:
    name = config.model.dtype
    return hardware.dtype_bytes if name == "auto" else DTYPE_BYTES[name]


def kv_budget(config: EngineConfig, hardware: Hardware, model: ModelShape, dtype_bytes: int,
              draft: ModelShape | None = None) -> int:
    """The KV bytes the real engine would take on one device by default: on a GPU, memory x
    gpu_memory_utilization - its share of the weights (the draft model's too) - a 1 GiB runtime
    reserve (as `Engine.from_config`); on a CPU, the engine's fixed default."""
    if not hardware.is_gpu:
        return CPU_DEFAULT_KV_BYTES
    budget = int(hardware.memory_bytes * config.cache.gpu_memory_utilization)
    return max(budget - device_weight_bytes(config, model, dtype_bytes, draft) - CUDA_RUNTIME_RESERVE, 0)


def stage_share(config: EngineConfig, model: ModelShape) -> float:
    """The share of the layers the fullest pipeline stage holds (1 without pipeline
    parallelism): the first stages take one layer more where the count does not divide."""
    p = config.model.pipeline_parallel_size
    return -(-model.num_layers // p) / model.num_layers


def device_weight_bytes(config: EngineConfig, model: ModelShape, dtype_bytes: int,
                        draft: ModelShape | None = None) -> int:
    """The weights one device holds: 1/n of the model's (and its draft's) under tensor
    parallelism, and its stage's share of them under pipeline parallelism (the fullest's)."""
    layer_bytes = 1 if config.model.quantization == "fp8" else None
    expert_bytes = expert_weight_bytes(config, model)
    mtp = config.scheduler.speculative_method == "mtp"
    draft_layer_bytes = layer_bytes if mtp else None
    weights = model.weight_bytes(dtype_bytes, layer_bytes, expert_bytes) + (
        draft.weight_bytes(dtype_bytes, draft_layer_bytes, expert_bytes if mtp else None) if draft else 0)
    if config.scheduler.speculative_method == "medusa":
        weights += medusa_params(config, model) * dtype_bytes
    n = config.model.tensor_parallel_size
    if config.model.enable_dp_attention:  # everything whole but the routed experts, 1/n of them each
        each = expert_bytes if expert_bytes is not None else layer_bytes or dtype_bytes
        experts = model.num_sparse_layers * model.num_experts * model.expert_params * each
        return math.ceil(weights - experts + experts / n)
    return math.ceil(weights * stage_share(config, model) / n)


def medusa_params(config: EngineConfig, model: ModelShape) -> int:
    """Medusa heads as the simulator assumes them: `num_speculative_tokens` heads (a token tree's
    depth) of one residual block (hidden x hidden and a bias, FasterDecoding's default) and an LM
    head over the model's vocabulary each."""
    h = model.hidden_size
    tree = config.scheduler.speculative_token_tree
    heads = config.scheduler.num_speculative_tokens if tree is None else TokenTree.parse(tree).depth
    return heads * (h * h + h + model.vocab_size * h)


class TreeSimDrafter(Drafter):
    """An EAGLE head drafting token trees in the simulator, as `MTPDrafter` runs them: the round's
    first step as a chain's (the rows the head lacks, the root's last), then one step a depth
    with a row for each node that has children; every guess is the runner's token (the rank
    rates decide what is kept).

    A dynamic tree (`speculative_eagle_topk`, EAGLE-2's) is the one the rule grows when the
    head's confidence in each rank is that rank's rate (`DynamicTree.expected`): the shape it
    reaches on average, the same every round, with the rows a depth the drafter expands. What
    reshaping each round to the head's confidence gains over that is not modelled."""

    def __init__(self, runner: Any, dynamic: DynamicTree | None = None, rates: Sequence[float] = ()) -> None:
        super().__init__(runner)
        self.dynamic, self.rates = dynamic, tuple(rates)
        self._grown: dict[tuple[int, int], tuple[TokenTree, list[int]]] = {}

    def fill(self, scheduler_output: SchedulerOutput) -> None:
        drafting = [it for it in scheduler_output.scheduled if it.num_draft]
        expanded: dict[int, list[int]] = {}  # a dynamic tree's rows a depth, by item
        for it in drafting:
            if it.tree_depth and self.dynamic is not None:
                key = (it.tree_depth, it.num_draft)
                if key not in self._grown:
                    self._grown[key] = self.dynamic.expected(self.rates, *key)
                it.tree, expanded[it.seq_id] = self._grown[key]
        if not any(it.tree is not None for it in drafting):
            return super().fill(scheduler_output)
        self.forget(scheduler_output.finished_seq_ids)
        self.forget(scheduler_output.preempted_seq_ids)
        self.last_duration_s = 0.0
        batch = [self._first(it) for it in drafting]
        token = getattr(self.runner, "token_id", 1)
        depth = 0
        while batch:
            self.num_fed_tokens += sum(len(d.token_ids) for d in batch)
            self.last_duration_s += self.runner.execute(SchedulerOutput(scheduler_output.step_id, batch)).duration_s
            depth += 1
            batch = [ScheduledSequence(it.seq_id, [token], it.start_pos + depth, it.block_table, True, GREEDY,
                                       it.all_token_ids, it.prompt_len)
                     for it in drafting for _ in range(self._rows(it, depth, expanded))]
        for it in drafting:
            it.token_ids[1:] = [token] * it.num_draft
            self._fed[it.seq_id] = self._after(it, [token])  # (what the head holds: the known tokens)
        return None

    @staticmethod
    def _rows(it: ScheduledSequence, depth: int, expanded: dict[int, list[int]]) -> int:
        """The head's rows for `it` in the step at `depth`: its nodes there with children."""
        if it.seq_id in expanded:
            grown = expanded[it.seq_id]
            return grown[depth - 1] if depth <= len(grown) else 0
        if it.tree is None:
            return 0
        return sum(1 for k in range(1, it.num_draft + 1) if it.tree.depths[k] == depth
                   and any(c <= it.num_draft for c in it.tree.children[k]))


class MedusaSimDrafter:
    """Medusa heads in the simulator: a round is one pass over every head's weights for the
    drafting rows, priced as an LM head of `medusa_params / hidden` rows (the blocks' and the
    heads' weights read once, their products for each row) plus one step's overhead, as each
    step of a draft model or an EAGLE head pays it; every guess is the token the simulated
    runner samples (its acceptance rate decides what is kept)."""

    def __init__(self, cost: RooflineCostModel, token_id: int) -> None:
        self.cost = cost
        self.token_id = token_id
        self.runner = self  # (`SimEngine.runner_busy_s` reads `drafter.runner.busy_s`)
        self.busy_s = 0.0
        self.last_duration_s = 0.0
        self.num_fed_tokens = 0

    def fill(self, scheduler_output: SchedulerOutput) -> None:
        drafting = [it for it in scheduler_output.scheduled if it.num_draft]
        self.last_duration_s = 0.0
        if not drafting:
            return
        for it in drafting:
            it.token_ids[1:] = [self.token_id] * it.num_draft
        self.last_duration_s = self.cost.head_time(len(drafting)) + self.cost.params.step_overhead_s
        self.busy_s += self.last_duration_s
        self.num_fed_tokens += len(drafting)


MXFP4_BYTES = 4.25 / 8  # a 4-bit value, and an 8-bit scale a block of 32


def expert_weight_bytes(config: EngineConfig, model: ModelShape) -> float | None:
    """A routed expert weight's bytes under `quantization="mxfp4"` (None otherwise)."""
    if config.model.quantization != "mxfp4":
        return None
    if not model.num_experts:
        raise ConfigError(f"quantization='mxfp4' quantizes a mixture's routed experts (gpt-oss); "
                          f"{model.name} has none")
    return MXFP4_BYTES


def device_kv_bytes_per_token(config: EngineConfig, model: ModelShape, dtype_bytes: int,
                              draft: ModelShape | None = None) -> int:
    """A token's K/V on one device (its share of the KV heads under tensor parallelism, of
    the layers under pipeline parallelism)."""
    n = config.model.tensor_parallel_size
    if config.model.enable_dp_attention:  # a token's K/V whole, on the one device that runs it
        return model.kv_bytes_per_token(dtype_bytes)
    per_token = model.kv_bytes_per_token(dtype_bytes) * model.kv_share(n) * stage_share(config, model)
    if draft is not None:
        per_token += draft.kv_bytes_per_token(dtype_bytes) * draft.kv_share(n)
    return math.ceil(per_token)


def _draft_shape(config: EngineConfig, model: ModelShape) -> ModelShape | None:
    """The draft model of `speculative_method='draft_model'` (a catalog name or config.json), or
    DeepSeek-V3's MTP layer as one (`mtp`): one of the model's sparse layers with its own
    embeddings and head (its `eh_proj`, 2 hidden x hidden, left out: 0.1 B of V3's 11.7 B)."""
    if config.scheduler.speculative_method == "mtp":
        if not model.num_experts or model.shared_expert_gated:
            raise ConfigError(f"speculative_method='mtp' drafts with the multi-token-prediction layer of DeepSeek-V3 "
                              f"or GLM-4.5; {model.name} is not a DeepSeek-style mixture")
        return dataclasses.replace(model, name=f"{model.name}-mtp", num_layers=1, num_sparse_layers=1)
    if config.scheduler.speculative_method in ("eagle", "eagle3"):
        # An EAGLE head: one dense layer of the model's width with its own LM head (EAGLE-3's
        # over a draft vocabulary: 32,000 tokens in the published Llama-3 heads), its K/V in
        # the same blocks. Its fc (2 or 3 hidden x hidden) is left out, as MTP's eh_proj is.
        if model.kv_lora_rank:
            raise ConfigError(f"speculative_method={config.scheduler.speculative_method!r} drafts for a model with "
                              f"grouped-query attention; {model.name} has latent attention")
        vocab = min(model.vocab_size, 32000) if config.scheduler.speculative_method == "eagle3" else model.vocab_size
        return dataclasses.replace(model, name=f"{model.name}-{config.scheduler.speculative_method}", num_layers=1,
                                   num_experts=0, experts_per_token=0, expert_intermediate_size=0,
                                   shared_expert_intermediate_size=0, num_sparse_layers=0, sliding_window=0,
                                   num_sliding_layers=0, vocab_size=vocab,
                                   intermediate_size=model.intermediate_size or model.expert_intermediate_size)
    if config.scheduler.speculative_method != "draft_model":
        return None
    from conveyor.sim.models import get_model

    name = config.model.speculative_model
    if name is None:
        raise ConfigError("speculative_method='draft_model' needs a speculative_model (a catalog name or config.json)")
    try:
        draft = get_model(name)
    except ValueError as e:
        raise ConfigError(f"speculative_model: {e}") from None
    if draft.vocab_size != model.vocab_size:
        raise ConfigError(
            f"the speculative model's vocabulary ({draft.vocab_size} tokens) is not {model.name}'s "
            f"({model.vocab_size}): its guesses must be the model's tokens"
        )
    return draft


def _sim_disk(config: EngineConfig, model: ModelShape, b: int, num_offload: int) -> MemoryDiskTier | None:
    """KV offloading's disk tier in the simulator: its bookkeeping without files (the path is not
    used), its copies priced at the hardware's `disk_bandwidth` (an assumption)."""
    cc = config.cache
    if cc.kv_disk_path is None or not num_offload:
        return None
    block_bytes = model.kv_bytes_per_token(b) * cc.block_size
    if cc.kv_disk_size < block_bytes:
        raise ConfigError(f"kv_disk_size={cc.kv_disk_size} bytes holds no KV block of {block_bytes} bytes")
    return MemoryDiskTier(cc.kv_disk_size // block_bytes, block_bytes)


def build_sim_engine(
    config: EngineConfig,
    hardware: Hardware,
    model: ModelShape,
    params: CostParams | None = None,
    cost_model: CostModel | None = None,
    trace: bool = True,
    max_trace_steps: int | None = 100_000,
    acceptance_rate: float | None = None,
    seed: int = 0,
    pipeline_link_bandwidth: float | None = None,
    rank_acceptance: Sequence[float] = (),
) -> SimEngine:
    """A simulated engine for `config` (scheduler and cache sections as for a real one);
    `acceptance_rate` is the chance that a speculative draft is accepted (`seed` draws them);
    `rank_acceptance` a token tree's chances that the model's token is the drafter's candidate
    of rank 1, 2, ... (`SimRunner._walk`);
    `pipeline_link_bandwidth` (bytes/s) the link between pipeline stages (default: the
    devices' own)."""
    if config.scheduler.speculative_method is not None and acceptance_rate is None:
        raise ConfigError(
            "the simulator has no model to verify drafts: speculative decoding needs "
            "--spec-acceptance-rate (the probability that a draft is accepted)"
        )
    if acceptance_rate is not None and not 0 <= acceptance_rate <= 1:
        raise ConfigError(f"spec acceptance rate {acceptance_rate} must be in [0, 1]")
    tree = config.scheduler.speculative_token_tree
    dynamic = config.scheduler.speculative_eagle_topk
    if rank_acceptance and tree is None and dynamic is None:
        raise ConfigError("spec rank acceptance: the rates of lower-ranked candidates apply to a speculative_token_tree "
                          "or speculative_eagle_topk")
    if (tree is not None or dynamic is not None) and not rank_acceptance:
        raise ConfigError(f"{'speculative_token_tree' if tree is not None else 'speculative_eagle_topk'}: the "
                          "simulator needs how often the drafter's lower-ranked candidates are right: "
                          "--spec-rank-acceptance (one rate per rank after the first)")
    if rank_acceptance and (any(not 0 <= r <= 1 for r in rank_acceptance)
                            or (acceptance_rate or 0) + sum(rank_acceptance) > 1 + 1e-9):
        raise ConfigError(f"spec rank acceptance {list(rank_acceptance)}: each in [0, 1], and with the acceptance "
                          "rate at most 1 in all (the model's token is one candidate at most)")
    b = dtype_bytes_of(config, hardware)
    draft = _draft_shape(config, model)
    tp, pp = config.model.tensor_parallel_size, config.model.pipeline_parallel_size
    if pp > 1:
        if draft is not None or config.scheduler.speculative_method is not None:
            raise ConfigError("pipeline_parallel_size > 1 with speculative decoding is not modelled")
        if not pp <= model.num_layers:
            raise ConfigError(f"pipeline_parallel_size={pp}: {model.name} has {model.num_layers} layers to split")
        if cost_model is not None and not hasattr(cost_model, "stage_times"):
            raise ConfigError("pipeline_parallel_size > 1 needs a cost model that prices stages (stage_times)")
    dp = config.model.enable_dp_attention
    if dp:
        if tp < 2 or pp > 1 or draft is not None or config.scheduler.speculative_method == "medusa":
            raise ConfigError("enable_dp_attention needs tensor_parallel_size >= 2 (the devices of the group), "
                              "without pipeline parallelism or a draft model")
        if model.num_experts % tp:
            raise ConfigError(f"enable_dp_attention: {tp} devices must divide {model.name}'s {model.num_experts} "
                              "experts (each holds an equal share)")
    for shape in (model, draft) if tp > 1 and not dp else ():
        if shape is not None:
            try:
                shape.check_tensor_parallel(tp)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    weights = device_weight_bytes(config, model, b, draft)
    if hardware.is_gpu and weights > hardware.memory_bytes * config.cache.gpu_memory_utilization:
        raise ConfigError(
            f"{model.name}{' and its draft weigh' if draft else ' weighs'} {weights / 2**30:.1f} GiB in {b}-byte weights"
            f"{f' on each of {tp * pp} devices' if tp * pp > 1 else ''}, more than "
            f"{config.cache.gpu_memory_utilization:.0%} of {hardware.name}'s {hardware.memory_bytes / 2**30:.0f} GiB"
            f"{'' if tp * pp > 1 else ' (tensor_parallel_size or pipeline_parallel_size splits them across devices)'}"
        )
    layout = sim_hybrid_layout(config, model)
    block_share = 1.0 if layout is None else layout.page_layers / model.num_layers
    num_blocks, num_swap, max_len, num_offload = plan_cache(
        config, block_kv_bytes_per_token(config, model, b, draft, layout),
        min(model.max_position_embeddings, draft.max_position_embeddings if draft else model.max_position_embeddings),
        lambda: kv_budget(config, hardware, model, b, draft), layout=layout,
    )
    eos = frozenset(model.eos_token_ids)
    scheduler_config = config.scheduler
    if dp:  # the group's devices are one engine here: each seat, token and block a device's, n times
        # (the sequences spread evenly over them: `RooflineCostModel.local_shape`)
        num_blocks, num_swap, num_offload = num_blocks * tp, num_swap * tp, num_offload * tp
        scheduler_config = dataclasses.replace(scheduler_config, max_num_seqs=scheduler_config.max_num_seqs * tp,
                                               max_num_batched_tokens=scheduler_config.max_num_batched_tokens * tp)
    scheduler = Scheduler(scheduler_config, BlockManager(num_blocks, config.cache.block_size, num_swap,
                                                         config.cache.enable_prefix_caching, layout,
                                                         num_offload_blocks=num_offload,
                                                         offloading_policy=config.cache.kv_offloading_policy,
                                                         eviction_policy=config.cache.eviction_policy,
                                                         disk=_sim_disk(config, model, b, num_offload)),
                          max_len, eos)
    fp8 = config.model.quantization == "fp8"  # (int8, the CPU engine's, is in a calibration's fitted speeds)
    cost = cost_model or RooflineCostModel(hardware, model, params, b, config.cache.block_size, tp, pp,
                                           pipeline_link_bandwidth, dp_attention=dp, fp8=fp8,
                                           expert_bytes=expert_weight_bytes(config, model), block_share=block_share)
    token = next(t for t in range(1, model.vocab_size) if t not in eos)
    kind = PipelineSimEngine if pp > 1 else SimEngine
    engine = kind(config, scheduler, SimRunner(cost, token, acceptance_rate, seed, rank_acceptance), None, max_len,
                  model.vocab_size,
                  clock=VirtualClock(), trace=trace, max_trace_steps=max_trace_steps)
    if draft is not None:
        # (the MTP layer is in the checkpoint's format, FP8 too; a draft model at its own dtype)
        mtp = config.scheduler.speculative_method == "mtp"
        draft_runner = SimRunner(RooflineCostModel(hardware, draft, params, b, config.cache.block_size, tp,
                                                   fp8=fp8 and mtp), token)
        if config.scheduler.speculative_method == "draft_model":  # (a head is no model: no native call)
            draft_runner.chain_max_span = config.scheduler.num_speculative_tokens + 1
        if tree is not None or dynamic is not None:  # (a dynamic tree's shape: the scheduler's)
            engine.drafter = TreeSimDrafter(draft_runner, scheduler.dynamic_tree, (acceptance_rate or 0.0, *rank_acceptance))
        else:
            engine.drafter = Drafter(draft_runner)
    if config.scheduler.speculative_method == "medusa":
        heads = dataclasses.replace(model, name=f"{model.name}-medusa",
                                    vocab_size=medusa_params(config, model) // model.hidden_size)
        engine.drafter = MedusaSimDrafter(RooflineCostModel(hardware, heads, params, b, config.cache.block_size, tp),
                                          token)  # type: ignore[assignment]
    engine.hardware = hardware  # type: ignore[attr-defined]
    engine.model_shape = model  # type: ignore[attr-defined]
    engine.cost_model = cost  # type: ignore[attr-defined]
    engine.num_kv_blocks = num_blocks  # type: ignore[attr-defined]
    return engine


def block_kv_bytes_per_token(config: EngineConfig, model: ModelShape, dtype_bytes: int, draft: ModelShape | None,
                             layout: HybridLayout | None) -> int:
    """What a block holds a token of, on one device: `device_kv_bytes_per_token`, or a hybrid
    cache's page's: its layers' share of the model's, and the draft's whole (its cache spans
    every block id, as the engine's drafter's does)."""
    per_token = device_kv_bytes_per_token(config, model, dtype_bytes, draft)
    if layout is None:
        return per_token
    own = device_kv_bytes_per_token(config, model, dtype_bytes)
    return math.ceil(own * layout.page_layers / model.num_layers) + per_token - own


def sim_hybrid_layout(config: EngineConfig, model: ModelShape) -> HybridLayout | None:
    """The hybrid KV cache's layout for `model` (`hybrid_kv_cache`), as the engine's
    (`conveyor.engine.hybrid_layout`; under tensor parallelism each device holds its heads'
    share of every page)."""
    if not config.cache.hybrid_kv_cache:
        return None
    if config.model.pipeline_parallel_size > 1 or config.model.enable_dp_attention:
        raise ConfigError("hybrid_kv_cache is not modelled with pipeline parallelism or DP attention (a stage's "
                          "or a device's own layers and sequences)")
    return hybrid_layout_of(config, [model.sliding_window] * model.num_sliding_layers
                            + [0] * (model.num_layers - model.num_sliding_layers), f"{model.name}: ")


def describe_capacity(engine: Any) -> dict[str, Any]:
    """KV capacity facts of a simulated engine, for reports."""
    cfg = engine.config
    model, hw = engine.model_shape, engine.hardware
    b = dtype_bytes_of(cfg, hw)
    blocks = engine.num_kv_blocks
    draft = _draft_shape(cfg, model)  # its weights and K/V count too
    weights = device_weight_bytes(cfg, model, b, draft)  # (one device's, as the KV figures below)
    per_token = device_kv_bytes_per_token(cfg, model, b, draft)
    if cfg.model.enable_dp_attention:  # one engine holds the group's blocks: a device's share
        blocks //= cfg.model.tensor_parallel_size
    layout = engine.scheduler.block_manager.layout
    # A hybrid cache's block holds its `page_layers` layers' K/V: its tokens are pages x block
    # size, each sequence's spread over its tables.
    page = block_kv_bytes_per_token(cfg, model, b, draft, layout)
    return {
        "hardware": hw.name,
        "model": model.name,
        "tensor_parallel_size": cfg.model.tensor_parallel_size,
        "enable_dp_attention": cfg.model.enable_dp_attention,
        "pipeline_parallel_size": cfg.model.pipeline_parallel_size,
        "dtype_bytes": b,
        "weight_gib": weights / 2**30,
        "kv_bytes_per_token": per_token,
        "kv_blocks": blocks,
        "kv_tokens": blocks * cfg.cache.block_size,
        "kv_gib": blocks * cfg.cache.block_size * page / 2**30,
        "hybrid_kv_cache": None if layout is None else {
            "window": layout.window, "page_layers": layout.page_layers,
            "num_window_groups": layout.num_window_groups},
        "max_model_len": engine.max_model_len,
        # KV offloading's host tier (its blocks hold what a device block does)
        "offload_tokens": engine.scheduler.block_manager.num_offload_blocks * cfg.cache.block_size,
        # ... and its disk tier (bookkeeping only in the simulator)
        "disk_tokens": (0 if (disk := engine.scheduler.block_manager.disk) is None
                        else disk.num_blocks * cfg.cache.block_size),
    }
