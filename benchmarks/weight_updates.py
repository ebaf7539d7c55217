"""What new weights cost (an RL trainer's turn; conveyor/weight_sync.py): on one model (SmolLM2 by
default), the seconds an idle engine takes to load every tensor again from its checkpoint
(`update_weights_from_disk`), from tensors handed over in the process (`update_weights_from_tensor`:
all of them, or one layer's), broadcast over a gloo group by a trainer thread
(`update_weights_from_distributed`), and to write and read them as the safetensors text
`POST /update_weights_from_tensor` takes. The ways run in turn, `--rounds` times each; the
median and its ratio to the disk's. The tensors sent are the checkpoint's own, so each way
must leave the greedy answer as it was (checked).

    python benchmarks/weight_updates.py --rounds 5
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from collections.abc import Callable

from conveyor import LLM, SamplingParams
from conveyor.models.loader import open_model, resolve_model_path
from conveyor.weight_sync import (
    WeightBroadcaster,
    deserialize_named_tensors,
    serialize_named_tensors,
    weight_metadata,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    llm = LLM(str(path))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = ["The capital of France is"]
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    _, tensors, _ = open_model(path)
    full = {n: t.float() for n, t in tensors}
    layer = {n: t for n, t in full.items() if ".layers.0." in n}
    size = sum(t.numel() * t.element_size() for t in full.values()) / 2**20
    print(f"{path.name}: {len(full)} tensors, {size:.0f} MiB in float32; one layer: {len(layer)} tensors")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    joined: dict[str, WeightBroadcaster] = {}
    joining = threading.Thread(target=lambda: joined.update(t=WeightBroadcaster("127.0.0.1", port, 2)))
    joining.start()
    llm.init_weights_update_group("127.0.0.1", port, 1, 2)
    joining.join()
    trainer = joined["t"]

    def distributed() -> None:
        sender = threading.Thread(target=trainer.send, args=(full,))
        sender.start()
        llm.update_weights_from_distributed(*weight_metadata(full))
        sender.join()

    ways: dict[str, Callable[[], object]] = {
        "update_weights_from_disk": lambda: llm.update_weights_from_disk(str(path)),
        "update_weights_from_tensor, every tensor": lambda: llm.update_weights_from_tensor(full),
        "update_weights_from_tensor, one layer": lambda: llm.update_weights_from_tensor(layer),
        "update_weights_from_distributed (gloo), every tensor": distributed,
        "safetensors text written and read, every tensor": lambda: deserialize_named_tensors(
            serialize_named_tensors(full)),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
            got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            assert got == want, f"{name} changed the greedy answer"
    base = statistics.median(times["update_weights_from_disk"])
    print("| way | median (s) | × disk | rounds (s) |\n|---|---:|---:|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.3f} | {m / base:.2f} | {', '.join(f'{t:.3f}' for t in ts)} |")
    llm.destroy_weights_update_group()
    trainer.close()


if __name__ == "__main__":
    main()
