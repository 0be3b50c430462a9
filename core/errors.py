"""The fleet's typed errors: one class per way a job can fail or be refused.

Every error round-trips through JSON (``to_dict`` / ``from_dict`` by its ``code``), so
the one a worker records is the one the client raises, and the gateway maps each code
to an HTTP status (gateway.errors).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class JobError(Exception):
    """Base of every typed fleet error. ``args`` are (message, details) so that Celery's
    JSON exception transport can rebuild the same class on the client."""

    code = "error"

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details or {})
        self.message = message
        self.details = details or {}

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "type": type(self).__name__, "message": self.message, "details": self.details}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> JobError:
        cls = ERROR_TYPES.get(data.get("code", ""), JobError)
        return cls(data.get("message", ""), data.get("details") or {})


class JobValidationError(JobError, ValueError):
    code = "validation_error"

    @classmethod
    def from_pydantic(cls, exc: ValidationError) -> JobValidationError:
        problems = [
            {"field": ".".join(str(p) for p in err["loc"]) or "(job)", "message": err["msg"]} for err in exc.errors()
        ]
        text = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
        return cls(f"invalid job: {text}", {"errors": problems})


class UnsupportedParameterError(JobValidationError):
    """A request field the fleet does not serve at all (no backend could): refused by name."""

    code = "unsupported_parameter"


class UnknownModelError(JobError, LookupError):
    code = "unknown_model"


class UnknownBackendError(JobError, LookupError):
    code = "unknown_backend"


class UnknownJobError(JobError, LookupError):
    code = "unknown_job"


class UnsupportedByBackendError(JobError):
    code = "unsupported_by_backend"


class NoLiveWorkerError(JobError):
    code = "no_live_worker"


class ContextOverflowError(JobError):
    code = "context_overflow"


class EngineError(JobError):
    code = "engine_failure"


class JobCancelledError(JobError):
    code = "cancelled"


class JobTimeoutError(JobError, TimeoutError):
    code = "timeout"


class InvalidMessageError(JobError, ValueError):
    """The job's broker message could not be run (its arguments do not validate: schema
    drift in a rolling upgrade, a foreign or corrupt message); it is a dead letter."""

    code = "invalid_message"


class EnqueueError(JobError):
    """Some jobs of one submit could not be enqueued (their record or push failed in
    Redis); the rest were. ``details``: ``sent`` and ``not_sent`` (id → reason), so the
    caller resubmits just those (or the same ids again: a sent id is never sent twice)."""

    code = "enqueue_failed"


ERROR_TYPES: dict[str, type[JobError]] = {
    cls.code: cls
    for cls in (
        JobError,
        JobValidationError,
        UnsupportedParameterError,
        UnknownModelError,
        UnknownBackendError,
        UnknownJobError,
        UnsupportedByBackendError,
        NoLiveWorkerError,
        ContextOverflowError,
        EngineError,
        JobCancelledError,
        JobTimeoutError,
        InvalidMessageError,
        EnqueueError,
    )
}
