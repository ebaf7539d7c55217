"""SGLang's weight-update routes on `conveyor serve --enable-rl-api` with two replicas: a
safetensors file of another checkpoint's tensors (base64 in JSON) makes both answer as that
checkpoint; SGLang's pickles and a body that is not a file are refused; the first checkpoint's
tensors as a safetensors body bring the first answers back; both replicas join a trainer's gloo
group (as ranks 1 and 2) and load what it broadcasts; /get_weight_version names the last update."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import httpx

from conveyor.models.loader import iter_hf_tensors
from conveyor.weight_sync import (
    WeightBroadcaster,
    save_named_tensors,
    serialize_named_tensors,
    weight_metadata,
)
from tests.server.conftest import ServerProcess


def test_weight_updates_over_http_reach_every_replica(tiny_model: Path, tmp_path: Path) -> None:
    from tests.conftest import build_tiny_model

    other = build_tiny_model(tmp_path / "other", "llama", seed=5, max_position_embeddings=8192)
    theirs, own = dict(iter_hf_tensors(other)), dict(iter_hf_tensors(tiny_model))
    server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "256", "--enable-rl-api",
                            "--data-parallel-size", "2", "--router-policy", "round_robin"], tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                "return_tokens_as_token_ids": True}

        def answers() -> list[list[str]]:  # (round robin: one from each replica)
            return [httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
                    ["logprobs"]["tokens"] for _ in range(2)]

        def post(route: str, payload: dict[str, Any]) -> httpx.Response:
            return httpx.post(server.url + route, json=payload, timeout=120)

        before = answers()
        assert before[0] == before[1]
        r = post("/update_weights_from_tensor", {"safetensors": serialize_named_tensors(theirs),
                                                 "weight_version": "theirs"})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        after = answers()
        assert after[0] == after[1] != before[0]
        assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": "theirs"}
        pickled = post("/update_weights_from_tensor", {"serialized_named_tensors": ["gASV"]})
        assert pickled.status_code == 400 and pickled.json()["error"]["param"] == "serialized_named_tensors"
        garbage = post("/update_weights_from_tensor", {"safetensors": "bm90IGEgZmlsZQ=="})
        assert garbage.status_code == 400 and "safetensors" in garbage.json()["error"]["message"]
        assert answers() == after  # (a refused update changes nothing)
        r = httpx.post(server.url + "/update_weights_from_tensor", content=save_named_tensors(own), timeout=120,
                       params={"weight_version": "own"}, headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        assert answers() == before
        assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": "own"}

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        failures: list[BaseException] = []
        trainer_ready = threading.Event()
        holder: dict[str, WeightBroadcaster] = {}

        def join() -> None:
            try:
                holder["t"] = WeightBroadcaster("127.0.0.1", port, 3, timeout_s=60)
            except BaseException as e:
                failures.append(e)
            trainer_ready.set()

        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        r = post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                "rank_offset": 1, "world_size": 3})
        assert r.status_code == 200, r.text
        assert trainer_ready.wait(60) and not failures
        names, dtypes, shapes = weight_metadata(theirs)
        result: dict[str, httpx.Response] = {}
        asking = threading.Thread(target=lambda: result.update(r=post(
            "/update_weights_from_distributed", {"names": names, "dtypes": dtypes, "shapes": shapes,
                                                 "weight_version": "theirs again"})))
        asking.start()
        holder["t"].send(theirs)
        asking.join(60)
        assert result["r"].status_code == 200, result["r"].text
        assert answers() == after
        assert httpx.get(server.url + "/get_weight_version").json() == {"weight_version": "theirs again"}
        bad = post("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": []})
        assert bad.status_code == 400
        assert post("/destroy_weights_update_group", {}).status_code == 200
        holder["t"].close()
        assert post("/destroy_weights_update_group", {}).status_code == 400
    finally:
        assert server.stop() == 0
