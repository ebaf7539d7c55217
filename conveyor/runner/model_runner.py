"""Runs the real model over one `SchedulerOutput`.

The step's sequences are ordered decodes first, then prefills, and flattened into one token
batch; attention metadata is built once and shared by every layer; the LM head runs only on
each sampling sequence's last row.
"""

from __future__ import annotations

import time

import torch

from conveyor.core.scheduler import ScheduledSequence, SchedulerOutput
from conveyor.models.attention import build_metadata
from conveyor.models.llama import LlamaForCausalLM
from conveyor.runner.base import RunnerOutput
from conveyor.runner.sampler import Sampler, prepare


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        num_swap_blocks: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.sliding_window = arch.sliding_window
        slots = num_blocks * block_size
        # Zeroed, not just allocated: attention reads whole blocks and hides the unused slots
        # with a zero weight, and 0 * NaN from uninitialised memory would still be NaN.
        self.kv_caches = [
            torch.zeros((2, slots, arch.num_kv_heads, arch.head_dim), dtype=self.kv_dtype, device=device)
            for _ in range(arch.num_layers)
        ]
        # CPU swap space, same layout (pinned on CUDA so copies can be asynchronous).
        pin = device.type == "cuda"
        self.swap_caches = [
            torch.zeros(
                (2, num_swap_blocks * block_size, arch.num_kv_heads, arch.head_dim),
                dtype=self.kv_dtype, pin_memory=pin,
            )
            for _ in range(arch.num_layers if num_swap_blocks else 0)
        ]
        self.sampler = Sampler(seed, device)
        self._generators: dict[int, torch.Generator] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def _generator(self, item: ScheduledSequence) -> torch.Generator | None:
        seed = item.sampling_params.seed
        if seed is None or item.sampling_params.greedy:
            return None
        g = self._generators.get(item.seq_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[item.seq_id] = g
        return g

    def _copy_blocks(
        self, src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]
    ) -> None:
        bs = self.block_size
        src_ids = torch.tensor([a for a, _ in pairs], dtype=torch.long)
        dst_ids = torch.tensor([b for _, b in pairs], dtype=torch.long)
        for s, d in zip(src, dst, strict=True):
            sv = s.view(2, -1, bs, *s.shape[2:])
            dv = d.view(2, -1, bs, *d.shape[2:])
            dv[:, dst_ids.to(dv.device)] = sv[:, src_ids.to(sv.device)].to(dv.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        for seq_id in scheduler_output.finished_seq_ids:
            self._generators.pop(seq_id, None)
        # All swap-outs first: their device blocks may be handed to others in this very step.
        if scheduler_output.blocks_to_swap_out:
            self._copy_blocks(self.kv_caches, self.swap_caches, scheduler_output.blocks_to_swap_out)
        if scheduler_output.blocks_to_swap_in:
            self._copy_blocks(self.swap_caches, self.kv_caches, scheduler_output.blocks_to_swap_in)
        items = sorted(scheduler_output.scheduled, key=lambda s: len(s.token_ids) > 1)
        if not items:
            return RunnerOutput(sampled={}, duration_s=0.0)

        token_ids: list[int] = []
        for it in items:
            token_ids.extend(it.token_ids)
        num_new = [len(it.token_ids) for it in items]
        meta = build_metadata(
            [it.block_table for it in items],
            [it.start_pos for it in items],
            num_new,
            self.block_size,
            self.device,
            self.sliding_window,
            self.dtype,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)

        rows: list[int] = []
        samplers: list[ScheduledSequence] = []
        end = 0
        for it, n in zip(items, num_new, strict=True):
            end += n
            if it.sample:
                rows.append(end - 1)
                samplers.append(it)
        output = RunnerOutput(sampled={})
        if samplers:
            picked = hidden if len(rows) == hidden.shape[0] else hidden[rows]  # decode steps: every row, in order
            logits = self.model.compute_logits(picked).float()
            batch = prepare(
                [it.sampling_params for it in samplers],
                [self._generator(it) for it in samplers],
                [it.all_token_ids for it in samplers],
                [it.prompt_len for it in samplers],
            )
            tokens, logprobs = self.sampler(logits, batch)
            output.sampled = {it.seq_id: tok for it, tok in zip(samplers, tokens, strict=True)}
            if logprobs is not None:
                output.logprobs = {
                    it.seq_id: lp
                    for it, lp in zip(samplers, logprobs, strict=True)
                    if it.sampling_params.logprobs is not None
                }
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        output.duration_s = time.perf_counter() - start
        return output
