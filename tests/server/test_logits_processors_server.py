"""`conveyor serve --logits-processors module:Class`: a request's `vllm_xargs` reach the
engine's processor (in the engine's own process) as `SamplingParams.extra_args`."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess


def test_vllm_xargs_reach_the_engines_processor(tiny_model: Path, tmp_path: Path) -> None:
    server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "256",
                            "--logits-processors", "tests.test_logits_processors:Force"], tmp_path / "server.log")
    try:
        server.wait_ready()

        def tokens(**extra: object) -> list[str]:
            body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                    "return_tokens_as_token_ids": True, **extra}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60.0)
            assert r.status_code == 200, r.text
            return list(r.json()["choices"][0]["logprobs"]["tokens"])

        assert tokens(vllm_xargs={"force": 77}) == ["token_id:77"] * 6
        assert tokens() != ["token_id:77"] * 6  # (a request that does not ask is left alone)
    finally:
        assert server.stop() == 0
