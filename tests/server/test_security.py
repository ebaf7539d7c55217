"""Who may call the API: `--api-key` (vLLM's), CORS for browsers, HTTPS, on real servers of
the tiny model."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conveyor.config import ConfigError
from conveyor.server.config import ServerConfig
from tests.server.conftest import ServerProcess, assert_openai_error

KEYS = ("first-key-0f3b9a", "second-key-7c21d4")


@pytest.fixture(scope="module")
def keyed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two keys, and CORS for one origin only."""
    server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "64", "--no-engine-process",
                            "--api-key", *KEYS, "--allowed-origins", "https://app.example"],
                           tmp_path_factory.mktemp("keyed") / "server.log")
    try:
        server.wait_ready()  # (/health asks for no key)
        yield server
    finally:
        server.stop()


def test_a_request_without_a_right_key_is_refused(keyed: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS[0]}"},
                    {"Authorization": f"Bearer {KEYS[0]}x"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            r = httpx.request(method, keyed.url + path, headers=headers, json={"prompt": [5, 6], "max_tokens": 1})
            err = assert_openai_error(r, 401)
            assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_either_key_is_served_and_the_probes_ask_for_none(keyed: ServerProcess) -> None:
    for key in KEYS:
        client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)
        out = client.completions.create(model=client.models.list().data[0].id, prompt=[5, 6, 7], max_tokens=3,
                                        extra_body={"ignore_eos": True})
        assert out.usage is not None and out.usage.completion_tokens == 3
        stream = client.completions.create(model=out.model, prompt=[5, 6, 7], max_tokens=3, stream=True,
                                           extra_body={"ignore_eos": True})
        assert sum(1 for c in stream if c.choices and c.choices[0].text is not None) >= 1
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(keyed.url + path).status_code == 200


def test_cors_answers_the_allowed_origin_only(keyed: ServerProcess) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(keyed.url + "/v1/completions", headers={"Origin": "https://app.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(keyed.url + "/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = httpx.get(keyed.url + "/v1/models", headers={"Origin": "https://app.example",
                                                      "Authorization": f"Bearer {KEYS[1]}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_the_key_is_read_from_the_environment_and_kept_out_of_reprs(tiny_model: Path, tmp_path: Path) -> None:
    """CONVEYOR_API_KEY, behind a proxy that serves the API under /api and strips it
    (--root-path /api): the probes ask for no key, the API does."""
    assert KEYS[0] not in repr(ServerConfig(api_key=KEYS))
    os.environ["CONVEYOR_API_KEY"] = KEYS[1]
    try:
        server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "64", "--no-engine-process",
                                "--root-path", "/api"], tmp_path / "server.log")
    finally:
        del os.environ["CONVEYOR_API_KEY"]
    try:
        server.wait_ready()
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/v1/models").status_code == 401
        ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert ok.status_code == 200, ok.text
        spec = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEYS[1]}"}).json()
        assert spec["servers"] == [{"url": "/api"}]  # the links it gives clients go through the proxy
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="makes a self-signed certificate with openssl")
def test_https_with_a_key_and_certificate(tiny_model: Path, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server = ServerProcess(["--model", str(tiny_model), "--num-kv-blocks", "64", "--no-engine-process",
                            "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)], tmp_path / "server.log")
    url = server.url.replace("http://", "https://")
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", verify=False, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", verify=str(cert),
                       json={"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(server.url + "/health", timeout=5.0)
    finally:
        server.stop()


@pytest.mark.parametrize(("options", "match"), [
    ({"ssl_keyfile": "k.pem"}, "go together"),
    ({"ssl_ca_certs": "ca.pem"}, "needs ssl_keyfile"),
    ({"api_key": ("",)}, "non-empty"),
])
def test_security_options_are_checked(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ServerConfig(**options)
