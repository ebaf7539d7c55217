"""LoRA adapters over HTTP (`--enable-lora --lora-modules name=path`): each adapter is a model
name, listed by /v1/models with the base model as its parent; a request naming it gets what
HF transformers makes with the adapter merged into the weights, streamed or whole, beside
requests of the base model and of the other adapter; a broken adapter fails its own requests
with a 400 while the server serves on; a server that could serve no adapter refuses to start.
With `--allow-runtime-lora-updating`, adapters are loaded and unloaded while it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, assert_openai_error
from tests.test_lora import SPECS, merged_reference, write_adapter

PROMPTS = [[5, 17, 99, 120, 7, 64, 3, 250, 31, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [44, 45, 46]]


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http_adapters")
    out = {name: write_adapter(root / name, tiny_model, *SPECS[name], seed=k)
           for k, name in enumerate(("attn-qv", "everything"))}
    broken = root / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    out["broken"] = broken  # no weights: found at the first request that names it
    return out


@pytest.fixture(scope="module")
def server(tiny_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        ["--model", str(tiny_model), "--dtype", "float64", "--num-kv-blocks", "256", "--served-model-name", "base",
         "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
         "--lora-modules", *(f"{name}={path}" for name, path in adapters.items() if name != "everything"),
         json.dumps({"name": "everything", "path": str(adapters["everything"])})],
        tmp_path_factory.mktemp("lora_server") / "server.log",
    )
    proc.wait_ready()
    yield proc
    proc.stop()


def test_models_lists_each_adapter_with_its_parent(server: ServerProcess, adapters: dict[str, Path]) -> None:
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [
        ("base", None), ("attn-qv", "base"), ("broken", "base"), ("everything", "base")]
    assert data[1]["root"] == str(adapters["attn-qv"])


def test_each_model_name_gets_its_adapters_tokens(server: ServerProcess, tiny_model: Path,
                                                   adapters: dict[str, Path]) -> None:
    with httpx.Client(timeout=120.0) as http:
        for model, folder in (("base", None), ("attn-qv", adapters["attn-qv"]), ("everything", adapters["everything"])):
            want = merged_reference(tiny_model, folder, PROMPTS, 10)
            body = {"model": model, "prompt": PROMPTS, "max_tokens": 10, "temperature": 0, "logprobs": 0}
            r = http.post(server.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["model"] == model
            assert [len(c["logprobs"]["tokens"]) for c in got["choices"]] == [len(w) for w in want]
            ids = [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in got["choices"]]
            assert ids == want, model
            chunks = []
            with http.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
            assert {c["model"] for c in chunks} == {model}
            streamed = [[int(t.removeprefix("token_id:")) for c in chunks for ch in c["choices"] if ch["index"] == i
                         for t in (ch.get("logprobs") or {}).get("tokens", [])] for i in range(2)]
            assert streamed == want


def test_a_broken_adapter_fails_alone_and_an_unknown_model_is_404(server: ServerProcess) -> None:
    with httpx.Client(timeout=60.0) as http:
        r = http.post(server.url + "/v1/completions", json={"model": "broken", "prompt": [5, 6], "max_tokens": 2})
        err = assert_openai_error(r, 400, param="lora_request")
        assert "adapter_model.safetensors" in err["message"]
        r = http.post(server.url + "/v1/completions", json={"model": "nope", "prompt": [5, 6], "max_tokens": 2})
        err = assert_openai_error(r, 404, param="model")
        assert "`attn-qv`" in err["message"]
        r = http.post(server.url + "/v1/completions", json={"model": "attn-qv", "prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_a_server_that_could_serve_no_adapter_refuses_to_start(tiny_model: Path, adapters: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    base = [sys.executable, "-m", "conveyor.cli", "serve", "--model", str(tiny_model)]
    cases = {
        "--lora-modules needs --enable-lora": ["--lora-modules", f"a={adapters['attn-qv']}"],
        "no adapter_config.json": ["--enable-lora", "--lora-modules", f"a={tmp_path}"],
        "must be name=path": ["--enable-lora", "--lora-modules", "just-a-name"],
        "is the base model's name": ["--enable-lora", "--served-model-name", "a", "--lora-modules",
                                     f"a={adapters['attn-qv']}"],
        "--allow-runtime-lora-updating needs --enable-lora": ["--allow-runtime-lora-updating"],
    }
    for message, args in cases.items():
        done = subprocess.run([*base, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and message in done.stderr, (message, done.stderr[-2000:])


def test_adapters_loaded_and_unloaded_while_the_server_runs(tiny_model: Path, adapters: dict[str, Path],
                                                            server: ServerProcess, tmp_path: Path) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a loaded adapter serves HF's
    merged tokens; a name unloaded and loaded again from another folder serves the new one's
    (its prompts' cached blocks under the old adapter are not reused); what cannot serve is
    refused at load with the reason; a server without the flag has no such routes."""
    other = write_adapter(tmp_path / "mlp-some", tiny_model, *SPECS["mlp-some"], seed=5)
    proc = ServerProcess(
        ["--model", str(tiny_model), "--dtype", "float64", "--num-kv-blocks", "256", "--served-model-name", "base",
         "--enable-lora", "--max-lora-rank", "4", "--allow-runtime-lora-updating"],
        tmp_path / "server.log",
    )
    body = {"model": "x", "prompt": PROMPTS, "max_tokens": 10, "temperature": 0, "logprobs": 0}

    def tokens(http: httpx.Client) -> list[list[int]]:
        r = http.post(proc.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in r.json()["choices"]]

    try:
        proc.wait_ready()
        with httpx.Client(timeout=120.0) as http:
            load, unload = proc.url + "/v1/load_lora_adapter", proc.url + "/v1/unload_lora_adapter"
            assert [m["id"] for m in http.get(proc.url + "/v1/models").json()["data"]] == ["base"]
            assert_openai_error(http.post(proc.url + "/v1/completions", json=body), 404, param="model")
            r = http.post(load, json={"lora_name": "x", "lora_path": str(adapters["attn-qv"])})
            assert r.status_code == 200 and "added" in r.text, r.text
            assert [(m["id"], m.get("parent")) for m in http.get(proc.url + "/v1/models").json()["data"]] == [
                ("base", None), ("x", "base")]
            assert tokens(http) == merged_reference(tiny_model, adapters["attn-qv"], PROMPTS, 10)

            refusals = {
                "already loaded": ("x", adapters["attn-qv"]),
                "base model's name": ("base", adapters["attn-qv"]),
                "exceeds max_lora_rank=4": ("y", adapters["everything"]),
                "adapter_model.safetensors": ("y", adapters["broken"]),
                "no adapter_config.json": ("y", tmp_path),
            }
            for message, (name, path) in refusals.items():
                err = assert_openai_error(http.post(load, json={"lora_name": name, "lora_path": str(path)}), 400)
                assert message in err["message"], (message, err)

            r = http.post(unload, json={"lora_name": "x"})
            assert r.status_code == 200 and "removed" in r.text, r.text
            assert_openai_error(http.post(proc.url + "/v1/completions", json=body), 404, param="model")
            assert_openai_error(http.post(unload, json={"lora_name": "x"}), 404, param="lora_name")
            assert http.post(load, json={"lora_name": "x", "lora_path": str(other)}).status_code == 200
            want = merged_reference(tiny_model, other, PROMPTS, 10)
            assert want != merged_reference(tiny_model, adapters["attn-qv"], PROMPTS, 10)  # told apart
            assert tokens(http) == want
            # vLLM's load_inplace: the name now serves the other folder, under a new id
            r = http.post(load, json={"lora_name": "x", "lora_path": str(adapters["attn-qv"]), "load_inplace": True})
            assert r.status_code == 200 and "replaced" in r.text, r.text
            assert tokens(http) == merged_reference(tiny_model, adapters["attn-qv"], PROMPTS, 10)
            # SGLang's pinned: loaded on every engine at once and kept there (a bad folder refused as ever)
            err = assert_openai_error(http.post(load, json={"lora_name": "y", "lora_path": str(adapters["broken"]),
                                                            "pinned": True}), 400)
            assert "adapter_model" in err["message"]
            assert [m["id"] for m in http.get(proc.url + "/v1/models").json()["data"]] == ["base", "x"]
            r = http.post(load, json={"lora_name": "x", "lora_path": str(other), "load_inplace": True, "pinned": True})
            assert r.status_code == 200, r.text
            assert tokens(http) == merged_reference(tiny_model, other, PROMPTS, 10)
            assert http.post(unload, json={"lora_name": "x"}).status_code == 200
        assert httpx.post(server.url + "/v1/load_lora_adapter",
                          json={"lora_name": "z", "lora_path": str(other)}).status_code == 404
    finally:
        proc.stop()
