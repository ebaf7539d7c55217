"""The pause a client sees when the engine process dies: SmolLM2, 8 greedy streams of 256
tokens, the engine killed (SIGKILL) 4 s in; prints each stream's longest gap between outputs
and checks every stream got all its tokens.

    python benchmarks/engine_restart.py
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from conveyor import SamplingParams
from conveyor.server.async_engine import EngineRequest, OutputStream
from conveyor.server.engine_process import ProcessAsyncEngine

TOKENS = 256


async def main() -> None:
    engine = ProcessAsyncEngine({})
    t0 = time.perf_counter()
    engine.start()
    print(f"engine process ready in {time.perf_counter() - t0:.1f} s")
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, output_kind="delta")

    async def consume(stream: OutputStream) -> tuple[float, int]:
        last, worst, n = None, 0.0, 0
        async for out in stream:
            now = time.perf_counter()
            if last is not None:
                worst = max(worst, now - last)
            last, n = now, n + len(out.outputs[0].delta_token_ids)
        return worst, n

    streams = [await engine.add([EngineRequest(f"r{i}", f"Tell me story number {i}.", params)]) for i in range(8)]
    tasks = [asyncio.create_task(consume(s)) for s in streams]
    await asyncio.sleep(4)
    assert engine.engine_pid is not None
    os.kill(engine.engine_pid, signal.SIGKILL)
    results = await asyncio.gather(*tasks)
    await engine.stop()
    print("longest gap between outputs, per stream (s):", [round(gap, 1) for gap, _ in results])
    assert all(n == TOKENS for _, n in results), results
    print(f"restarts: {engine.restarts}; every stream got its {TOKENS} tokens")


if __name__ == "__main__":
    asyncio.run(main())
