"""LoRA resolvers (vLLM's `LoRAResolver`): an adapter no one loaded, found when a request names
it. Over HTTP with `--lora-resolver-dir`: the folder's adapter serves HF's merged tokens at
its first request and is listed from then on; a name that is no folder is the 404 of an unknown
model (a path is never a name); what is found but cannot serve is a 400 with the reason, and
the server serves on. `ServerState.resolve_lora` on its own: resolvers asked in turn, one
lookup a name however many requests wait on it, a plugin's failure reported beside the
others', a resolver registered by name or found as a package's entry point."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor.lora import (
    FilesystemResolver,
    LoRARequest,
    LoRAResolver,
    lora_resolver,
    register_lora_resolver,
)
from conveyor.server.config import ServerConfig
from conveyor.server.errors import APIError
from conveyor.server.metrics import ServerMetrics
from conveyor.server.serving import ServerState
from tests.server.conftest import ServerProcess, assert_openai_error
from tests.test_lora import SPECS, merged_reference, write_adapter

PROMPTS = [[5, 17, 99, 120, 7, 64, 3, 250, 31, 8], [44, 45, 46]]


def test_a_folder_named_by_a_request_is_loaded_and_served(tiny_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    write_adapter(root / "sql", tiny_model, *SPECS["attn-qv"], seed=3)
    write_adapter(tmp_path / "elsewhere", tiny_model, *SPECS["mlp-some"], seed=4)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4,
                                                                      "target_modules": ["q_proj"]}))
    proc = ServerProcess(
        ["--model", str(tiny_model), "--dtype", "float64", "--num-kv-blocks", "256", "--served-model-name", "base",
         "--enable-lora", "--max-lora-rank", "8", "--lora-resolver-dir", str(root), "--allow-runtime-lora-updating"],
        tmp_path / "server.log",
    )

    def complete(http: httpx.Client, model: str) -> httpx.Response:
        return http.post(proc.url + "/v1/completions",
                         json={"model": model, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "logprobs": 0})

    def tokens(r: httpx.Response) -> list[list[int]]:
        assert r.status_code == 200, r.text
        return [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in r.json()["choices"]]

    try:
        proc.wait_ready()
        with httpx.Client(timeout=120.0) as http:
            models = proc.url + "/v1/models"
            assert [m["id"] for m in http.get(models).json()["data"]] == ["base"]
            assert tokens(complete(http, "sql")) == merged_reference(tiny_model, root / "sql", PROMPTS, 8)
            assert [(m["id"], m.get("parent"), m["root"]) for m in http.get(models).json()["data"]][1:] == [
                ("sql", "base", str(root / "sql"))]
            for unknown in ("nope", "../elsewhere", str(tmp_path / "elsewhere"), "."):
                assert_openai_error(complete(http, unknown), 404, param="model")
            err = assert_openai_error(complete(http, "broken"), 400, param="model")
            assert "was found but cannot serve" in err["message"] and "adapter_model.safetensors" in err["message"]
            # Unloaded, the name is found again: the folder as it is now, under a new id.
            assert http.post(proc.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
            shutil.rmtree(root / "sql")
            shutil.copytree(tmp_path / "elsewhere", root / "sql")
            assert tokens(complete(http, "sql")) == merged_reference(tiny_model, root / "sql", PROMPTS, 8)
            assert tokens(complete(http, "base")) == merged_reference(tiny_model, None, PROMPTS, 8)
    finally:
        proc.stop()


def test_resolver_flags_are_checked_at_start(tiny_model: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    cases = {
        "need --enable-lora": ["--lora-resolver-dir", str(tmp_path)],
        "is not a folder": ["--enable-lora", "--lora-resolver-dir", str(tmp_path / "missing")],
        "no LoRA resolver 'nowhere' is registered": ["--enable-lora", "--lora-resolver", "nowhere"],
    }
    for message, flags in cases.items():
        done = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve", "--model", str(tiny_model), *flags],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and message in done.stderr, (message, done.stderr[-2000:])


# -- ServerState.resolve_lora on its own ----------------------------------------------------------
class _Front:
    """What resolve_lora reads of an engine front."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = str(model_path)
        self.model_arg = "my/model"


