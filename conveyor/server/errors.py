"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, whatever raised them.

`install_error_handlers` maps every exception a request can raise to its status: 400 bad
parameters (pydantic's or `InvalidRequestError`), 404 unknown model or route, 429 queue full,
503 shutting down or engine dead, 500 only for the server's own failures.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.sampling_params import InvalidRequestError
from conveyor.server.async_engine import EngineDeadError, EngineShuttingDownError, QueueFullError

logger = logging.getLogger("conveyor.server")


class APIError(Exception):
    """An error answered with OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code,
        )

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    def handler(
        fn: Callable[[Any], JSONResponse],
    ) -> Callable[[Request, Any], Awaitable[JSONResponse]]:
        async def wrapped(request: Request, exc: Any) -> JSONResponse:
            return fn(exc)

        return wrapped

    app.add_exception_handler(APIError, handler(lambda e: e.response()))
    app.add_exception_handler(
        InvalidRequestError,
        handler(lambda e: error_response(400, str(e), "invalid_request_error", e.param)),
    )
    app.add_exception_handler(
        QueueFullError,
        handler(lambda e: error_response(429, str(e), "rate_limit_error", code="queue_full")),
    )
    app.add_exception_handler(
        EngineShuttingDownError,
        handler(lambda e: error_response(503, str(e), "service_unavailable_error", code="shutting_down")),
    )
    app.add_exception_handler(
        EngineDeadError,
        handler(lambda e: error_response(503, str(e), "service_unavailable_error", code="engine_dead")),
    )
    app.add_exception_handler(RequestValidationError, handler(_validation_error))
    app.add_exception_handler(StarletteHTTPException, handler(_http_error))

    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s: %r", request.method, request.url.path, exc)
        return error_response(500, "internal server error", "internal_server_error")

    app.add_exception_handler(Exception, internal)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if not errors:
        return error_response(400, "invalid request body", "invalid_request_error")
    first = errors[0]
    # Drop "body" and pydantic's union-member tags ("str", "list[TextPart]"): not fields.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(str(p))]
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('msg')}", "invalid_request_error")
    param = ".".join(loc) if loc else None
    msg = first.get("msg", "invalid value")
    message = f"{param}: {msg}" if param else str(msg)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(400, message, "invalid_request_error", param)


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none")


def _http_error(exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, str(exc.detail), kind, code=code)
