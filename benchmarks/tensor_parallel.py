"""Tensor parallelism on CPU: one rank with all the cores against `size` ranks with a share each.

A random-weight Llama (float32, saved once under --dir; its shape by the flags: by default
16 query heads, 8 KV heads, hidden 1024, 12 layers, ~0.2 B parameters) is served by an engine
of one rank (torch threads = the cores) and by one of --size ranks (threads = cores / size each),
in turns (A B B A ...), on the same requests with ignore_eos; the median of the rounds is
compared. Workloads: decode at batch 1, 8 and 32 (16-token prompts, --decode-tokens each), and
a prefill of 8 prompts of 256 tokens. Also printed: the gloo all-reduce's time for one decode
row and for a 2048-token chunk, between two processes, which a step pays twice a layer.

    python benchmarks/tensor_parallel.py --size 2 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from conveyor import LLM, SamplingParams

_PEER = """
import datetime, sys, torch
from torch.distributed import ProcessGroupGloo, TCPStore
port, rows, hidden, n = (int(a) for a in sys.argv[1:])
store = TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
group = ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
t = torch.ones(rows, hidden)
for _ in range(n + 10):
    group.allreduce([t]).wait()
"""


def all_reduce_us(rows: int, hidden: int, n: int = 400) -> float:
    """Median-free mean time of one all-reduce of `[rows, hidden]` float32 between two processes."""
    from torch.distributed import ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=60)
    store = TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(store.port), str(rows), str(hidden), str(n)])
    group = ProcessGroupGloo(store, 0, 2, timeout)
    t = torch.ones(rows, hidden)
    for _ in range(10):
        group.allreduce([t]).wait()
    start = time.perf_counter()
    for _ in range(n):
        group.allreduce([t]).wait()
    elapsed = time.perf_counter() - start
    peer.wait()
    return elapsed / n * 1e6


def build(folder: Path, args: argparse.Namespace) -> Path:
    if (folder / "config.json").is_file():
        return folder
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    )
    tf.LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/conveyor-tp-bench-model")
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    cores = os.cpu_count() or 1
    path = str(build(Path(args.dir), args))
    options = dict(dtype="float32", kv_cache_memory=1 << 30, max_model_len=1024, enable_prefix_caching=False)
    threads = {1: cores, args.size: max(1, cores // args.size)}
    engines = {
        1: LLM(path, num_threads=threads[1], **options),
        args.size: LLM(path, tensor_parallel_size=args.size, **options),
    }
    vocab = args.vocab
    workloads = {}
    for batch in (1, 8, 32):
        prompts = [[(97 * i + 7 * j) % (vocab - 3) + 3 for j in range(16)] for i in range(batch)]
        workloads[f"decode b{batch}"] = (prompts, SamplingParams(max_tokens=args.decode_tokens, temperature=0.0,
                                                                 ignore_eos=True), batch * args.decode_tokens)
    prefill = [[(31 * i + 11 * j) % (vocab - 3) + 3 for j in range(256)] for i in range(8)]
    workloads["prefill 8x256"] = (prefill, SamplingParams(max_tokens=1, ignore_eos=True), 8 * 256)

    def timed(size: int, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
        torch.set_num_threads(threads[size])  # the two engines share this process (rank 0)
        start = time.perf_counter()
        outs = engines[size].generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
          f"MLP {args.intermediate}, vocab {vocab}; {cores} cores; ranks {args.size} x {threads[args.size]} threads "
          f"vs 1 x {threads[1]}")
    print(f"{'workload':<16}{'1 rank s':>10}{f'{args.size} ranks s':>12}{'tok/s 1':>10}{f'tok/s {args.size}':>10}"
          f"{'ratio':>8}  same tokens")
    for name, (prompts, params, tokens) in workloads.items():
        timed(1, prompts, params)  # warm-up
        timed(args.size, prompts, params)
        times: dict[int, list[float]] = {1: [], args.size: []}
        same = True
        for r in range(args.rounds):
            order = (1, args.size) if r % 2 == 0 else (args.size, 1)
            got = {}
            for size in order:
                t, got[size] = timed(size, prompts, params)
                times[size].append(t)
            same = same and got[1] == got[args.size]
        a, b = statistics.median(times[1]), statistics.median(times[args.size])
        print(f"{name:<16}{a:>10.3f}{b:>12.3f}{tokens / a:>10.1f}{tokens / b:>10.1f}{a / b:>8.2f}  {same}")
    torch.set_num_threads(cores)
    for rows in (1, 2048):
        print(f"gloo all-reduce of [{rows}, {args.hidden}] float32 between 2 processes: "
              f"{all_reduce_us(rows, args.hidden):.0f} us")


if __name__ == "__main__":
    main()
