"""Where a worker puts a message it cannot run: the dead-letter list, never the void.

Celery's consumer logs such a message (body and all: the prompt would land in the log)
and acks it. Here the consumer hands it to ``core.store.dead_letters`` with the
reason instead and logs only the reason; the ``ib.generate`` task does the same for
arguments that do not validate, and fails the job's record (and its batch line) with a
typed ``InvalidMessageError`` when the job id is readable, so no caller waits forever.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from celery.worker.consumer import Consumer
from pydantic import BaseModel, ValidationError

from core.celery_app import GENERATE_GROUP_TASK
from core.errors import InvalidMessageError
from core.jobs import GenerationJob, Selection
from core.records import job_error_record
from core.store import keys
from core.store.dead_letters import DeadLetter, DeadLetters, letter_from_message
from core.store.jobstore import JobStore, LineRecord

log = logging.getLogger(__name__)


def consumer_class(letters: DeadLetters) -> type[Consumer]:
    """Celery's consumer, with the four ways it drops a message sending it here instead
    (``worker_consumer`` takes the class itself)."""

    class DeadLetterConsumer(Consumer):
        def _keep(self, reason: str, exc: BaseException | None, message: Any) -> None:
            detail = f"{type(exc).__name__}: {exc}" if exc is not None else "not a Celery task message"
            letter = letter_from_message(reason, detail, message)
            letters.add(letter)
            log.error("dead letter %s (%s, task %s): %s", letter.id, reason, letter.task, detail[:200])

        def on_decode_error(self, message: Any, exc: Exception) -> None:
            self._keep("undecodable", exc, message)
            message.ack()

        def on_unknown_message(self, body: Any, message: Any) -> None:
            self._keep("unknown_format", None, message)
            message.reject_log_error(log, self.connection_errors)

        def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
            self._keep("unknown_task", exc, message)
            message.reject_log_error(log, self.connection_errors)

        def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
            self._keep("invalid_task", exc, message)
            message.reject_log_error(log, self.connection_errors)

    return DeadLetterConsumer


def parse_arguments(args: tuple, kwargs: dict) -> tuple[GenerationJob, Selection]:
    """``ib.generate``'s (job, selection), or InvalidMessageError naming what is wrong
    (field paths and reasons only: the values may be the prompt)."""
    if kwargs or len(args) != 2:
        raise InvalidMessageError(
            f"ib.generate takes (job, selection); got {len(args)} argument(s), keywords {sorted(kwargs)}"
        )
    return _validated(GenerationJob, args[0], "job"), _validated(Selection, args[1], "selection")


def parse_group_arguments(args: tuple, kwargs: dict) -> list[tuple[GenerationJob, Selection]]:
    """``ib.generate_group``'s [job, selection] pairs, or InvalidMessageError naming the
    first entry that is wrong (a group is sent by one client: one bad entry, all suspect)."""
    if kwargs or not args:
        raise InvalidMessageError(
            f"ib.generate_group takes [job, selection] pairs; got {len(args)} argument(s), keywords {sorted(kwargs)}"
        )
    items = []
    for i, pair in enumerate(args):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise InvalidMessageError(f"ib.generate_group: entry {i} is not a [job, selection] pair")
        job = _validated(GenerationJob, pair[0], f"[{i}].job")
        items.append((job, _validated(Selection, pair[1], f"[{i}].selection")))
    return items


M = TypeVar("M", bound=BaseModel)


def _validated(model: type[M], data: object, name: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where = "; ".join(f"{name}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        raise InvalidMessageError(f"the message does not match this worker's schema: {where}") from None


def dead_letter_task(
    letters: DeadLetters, store: JobStore, request: Any, args: tuple, kwargs: dict, exc: InvalidMessageError
) -> list[str]:
    """Keep a task whose arguments did not validate, and fail its jobs (and batch lines):
    a group message's every job whose id is readable. Returns the ids of the jobs failed."""
    info = getattr(request, "delivery_info", None) or {}
    letter = DeadLetter(
        reason="invalid_arguments",
        detail=exc.message,
        queue=info.get("routing_key"),
        task=getattr(request, "task", None),
        task_id=getattr(request, "id", None),
        body=json.dumps({"args": list(args), "kwargs": kwargs}, default=str),
        content_type="application/json",
        priority=info.get("priority"),
    )
    letters.add(letter)
    log.error("dead letter %s (invalid_arguments, task %s): %s", letter.id, letter.task_id, exc.message[:200])
    error = InvalidMessageError(f"{exc.message} (dead letter {letter.id})", {"dead_letter": letter.id})
    failed = []
    for job, job_id in _named_jobs(request, args, letter.task_id):
        if store.r.exists(keys.job(job_id)):
            store.finish(job_id, "failed", error.to_dict(), line=_batch_line(job, job_id, error))
            failed.append(job_id)
    return failed


def _named_jobs(request: Any, args: tuple, task_id: str | None) -> list[tuple[dict, str]]:
    """(job fields as sent, job id) for each job a bad message names: a group's entries,
    else its one job (whose id is the task's if the fields lack it)."""
    if getattr(request, "task", None) == GENERATE_GROUP_TASK:
        jobs = [pair[0] for pair in args if isinstance(pair, list) and pair and isinstance(pair[0], dict)]
        return [(job, job["id"]) for job in jobs if isinstance(job.get("id"), str)]
    job = args[0] if args and isinstance(args[0], dict) else {}
    job_id = job.get("id") if isinstance(job.get("id"), str) else task_id
    return [(job, job_id)] if job_id else []


def _batch_line(job: dict, job_id: str, error: InvalidMessageError) -> LineRecord | None:
    batch_id, line, custom_id = job.get("batch_id"), job.get("batch_line"), job.get("custom_id")
    if not (isinstance(batch_id, str) and isinstance(line, int) and isinstance(custom_id, str)):
        return None
    return LineRecord(batch_id, line, job_error_record(custom_id, job_id, error), "failed")
