"""A job's own writes outlive a broker outage: they wait for Redis instead of failing the job.

The worker's Redis client already retries a lost connection for ``redis.retry_s`` (60 s).
A task that still raised after that lost its job: the job record said it was running on
this live worker, the task's failure acked the message, and nothing ran the job again;
or, where the ack could not land, the job ran a second time although the first run had
its outcome in hand. So the writes that decide a job's fate (becoming its attempt,
recording its outcome) keep waiting for as long as the outage lasts, and the outcome is
written when Redis is back. Only a worker that is shutting down stops waiting: its
messages stay unacked (the broker is down, no ack can land) and recorded as held, and the
reaper or the visibility timeout hands them out again.

Writes that only help (prefix hints) are dropped in an outage instead: they are refreshed
by the next job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from celery.worker import state as worker_state

log = logging.getLogger(__name__)

T = TypeVar("T")
PAUSE_S = 1.0  # between tries, after the client's own retries gave up
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


def shutting_down() -> bool:
    """Celery's warm or cold shutdown has begun in this process."""
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


def until_reachable(job_id: str, what: str, call: Callable[[], T], pause_s: float = PAUSE_S) -> T:
    """``call()``, tried again for as long as Redis is unreachable (unless the worker is
    stopping, when the last error is raised). ``what`` names the write in the log line."""
    started = time.monotonic()
    while True:
        try:
            return call()
        except UNREACHABLE as exc:
            if shutting_down():
                raise
            waited = time.monotonic() - started
            log.warning(
                "job %s: Redis unreachable for %.0f s (%s); %s waits for it", job_id, waited, type(exc).__name__, what
            )
            time.sleep(pause_s)


def best_effort(what: str, call: Callable[[], object]) -> None:
    """``call()``; in an outage it is skipped with a warning (a write that only helps)."""
    try:
        call()
    except UNREACHABLE as exc:
        log.warning("%s skipped: Redis unreachable (%s)", what, type(exc).__name__)
