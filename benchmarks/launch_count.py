"""How many kernels a decode step of the CUDA path launches, counted on a CPU.

A batch-1 decode step of a 1B model on an H100 is about 0.8 ms of weight reads (BENCHMARKS.md,
ninth session) spread over a few hundred kernels, and every kernel boundary costs a few
microseconds of a memory system that is not reading weights. The ninth session's profile found
about 450 nodes in the graph of the default path. This script counts, without a GPU, what each
path launches in a graphed decode step: the CUDA graph's nodes, which run from the embedding
through the LM head to the greedy tokens (a greedy step launches nothing else):

- every torch operation that computes counts as one kernel (views and empty tensors are free;
  a cuBLAS GEMM that splits K adds a reduce kernel this count does not see);
- every Triton launch counts as one; the kernels run through Triton's interpreter;
- a step is `GraphedDecode(capture=False)`'s forward, the same fixed-buffer forward a graph
  captures on CUDA, and the decode attention splits the context as it would on an H100
  (`triton_attention.gpu_split_len` with 132 SMs).

    python benchmarks/launch_count.py                 # Llama-3.2-1B's structure, batch 1 and 40
    python benchmarks/launch_count.py --batch 1 --layers 2 --detail

The model has Llama-3.2-1B's structure (16 layers, 4 query heads a kv head, tied embeddings,
llama3 RoPE) at a tiny width, in bfloat16: the count depends on the structure, not the width.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_speed import LLAMA_1B_SHAPE, build_llama, opt_in_kernels

TINY_1B = LLAMA_1B_SHAPE | dict(hidden_size=128, intermediate_size=256, num_attention_heads=8,
                                num_key_value_heads=2, vocab_size=1024)
VARIANTS = ("triton", "triton+fused", "triton+fused+gemv+3launch", "triton+fused+gemv")
H100_SMS = 132
FREE = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "alias", "_to_copy_noop"}


class KernelCount(TorchDispatchMode):
    """Counts the torch operations that compute (one kernel each on CUDA), and, through
    `launches`, the Triton launches; what a Triton launch does inside the interpreter is not
    counted. `syncs` counts the operations that would wait for a CUDA device (`.item()`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs = 0
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self.paused:
            name = func.overloadpacket.__name__
            if name == "_local_scalar_dense":
                self.syncs += 1
            elif not func.is_view and name not in FREE:
                self.ops[f"torch.{name}"] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def launches(self) -> Iterator[None]:
        """Counts every Triton kernel launched inside, by name."""
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.__getitem__
        counter = self

        def getitem(kernel: Any, grid: Any) -> Callable[..., Any]:
            launch = original(kernel, grid)

            def run(*args: Any, **kwargs: Any) -> Any:
                counter.ops[f"triton.{kernel.fn.__name__}"] += 1
                counter.paused += 1
                try:
                    return launch(*args, **kwargs)
                finally:
                    counter.paused -= 1
            return run

        InterpretedFunction.__getitem__ = getitem  # type: ignore[method-assign]
        try:
            yield
        finally:
            InterpretedFunction.__getitem__ = original  # type: ignore[method-assign]


def count_step(path: str, variant: str, batch: int, max_model_len: int) -> dict:
    """Kernels of one graphed decode step of `batch` sequences on `variant`: in the graph
    (forward, LM head, argmax), in a layer of it, and outside the layers."""
    from conveyor import LLM
    from conveyor.kernels.triton_attention import TritonPagedAttention, gpu_split_len
    from conveyor.models.llama import DecoderLayer
    from conveyor.runner.cuda_graphs import GraphedDecode

    dtype = torch.bfloat16
    with opt_in_kernels(variant):
        llm = LLM(path, device="cpu", dtype="bfloat16", num_kv_blocks=batch * max_model_len // 16 + 1, block_size=16,
                  max_model_len=max_model_len, enforce_eager=True)
        model = llm.engine.runner.model
        model._use_triton_attention(dtype)  # on CUDA, prepare_for_inference does these three
        model._use_triton_fused(dtype)
        model._use_triton_gemv(dtype)
    runner = llm.engine.runner
    # What differs on a CPU: the LM head's transposed copy, and the sampler's argmax (on CUDA
    # torch's, or with the fused kernels theirs: `Sampler._cuda_argmax`).
    model._head_t = None
    greedy = None
    if "+fused" in variant:
        from conveyor.kernels import triton_fused

        greedy = triton_fused.argmax
    backend = next(m.backend for m in model.modules() if hasattr(m, "backend"))
    assert isinstance(backend, TritonPagedAttention)
    blocks = max_model_len // 16
    # The splits Llama-3.2-1B's 8 kv heads would get (the tiny model has 2, in the same groups of 4).
    backend.decode_split_len = gpu_split_len(batch * LLAMA_1B_SHAPE["num_key_value_heads"], blocks * 16, H100_SMS)
    graphs = GraphedDecode(model, runner.kv_caches, 16, blocks, runner.scratch_block, batch, capture=False,
                           greedy=greedy)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    positions = [100 + 37 * i for i in range(batch)]
    slots = [t[p // 16] * 16 + p % 16 for t, p in zip(tables, positions, strict=True)]
    ids = torch.arange(batch) + 5
    graphs(ids, positions, slots, tables)  # once outside the count

    counter = KernelCount()
    layer_ops: collections.Counter[str] = collections.Counter()
    first = model.layers[0]
    wrapped = {}
    for name in ("forward", "forward_fused", "forward_gemv"):
        method = getattr(DecoderLayer, name)

        def counted(self: Any, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
            if self is not first:
                return _method(self, *args, **kwargs)
            before = collections.Counter(counter.ops)
            out = _method(self, *args, **kwargs)
            layer_ops.update(counter.ops - before)
            return out
        wrapped[name] = method
        setattr(DecoderLayer, name, counted)
    try:
        with counter.launches(), counter:
            graphs._forward(graphs.padded_size(batch))
        forward_ops = collections.Counter(counter.ops)
        forward_syncs = counter.syncs
    finally:
        for name, method in wrapped.items():
            setattr(DecoderLayer, name, method)
    layers = len(model.layers)
    return {
        "variant": variant, "batch": batch, "layers": layers, "splits": -(-blocks * 16 // backend.decode_split_len),
        "forward": sum(forward_ops.values()), "per_layer": sum(layer_ops.values()),
        "outside_layers": sum(forward_ops.values()) - layers * sum(layer_ops.values()),
        "forward_syncs": forward_syncs,
        "layer_kernels": dict(sorted(layer_ops.items())),
        "outside_kernels": dict(sorted((forward_ops - collections.Counter({k: v * layers for k, v in layer_ops.items()}))
                                       .items())),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,40", help="comma-separated decode batch sizes (40 x 8 kv heads fill an H100"
                    " without splitting the context: no reduce launch)")
    ap.add_argument("--layers", type=int, default=LLAMA_1B_SHAPE["num_hidden_layers"])
    ap.add_argument("--max-model-len", type=int, default=4096, help="sets the graph's block-table width")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--detail", action="store_true", help="also print each kernel of a layer and of the head")
    ap.add_argument("--out", type=Path, help="also write every count, kernel by kernel, to this JSON file")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    print("| path | batch | splits | kernels in the graph (forward, LM head, argmax) | a layer | outside the layers |")
    print("|---|---|---|---|---|---|")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_llama(Path(tmp) / "llama", TINY_1B | dict(num_hidden_layers=args.layers))
        for variant in variants:
            for batch in batches:
                r = count_step(path, variant, batch, args.max_model_len)
                results.append(r)
                print(f"| {variant} | {batch} | {r['splits']} | {r['forward']} | {r['per_layer']} | "
                      f"{r['outside_layers']} |", flush=True)
                if args.detail:
                    for key in ("layer_kernels", "outside_kernels"):
                        print(f"    {key}: {r[key]}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
