"""Redis faults the fleet waits out instead of failing on, and how they are told.

Four faults are not the job's fault and end by themselves: Redis unreachable (restart,
network), a timeout, a read-only replica (a failover in progress) and a full Redis
(``maxmemory`` reached under ``noeviction``: every write that may grow memory is refused
until something is freed). A job's own writes, the worker's broker bookkeeping and the
batch feeder wait for them with a bounded back-off; anything else Redis answers is an
error of the caller's own and fails what it was doing.

An operator reads one line when such a fault starts (with the memory numbers when Redis is
full), a reminder each minute while it lasts and one line when it ends, per process and
per part, not one per job and per try.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

T = TypeVar("T")

WAIT_OUT: tuple[type[BaseException], ...] = (
    redis.ConnectionError,  # BusyLoadingError (a restart reading its data) is one
    redis.TimeoutError,
    redis.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
)
REMIND_S = 60.0
PAUSE_MIN_S, PAUSE_MAX_S = 0.1, 2.0  # so work resumes within ~2 s of the fault's end


def memory_numbers(client: redis.Redis | None) -> str:
    """'used 63.9 MiB of maxmemory 64.0 MiB, policy noeviction' (or '' if unreadable)."""
    if client is None:
        return ""
    try:
        info = client.info("memory")
    except redis.RedisError:
        return ""
    mib = 1 << 20
    used, peak = info.get("used_memory", 0) / mib, info.get("maxmemory", 0) / mib
    return f"used {used:.1f} MiB of maxmemory {peak:.1f} MiB, policy {info.get('maxmemory_policy', '?')}"


def describe(exc: BaseException, client: redis.Redis | None = None) -> str:
    """The fault in an operator's words."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        numbers = memory_numbers(client)
        return "Redis is full" + (f" ({numbers})" if numbers else " (maxmemory reached)")
    if isinstance(exc, redis.ReadOnlyError):
        return "Redis is a read-only replica (a failover in progress?)"
    return f"Redis is unreachable ({type(exc).__name__})"


class Episode:
    """One part's fault, from its first failure to its first success after it (thread-safe:
    a worker's task threads share one)."""

    def __init__(self, log: logging.Logger, part: str, client: redis.Redis | None = None) -> None:
        self.log, self.part, self.client = log, part, client
        self._lock = threading.Lock()
        self._since: float | None = None
        self._told = 0.0

    def failed(self, exc: BaseException, what: str) -> None:
        now = time.monotonic()
        with self._lock:
            first = self._since is None
            if first:
                self._since = now
            elif now - self._told < REMIND_S:
                return
            self._told = now
            since = self._since
        if first:
            self.log.warning("%s: %s; %s waits for it", self.part, describe(exc, self.client), what)
        else:
            self.log.warning("%s: still waiting after %.0f s: %s", self.part, now - since, describe(exc, self.client))

    def succeeded(self) -> None:
        if self._since is None:  # the common case: no lock taken
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            self.log.warning("%s: Redis answers again after %.1f s; work resumes", self.part, time.monotonic() - since)


def wait_out(
    episode: Episode,
    what: str,
    call: Callable[[], T],
    stop: Callable[[], bool] = lambda: False,
    faults: tuple[type[BaseException], ...] = WAIT_OUT,
) -> T:
    """``call()``, tried again with a back-off (0.1 s doubling to 2 s) for as long as Redis
    has one of ``faults``; ``stop()`` true gives up with the last error."""
    pause = PAUSE_MIN_S
    while True:
        try:
            out = call()
        except faults as exc:
            episode.failed(exc, what)
            if stop():
                raise
            time.sleep(pause)
            pause = min(pause * 2, PAUSE_MAX_S)
            continue
        episode.succeeded()
        return out
