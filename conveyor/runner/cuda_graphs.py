"""CUDA graphs for decode steps: the whole forward of a decode batch replayed as one graph.

A decode step of a small model on a GPU is launch-bound: hundreds of kernels of a few
microseconds each, every one launched from Python. Capturing the forward once per batch size
and replaying it costs one launch. The graph reads fixed buffers, so a step copies its inputs
into them and pads the batch up to the next captured size: the token ids (on the device
already), the block tables, and the positions, K/V slots and context lengths in one copy
(packed as the graph of that size reads them). Padded rows write their K/V into a scratch
block that no sequence owns and attend over it alone, and their outputs are dropped.

The graph runs on through the LM head and the greedy sampler's argmax
(`LlamaForCausalLM.forward_greedy`), into two fixed buffers that every captured size shares:
the logits and the greedy tokens. A step of greedy requests takes the tokens as they are (its
only launch is the graph); any other step samples from the logits (SGLang likewise captures
the logits; vLLM stops at the hidden states). The argmax a sampled step does not use costs a
few microseconds.

What makes the forward capturable: the attention kernels take the block tables' width (fixed
here: the blocks of `max_model_len`) as their bound, never a length read back from the device;
nothing in the decode forward syncs with the host. Prefills and mixed steps stay eager.

A hybrid cache (`HybridLayout`) gives each sliding group of layers block tables of its own:
the graph reads those from fixed buffers too, one table buffer and one slot vector a group
beside the block table's, and each layer attends through its group's (`layer_metas`).

`GraphedDecode(..., capture=False)` runs the same padded, fixed-buffer forward eagerly: on a
CPU that is how the tests check the padding and the buffers against the plain forward (a CPU
has no graphs), and on CUDA it is the fallback when capture fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from conveyor.models.attention import AttentionMetadata, host_longs, host_table

if TYPE_CHECKING:
    from conveyor.models.llama import LlamaForCausalLM

logger = logging.getLogger("conveyor")


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 up to `max_batch` (vLLM's
    choice: a step pads by at most 7 rows), and `max_batch` itself."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if max_batch not in sizes:
        sizes.append(max_batch)
    return sorted(set(sizes))


class GraphedDecode:
    """Decode-only steps of up to `max_batch` sequences through captured CUDA graphs.

    `scratch_block` is a KV block outside the scheduler's pool (the runner allocates one more
    than it hands out): padded rows write and read only there. `greedy(logits, out=tokens)`
    is the sampler's argmax (`Sampler.greedy`; torch's if none).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks: int,
        scratch_block: int,
        max_batch: int,
        capture: bool = True,
        greedy: Callable[..., torch.Tensor] | None = None,
        layer_groups: Sequence[int] = (),
        window: int | None = None,
    ) -> None:
        """`layer_groups`: a hybrid cache's table of each layer (0: the block table; g: the
        g-th sliding group's, whose layers attend within `window`); empty for a whole cache."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.dtype = weight.dtype
        self.sliding_window = model.arch.sliding_window
        self.layer_groups = list(layer_groups)
        self.num_groups = max(self.layer_groups, default=0)  # sliding groups with tables of their own
        self.window = window
        n, dev = self.max_batch, self.device
        # The fixed buffers every graph reads; a step copies its inputs into their first rows.
        # Input ids only ever hold token ids: a padded row reads whichever an earlier step left.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        # Positions, K/V slots and context lengths, packed as a graph of size b reads them:
        # `[positions | slots | context lengths | each sliding group's slots]` of b each at the
        # start, so a step's vectors are one copy from the host (`_vectors`).
        self.packed = torch.zeros((3 + self.num_groups) * n, dtype=torch.long, device=dev)
        # The block tables, then each sliding group's: one copy too.
        self.all_tables = torch.full((1 + self.num_groups, n, max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.tables = self.all_tables[0]
        # What every graph writes: one buffer for all sizes (a graph's own outputs would be
        # a copy per size: some 1 GB of logits at 35 sizes of up to 256 rows of Llama-3's vocabulary).
        self.logits = torch.empty(n, model.arch.vocab_size, dtype=self.dtype, device=dev)
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.greedy = greedy or (lambda logits, out: torch.argmax(logits, dim=-1, out=out))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captured = False
        if capture:
            self._capture()

    def applies(self, num_decodes: int, all_decodes: bool) -> bool:
        return all_decodes and 0 < num_decodes <= self.max_batch

    def padded_size(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def _vectors(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The positions, slots and context lengths a graph of size b reads."""
        packed = self.packed
        return packed[:b], packed[b : 2 * b], packed[2 * b : 3 * b]

    def _meta(self, b: int) -> AttentionMetadata:
        positions, slots, context_lens = self._vectors(b)

        def meta(slot_mapping: torch.Tensor, blocks: torch.Tensor, window: int | None) -> AttentionMetadata:
            return AttentionMetadata(
                block_size=self.block_size,
                positions=positions,
                slot_mapping=slot_mapping,
                num_decodes=b,
                decode_blocks=blocks,
                decode_context_lens=context_lens,
                sliding_window=window,
                mask_dtype=self.dtype,
            )

        main = meta(slots, self.tables[:b], self.sliding_window)
        if self.num_groups:
            groups = [main] + [meta(self.packed[(3 + g) * b : (4 + g) * b], self.all_tables[1 + g, :b], self.window)
                               for g in range(self.num_groups)]
            main.layer_metas = [groups[g] for g in self.layer_groups]
        return main

    def _forward(self, b: int) -> None:
        meta = self._meta(b)
        self.model.forward_greedy(self.input_ids[:b], meta.positions, self.kv_caches, meta,
                                  self.greedy, self.logits[:b], self.tokens[:b])

    def _idle_inputs(self, b: int) -> None:
        """Rows that write to the scratch block at position 0 and attend over it alone: what
        the run before a capture, and the capture, compute on."""
        positions, slots, context_lens = self._vectors(b)
        positions.zero_()
        slots.fill_(self.scratch_block * self.block_size)
        self.packed[3 * b : (3 + self.num_groups) * b].fill_(self.scratch_block * self.block_size)  # groups' slots
        context_lens.fill_(1)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest size first, all sharing one memory pool (a smaller graph's buffers fit in
        the pool the largest left). Each size runs eagerly once first (Triton compiles)."""
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                for b in reversed(self.sizes):
                    self._idle_inputs(b)
                    self._forward(b)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._forward(b)
                    pool = graph.pool()
                    self.graphs[b] = graph
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.captured = True
            logger.info("captured CUDA graphs for decode batches %s", self.sizes)
        except RuntimeError as e:  # a kernel that is not capturable: stay correct, stay eager
            self.graphs.clear()
            logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", e)

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[Sequence[int]],
        window_slots: Sequence[Sequence[int]] = (),
        window_tables: Sequence[Sequence[Sequence[int]]] = (),
        rope_positions: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits `[n, vocab]` and greedy tokens `[n]` of a step of n decodes: token
        `input_ids[i]` (already on the device: it may be a pending token) at `positions[i]`,
        written to `slots[i]`, over the blocks `tables[i]`. Both are views of the fixed
        buffers, which the next step overwrites: whatever reads them is queued on the stream
        before that step's launch (the next step's input ids, the copy of the tokens to the host).
        A hybrid cache's step gives each sliding group's slots and tables too; M-RoPE's decodes
        (Qwen2-VL) turn at `rope_positions` (each row's position plus its prompt's delta), their
        context still `positions[i] + 1` long."""
        n = len(positions)
        b = self.padded_size(n)
        pad = b - n
        # Only the columns this step's tables use: attention reads no block past a row's
        # context length, so whatever an earlier step left further right is never read.
        assert len(window_tables) == len(window_slots) == self.num_groups
        width = max(map(len, [*tables, *(t for group in window_tables for t in group)]))
        scratch = self.scratch_block
        # Padded rows: position 0, the scratch block's first slot, over the scratch block alone.
        idle_slots = [scratch * self.block_size] * pad
        turns = positions if rope_positions is None else rope_positions  # (the model reads them only to turn)
        vectors = host_longs([*turns, *[0] * pad, *slots, *idle_slots, *[p + 1 for p in positions], *[1] * pad,
                              *(s for group in window_slots for s in (*group, *idle_slots))])
        groups = (tables, *window_tables)
        table = host_table([t for group in groups for t in (*group, *[()] * pad)], width, scratch)
        if self.device.type == "cuda":
            vectors, table = vectors.pin_memory(), table.pin_memory()
        self.packed[: (3 + self.num_groups) * b].copy_(vectors, non_blocking=True)
        self.all_tables[:, :b, :width].copy_(table.view(len(groups), b, width), non_blocking=True)
        self.input_ids[:n].copy_(input_ids)
        graph = self.graphs.get(b)
        if graph is None:
            self._forward(b)
        else:
            graph.replay()
        return self.logits[:n], self.tokens[:n]