class _Counting(LoRAResolver):
    def __init__(self, answers: dict[str, str], fail: bool = False) -> None:
        self.answers, self.fail, self.calls = answers, fail, []

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        self.calls.append((base_model_name, lora_name))
        await asyncio.sleep(0.05)  # (others wait on the name's lock meanwhile)
        if self.fail:
            raise RuntimeError("the adapter store is down")
        path = self.answers.get(lora_name)
        return None if path is None else LoRARequest(lora_name, 77, path)


def _state(tiny_model: Path, **config: Any) -> ServerState:
    return ServerState(_Front(tiny_model), ServerConfig(**config), ("base",), ServerMetrics("base"),  # type: ignore[arg-type]
                       max_lora_rank=8)


def test_resolvers_are_asked_in_turn_once_a_name(tiny_model: Path, tmp_path: Path) -> None:
    good = write_adapter(tmp_path / "good", tiny_model, *SPECS["attn-qv"], seed=1)
    too_big = write_adapter(tmp_path / "big", tiny_model, 16, 32, ("q_proj",), (0,), False, seed=2)
    failing, big, fine = _Counting({}, fail=True), _Counting({"a": str(too_big)}), _Counting({"a": str(good)})
    for name, resolver in (("failing", failing), ("big", big), ("fine", fine)):
        register_lora_resolver(name, resolver)
    state = _state(tiny_model, lora_resolver=("failing", "big", "fine"), lora_modules=(f"known={good}",))

    async def main() -> list[Any]:
        return await asyncio.gather(*(state.resolve_lora("a") for _ in range(4)), state.resolve_lora("b"),
                                    return_exceptions=True)

    *found, missing = asyncio.run(main())
    assert isinstance(missing, APIError) and missing.status == 503 and missing.code == "lora_resolver_failed"
    assert "the resolver failing failed: RuntimeError: the adapter store is down" in missing.message
    # The server's own id: 1 is --lora-modules' adapter, 2 went to big's adapter, refused.
    assert len({id(f) for f in found}) == 1 and found[0] == LoRARequest("a", 3, str(good))
    assert state.loras["a"] is found[0]
    # Once for "a": the others waited on the name, then found it served.
    assert sorted(fine.calls) == sorted(failing.calls) == [("my/model", "a"), ("my/model", "b")]

    state = _state(tiny_model, lora_resolver=("failing", "big"))
    with pytest.raises(APIError) as info:
        asyncio.run(state.resolve_lora("a"))
    assert info.value.status == 400
    message = info.value.message
    assert "was found but cannot serve" in message and "exceeds max_lora_rank=8" in message
    assert "the resolver failing failed: RuntimeError: the adapter store is down" in message
    assert "a" not in state.loras
    assert asyncio.run(_state(tiny_model, lora_resolver=("fine",)).resolve_lora("c")) is None


def test_a_resolver_from_a_packages_entry_point(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    point = importlib.metadata.EntryPoint("shelf", "conveyor.lora:FilesystemResolver", "conveyor.lora_resolvers")
    real = importlib.metadata.entry_points

    def entry_points(**selection: Any) -> Any:
        return [point] if selection.get("group") == "conveyor.lora_resolvers" else real(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(FilesystemResolver, "__init__", lambda self, root=tmp_path: setattr(self, "root", Path(root)))
    resolver = lora_resolver("shelf")
    assert isinstance(resolver, FilesystemResolver) and resolver.root == tmp_path
    with pytest.raises(KeyError, match=r"no LoRA resolver 'other' is registered \(there are .*shelf"):
        lora_resolver("other")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    found = asyncio.run(resolver.resolve_lora("m", "x"))
    assert found is not None and found.lora_path == str(tmp_path / "x")
    assert [asyncio.run(resolver.resolve_lora("m", n)) for n in ("p", "y", "../x", "x/", "")] == [None] * 5
    with pytest.raises(TypeError, match="is not a LoRAResolver"):
        register_lora_resolver("bad", object())  # type: ignore[arg-type]
