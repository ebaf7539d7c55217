"""What new weights cost (an RL trainer's turn; conveyor/weight_sync.py): on one model (SmolLM2 by
default), the seconds an idle engine takes to load every tensor again from its checkpoint
(`update_weights_from_disk`), from tensors handed over in the process (`update_weights_from_tensor`:
all of them, or one layer's), broadcast over a gloo group by a trainer thread
(`update_weights_from_distributed`), and to write and read them as the safetensors text
`POST /update_weights_from_tensor` takes; disk and every tensor also with the model built again
(CUDA's way, and this CPU's before the copy in place). The ways run in turn, `--rounds` times each; the
median and its ratio to the disk's. The tensors sent are the checkpoint's own, so each way
must leave the greedy answer as it was (checked). With `--http`, every tensor also sent to a
`conveyor serve --enable-rl-api` of the same model (its engine in a process of its own): as a
safetensors body (`application/octet-stream`) and as base64 in JSON.

With `--small-tensors N`, first a table of N tensors of 256 float32 each (a mixture of experts'
many small ones) broadcast over a gloo pair of threads, one broadcast each against buckets (no
model: the group alone).

    python benchmarks/weight_updates.py --rounds 3 --http --small-tensors 20000
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from conveyor import LLM, SamplingParams
from conveyor.models.loader import open_model, resolve_model_path
from conveyor.weight_sync import (
    WeightBroadcaster,
    deserialize_named_tensors,
    save_named_tensors,
    serialize_named_tensors,
    weight_metadata,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--http", action="store_true", help="also over HTTP, to a server of the same model")
    ap.add_argument("--small-tensors", type=int, default=0, help="also N small tensors over a gloo pair")
    args = ap.parse_args()
    if args.small_tensors:
        small_tensors(args.small_tensors, args.rounds)
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

    trainer = trainer_of(lambda port: llm.init_weights_update_group("127.0.0.1", port, 1, 2))

    def distributed(bucket_bytes: int = 0) -> None:
        sender = threading.Thread(target=trainer.send, args=(full, bucket_bytes))
        sender.start()
        llm.update_weights_from_distributed(*weight_metadata(full), bucket_bytes=bucket_bytes)
        sender.join()

    from conveyor.models import loader

    in_place = loader.update_weights_in_place

    def built_again(way: Callable[[], object]) -> Callable[[], object]:
        """`way` with the model built again (as on CUDA, or before the copy in place)."""
        def run() -> None:
            loader.update_weights_in_place = lambda *a, **k: False
            try:
                way()
            finally:
                loader.update_weights_in_place = in_place
        return run

    ways: dict[str, Callable[[], object]] = {
        "update_weights_from_disk": lambda: llm.update_weights_from_disk(str(path)),
        "update_weights_from_disk, built again": built_again(lambda: llm.update_weights_from_disk(str(path))),
        "update_weights_from_tensor, every tensor": lambda: llm.update_weights_from_tensor(full),
        "update_weights_from_tensor, every tensor, built again": built_again(
            lambda: llm.update_weights_from_tensor(full)),
        "update_weights_from_tensor, one layer": lambda: llm.update_weights_from_tensor(layer),
        "update_weights_from_distributed (gloo), every tensor": distributed,
        "update_weights_from_distributed (gloo), every tensor, buckets of 64 MiB": lambda: distributed(64 << 20),
        "safetensors text written and read, every tensor": lambda: deserialize_named_tensors(
            serialize_named_tensors(full)),
    }
    server = start_server(path) if args.http else None
    if server is not None:
        url = server[1]
        ways["over HTTP, a safetensors body, every tensor"] = lambda: post(
            url, save_named_tensors(full), "application/octet-stream")
        ways["over HTTP, base64 in JSON, every tensor"] = lambda: post(
            url, json.dumps({"safetensors": serialize_named_tensors(full)}).encode(), "application/json")
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
    if server is not None:
        server[0].terminate()
        server[0].wait(60)


def trainer_of(join: Callable[[int], object]) -> WeightBroadcaster:
    """A trainer (rank 0 of two) on a free port, joined while `join(port)` joins the other side."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    joined: dict[str, WeightBroadcaster] = {}
    joining = threading.Thread(target=lambda: joined.update(t=WeightBroadcaster("127.0.0.1", port, 2)))
    joining.start()
    join(port)
    joining.join()
    return joined["t"]


def small_tensors(n: int, rounds: int) -> None:
    """N tensors of 256 float32 over a gloo pair of threads: per tensor, and in buckets."""
    from conveyor.weight_sync import WeightUpdateGroup

    tensors = {f"t{i}": torch.randn(256) for i in range(n)}
    names, dtypes, shapes = weight_metadata(tensors)
    receivers: list[WeightUpdateGroup] = []
    sender = trainer_of(lambda port: receivers.append(WeightUpdateGroup("127.0.0.1", port, 1, 2)))
    receiver = receivers[0]
    print(f"{n} tensors of 256 float32 ({n * 1024 / 2**20:.0f} MiB), gloo, two threads")
    print("| bucket_bytes | median (s) | rounds (s) |\n|---:|---:|---|")
    for bucket in (0, 1 << 20, 16 << 20):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            thread = threading.Thread(target=sender.send, args=(tensors, bucket))
            thread.start()
            got = receiver.receive(names, dtypes, shapes, bucket)
            thread.join()
            times.append(time.perf_counter() - start)
            assert torch.equal(got["t7"], tensors["t7"])
        print(f"| {bucket} | {statistics.median(times):.3f} | {', '.join(f'{t:.3f}' for t in times)} |")
    sender.close()
    receiver.close()


def start_server(path: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve", "--model", str(path), "--port",
                             str(port), "--enable-rl-api"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.5)


def post(url: str, content: bytes, content_type: str) -> None:
    """One POST with the standard library's client (httpx takes about 10 s to send 513 MiB here,
    urllib and curl about 1 s)."""
    import urllib.request

    req = urllib.request.Request(url + "/update_weights_from_tensor", data=content, method="POST",
                                 headers={"content-type": content_type})
    with urllib.request.urlopen(req, timeout=600) as r:
        assert r.status == 200, r.read()


if __name__ == "__main__":
    main()
