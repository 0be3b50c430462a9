"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
HTTP status the official SDKs turn into their typed exceptions (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 413, 429 RateLimitError, 503)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import JobError

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
