"""What every request handler reaches through ``request.app.state.fleet``: the fleet's
client, an asyncio Redis client for waiting, the gateway's settings and its stores. All
state is in Redis and the file store; the process holds only connections.

The client is synchronous: every call of it runs in a worker thread, never on the event
loop, so a Redis that stops answering holds up the requests that need it (for at most
``gateway.redis_wait_s``) and not every other request, ``/health`` included.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio
import redis.asyncio
from fastapi import Request

from core.settings import GatewaySettings
from core.store import keys
from dispatcher.client import Client, JobHandle
from gateway.errors import STORE_FAULTS
from gateway.files import FileStore
from gateway.quota import Quota

log = logging.getLogger(__name__)


@dataclass
class Fleet:
    client: Client
    aredis: redis.asyncio.Redis
    cfg: GatewaySettings
    quota: Quota
    files: FileStore
    batch_staging: anyio.CapacityLimiter  # batch files validated at once (gateway.batch_stagings)
    # Cancels and quota releases run in threads of their own few: in an outage each holds a
    # thread for the client's retries, and sixty of them must not take the threads that
    # new requests need to get their 503.
    cleanup: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(4))

    _pending: set[asyncio.Task] = field(default_factory=set)

    def cancel(self, job_id: str) -> None:
        """Ask the job to stop (nobody will read its answer), in the background: a
        response never waits for it (in a Redis outage it is given up after the client's
        retries, with a warning)."""
        self._later(f"cancel of job {job_id}", self.client.cancel, job_id)

    def release(self, tenant: str, job_id: str) -> None:
        """Give back the request's slot of its key's limit, in the background; in an
        outage the slot expires at its deadline instead (gateway.quota)."""
        self._later(f"quota release of job {job_id}", self.quota.release, tenant, job_id)

    @contextmanager
    def resending_if_lost(self, handle: JobHandle) -> Iterator[None]:
        """While the request waits: every ``client.lost_check_s``, a job still queued whose
        message was lost on its way to a worker is sent again (Client.resend_if_lost)."""
        task = asyncio.get_running_loop().create_task(self._resend_if_lost(handle))
        try:
            yield
        finally:
            task.cancel()

    async def _resend_if_lost(self, handle: JobHandle) -> None:
        if handle.job is None or handle.selection is None:
            return
        every = self.client.parts.lost_check_s
        while True:
            await asyncio.sleep(every)
            try:
                if await self.aredis.hget(keys.job(handle.id), "status") == b"queued":
                    check = self.client.resend_if_lost
                    await anyio.to_thread.run_sync(check, handle.job, handle.selection, limiter=self.cleanup)
            except STORE_FAULTS as exc:
                log.warning("job %s: lost-message check skipped: %s", handle.id, type(exc).__name__)

    def _later(self, what: str, call: Callable[..., object], *args: str) -> None:
        task = asyncio.get_running_loop().create_task(_off_loop(what, self.cleanup, call, *args))
        self._pending.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._pending.discard)


CLEANUP_FOR_S = 300.0  # a cancel or release tried this long through a Redis outage


async def _off_loop(what: str, limiter: anyio.CapacityLimiter, call: Callable[..., object], *args: str) -> None:
    """``call(*args)`` in a thread, tried again through a Redis outage: a cancel that never
    lands leaves a worker generating for nobody, ahead of the requests that come next."""
    give_up = time.monotonic() + CLEANUP_FOR_S
    pause = 0.5
    while True:
        try:
            await anyio.to_thread.run_sync(call, *args, limiter=limiter)
            return
        except STORE_FAULTS as exc:
            if time.monotonic() > give_up:
                log.warning("%s given up after %.0f s: %s", what, CLEANUP_FOR_S, type(exc).__name__)
                return
        await asyncio.sleep(pause)
        pause = min(pause * 2, 5.0)


def fleet_of(request: Request) -> Fleet:
    return request.app.state.fleet
