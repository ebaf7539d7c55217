"""The native skinny kernel against torch's matmul, at the row counts of decode steps.

For each row count M, multiplies `[M, K]` activations by 40 different `[N, K]` weight matrices
(SmolLM2's 576 x 1536, 140 MB in all, so they stream from memory as in a real decode step) and
prints the effective weight bandwidth of torch (`x @ W_t`, conveyor's layout without the kernel)
and of the kernel, with their ratio, beside the memory read bandwidth measured on the spot.

    python benchmarks/skinny_linear.py
"""

from __future__ import annotations

import time

import torch

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
    k, n, layers = 576, 1536, 40
    ws = [torch.randn(n, k) for _ in range(layers)]
    wts = [w.t().contiguous() for w in ws]
    big = torch.ones((1 << 30) // 4)
    read = big.numel() * 4 / min(bench(big.sum, 1) for _ in range(5))
    nbytes = n * k * 4 * layers
    print(f"threads {torch.get_num_threads()}, memory read bandwidth {read / 1e9:.1f} GB/s (1 GiB sum)")
    print("| rows | torch x @ W_t GB/s | kernel GB/s | kernel / torch |")
    print("|---|---|---|---|")
    for m in (1, 2, 4, 8, 16, 64):
        x = torch.randn(m, k)
        a = bench(lambda: [x @ wt for wt in wts])
        b = bench(lambda: [op(x, w) for w in ws])
        print(f"| {m} | {nbytes / a / 1e9:.1f} | {nbytes / b / 1e9:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
