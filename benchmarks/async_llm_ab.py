"""What `AsyncLLM`'s asyncio front costs against `LLM.generate` on the same work, side by side.

The same greedy chat requests (the speculative benchmark's open questions, `max_tokens` each),
all given at once: (A) `LLM.generate` over the list, (B) `AsyncLLM.chat` with every request a
task, consumed as the outputs stream. Two engines of one model, run in turns (A B B A ...) so
both see the same machine; the tokens must be the same; the ratio of median times is the
front's cost (its engine thread, the event loop's hand-offs, one output a step a request).
With `--engine-process`, (B) runs its engine in a process of its own (`AsyncLLM(engine_process=True)`):
the cost adds the pipe between the processes (a message a step) and the parent's bookkeeping.

    python benchmarks/async_llm_ab.py --requests 16 --rounds 4 [--engine-process]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from conveyor import LLM, AsyncLLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--output-kind", default="cumulative", choices=["cumulative", "delta", "final_only"])
    ap.add_argument("--engine-process", action="store_true", help="AsyncLLM's engine in a process of its own")
    args = ap.parse_args()
    import speculative as bench  # (benchmarks/speculative.py: a sibling on the script's path)

    convs = bench.conversations("open", args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, output_kind=args.output_kind)
    kv = {"kv_cache_memory": 512 << 20}
    offline = LLM(args.model, **kv)

    async def run_async() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {"LLM.generate": [], "AsyncLLM": []}
        async with AsyncLLM(args.model, engine_process=args.engine_process, **kv) as llm:
            async def one(conv) -> list[int]:
                tokens: list[int] = []
                async for out in llm.chat(conv, params):
                    c = out.outputs[0]
                    tokens = tokens + c.token_ids if args.output_kind == "delta" else c.token_ids
                return tokens

            await asyncio.gather(one(convs[0]))  # warm-up
            offline.chat(convs[:1], params, use_tqdm=False)
            for rnd in range(args.rounds):
                for name in ("LLM.generate", "AsyncLLM") if rnd % 2 == 0 else ("AsyncLLM", "LLM.generate"):
                    t = time.perf_counter()
                    if name == "AsyncLLM":
                        got = await asyncio.gather(*[one(c) for c in convs])
                    else:
                        want = [o.outputs[0].token_ids for o in offline.chat(convs, params, use_tqdm=False)]
                    times[name].append(time.perf_counter() - t)
                assert got == want, "AsyncLLM and LLM.generate gave different tokens"
        return times

    times = asyncio.run(run_async())
    n_tokens = args.requests * args.max_tokens
    print(f"| engine | s by round | median s | output tok/s |  ({args.requests} requests, {args.max_tokens} tokens each, "
          f"output_kind={args.output_kind}, engine_process={args.engine_process})")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {', '.join(f'{t:.2f}' for t in ts)} | {med:.2f} | {n_tokens / med:.1f} |")
    ratio = statistics.median(times["AsyncLLM"]) / statistics.median(times["LLM.generate"])
    print(f"\nAsyncLLM / LLM.generate, median time: {ratio:.3f} (same tokens)")


if __name__ == "__main__":
    main()
