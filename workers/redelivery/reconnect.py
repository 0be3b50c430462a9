"""After a broker reconnect, put back the messages this worker no longer tracks.

When the broker connection drops (a Redis restart), the consumer's delivery tags belong
to the old channel: a reserved message that is not running by the time the consumer
reconnects may never be acked, and the broker (append-only persistence keeps it as
unacked) would hand it out again only after the visibility timeout (hours, above the
longest job). This consumer step runs each time the consumer (re)starts: every message
this worker recorded as reserved (``ib:inflight:<worker>``) that is not running is
restored to the head of its queue at once. If the thread pool still starts one of them
later, the job record lets only one delivery finish (workers.running.tasks). Running jobs carry
on and finish normally. Often there is nothing to restore: reserved jobs the pool
started during a short outage finish and ack as usual.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import Celery, bootsteps
from celery.worker.state import active_requests

from workers.redelivery import reaper
from workers.redelivery.inflight import InflightLedger

log = logging.getLogger(__name__)


def restore_step(client: redis.Redis, inflight: InflightLedger) -> type[bootsteps.StartStopStep]:
    """The consumer step for this worker's in-flight ledger (Celery makes the instance itself)."""

    class RestoreReservedOnReconnect(bootsteps.StartStopStep):
        """After Tasks has set up consuming, before the event loop runs."""

        requires = {"celery.worker.consumer.tasks:Tasks"}

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.starts = 0

        def start(self, parent: Any) -> None:  # the worker's Consumer
            self.starts += 1
            if self.starts == 1:
                return  # the first connection: nothing was reserved before it
            if not inflight.flush():
                log.warning("broker reconnected: in-flight records not yet written; restoring from what is there")
            running = {r.id for r in active_requests}
            held = {k.decode(): v.decode() for k, v in client.hgetall(inflight.key).items()}
            lost = {task_id: tag for task_id, tag in held.items() if task_id not in running}
            log.info("broker reconnected: %d job(s) reserved, %d running", len(held), len(running))
            if not lost:
                return
            reaper.restore_tags(parent.app, list(lost.values()))
            client.hdel(inflight.key, *lost)
            log.warning("broker reconnected: put %d reserved job(s) back on their queues", len(lost))

    return RestoreReservedOnReconnect


def install(app: Celery, client: redis.Redis, inflight: InflightLedger) -> None:
    app.steps["consumer"].add(restore_step(client, inflight))
