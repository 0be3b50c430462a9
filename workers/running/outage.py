"""A job's own writes outlive a broker outage: they wait for Redis instead of failing the job.

The worker's Redis client already retries a lost connection for ``redis.retry_s`` (60 s).
A task that still raised after that lost its job: the job record said it was running on
this live worker, the task's failure acked the message, and nothing ran the job again;
or, where the ack could not land, the job ran a second time although the first run had
its outcome in hand. So the writes that decide a job's fate (becoming its attempt,
recording its outcome) keep waiting for as long as the outage lasts, and the outcome is
written when Redis is back. The same holds for a Redis that is full (``maxmemory`` under
``noeviction``) or a read-only replica mid-failover (core.store.faults). Only a worker
that is shutting down stops waiting: its messages stay unacked (the broker is down, no
ack can land) and recorded as held, and the reaper or the visibility timeout hands them
out again.

Writes that only help (prefix hints) are dropped in an outage instead: they are refreshed
by the next job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import redis
from celery.worker import state as worker_state

from core.store.faults import WAIT_OUT, Episode, describe, wait_out

log = logging.getLogger(__name__)

T = TypeVar("T")
UNREACHABLE = WAIT_OUT  # unreachable, read-only or full: each ends by itself
_episode = Episode(log, "job records")


def watch(client: redis.Redis) -> None:
    """The worker's Redis client: a full Redis is logged with its memory numbers."""
    _episode.client = client


def shutting_down() -> bool:
    """Celery's warm or cold shutdown has begun in this process."""
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


def until_reachable(job_id: str, what: str, call: Callable[[], T]) -> T:
    """``call()``, tried again for as long as Redis is unreachable, read-only or full
    (unless the worker is stopping, when the last error is raised). ``what`` names the
    write in the log line, which is written once per episode, not per job."""
    return wait_out(_episode, f"job {job_id}: {what}", call, stop=shutting_down)


def best_effort(what: str, call: Callable[[], object]) -> None:
    """``call()``; in an outage it is skipped with a warning (a write that only helps)."""
    try:
        call()
    except UNREACHABLE as exc:
        log.warning("%s skipped: %s", what, describe(exc))
