"""Runs the real model over one `SchedulerOutput`.

The step's sequences are ordered decodes first, then prefills, and flattened into one token
batch; attention metadata is built once and shared by every layer; the LM head runs only on
each sampling sequence's last row.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from conveyor.core.block_manager import HybridLayout
from conveyor.core.scheduler import ScheduledSequence, SchedulerOutput
from conveyor.logits_process import LogitsProcessor, LogitsRow
from conveyor.models.attention import (
    CrossMetadata,
    HostBlockTables,
    build_metadata,
    chain_decodes,
    host_longs,
    open_ranges,
    to_device,
)
from conveyor.models.llama import LlamaForCausalLM
from conveyor.models.lora import LoRAManager
from conveyor.runner.base import PromptLogprob, RunnerOutput
from conveyor.runner.cuda_graphs import GraphedDecode
from conveyor.runner.sampler import Sampler, SamplingBatch, TopLogprobs, prepare
from conveyor.runner.tensor_parallel import Step, TensorParallelGroup, split_logits, splits_head
from conveyor.sequence import PLACEHOLDER
from conveyor.structured.grammar import Grammar, GrammarCache, PushdownGrammar

if TYPE_CHECKING:
    from conveyor.core.disk_tier import DiskTier
    from conveyor.runner.mtp import HiddenStore


class StepHandle:
    """One launched step. `result()` waits for it and returns its `RunnerOutput`; on CUDA the
    sampled ids come to the host through pinned memory after an event, the step's one sync."""

    def __init__(self, output: RunnerOutput, start: float, cuda: bool,
                 seq_ids: list[int] | None = None, tokens: torch.Tensor | None = None) -> None:
        self.output = output
        self._start = start
        self._seq_ids = seq_ids
        self._host = tokens
        self._event = None
        if cuda:
            if tokens is not None:
                self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # computed already: the step's time is known now
            output.duration_s = time.perf_counter() - start
            if tokens is not None:  # a graphed step's buffer, which the next step overwrites
                self._host = tokens.clone()

    def result(self) -> RunnerOutput:
        if self._event is not None:
            self._event.synchronize()
            self.output.duration_s = time.perf_counter() - self._start  # launch to done
            self._event = None
        if self._seq_ids is not None:
            assert self._host is not None
            self.output.sampled.update(zip(self._seq_ids, self._host.tolist(), strict=True))
            self._seq_ids = self._host = None
        return self.output


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
        max_model_len: int | None = None,
        cuda_graph_max_batch: int = 0,
        layout: HybridLayout | None = None,
    ) -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.sliding_window = arch.sliding_window
        # One block more than the scheduler hands out: the scratch block that padded rows of a
        # graphed decode step write to and read from (`GraphedDecode`).
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        # Zeroed, not just allocated: attention reads whole blocks and hides the unused slots
        # with a zero weight, and 0 * NaN from uninitialised memory would still be NaN.
        layers = 0 if arch.is_encoder else arch.num_layers  # (an encoder keeps no K/V)
        # A hybrid cache (`HybridLayout`): `page_layers` tensors, each layer reading and writing
        # one of them (its slot) through its group's tables; the scratch block is the null one.
        self.layout = layout
        self.layer_groups = [0] * layers  # each layer's table: the block table's, or its sliding group's
        if layout is not None:
            placed = layout.groups_of([arch.window_of(i) for i in range(layers)])
            self.layer_groups = [g for g, _ in placed]
            layers = layout.page_layers
        self.kv_pages = [
            torch.zeros((2, slots, *arch.kv_cache_shape), dtype=self.kv_dtype, device=device)
            for _ in range(layers)
        ]
        # CPU swap space, same layout (pinned on CUDA so copies can be asynchronous).
        pin = device.type == "cuda"
        self.swap_pages = [
            torch.zeros(
                (2, num_swap_blocks * block_size, *arch.kv_cache_shape),
                dtype=self.kv_dtype, pin_memory=pin,
            )
            for _ in range(layers if num_swap_blocks else 0)
        ]
        # Each layer's cache (a page slot's, shared by a slot's layers, in a hybrid cache).
        self.kv_caches = self.kv_pages if layout is None else [self.kv_pages[i] for _, i in placed]
        self.swap_caches = self.swap_pages if layout is None else [
            self.swap_pages[i] for _, i in placed] if num_swap_blocks else []
        # The sliding groups' tables as int64 arrays (`host_tables`'s, a group each).
        self.window_host_tables = [HostBlockTables() for _ in range(layout.num_window_groups if layout else 0)]
        self.sampler = Sampler(seed, device)
        self.hidden_size = arch.hidden_size  # an embedding's length (SamplingParams.pooling)
        # A sentence-transformers model's Dense modules, applied to a pooled embedding in order
        # (conveyor/models/loader.py; set by the engine, with `hidden_size` their output's).
        self.pool_dense: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self.token_heads: Any = None  # BGE-M3's (conveyor/models/loader.py `TokenHeads`), if the model has them
        # speculative_method="mtp", "eagle" or "eagle3": each sequence's hidden states (or the
        # streams its EAGLE-3 head reads), kept for the drafter.
        self.hidden_store: HiddenStore | None = None
        self._generators: dict[int, torch.Generator] = {}
        # Embedding requests pooling every prompt position ("mean"): the sum of their rows so
        # far ("max": their maximum), over the chunks of their prompt (restarted when a prompt
        # is computed again).
        self._pool_sums: dict[int, torch.Tensor] = {}
        self._image_cache: dict[int, dict[int, torch.Tensor]] = {}  # images' embeddings, by sequence and image
        self._encoder_decoder = bool(getattr(model, "encoder_decoder", False))
        # ... and across requests, by the image's digest, up to `encoder_cache_tokens` rows
        self._encoded: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._encoded_rows = 0
        self.encoder_cache_tokens = 0
        self.images_encoded = 0  # images through the tower (the others came from `_encoded`)
        # Structured outputs: the engine's grammars (None: it has no tokenizer), and where
        # each constrained sequence stands in its grammar.
        self.grammars: GrammarCache | None = None
        self._guides: dict[int, _Guide] = {}
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(arch.eos_token_ids))  # what min_tokens holds back
        # bad_words -> the token sequences that spell them (the engine's tokenizer, cached)
        self.word_token_ids: Callable[[tuple[str, ...]], tuple[tuple[int, ...], ...]] | None = None
        self.host_tables = HostBlockTables()  # running sequences' block tables as int64 arrays
        # Spans of up to this many tokens may run as one-token decodes side by side (`_chains`;
        # a draft model's runner: the tokens it catches up on at a round's start).
        self.chain_max_span = 0
        self.keep_logits = False  # (a draft model's runner: each step's logits rows in its output)
        self.logits_processors: list[LogitsProcessor] = []  # the engine's own (conveyor/logits_process.py)
        self.logprobs_mode = "raw_logprobs"  # what logprobs hold (the engine's logprobs_mode)
        self.chain_steps = os.environ.get("CONVEYOR_CHAINED_DECODE", "1") != "0"  # (off: spans as modules)
        # The last submitted step's sampled ids (on the device) and each sequence's row in
        # them: where a decode of a pending token (async scheduling) reads its input.
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[int, int] = {}
        self._last_handle: StepHandle | None = None
        self.lora: LoRAManager | None = None  # the adapters (enable_lora; set by the engine)
        # Tensor parallelism: the other ranks, which run each step's swaps and forward pass
        # over their shards (conveyor/runner/tensor_parallel.py; set by the engine).
        self.peers: TensorParallelGroup | None = None
        self.disk: DiskTier | None = None  # KV offloading's disk tier (`_disk_copies`)
        self.graphs: GraphedDecode | None = None
        self._graph_args = (-(-(max_model_len or arch.max_position_embeddings) // block_size), cuda_graph_max_batch)
        if cuda_graph_max_batch and device.type == "cuda":
            self.graphs = self.capture_graphs()

    def release_kv(self) -> None:
        """Give the KV cache's memory back (sleep mode): every page and swap tensor keeps its shape
        over an empty storage until `restore_kv` (its contents are gone)."""
        tensors = [*self.kv_pages, *self.swap_pages]
        self._kv_nbytes = [t.untyped_storage().nbytes() for t in tensors]
        for t in tensors:
            t.untyped_storage().resize_(0)
        self._had_graphs = self.graphs is not None
        self.graphs = None  # (they read the memory given back)

    def restore_kv(self) -> None:
        """The KV cache's memory again, zeroed (as first allocated); CUDA graphs captured again."""
        for t, n in zip([*self.kv_pages, *self.swap_pages], self._kv_nbytes, strict=True):
            t.untyped_storage().resize_(n)
            t.zero_()
        if getattr(self, "_had_graphs", False):
            self.graphs = self.capture_graphs()

    def capture_graphs(self) -> GraphedDecode:
        """CUDA graphs of this runner's model's decode steps (captured again when the model is
        replaced: `Engine.update_weights_from_disk`)."""
        max_blocks, max_batch = self._graph_args
        return GraphedDecode(self.model, self.kv_caches, self.block_size, max_blocks, self.scratch_block, max_batch,
                             greedy=self.sampler.greedy, **self.graph_layout())

    def _chains(self, items: list[ScheduledSequence], num_new: list[int], bare: bool) -> bool:
        """Whether this step's few-token spans run as one-token decodes side by side
        (`chain_decodes`): where that puts the whole step in the native decode call (CPU
        float32), which would otherwise run the layers as modules. The spans are a speculative
        step's guesses to verify, or spans of at most `chain_max_span` tokens (a draft model's
        first step of a round)."""
        fused = getattr(self.model, "fused_decode", None)
        if (fused is None or not self.chain_steps or not bare or self.layout is not None or self.peers is not None
                or not fused.applies(sum(num_new), None, self.kv_dtype)):
            return False
        return all(n == 1 or it.num_draft or n <= self.chain_max_span for it, n in zip(items, num_new, strict=True))

    def graph_layout(self) -> dict[str, Any]:
        """What `GraphedDecode` needs of a hybrid cache: each layer's table, the sliding window."""
        if self.layout is None:
            return {}
        return {"layer_groups": self.layer_groups, "window": self.layout.window}

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_pages)

    def _generator(self, item: ScheduledSequence) -> torch.Generator | None:
        seed = item.sampling_params.seed
        if seed is None or item.sampling_params.greedy:
            return None
        g = self._generators.get(item.seq_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            # A request resumed with outputs (its engine died) draws on where it stood: one
            # row of noise a sampled token, as the sampler draws them.
            ids, done = item.all_token_ids, len(item.all_token_ids)
            while done > item.prompt_len and ids[done - 1] == PLACEHOLDER:  # this step's own
                done -= 1
            for _ in range(done - item.prompt_len):
                torch.empty(self.model.arch.vocab_size, device=self.device).exponential_(generator=g)
            self._generators[item.seq_id] = g
        return g

    def hybrid_metadata(self, meta: Any, window_tables: list[Any], starts: list[int], num_new: list[int]) -> None:
        """A hybrid cache's step: each sliding group's metadata from its tables (slots, and the
        window's masks), and every layer's (`AttentionMetadata.layer_metas`)."""
        assert self.layout is not None
        groups = [meta] + [build_metadata(tables, starts, num_new, self.block_size, self.device, self.layout.window,
                                          self.dtype) for tables in window_tables]
        meta.layer_metas = [groups[g] for g in self.layer_groups]

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

    def _disk_copies(self, writes: list[tuple[int, bytes]], reads: list[tuple[bytes, int]]) -> None:
        """KV offloading's disk tier (`self.disk`): write the tier blocks the step's stores just
        filled, and read blocks into the tier blocks its loads copy from; a file holds a block's
        K/V of every layer, `[layers, 2, block_size, kv_heads, head_dim]`, as raw bytes."""
        disk = self.disk
        assert disk is not None, "disk copies without a disk tier"
        if self.device.type == "cuda":  # the stores' device-to-host copies land first
            torch.cuda.current_stream().synchronize()
        bs = self.block_size
        for tier, h in writes:
            block = torch.stack([p[:, tier * bs:(tier + 1) * bs] for p in self.swap_pages])
            disk.write(h, memoryview(block.view(torch.uint8).numpy().data).cast("B"))
        if reads:
            shape = (len(self.swap_pages), 2, bs, *self.swap_pages[0].shape[2:])
            buf = torch.empty(shape, dtype=self.kv_dtype)
            view = memoryview(buf.view(torch.uint8).numpy().data).cast("B")
            for h, tier in reads:
                disk.take_read(h, view)
                for p, layer in zip(self.swap_pages, buf, strict=True):
                    p[:, tier * bs:(tier + 1) * bs] = layer

    def _slots(self, table: list[int], num_tokens: int) -> torch.Tensor:
        bs = self.block_size
        pos = torch.arange(num_tokens)
        return torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs

    @torch.inference_mode()
    def read_kv(self, block_table: list[int], num_tokens: int, window_tables: Sequence[list[int]] = ()) -> torch.Tensor:
        """The K/V of a sequence's first `num_tokens` tokens, `[layers, 2, tokens, kv_heads,
        head_dim]` on the CPU (prefill/decode disaggregation: conveyor/kv_transfer.py). A
        hybrid cache's sliding layers read their group's table: zeros where it released the
        blocks, which no query of theirs reads again."""
        self._whole_kv()
        slots = [self._slots(t, num_tokens).to(self.device) for t in (block_table, *window_tables)]
        return torch.stack([cache[:, slots[g]] for cache, g in zip(self.kv_caches, self.layer_groups, strict=True)]).cpu()

    @torch.inference_mode()
    def receive_kv(self, swap_table: list[int], data: torch.Tensor, window_tables: Sequence[list[int]] = (),
                   window_start: int = 0) -> None:
        """Write handed-over K/V (`read_kv`'s layout, any float dtype) into swap blocks, from
        where the scheduler's swap-in brings them onto the device. A hybrid cache's sliding
        layers keep the blocks from `window_start` on (`BlockManager.receive`)."""
        self._whole_kv()
        n = data.shape[2]
        first = [window_start * self.block_size if self.layout is not None and self.layout.all_sliding else 0]
        first += [window_start * self.block_size] * len(window_tables)
        slots = [self._slots(t, n)[f:] for t, f in zip((swap_table, *window_tables), first, strict=True)]
        if self.device.type == "cuda":  # a swap-in still copying out of these pinned blocks
            torch.cuda.current_stream(self.device).synchronize()
        for cache, layer, g in zip(self.swap_caches, data, self.layer_groups, strict=True):
            cache[:, slots[g]] = layer[:, first[g]:].to(cache.dtype)

    def kv_bytes(self, num_tokens: int) -> int:
        return self.model.arch.kv_bytes_per_token(self.kv_caches[0].element_size()) * num_tokens

    def _whole_kv(self) -> None:
        if self.peers is not None:
            raise RuntimeError("a tensor-parallel engine's K/V lie across its ranks: it hands none over")

    def kv_mismatch(self, data: torch.Tensor) -> str | None:
        if self.peers is not None:
            return "this engine is tensor-parallel: its K/V lie across its ranks, and it takes none handed over"
        arch = self.model.arch
        want = (arch.num_layers, 2, *arch.kv_cache_shape)
        got = (*data.shape[:2], *data.shape[3:]) if isinstance(data, torch.Tensor) and data.dim() == 5 else None
        if got != want or not data.is_floating_point():
            shape = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
            return f"K/V of shape {shape} do not fit this model ([{want[0]}, 2, tokens, {want[2]}, {want[3]}])"
        return None

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.submit(scheduler_output).result()

    @torch.inference_mode()
    def submit(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch one step and return at once; `result()` waits for its tokens.

        On CUDA the kernels run asynchronously: the engine schedules and launches the next step
        before it asks for this one's tokens (async scheduling). A decode of a token that is
        still pending (`PLACEHOLDER`) takes its input from the previous step's sampled ids,
        on the device. On CPU the step is computed here, before this returns."""
        start = time.perf_counter()
        for seq_id in scheduler_output.finished_seq_ids:
            if self.hidden_store is not None:
                self.hidden_store.drop(seq_id)
            self._generators.pop(seq_id, None)
            self._guides.pop(seq_id, None)
            self._pool_sums.pop(seq_id, None)
            self._image_cache.pop(seq_id, None)
            self.host_tables.drop(seq_id)
            for group in self.window_host_tables:
                group.drop(seq_id)
        peers = self.peers
        # KV offloading's stores and loads are copies to and from the same host pool.
        swap_out, swap_in = scheduler_output.blocks_to_swap_out, scheduler_output.blocks_to_swap_in
        if scheduler_output.blocks_to_store or scheduler_output.blocks_to_load:
            swap_out, swap_in = swap_out + scheduler_output.blocks_to_store, swap_in + scheduler_output.blocks_to_load
        if peers is not None and (swap_out or swap_in):
            peers.send(Step(swap_out=swap_out, swap_in=swap_in))
        # All swap-outs first: their device blocks may be handed to others in this very step.
        if swap_out:
            self._copy_blocks(self.kv_pages, self.swap_pages, swap_out)
        if scheduler_output.disk_writes or scheduler_output.disk_reads:
            self._disk_copies(scheduler_output.disk_writes, scheduler_output.disk_reads)
        if swap_in:
            self._copy_blocks(self.swap_pages, self.kv_pages, swap_in)
        cuda = self.device.type == "cuda"
        items = scheduler_output.scheduled
        if not items:
            return StepHandle(RunnerOutput(sampled={}), start, cuda)
        num_new = [len(it.token_ids) for it in items]
        all_decodes = max(num_new) == 1  # the common step, already in order
        if not all_decodes:
            items = sorted(items, key=lambda s: len(s.token_ids) > 1)
            num_new = [len(it.token_ids) for it in items]

        token_ids: list[int] = []
        pending_rows: list[int] = []  # rows whose input is the previous step's sampled token
        pending_from: list[int] = []  # ... at this row of that step's ids
        last_rows = self._last_rows
        for it in items:
            if it.token_ids[-1] == PLACEHOLDER:  # only ever a decode's single token
                pending_rows.append(len(token_ids))
                pending_from.append(last_rows[it.seq_id])
                token_ids.append(0)
            else:
                token_ids.extend(it.token_ids)
        input_ids = self._input_ids(token_ids, pending_rows, pending_from)
        tables = self.host_tables.rows([it.seq_id for it in items], [it.block_table for it in items])
        graphs = self.graphs
        # A graphed step gives every row's logits and greedy token (`GraphedDecode`); an eager
        # one the hidden states, which go through the LM head below.
        logits: torch.Tensor | None = None
        greedy: torch.Tensor | None = None
        hidden: torch.Tensor | None = None
        adapters = None if self.lora is None else self.lora.step([it.lora_request for it in items], num_new)
        pooling = any(it.sampling_params.pooling is not None for it in items)  # (they need hidden states)
        # (Whisper's clip is its encoder's input, no image tokens: `_cross_states`)
        images = any(it.images for it in items) and not self._encoder_decoder
        embeds = self._image_embeds(items, num_new) if images else None
        # M-RoPE (Qwen2-VL): a sequence with images turns by 3D positions. Where a step's rows
        # all have three alike (decodes, chunks past the images: the index plus the prompt's
        # delta) they are the rotary positions the fused and graphed paths take; otherwise
        # the modules read them (`AttentionMetadata.mrope`).
        mrope = self._mrope(items, num_new) if images and self.model.arch.mrope_section else None
        flat = mrope is not None and bool((mrope == mrope[:, :1]).all())
        # (a drafter reading the model's hidden states needs them from every step: no graph)
        if (graphs is not None and adapters is None and not pooling and self.hidden_store is None
                and embeds is None and (mrope is None or flat) and graphs.applies(len(items), all_decodes)):
            bs = self.block_size
            positions = [it.start_pos for it in items]
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
            ids = [it.seq_id for it in items]
            window_tables = [host.rows(ids, [it.window_tables[g] for it in items])
                             for g, host in enumerate(self.window_host_tables)]
            window_slots = [[t[p // bs] * bs + p % bs for t, p in zip(group, positions, strict=True)]
                            for group in window_tables]
            if mrope is None:
                logits, greedy = graphs(input_ids, positions, slots, tables, window_slots, window_tables)
            else:
                logits, greedy = graphs(input_ids, positions, slots, tables, window_slots, window_tables,
                                        rope_positions=mrope[:, 0].tolist())
        else:
            # Token trees (a speculative step's branching guesses): each row at its depth's position.
            trees = None if all_decodes else [it.tree if it.num_draft else None for it in items]
            if trees is not None and all(t is None for t in trees):
                trees = None
            if not all_decodes and self._chains(items, num_new, adapters is None and not pooling):
                meta = chain_decodes(tables, [it.start_pos for it in items], num_new, self.block_size, self.device,
                                     self.sliding_window, self.dtype, trees)
            else:
                meta = build_metadata(
                    tables,
                    [it.start_pos for it in items],
                    num_new,
                    self.block_size,
                    self.device,
                    self.sliding_window,
                    self.dtype,
                    trees,
                )
            window_tables = None
            if self.window_host_tables:
                ids = [it.seq_id for it in items]
                window_tables = [host.rows(ids, [it.window_tables[g] for it in items])
                                 for g, host in enumerate(self.window_host_tables)]
                self.hybrid_metadata(meta, window_tables, [it.start_pos for it in items], num_new)
            meta.embeds = embeds
            if self._encoder_decoder:
                meta.cross = self._cross_states(items, num_new)
            rope_positions = meta.positions
            if flat:
                assert mrope is not None
                rope_positions = to_device(mrope[:, 0].contiguous(), self.device)
            elif mrope is not None:
                meta.mrope = to_device(mrope, self.device)
            ranges = None
            if embeds is not None and any(s.bidirectional for it in items for s in it.images):
                ranges = [tuple((s.offset, s.end) for s in it.images if s.bidirectional)
                          for it in items[meta.num_decodes:]]
                open_ranges(meta, ranges)
            if peers is not None:
                peers.send(Step(token_ids=input_ids.tolist(), tables=tables, starts=[it.start_pos for it in items],
                                num_new=num_new, window_tables=window_tables,
                                lora=None if adapters is None else [it.lora_request for it in items],
                                lora_pinned=frozenset() if self.lora is None else frozenset(self.lora.pinned),
                                embeds=None if embeds is None else (embeds[0].tolist(), embeds[1].cpu()),
                                ranges=ranges, mrope=mrope))
            if adapters is None:
                hidden = self.model(input_ids, rope_positions, self.kv_caches, meta)
            else:
                assert self.lora is not None
                with self.lora.context.use(adapters):
                    hidden = self.model(input_ids, rope_positions, self.kv_caches, meta)
            if self.hidden_store is not None:  # the MTP or EAGLE drafter reads them (runner/mtp.py)
                aux = getattr(self.model, "aux_hidden", None)  # (EAGLE-3: streams inside the model)
                self.hidden_store.put_step(items, num_new, hidden if aux is None else aux)
        prompt_lps = (
            self._prompt_logprobs(items, num_new, hidden, logits)
            if any(it.sampling_params.prompt_logprobs is not None for it in items) else None
        )
        pooled = self._pool(items, num_new, hidden) if pooling else None

        rows: torch.Tensor | None = None  # the rows that sample, if not all of them
        drafting = False  # a sequence verifies drafts: it samples at each of its rows
        # An embedding or classification ends with its prompt: its one "sampled" token (which
        # finishes it, and is no output) skips the LM head. A classifier has none.
        done_pooling = {it.seq_id: 0 for it in items if it.sample and it.sampling_params.pooling is not None}
        if all_decodes and not done_pooling and all(it.sample for it in items):  # (a 1-token chunk may not sample)
            samplers = items  # every row, in order
        else:
            rows_out: list[int] = []
            samplers = []
            end = 0
            for it, n in zip(items, num_new, strict=True):
                end += n
                if it.num_draft:
                    drafting = True
                    rows_out.extend(range(end - 1 - it.num_draft, end))
                    samplers.extend([it] * (1 + it.num_draft))
                elif it.sample and it.seq_id not in done_pooling:
                    rows_out.append(end - 1)
                    samplers.append(it)
            if not samplers:
                return StepHandle(RunnerOutput(sampled=done_pooling, prompt_logprobs=prompt_lps or {},
                                               pooled=pooled or {}), start, cuda)
            rows = to_device(host_longs(rows_out), self.device)  # not a list: indexing by one would wait
        params = [it.sampling_params for it in samplers]
        batch = prepare(params, [it.prompt_len for it in samplers])
        batch.logprobs_mode = self.logprobs_mode
        # Generators and histories only for a batch that uses them: per sequence, they would
        # be most of a large decode step's host time.
        if not batch.all_greedy and any(p.seed is not None for p in params):
            batch.generators = [self._generator(it) for it in samplers]
            if drafting and any(it.tree is not None for it in samplers):
                batch.noise_from = self._noise_rows(samplers)
        processing = bool(self.logits_processors) or any(p.logits_processors for p in params)
        if batch.any_penalty or processing:
            batch.history = (self._histories(samplers, processing) if drafting
                             else [self._history(it, processing) for it in samplers])
        if processing:  # (custom logits processors: conveyor/logits_process.py)
            batch.rows = [LogitsRow(p, h[: it.prompt_len], h[it.prompt_len:], it.seq_id)
                          for p, h, it in zip(params, batch.history, samplers, strict=True)]
            batch.processors = self.logits_processors
        if any(p.shapes_logits for p in params):
            batch.allowed, batch.bias, batch.timestamps = self._constraints(samplers)
            if any(p.whisper is not None and p.logprobs is not None for p in params):
                batch.processed = to_device(torch.tensor([p.whisper is not None for p in params]), self.device)
        if logits is None:
            assert hidden is not None
            sampled = hidden if rows is None else hidden[rows]
            if peers is not None and splits_head(self.model):  # each rank a slice of the vocabulary
                peers.send(Step(head=True, head_rows=None if rows is None else rows_out))
                logits = split_logits(self.model, sampled, 0, peers.size, peers.all_reduce)
            else:
                logits = self.model.compute_logits(sampled)
        elif rows is not None:
            assert greedy is not None
            logits, greedy = logits[rows], greedy[rows]
        # Drafting: seeded generators draw a row per position, and give back those not kept.
        states = self._generator_states(samplers, batch) if drafting else None
        probs = None  # (the rows' distributions: a step that verifies sampled drafts)
        if (greedy is not None and batch.all_greedy and not batch.any_penalty and batch.max_logprobs is None
                and batch.allowed is None and batch.bias is None and batch.timestamps is None and batch.rows is None):
            tokens, logprobs = greedy, None  # the graph's own argmax: nothing more to launch
        elif drafting and any(it.draft_probs is not None for it in samplers):  # (speculative sampling)
            tokens, logprobs, probs = self.sampler.sample_with_probs(logits, batch)
        else:
            tokens, logprobs = self.sampler.sample(logits, batch)
        if drafting:
            self._last_tokens, self._last_rows, self._last_handle = None, {}, None
            output = self._verify(samplers, tokens.tolist(), logprobs, states, probs)
            output.sampled.update(done_pooling)
            output.prompt_logprobs = prompt_lps or {}
            output.pooled = pooled or {}
            return StepHandle(output, start, cuda)
        seq_ids = [it.seq_id for it in samplers]
        self._last_tokens = tokens
        self._last_rows = {seq_id: row for row, seq_id in enumerate(seq_ids)}
        handle = StepHandle(RunnerOutput(sampled=done_pooling, prompt_logprobs=prompt_lps or {}, pooled=pooled or {}),
                            start, cuda, seq_ids, tokens)
        if self.keep_logits:
            handle.output.logits = {seq_id: logits[i] for i, seq_id in enumerate(seq_ids)}
        if logprobs is not None:
            handle.output.logprobs = {
                it.seq_id: lp
                for it, lp in zip(samplers, logprobs, strict=True)
                if it.sampling_params.logprobs is not None
            }
        self._last_handle = handle
        return handle

    def _image_embeds(self, items: list[ScheduledSequence], num_new: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of this step that are image tokens and their embeddings (`AttentionMetadata.embeds`).

        An image is encoded at the first step that computes any of its tokens, all of this
        step's new images in one batch, and its embeddings are kept until a step reaches past
        its last token (a prompt in chunks reads them over several steps); a sequence that
        ends drops them. An image of the same digest that another request encoded is taken from
        the encoder cache (`encoder_cache_tokens`, least recently used out) instead; a sequence
        computed again after a preemption finds its images there, or encodes them again."""
        vision = self.model.vision
        spans: list[tuple[int, int, int, int, int]] = []  # (seq, image, first row, from, to)
        new: dict[tuple[int, int], Any] = {}
        row = 0
        for it, n in zip(items, num_new, strict=True):
            start, end = it.start_pos, it.start_pos + n
            for k, span in enumerate(it.images):
                lo, hi = max(start, span.offset), min(end, span.end)
                if lo < hi:
                    spans.append((it.seq_id, k, row + lo - start, lo - span.offset, hi - span.offset))
                    if k not in self._image_cache.get(it.seq_id, {}):
                        new[it.seq_id, k] = span.pixels
            row += n
        if not spans:
            return None
        if new:
            towers = {p.digest: p for p in new.values() if not p.embeds}
            got: dict[bytes, Any] = {}
            if towers:
                assert vision is not None, "image tokens for a model without a vision side"
                got = self._through_encoder(towers, vision)
            for (seq_id, k), pixels in new.items():  # (a prompt's own embeddings: scaled as the model's)
                self._image_cache.setdefault(seq_id, {})[k] = (
                    self.model.scale_embeds(pixels.values.to(self.device, self.dtype)) if pixels.embeds
                    else got[pixels.digest])
        rows: list[int] = []
        parts = []
        for seq_id, k, first, lo, hi in spans:
            cache = self._image_cache[seq_id]
            rows.extend(range(first, first + hi - lo))
            parts.append(cache[k][lo:hi])
            if hi == cache[k].shape[0]:  # the prefill has passed this image
                del cache[k]
        return to_device(host_longs(rows), self.device), torch.cat(parts)

    def _mrope(self, items: list[ScheduledSequence], num_new: list[int]) -> torch.Tensor:
        """M-RoPE's positions `[T, 3]` on the host for this step's rows: a sequence with images
        by `mrope_positions`, any other at its positions (a token tree's row at its depth's)."""
        from conveyor.models.qwen_vision import mrope_positions

        vision = self.model.vision
        assert vision is not None
        out: list[list[int]] = []
        for it, n in zip(items, num_new, strict=True):
            tree = it.tree if it.num_draft else None
            rows = [it.start_pos + (k if tree is None else tree.depths[k]) for k in range(n)]
            if not it.images:
                out.extend([p, p, p] for p in rows)
                continue
            grid = [vision.config.mrope_grid(span.pixels) for span in it.images]
            if it.start_pos >= it.images[-1].end:  # (past its images, as decodes are: index + delta)
                delta = sum(max(times[-1] + 1, h, w) - span.length
                            for (times, h, w), span in zip(grid, it.images, strict=True))
                out.extend([p + delta] * 3 for p in rows)
            else:
                out.extend(mrope_positions(torch.tensor(rows), it.images, grid).tolist())
        return torch.tensor(out, dtype=torch.int64).view(-1, 3)

    def _through_encoder(self, todo: dict[bytes, Any], encode: Callable[[list[Any]], Any]) -> dict[bytes, Any]:
        """Each media item's encoder output, by digest: from the encoder cache where it is
        there, the others through `encode` in one batch and kept (least recently used out)."""
        known = self._encoded
        got = {d: known[d] for d in todo if d in known}
        for digest in got:
            known.move_to_end(digest)
        missing = {d: item for d, item in todo.items() if d not in got}
        if missing:
            encoded = dict(zip(missing, encode(list(missing.values())), strict=True))
            self.images_encoded += len(missing)
            got |= encoded
            for digest, values in encoded.items():
                self._keep_encoded(digest, values)
        return got

    def reset_encoder_cache(self) -> None:
        """Empty the encoder cache (`Engine.reset_mm_cache`)."""
        self._encoded.clear()
        self._encoded_rows = 0

    def encoded(self, digest: bytes) -> torch.Tensor | None:
        """The encoder cache's output for the media item of `digest` (None: not kept)."""
        values = self._encoded.get(digest)
        if values is not None:
            self._encoded.move_to_end(digest)
        return values

    def _cross_states(self, items: list[ScheduledSequence], num_new: list[int]) -> Any:
        """An encoder-decoder's step (Whisper's): where each sequence's cross keys and values lie
        in the cache (its cross table), and the encoder's outputs of the clips of the sequences
        at their first step (start 0: new, or preempted and computed again): from the encoder
        cache (a fallback's retry, a window's no-speech request, a recomputed sequence), the
        others in one batch through the encoder, a clip that several of them hear encoded once."""
        from conveyor.models.whisper import CrossStates

        encoder = self.model.arch.encoder
        assert encoder is not None
        length = encoder.image_size
        bs, device = self.block_size, self.device
        tables = torch.tensor([it.cross_table for it in items], dtype=torch.int64)  # [seqs, pages]
        clips: dict[bytes, Any] = {}
        heard: dict[bytes, list[torch.Tensor]] = {}  # each clip's sequences' cross slots
        offsets = torch.arange(length)
        for i, it in enumerate(items):
            if it.start_pos == 0:
                pixels = it.images[0].pixels
                clips[pixels.digest] = pixels.values
                heard.setdefault(pixels.digest, []).append(tables[i][offsets // bs] * bs + offsets % bs)
        encoded: list[torch.Tensor] = []
        if clips:
            model: Any = self.model
            got = self._through_encoder(clips, model.encode)
            encoded = [got[d] for d in clips]
        ends = list(itertools.accumulate(num_new))
        meta = CrossMetadata(list(zip([0, *ends[:-1]], ends, strict=True)), to_device(tables, device),
                             to_device(tables.repeat_interleave(torch.tensor(num_new), dim=0), device),
                             to_device(torch.full((ends[-1],), length, dtype=torch.int64), device), length, bs)
        slots = [to_device(torch.cat(heard[d]), device) for d in clips]
        return CrossStates(meta, encoded, slots)

    def holds_encoded(self, digest: bytes) -> bool:
        """Whether the encoder cache holds the embeddings of the media item of `digest`."""
        return digest in self._encoded

    def _keep_encoded(self, digest: bytes, values: torch.Tensor) -> None:
        """Keep an image's embeddings for other requests, the least recently used leaving first."""
        rows, budget = values.shape[0], self.encoder_cache_tokens
        if rows > budget:
            return
        if values.untyped_storage().nbytes() > values.nbytes:  # (a batch's slice: not the whole batch kept)
            values = values.clone()
        self._encoded[digest] = values
        self._encoded_rows += rows
        while self._encoded_rows > budget:
            _, old = self._encoded.popitem(last=False)
            self._encoded_rows -= old.shape[0]

    def _prompt_logprobs(
        self, items: list[ScheduledSequence], num_new: list[int], hidden: torch.Tensor | None,
        logits: torch.Tensor | None,
    ) -> dict[int, tuple[int, list[PromptLogprob]]]:
        """The prompt tokens' logprobs that this step's rows predict, for the sequences that
        ask them: the row at position p predicts the token at p + 1, a prompt token while
        p + 1 < prompt_len. The LM head runs on those rows only, a slice at a time (a
        2048-token chunk's logits over a large vocabulary would be hundreds of MB at once)."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[ScheduledSequence, int, int]] = []  # (sequence, first row, rows)
        end = 0
        for it, n in zip(items, num_new, strict=True):
            first_row, end = end, end + n
            if it.sampling_params.prompt_logprobs is None or it.num_draft:
                continue
            last = min(it.start_pos + n, it.prompt_len - 1)  # positions start_pos .. last-1
            if last <= it.start_pos:
                continue
            spans.append((it, len(rows), last - it.start_pos))
            rows.extend(range(first_row, first_row + last - it.start_pos))
            targets.extend(it.all_token_ids[it.start_pos + 1 : last + 1])
        if not rows:
            return {}
        k = max(it.sampling_params.prompt_logprobs or 0 for it, _, _ in spans)
        chosen: list[float] = []
        ranks: list[int] = []
        top_ids: list[list[int]] = []
        top_vals: list[list[float]] = []
        dev = self.device
        for s in range(0, len(rows), 256):
            index = to_device(host_longs(rows[s : s + 256]), dev)
            if hidden is not None:
                part = self.model.compute_logits(hidden[index])
            else:
                assert logits is not None  # a graphed step: every row's logits
                part = logits[index]
            logp = torch.log_softmax(part.float(), dim=-1)
            own = logp.gather(1, to_device(host_longs(targets[s : s + 256]), dev)[:, None])
            chosen += own.squeeze(1).tolist()
            ranks += ((logp > own).sum(dim=1) + 1).tolist()
            if k:
                vals, ids = logp.topk(k, dim=-1)
                top_vals += vals.tolist()
                top_ids += ids.tolist()
        out: dict[int, tuple[int, list[PromptLogprob]]] = {}
        for it, at, count in spans:
            want = it.sampling_params.prompt_logprobs or 0
            out[it.seq_id] = (it.start_pos + 1, [
                (chosen[r], ranks[r], list(zip(top_ids[r][:want], top_vals[r][:want], strict=True)) if want else None)
                for r in range(at, at + count)
            ])
        return out

    def _pool(
        self, items: list[ScheduledSequence], num_new: list[int], hidden: torch.Tensor | None
    ) -> dict[int, torch.Tensor]:
        """The pooled hidden states (on the device, float32 at least) of the embedding requests whose
        prompt this step completes; a "mean" request's earlier chunks are summed as they pass
        (a "max" request's reduced to their maximum)."""
        assert hidden is not None  # (a step with an embedding request is never graphed)
        if hidden.dtype not in (torch.float32, torch.float64):
            hidden = hidden.float()  # half precision pools in float32
        out: dict[int, torch.Tensor] = {}
        end = 0
        for it, n in zip(items, num_new, strict=True):
            first, end = end, end + n
            pooling = it.sampling_params.pooling
            if pooling is None:
                continue
            kind = pooling.pooling_type
            if kind == "mean":
                part = hidden[first:end].sum(dim=0)
                if it.start_pos:
                    part = part + self._pool_sums[it.seq_id]
                if it.sample:
                    self._pool_sums.pop(it.seq_id, None)
                    out[it.seq_id] = part / it.prompt_len
                else:
                    self._pool_sums[it.seq_id] = part
            elif kind == "max":
                part = hidden[first:end].amax(dim=0)
                if it.start_pos:
                    part = torch.maximum(part, self._pool_sums[it.seq_id])
                if it.sample:
                    self._pool_sums.pop(it.seq_id, None)
                    out[it.seq_id] = part
                else:
                    self._pool_sums[it.seq_id] = part
            elif kind == "cls":
                if it.start_pos == 0:
                    self._pool_sums[it.seq_id] = hidden[first]
                if it.sample:
                    out[it.seq_id] = self._pool_sums.pop(it.seq_id)
            elif kind in ("all", "step"):  # every prompt row (a step's last), the earlier chunks' kept
                rows = hidden[first:end]
                if kind == "all" and self.token_heads is not None:
                    rows = self._token_head(it, rows, pooling.task)
                if kind == "step":
                    tags = [i for i, t in enumerate(it.token_ids) if t == pooling.step_tag_id]
                    rows = rows[to_device(host_longs(tags), rows.device)] if tags else rows[:0]
                if it.start_pos:
                    rows = torch.cat((self._pool_sums[it.seq_id], rows))
                if it.sample:
                    self._pool_sums.pop(it.seq_id, None)
                    out[it.seq_id] = rows
                else:
                    self._pool_sums[it.seq_id] = rows.clone()
            elif it.sample:  # "last"
                out[it.seq_id] = hidden[end - 1]
        if self.pool_dense:  # an embedding's Dense modules, after its pooling
            for it in items:
                if (v := out.get(it.seq_id)) is not None and v.dim() == 1 and it.sampling_params.pooling is not None \
                        and it.sampling_params.pooling.task == "embed":
                    for layer in self.pool_dense:
                        v = layer(v)
                    out[it.seq_id] = v
        classify = [seq_id for it in items if (seq_id := it.seq_id) in out
                    and it.sampling_params.pooling is not None and it.sampling_params.pooling.task == "classify"]
        vectors = [seq_id for seq_id in classify if out[seq_id].dim() == 1]
        if vectors:  # a classifier's head, once over the step's pooled rows
            logits = self.model.classify(torch.stack([out[seq_id] for seq_id in vectors]))
            out.update(zip(vectors, logits, strict=True))
        lexical = self.token_heads is not None and self.token_heads.sparse is not None
        for seq_id in classify:
            if out[seq_id].dim() == 2 and not lexical:  # "all": the head over every token
                out[seq_id] = self.model.classify(out[seq_id])
        return out

    def _token_head(self, it: ScheduledSequence, rows: torch.Tensor, task: str) -> torch.Tensor:
        """One chunk's rows through BGE-M3's head for `task` (its lexical weights for
        "classify", its ColBERT vectors for "embed"), less the first token where it is the BOS
        and, for the weights, the last where it is the EOS (as FlagEmbedding leaves them out)."""
        heads = self.token_heads
        head = heads.sparse if task == "classify" else heads.colbert
        if head is None:
            return rows
        bos, eos = heads.bos_token_id, heads.eos_token_id
        ids = it.token_ids
        lo = 1 if it.start_pos == 0 and ids and ids[0] == bos else 0
        hi = len(rows) - (1 if task == "classify" and it.sample and ids and ids[-1] == eos else 0)
        return head(rows[lo:max(hi, lo)])

    def _input_ids(self, token_ids: list[int], pending_rows: list[int], pending_from: list[int]) -> torch.Tensor:
        """The step's input ids on the device: `token_ids`, where rows `pending_rows` take the
        previous step's sampled ids at `pending_from` (async scheduling; still on the device)."""
        n = len(token_ids)
        if pending_rows and len(pending_rows) == n:  # a step of pending decodes only
            assert self._last_tokens is not None
            if pending_from == list(range(len(self._last_tokens))):
                return self._last_tokens  # the same sequences as the step before, in its order
            return self._last_tokens[to_device(host_longs(pending_from), self.device)]
        input_ids = to_device(host_longs(token_ids), self.device)
        if pending_rows:
            assert self._last_tokens is not None
            index = to_device(host_longs(pending_from), self.device)
            rows = to_device(host_longs(pending_rows), self.device)
            input_ids[rows] = self._last_tokens[index]
        return input_ids

    def _verify(
        self,
        samplers: list[ScheduledSequence],
        tokens: list[int],
        logprobs: list[tuple[float, TopLogprobs | None]] | None,
        states: dict[int, torch.Tensor] | None,
        probs: torch.Tensor | None = None,
    ) -> RunnerOutput:
        """Each sequence's tokens of a step with drafts: the token sampled at its first row,
        then, while the draft at a row equals the token sampled at the row before it, the
        token sampled at that row (a token tree: down from the root, while a child of the row
        reached guessed the token sampled there; the kept rows then move into place,
        `_follow_branches`). A seeded sequence's generator is left where one row of noise per
        kept token leaves it, as if it had decoded them one by one. A chain of guesses drawn
        from the drafter's distributions (`draft_probs`) is kept by speculative sampling
        instead (`_speculative_sampling`)."""
        output = RunnerOutput(sampled={})
        moved: list[tuple[ScheduledSequence, list[int]]] = []  # token trees' kept branches off their slots
        row = 0
        while row < len(samplers):
            it = samplers[row]
            lps = logprobs if it.sampling_params.logprobs is not None else None  # this sequence's asked
            n = 1 + it.num_draft
            guesses = it.token_ids
            if probs is not None and it.draft_probs is not None and it.tree is None:  # drawn guesses
                emitted = self._speculative_sampling(guesses[1:n], probs[row : row + n], it.draft_probs,
                                                     tokens[row + n - 1])
                output.sampled[it.seq_id] = emitted[0]
                if len(emitted) > 1:
                    output.accepted[it.seq_id] = [(t, None) for t in emitted[1:]]
                row += n
                continue
            kept = [0]  # the rows kept: the root, then each guess equal to the token sampled before it
            if it.tree is None:
                while len(kept) < n and tokens[row + len(kept) - 1] == guesses[len(kept)]:
                    kept.append(len(kept))
            else:  # down the tree: the child (if any) that guessed the token its parent's row sampled
                children = it.tree.children
                while child := next((c for c in children[kept[-1]] if c < n and guesses[c] == tokens[row + kept[-1]]),
                                    0):
                    kept.append(child)
                if kept[-1] != len(kept) - 1:
                    moved.append((it, kept))
            keep = len(kept)
            output.sampled[it.seq_id] = tokens[row]
            if lps is not None:
                output.logprobs[it.seq_id] = lps[row]
            if keep > 1:
                output.accepted[it.seq_id] = [
                    (tokens[row + r], None if lps is None else lps[row + r]) for r in kept[1:]
                ]
            if states is not None and (state := states.get(it.seq_id)) is not None:
                g = self._generators[it.seq_id]
                g.set_state(state)
                for _ in range(keep):
                    torch.empty(self.model.arch.vocab_size, device=self.device).exponential_(generator=g)
            row += n
        if moved:
            self._follow_branches(moved)
        return output

    def _speculative_sampling(self, guesses: list[int], target: torch.Tensor, draft: torch.Tensor, bonus: int
                              ) -> list[int]:
        """The tokens a chain of `guesses` drawn from `draft` (`[k, vocab]`: guess i from row i)
        gives under the target's distributions `target` (`[k + 1, vocab]`: row i predicts the
        token after guess i's predecessor), by speculative sampling (Leviathan et al. 2023; Chen
        et al. 2023): guess i is kept with probability min(1, p_i / q_i) of its token while all
        before it were; at the first refused, a token is drawn from the normalized positive part
        of p - q there (p where q covers it), and the chain ends; all kept, `bonus` (the target's
        own draw from its last row) follows. The tokens so made are distributed as the target's."""
        k = len(guesses)
        vocab = target.shape[1]
        q = draft.to(target.device, torch.float32)
        if q.shape[1] != vocab:  # (a draft head of another width: no mass outside the target's)
            q = torch.nn.functional.pad(q, (0, max(0, vocab - q.shape[1])))[:, :vocab]
        ids = torch.tensor(guesses, device=target.device)
        rows = torch.arange(k, device=target.device)
        p_g, q_g = target[rows, ids], q[rows, ids]
        u = torch.rand(k, generator=self.sampler.generator, device=target.device)
        refused = (u * q_g >= p_g).tolist()  # (keep with probability p/q: u < p/q, q > 0 for a drawn guess)
        m = refused.index(True) if True in refused else k
        if m == k:
            return [*guesses, bonus]
        residual = (target[m] - q[m]).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # (p <= q everywhere: p itself, as the limit has it)
            residual = target[m]
        token = int(torch.multinomial(residual, 1, generator=self.sampler.generator))
        return [*guesses[:m], token]

    def _follow_branches(self, moved: list[tuple[ScheduledSequence, list[int]]]) -> None:
        """The K/V (and kept hidden states) of each token tree's kept nodes, written at the slots
        of their rows, into the positions they now hold: row `kept[i]` (position start + depth i,
        slot of start + kept[i]) to the slot of start + i. Sources lie at or after their targets
        and are all read before any is written."""
        bs = self.block_size
        src: list[int] = []
        dst: list[int] = []
        for it, kept in moved:
            table, start = it.block_table, it.start_pos
            for i, r in enumerate(kept):
                if r != i:
                    src.append(table[(start + r) // bs] * bs + (start + r) % bs)
                    dst.append(table[(start + i) // bs] * bs + (start + i) % bs)
            if self.hidden_store is not None:
                self.hidden_store.follow(it.seq_id, start, kept)
        src_t, dst_t = to_device(host_longs(src), self.device), to_device(host_longs(dst), self.device)
        for cache in self.kv_caches:
            cache[:, dst_t] = cache[:, src_t]

    def _noise_rows(self, samplers: list[ScheduledSequence]) -> list[int]:
        """Per row, the row whose noise a seeded row takes (`SamplingBatch.noise_from`): a token
        tree's rows at one depth share the first one's, so that the kept branch draws one row of
        noise per position, as decoding one token at a time would."""
        out: list[int] = []
        row = 0
        while row < len(samplers):
            it = samplers[row]
            n = 1 + it.num_draft
            if it.tree is None:
                out.extend(range(row, row + n))
            else:
                first: dict[int, int] = {}
                out.extend(row + first.setdefault(d, k) for k, d in enumerate(it.tree.depths[:n]))
            row += n
        return out

    @staticmethod
    def _branch(it: ScheduledSequence, k: int) -> list[int]:
        """The guesses row k of a step with drafts follows (its own included): the first k for a
        chain, its branch for a token tree."""
        if it.tree is None:
            return it.token_ids[1 : 1 + k]
        return [it.token_ids[r] for r in it.tree.branch(k)]

    @staticmethod
    def _depth(it: ScheduledSequence, k: int) -> int:
        """Row k's place after the step's first position (k for a chain)."""
        return k if it.tree is None else it.tree.depths[k]

    def _generator_states(self, samplers: list[ScheduledSequence], batch: SamplingBatch) -> dict[int, torch.Tensor]:
        """Where each seeded sequence with drafts has its generator before the step's draws."""
        return {
            it.seq_id: g.get_state()
            for it, g in zip(samplers, batch.generators, strict=True)
            if g is not None and it.num_draft
        }

    def _histories(self, samplers: list[ScheduledSequence], every: bool = False) -> list[list[int]]:
        """`_history` of each row of a step with drafts: a sequence's row i follows its last
        token and its first i drafts."""
        out: list[list[int]] = []
        row = 0
        while row < len(samplers):
            it = samplers[row]
            if not it.num_draft:
                out.append(self._history(it, every))
                row += 1
                continue
            base = it.all_token_ids[: it.start_pos + 1] if every or it.sampling_params.needs_history else None
            for i in range(1 + it.num_draft):
                out.append([] if base is None else base + self._branch(it, i))
            row += 1 + it.num_draft
        return out

    def _history(self, item: ScheduledSequence, every: bool = False) -> list[int]:
        """The tokens before this step's sampled one, for penalties and a request's own logits
        processors (others get none, unless `every`: the engine's processors)."""
        if not (every or item.sampling_params.needs_history):
            return []
        return self._known(item, item.context_len)

    def _known(self, item: ScheduledSequence, end: int, start: int = 0) -> list[int]:
        """The sequence's tokens `start .. end-1`. A token still pending (async scheduling) is
        read from the previous step: a sync, paid only by requests that need the tokens
        (penalties, structured outputs)."""
        tokens = item.all_token_ids[start:end]
        if tokens and tokens[-1] == PLACEHOLDER:
            assert self._last_handle is not None
            tokens[-1] = self._last_handle.result().sampled[item.seq_id]
        return tokens

    def _constraints(self, samplers: list[ScheduledSequence]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[int, torch.Tensor] | None]:
        """The tokens each row may draw (`[rows, vocab]` bool; None: any), the bias added
        to its logits (float; None: none) and Whisper's first timestamp token with the rows
        that have timestamps (`SamplingBatch.timestamps`; None: no row has any), from its request's
        structured outputs, allowed_token_ids, bad_words, logit_bias, Whisper's rules
        (`WhisperRules`), and min_tokens, which holds the end and the stop token ids back while
        the row's output index is below it.

        A row left with no token (the controls against its grammar) falls back to its
        grammar's mask: the grammar decides what is valid output."""
        grammar_rows: list[int] = []
        grammar_masks: list[torch.Tensor] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        only_rows: list[int] = []
        only_ids: list[tuple[int, ...]] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        ranges: list[tuple[int, int, int]] = []  # (row, lo, hi): tokens lo..hi-1 banned
        vocab, dev = self.model.arch.vocab_size, self.device
        begin: int | None = None  # (Whisper's first timestamp token, and the rows that have them)
        stamped: list[int] = []
        row = 0
        for it in self._first_rows(samplers):
            p = it.sampling_params
            n = 1 + it.num_draft
            first = it.start_pos + 1 if it.num_draft else it.context_len  # the tokens before the first row
            states = self._grammar_states(it, first) if p.structured_outputs is not None else None
            grammar = self._guides[it.seq_id].grammar if states is not None else None
            words = self._bad_word_bans(it, first) if p.bad_words else None
            output = self._known(it, first, start=it.prompt_len) if p.whisper is not None else None
            for i in range(n):
                r = row + i
                if grammar is not None and states is not None:
                    grammar_rows.append(r)
                    grammar_masks.append(grammar.allowed(states[i]))
                if first + self._depth(it, i) - it.prompt_len < p.min_tokens and not (
                    grammar is not None and states is not None and grammar.ends_only(states[i])
                ):
                    held = (*(() if p.ignore_eos else self.eos_token_ids), *p.stop_token_ids)
                    ban_rows.extend([r] * len(held))
                    ban_ids.extend(held)
                if words is not None:
                    ban_rows.extend([r] * len(words[i]))
                    ban_ids.extend(words[i])
                if p.whisper is not None and output is not None:
                    ids, spans = p.whisper.bans(output + self._branch(it, i), vocab)
                    ban_rows.extend([r] * len(ids))
                    ban_ids.extend(ids)
                    ranges.extend((r, lo, hi) for lo, hi in spans if lo < hi)
                    if p.whisper.timestamp_begin is not None:
                        begin = p.whisper.timestamp_begin
                        stamped.append(r)
                if p.allowed_token_ids is not None:
                    only_rows.append(r)
                    only_ids.append(p.allowed_token_ids)
                if p.logit_bias:
                    bias_rows.extend([r] * len(p.logit_bias))
                    bias_ids.extend(p.logit_bias)
                    bias_vals.extend(p.logit_bias.values())
            row += n
        bias: torch.Tensor | None = None
        rows = row
        timestamps = None
        if begin is not None:
            has = torch.zeros(rows, dtype=torch.bool)
            has[stamped] = True
            timestamps = (begin, to_device(has, dev))
        if bias_rows:
            bias = torch.zeros((rows, vocab), dtype=torch.float32, device=dev)
            bias[to_device(host_longs(bias_rows), dev), to_device(host_longs(bias_ids), dev)] = to_device(
                torch.tensor(bias_vals, dtype=torch.float32), dev
            )
        if not (grammar_rows or ban_rows or only_rows):
            return None, bias, timestamps
        stacked = torch.stack(grammar_masks) if grammar_masks else None
        if stacked is not None and len(grammar_rows) == rows:
            allowed = stacked
        else:
            allowed = torch.ones((rows, vocab), dtype=torch.bool, device=dev)
            if stacked is not None:
                allowed[to_device(host_longs(grammar_rows), dev)] = stacked
        if not (ban_rows or only_rows):
            return allowed, bias, timestamps
        grammar_only = allowed.clone() if stacked is not None else None
        if only_rows:
            keep = torch.zeros((len(only_rows), vocab), dtype=torch.bool, device=dev)
            flat_rows = [i for i, ids in enumerate(only_ids) for _ in ids]
            keep[to_device(host_longs(flat_rows), dev), to_device(host_longs([t for ids in only_ids for t in ids]), dev)] = True
            index = to_device(host_longs(only_rows), dev)
            allowed[index] &= keep
        if ban_rows:
            allowed[to_device(host_longs(ban_rows), dev), to_device(host_longs(ban_ids), dev)] = False
        for r, lo, hi in ranges:
            allowed[r, lo:hi] = False
        if grammar_only is not None:  # on the device: no sync to find the rows left empty
            allowed = torch.where(allowed.any(dim=1, keepdim=True), allowed, grammar_only)
        return allowed, bias, timestamps

    def _bad_word_bans(self, it: ScheduledSequence, first: int) -> list[list[int]]:
        """The tokens each row of `it` may not draw for its bad_words: a word's last token
        where the output so far ends with the word's other tokens (a one-token word always).
        Row i follows the tokens before position `first` and the first i drafts."""
        assert self.word_token_ids is not None, "the engine checks bad_words before queueing them"
        spellings = self.word_token_ids(it.sampling_params.bad_words)
        longest = max(len(s) for s in spellings)
        recent = self._known(it, first, start=max(it.prompt_len, first - longest + 1)) if longest > 1 else []
        bans: list[list[int]] = []
        for i in range(1 + it.num_draft):
            before = recent + self._branch(it, i)
            bans.append([
                s[-1] for s in spellings
                if len(s) == 1 or (len(before) >= len(s) - 1 and tuple(before[len(before) - len(s) + 1 :]) == s[:-1])
            ])
        return bans

    @staticmethod
    def _first_rows(samplers: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """Each sampling sequence once, in row order (one with drafts has 1 + num_draft rows)."""
        out: list[ScheduledSequence] = []
        row = 0
        while row < len(samplers):
            out.append(samplers[row])
            row += 1 + samplers[row].num_draft
        return out

    def _grammar_states(self, it: ScheduledSequence, end: int) -> list[Any]:
        """A constrained sequence's grammar state at each of its rows: after its output tokens
        before position `end`, then (with drafts) after each draft in turn."""
        spec = it.sampling_params.structured_outputs
        assert self.grammars is not None and spec is not None, "the engine checks structured outputs before queueing them"
        guide = self._guides.get(it.seq_id)
        if guide is None:
            guide = self._guides[it.seq_id] = _Guide(self.grammars.get(spec))
        if end - it.prompt_len < guide.consumed:
            guide.restart()
        state = guide.advance(self._known(it, end, start=it.prompt_len + guide.consumed))
        states = [state]
        for k, token in enumerate(it.token_ids[1 : 1 + it.num_draft], 1):  # (a tree's row after its parent's)
            states.append(guide.grammar.advance(states[k - 1 if it.tree is None else it.tree.parents[k]], token))
        return states


class _Guide:
    """Where one constrained sequence stands in its grammar: the state after its first
    `consumed` output tokens. Outputs only grow while it runs (a preempted sequence keeps
    them), so each step reads and walks just the new ones; fewer than were walked restart it."""

    __slots__ = ("consumed", "grammar", "state")

    def __init__(self, grammar: Grammar | PushdownGrammar) -> None:
        self.grammar: Any = grammar  # states: a DFA's ints, a pushdown grammar's Configs
        self.restart()

    def restart(self) -> None:
        self.state, self.consumed = self.grammar.START, 0

    def advance(self, new: list[int]) -> Any:
        for token in new:
            self.state = self.grammar.advance(self.state, token)
        self.consumed += len(new)
        return self.state
