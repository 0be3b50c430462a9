"""Redeliver the jobs of dead workers.

Every worker records each message it reserves in ``ib:inflight:<worker>`` (task id →
broker delivery tag). When a worker's heartbeat key expires (SIGKILL, OOM, lost host),
any live worker takes a short lock for it and puts those messages back at the head of
their queues through kombu's own ``restore_by_tag``, which also drops them from the
broker's unacked set, so the visibility-timeout restore cannot deliver them a second time.
Exactly-once completion is still guarded by the job record (dispatcher.jobstore).
"""

from __future__ import annotations

import logging

import redis
from celery import Celery

from dispatcher.fleet import WORKERS_SET, inflight_key, worker_key

log = logging.getLogger(__name__)


def restore_tags(app: Celery, tags: list[str]) -> None:
    """Put reserved messages back at the head of their queues (and out of the unacked set)."""
    if not tags:
        return
    with app.connection_for_write() as conn:
        qos = conn.default_channel.qos
        for tag in tags:
            qos.restore_by_tag(tag)


def dead_workers(client: redis.Redis, me: str) -> list[str]:
    ids = [m.decode() for m in client.smembers(WORKERS_SET)]
    others = [i for i in ids if i != me]
    if not others:
        return []
    alive = client.mget([worker_key(i) for i in others])
    return [i for i, beat in zip(others, alive) if beat is None]


def reap(client: redis.Redis, app: Celery, me: str) -> dict[str, int]:
    """Restore every dead worker's reserved messages. Returns {worker: messages restored}."""
    restored: dict[str, int] = {}
    for dead in dead_workers(client, me):
        if not client.set(f"ib:reap-lock:{dead}", me, nx=True, ex=60):
            continue  # another worker is on it
        tags = client.hgetall(inflight_key(dead))
        restore_tags(app, [t.decode() for t in tags.values()])
        pipe = client.pipeline()
        pipe.delete(inflight_key(dead))
        pipe.srem(WORKERS_SET, dead)
        pipe.execute()
        restored[dead] = len(tags)
        log.warning("worker %s is gone: redelivered %d job(s)", dead, len(tags))
    return restored
