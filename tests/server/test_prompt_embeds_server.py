"""vLLM's `prompt_embeds` on the completions API (`--enable-prompt-embeds`): a base64
`torch.save` of a `[tokens, hidden]` tensor answers as `LLM.generate({"prompt_embeds": ...})`
does, beside a prompt of token ids in the same request; what is not a tensor (a pickle of
anything else, read with `weights_only`), bad base64 and a server without the flag are 400s."""

from __future__ import annotations

import base64
import io
import pickle
from pathlib import Path

import httpx
import torch

from conveyor import LLM, SamplingParams
from tests.server.conftest import ServerProcess


def b64(obj: object) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_prompt_embeds_over_the_completions_api(tiny_model: Path, tmp_path: Path) -> None:
    hidden = LLM(str(tiny_model), num_kv_blocks=16).engine.runner.model.arch.hidden_size  # type: ignore[attr-defined]
    embeds = torch.randn(6, hidden, generator=torch.Generator().manual_seed(0)) * 0.05
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    local = LLM(str(tiny_model), num_kv_blocks=64, enable_prompt_embeds=True)
    want = local.generate({"prompt_embeds": embeds}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    want_ids = local.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "256", "--enable-prompt-embeds"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"prompt_embeds": b64(embeds[None]), "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["token_ids"] for c in choices] == [want, want_ids]
        assert r.json()["usage"]["prompt_tokens"] == 6 + 3
        for bad in ("not base64!", base64.b64encode(pickle.dumps({1, 2})).decode(), b64({"x": {1, 2}}),
                    b64(torch.zeros(2, hidden + 1))):
            r = httpx.post(server.url + "/v1/completions", json={"prompt_embeds": bad, "max_tokens": 2}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds", r.text
    finally:
        assert server.stop() == 0
    plain = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "64"], tmp_path / "plain.log")
    try:
        plain.wait_ready()
        r = httpx.post(plain.url + "/v1/completions", json={"prompt_embeds": b64(embeds), "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and "enable_prompt_embeds" in r.json()["error"]["message"]
    finally:
        assert plain.stop() == 0
