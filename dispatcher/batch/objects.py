"""A batch as OpenAI's API describes one (``Batch``), plus what the fleet knows about its
run, read from its record in Redis; and the errors a batch call raises."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, Field

from core.errors import JobError
from core.jobs import Priority
from core.store.batchstore import FINAL_STATUSES

WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class UnknownBatchError(JobError, LookupError):
    code = "unknown_batch"


class BatchInputError(JobError, ValueError):
    code = "invalid_batch"


class BatchLimitError(JobError):
    """The owner has as many batches validating or running as it may (checked and taken
    in one step: concurrent creates cannot both take the last slot)."""

    code = "batch_limit"


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrors(BaseModel):
    object: str = "list"
    data: list[dict[str, Any]] = Field(default_factory=list)


class Batch(BaseModel):
    """A batch as OpenAI's API describes one, plus what the fleet knows about its run."""

    id: str
    object: str = "batch"
    endpoint: str | None = None
    input_file: str | None = None
    input_file_id: str | None = None  # the gateway's uploaded file it was made from
    completion_window: str
    status: str
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    errors: BatchErrors | None = None
    metadata: dict[str, str] | None = None
    # ours, beyond OpenAI's object:
    model: str | None = None
    priority: str = Priority.batch.value
    completion_tokens: int = 0
    prompt_tokens: int = 0
    owner: str | None = Field(default=None, exclude=True)  # the API key (a hash) that created it
    fed: int = 0  # lines handed to the queues so far
    feed_s: float = 0.0  # time the feeder spent deciding and enqueueing them
    feed_cpu_s: float = 0.0  # CPU time of that
    backends: dict[str, int] = Field(default_factory=dict)  # lines per backend the tree chose

    @property
    def done(self) -> int:
        return self.request_counts.completed + self.request_counts.failed

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES

    @classmethod
    def from_record(cls, h: dict[str, str]) -> Batch:
        def ts(key: str) -> int | None:
            return int(float(h[key])) if key in h else None

        return cls(
            id=h["id"],
            endpoint=h.get("endpoint"),
            input_file=h.get("input_file"),
            input_file_id=h.get("input_file_id"),
            completion_window=h.get("completion_window", "24h"),
            status=h["status"],
            created_at=ts("created_at") or 0,
            in_progress_at=ts("in_progress_at"),
            expires_at=ts("expires_at") or 0,
            completed_at=ts("completed_at"),
            failed_at=ts("failed_at"),
            expired_at=ts("expired_at"),
            cancelling_at=ts("cancelling_at"),
            cancelled_at=ts("cancelled_at"),
            request_counts=RequestCounts(
                total=int(h.get("total", 0)),
                completed=int(h.get("completed", 0)),
                failed=int(h.get("failed", 0)),
            ),
            errors=BatchErrors.model_validate_json(h["errors"]) if "errors" in h else None,
            metadata=json.loads(h["metadata"]) if "metadata" in h else None,
            model=h.get("model"),
            priority=h.get("priority", Priority.batch.value),
            completion_tokens=int(h.get("completion_tokens", 0)),
            prompt_tokens=int(h.get("prompt_tokens", 0)),
            owner=h.get("owner"),
            fed=int(h.get("fed", 0)),
            feed_s=float(h.get("feed_s", 0.0)),
            feed_cpu_s=float(h.get("feed_cpu_s", 0.0)),
            backends={k.split(":", 1)[1]: int(v) for k, v in h.items() if k.startswith("backend:")},
        )


def parse_window(window: str, longest: str | None = None) -> int:
    """'24h' → seconds. OpenAI accepts only 24h; any positive s/m/h/d window up to
    ``longest`` (``batch.max_completion_window``) is served here: a batch's data is kept
    for its window plus the retention, so an unbounded window would keep it for ever."""
    m = re.fullmatch(r"\s*(\d{1,9})\s*([smhd])\s*", window)
    if not m or int(m.group(1)) <= 0:
        raise BatchInputError(f"completion_window {window!r} is not a duration like 24h, 90m or 2d", {"window": window})
    seconds = int(m.group(1)) * WINDOW_UNITS[m.group(2)]
    if longest is not None and seconds > parse_window(longest):
        raise BatchInputError(
            f"completion_window {window!r} is longer than this fleet allows ({longest}, batch.max_completion_window)",
            {"window": window, "max": longest},
        )
    return seconds
