"""The native CPU kernels against torch, at the shapes of decode steps.

1. The skinny matrix product against torch's matmul.
For each row count M, multiplies `[M, K]` activations by the projections of ten SmolLM2 layers
(qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536: 141 MB, so they stream from
memory as in a real decode step) and prints the effective weight bandwidth and FLOP rate of
torch (`x @ W_t`, conveyor's layout without the kernels; `F.linear(x, W)`, MKL on the kernel's
layout, which the runner uses above SKINNY_MAX_ROWS) and of the kernel, with the ratios,
beside the memory read bandwidth measured on the spot. The three alternate over five rounds;
medians.

2. Paged decode attention against the torch backend (block gather + SDPA), one layer of
SmolLM2's shape (9 query heads, 3 KV heads, head dim 64, block 16), decodes x context; and the
kernel over a float16 cache (kv_cache_dtype="float16").

3. A layer's element-wise passes, the K/V write and the greedy argmax against their torch code, at 64 rows (a
decode step of 64 sequences) and 2048 (a prompt step), on the 134M model's shapes (hidden 768,
12 + 12 heads of 64 roped, intermediate 2048, vocab 32000); best of three timings each.

    python benchmarks/cpu_kernels.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from conveyor.kernels import skinny_linear


def bench(fn, n: int = 5) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def main() -> None:
    op = skinny_linear()
    if op is None:
        print("the native kernel is unavailable here (see the log); nothing to compare")
        return
    torch.manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 10
    ws = [torch.randn(n, k) for n, k in shapes]
    wts = [w.t().contiguous() for w in ws]
    big = torch.ones((1 << 30) // 4)
    read = big.numel() * 4 / min(bench(big.sum, 1) for _ in range(5))
    nbytes = sum(w.numel() * 4 for w in ws)
    print(f"threads {torch.get_num_threads()}, memory read bandwidth {read / 1e9:.1f} GB/s (1 GiB sum)")
    print("| rows | x @ W_t GB/s | F.linear GFLOP/s | kernel GB/s | kernel GFLOP/s | kernel / x @ W_t | kernel / F.linear |")
    print("|---|---|---|---|---|---|---|")
    for m in (1, 2, 4, 8, 16, 32, 64, 128):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        runs: dict[str, list[float]] = {"t": [], "mkl": [], "kernel": []}
        for _ in range(5):
            runs["t"].append(bench(lambda: [xs[wt.shape[0]] @ wt for wt in wts], 1))  # noqa: B023 (called at once)
            runs["mkl"].append(bench(lambda: [F.linear(xs[w.shape[1]], w) for w in ws], 1))  # noqa: B023
            runs["kernel"].append(bench(lambda: [op(xs[w.shape[1]], w) for w in ws], 1))  # noqa: B023
        a, c, b = (statistics.median(runs[key]) for key in ("t", "mkl", "kernel"))
        flop = 2 * m * nbytes / 4
        print(f"| {m} | {nbytes / a / 1e9:.1f} | {flop / c / 1e9:.0f} | {nbytes / b / 1e9:.1f} | {flop / b / 1e9:.0f} "
              f"| {statistics.median(t / k for t, k in zip(runs['t'], runs['kernel'], strict=True)):.2f} "
              f"| {statistics.median(t / k for t, k in zip(runs['mkl'], runs['kernel'], strict=True)):.2f} |", flush=True)
    attention()
    elementwise()


def attention() -> None:
    from conveyor.kernels import paged_decode_attention
    from conveyor.models.attention import CpuPagedAttention, TorchPagedAttention, build_metadata

    heads, kv_heads, d, bs = 9, 3, 64, 16
    torch_backend, native = TorchPagedAttention(), CpuPagedAttention(paged_decode_attention())
    print()
    print("| decodes x context | torch ms | kernel ms | speedup | kernel, float16 cache ms | float32 / float16 |")
    print("|---|---|---|---|---|---|")
    for n, ctx in ((1, 512), (8, 512), (64, 64), (64, 512)):
        nb = ctx // bs + 1
        cache = torch.randn(2, (n * nb + 1) * bs, kv_heads, d)
        meta = build_metadata([list(range(i * nb, (i + 1) * nb)) for i in range(n)], [ctx - 1] * n, [1] * n,
                              bs, torch.device("cpu"))
        q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
        a = bench(lambda: torch_backend.forward(q, k, v, cache, meta, d**-0.5), 10)  # noqa: B023
        b = bench(lambda: native.forward(q, k, v, cache, meta, d**-0.5), 10)  # noqa: B023
        half = cache.half()
        c = bench(lambda: native.forward(q, k, v, half, meta, d**-0.5), 10)  # noqa: B023
        print(f"| {n} x {ctx} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.1f}x | {c * 1e3:.2f} | {b / c:.2f}x |")



def elementwise() -> None:
    import torch.nn.functional as F

    from conveyor import kernels
    from conveyor.models.attention import TorchPagedAttention
    from conveyor.models.llama import apply_rope

    norm, rope, silu_mul, argmax = kernels.rms_norm(), kernels.rope(), kernels.silu_mul(), kernels.argmax()
    write, torch_backend = kernels.write_kv(), TorchPagedAttention()
    print()
    print("| rows | pass | torch us | kernel us | torch / kernel |")
    print("|---|---|---|---|---|")
    for rows in (64, 2048):
        x, w = torch.randn(rows, 768), torch.randn(768)
        qkv = torch.randn(rows, 36, 64)
        angles = torch.rand(rows, 1, 32)
        cos, sin = angles.cos(), angles.sin()
        gate_up = torch.randn(rows, 4096)
        logits = torch.randn(rows, 32000)
        k, v = qkv[:, 12:24], qkv[:, 24:]
        cache = torch.zeros(2, 8192, 12, 64, dtype=torch.float16)
        slots = torch.randperm(8192)[:rows]
        pairs = {
            "RMSNorm": (lambda: F.rms_norm(x, (768,), w, 1e-5), lambda: norm(x, w, 1e-5)),  # noqa: B023
            "rope (q and k heads)": (lambda: apply_rope(qkv[:, :24], (cos, sin)),  # noqa: B023
                                     lambda: rope(qkv[:, :24], cos, sin, 24)),  # noqa: B023
            "SiLU(gate) * up": (lambda: F.silu(gate_up[:, :2048]) * gate_up[:, 2048:],  # noqa: B023
                                lambda: silu_mul(gate_up)),  # noqa: B023
            "argmax over the vocabulary": (lambda: logits.argmax(-1), lambda: argmax(logits)),  # noqa: B023
            "K/V write, float16 cache": (lambda: torch_backend.write(k, v, cache[0], cache[1], slots),  # noqa: B023
                                         lambda: write(k, v, cache[0], cache[1], slots)),  # noqa: B023
        }
        for name, (a, b) in pairs.items():
            ta = min(bench(a, 20) for _ in range(3))
            tb = min(bench(b, 20) for _ in range(3))
            print(f"| {rows} | {name} | {ta * 1e6:.0f} | {tb * 1e6:.0f} | {ta / tb:.1f}x |")


if __name__ == "__main__":
    main()
