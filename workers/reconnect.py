"""After a broker reconnect, put back the messages Celery let go of.

When the broker connection drops (a Redis restart), Celery's consumer forgets the
messages it had reserved but not started: their delivery tags belonged to the old
channel. The broker still holds them as unacked (append-only persistence keeps them), and
would hand them out again only after the visibility timeout (hours, above the longest
job). This consumer step runs each time the consumer (re)starts: every message this
worker recorded as reserved (``ib:inflight:<worker>``) that is not running is restored to
the head of its queue at once. Running jobs carry on and finish normally.
"""

from __future__ import annotations

import logging

from celery import Celery, bootsteps
from celery.worker.state import active_requests

from dispatcher.fleet import inflight_key
from workers import reaper, tasks

log = logging.getLogger(__name__)


class RestoreReservedOnReconnect(bootsteps.StartStopStep):
    """A consumer step: after Tasks has set up consuming, before the event loop runs."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent, **kwargs) -> None:  # noqa: ANN001
        super().__init__(parent, **kwargs)
        self.starts = 0

    def start(self, parent) -> None:  # noqa: ANN001
        self.starts += 1
        rt = tasks.RUNTIME
        if self.starts == 1 or rt is None:
            return  # the first connection: nothing was reserved before it
        running = {r.id for r in active_requests}
        held = {k.decode(): v.decode() for k, v in rt.redis.hgetall(inflight_key(rt.worker_id)).items()}
        lost = {task_id: tag for task_id, tag in held.items() if task_id not in running}
        if not lost:
            return
        reaper.restore_tags(parent.app, list(lost.values()))
        rt.redis.hdel(inflight_key(rt.worker_id), *lost)
        log.warning("broker reconnected: put %d reserved job(s) back on their queues", len(lost))


def install(app: Celery) -> None:
    app.steps["consumer"].add(RestoreReservedOnReconnect)
