"""KV offloading's disk tier through the server: a restarted server (a new process, a new engine)
finds on disk the prefixes the one before it computed, and says so in the usage it reports."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess, sample, scrape


def test_a_restarted_server_finds_its_prefixes_on_disk(tiny_model: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_model), "--num-kv-blocks", "64", "--num-offload-blocks", "16",
            "--kv-offloading-policy", "write_through", "--kv-disk-path", str(tmp_path / "kv"),
            "--kv-disk-size", str(1 << 24)]
    request = {"prompt": list(range(5, 75)), "max_tokens": 4, "temperature": 0.0, "logprobs": 0}
    answers = []
    for run in range(2):
        server = ServerProcess(args, tmp_path / f"server{run}.log")
        try:
            server.wait_ready()
            answer = httpx.post(server.url + "/v1/completions", json=request, timeout=120.0)
            assert answer.status_code == 200, answer.text
            answers.append(answer.json())
            metrics = scrape(server.url)
        finally:
            server.stop()
        if run == 0:  # every full block of the prompt went to disk (the step after it was computed)
            assert len(list((tmp_path / "kv").glob("*/*.kv"))) == 70 // 16
            assert sample(metrics, "conveyor:kv_disk_blocks_written_total") == 70 // 16
    first, again = answers
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (70 - 1) // 16 * 16
    assert sample(metrics, "conveyor:kv_disk_blocks_read_total") == (70 - 1) // 16
    assert again["choices"][0]["logprobs"]["tokens"] == first["choices"][0]["logprobs"]["tokens"]
