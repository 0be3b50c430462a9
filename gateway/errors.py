"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
HTTP status the official SDKs turn into their typed exceptions (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 413, 429 RateLimitError, 503).

Nothing leaves in another shape: a Redis or broker fault is a 503 ``service_unavailable``
with ``Retry-After`` (the SDKs retry it), and a bug is a 500 that carries a request id the
log line beside its traceback also carries, never the traceback itself.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError as BrokerError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import JobError
from core.store.faults import WAIT_OUT

log = logging.getLogger("gateway.errors")

# A fleet error code → (HTTP status, OpenAI error type).
JOB_ERROR_STATUS: dict[str, tuple[int, str]] = {
    "validation_error": (400, "invalid_request_error"),
    "unsupported_parameter": (400, "invalid_request_error"),
    "unknown_backend": (400, "invalid_request_error"),
    "unsupported_by_backend": (400, "invalid_request_error"),
    "context_overflow": (400, "invalid_request_error"),
    "invalid_batch": (400, "invalid_request_error"),
    "unknown_model": (404, "invalid_request_error"),
    "unknown_job": (404, "invalid_request_error"),
    "unknown_batch": (404, "invalid_request_error"),
    "no_live_worker": (503, "service_unavailable"),
    "timeout": (504, "timeout"),
    "engine_failure": (500, "server_error"),
    "enqueue_failed": (503, "service_unavailable"),
}
# OpenAI's own code where it has one for the same thing.
OPENAI_CODE = {"unknown_model": "model_not_found"}
STATUS_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type_ or STATUS_TYPE.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_job_error(cls, exc: JobError) -> APIError:
        status, type_ = JOB_ERROR_STATUS.get(exc.code, (500, "server_error"))
        param = None
        errors = exc.details.get("errors") if isinstance(exc.details, dict) else None
        if errors and isinstance(errors, list):
            param = str(errors[0].get("field")) or None
        return cls(status, exc.message, OPENAI_CODE.get(exc.code, exc.code), param, type_)


# Faults of the fleet's Redis or broker, not of the request: down, restarting, loading its
# data, a replica that cannot be written, or full (maxmemory with noeviction).
STORE_FAULTS: tuple[type[BaseException], ...] = (*WAIT_OUT, BrokerError)


def store_fault(exc: BaseException, retry_after_s: int) -> APIError:
    """A 503 naming what is wrong in words an operator can act on (no address, no key)."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        what = "the fleet's Redis is full (maxmemory reached)"
    elif isinstance(exc, redis.ReadOnlyError):
        what = "the fleet's Redis is a read-only replica (failover in progress?)"
    else:
        what = "the fleet's Redis or broker is unreachable"
    return APIError(
        503,
        f"{what}: retry later",
        "service_unavailable",
        type_="service_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


def unexpected(exc: BaseException) -> APIError:
    """A bug's answer: a request id to quote, logged here with the traceback."""
    request_id = f"req_{uuid.uuid4().hex[:24]}"
    log.error("request %s failed: %s", request_id, type(exc).__name__, exc_info=exc)
    return APIError(
        500,
        f"internal error (request id {request_id}): the server log has the details",
        "server_error",
        headers={"x-request-id": request_id},
    )


def install(app: FastAPI) -> None:
    """Every error leaves as OpenAI's shape: ours, the fleet's, FastAPI's and a bug's."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(JobError)
    async def _job(_: Request, exc: JobError) -> JSONResponse:
        return APIError.from_job_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return APIError(400, f"{param or 'request'}: {first['msg']}", "invalid_request", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code).response()


class CatchAll:
    """ASGI middleware inside Starlette's own error middleware (whose 500 is plain text):
    an exception no handler answered becomes OpenAI's shape, a 503 for a store fault and a
    500 with a request id for anything else. Once a response has started (a stream) it
    cannot be answered any more: the route itself ends a stream with an error event."""

    def __init__(self, app: ASGIApp, retry_after_s: int) -> None:
        self.app, self.retry_after_s = app, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            if isinstance(exc, STORE_FAULTS):
                log.warning("%s %s: 503, %s", scope["method"], scope["path"], type(exc).__name__)
                error = store_fault(exc, self.retry_after_s)
            else:
                error = unexpected(exc)
            await error.response()(scope, receive, send)
