"""What sleep mode gives back (vLLM's `sleep`, `Engine.sleep`): the process's resident memory
with an engine awake (after serving a batch, so the KV cache's pages are touched), asleep at
level 1 (KV cache freed) and level 2 (weights too), and awake again, on one model (SmolLM2 by
default, its engine's default 2 GiB KV cache on CPU).

    python benchmarks/sleep_memory.py
"""

from __future__ import annotations

import argparse
import gc
import time

from conveyor import LLM, SamplingParams


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    llm = LLM(args.model)
    kv = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_pages) / 2**20  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate(["Tell me a story."] * 8, params, use_tqdm=False)
    for t in llm.engine.runner.kv_pages:  # type: ignore[attr-defined]
        t.zero_()  # (every page touched, as a long-running server's would be)
    print(f"KV cache {kv:.0f} MiB")
    print("| state | resident (MiB) | wake_up (s) |")
    print("|---|---:|---:|")
    print(f"| awake | {rss_mib():.0f} | |")
    for level in (1, 2):
        llm.sleep(level)
        gc.collect()
        print(f"| asleep, level {level} | {rss_mib():.0f} | |")
        start = time.perf_counter()
        llm.wake_up()
        took = time.perf_counter() - start
        llm.generate(["Tell me a story."], params, use_tqdm=False)
        print(f"| awake again | {rss_mib():.0f} | {took:.2f} |")


if __name__ == "__main__":
    main()
