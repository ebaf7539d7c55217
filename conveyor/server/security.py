"""Who may call the API: API keys (vLLM's --api-key) and CORS for browsers.

`install_security` wraps a built app. The key check is plain ASGI middleware in front of every
route, streaming ones included: a request must carry `Authorization: Bearer KEY` with one of
the server's keys, compared in constant time, or it is answered 401 in OpenAI's error shape
(`invalid_api_key`, which the `openai` client raises as `AuthenticationError`) before it reaches
a handler. vLLM guards only the paths under /v1; conveyor guards every route but the probes a
load balancer or Prometheus polls (`OPEN_PATHS`), so /tokenize, /score and the adapter routes
need a key too. CORS preflights (OPTIONS) pass without one, as browsers send them without
credentials; the CORS middleware sits outside the key check and answers them.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from conveyor.server.config import ServerConfig
from conveyor.server.errors import error_body

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


class ApiKeyMiddleware:
    """Answer 401 to an HTTP request without a right `Authorization: Bearer` key."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self._keys = [k.encode() for k in keys]

    def _allowed(self, scope: Scope) -> bool:
        if scope.get("method") == "OPTIONS":
            return True
        root = scope.get("root_path", "")
        path = scope.get("path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path in OPEN_PATHS:
            return True
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # Every key compared, each in constant time: the reply's timing tells nothing of which.
        return sum(hmac.compare_digest(token, k) for k in self._keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(
            "Incorrect or missing API key: send it as the header `Authorization: Bearer <key>`.",
            "invalid_request_error", code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def install_security(app: FastAPI, config: ServerConfig) -> None:
    """The key check (when the server has keys), then CORS outermost (middleware added last
    runs first)."""
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, keys=config.api_key)
    cors: dict[str, Any] = dict(allow_origins=list(config.allowed_origins), allow_methods=list(config.allowed_methods),
                                allow_headers=list(config.allowed_headers), allow_credentials=config.allow_credentials)
    app.add_middleware(CORSMiddleware, **cors)
