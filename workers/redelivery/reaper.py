"""Redeliver the jobs of dead workers.

Every worker records each message it reserves in ``ib:inflight:<worker>`` (job id →
broker delivery tag; a group message's tag under each of its jobs). When a worker's
heartbeat key expires (SIGKILL, OOM, lost host), any live worker takes a short lock for
it and puts those messages back at the head of their queues through kombu's own
``restore_by_tag``, which also drops them from the broker's unacked set, so the
visibility-timeout restore cannot deliver them a second time.
Exactly-once completion is still guarded by the job record (core.store.jobstore).

Two windows are not covered by those records: a worker killed between taking a message
from the broker and recording it, and a job whose ack was lost in a broker outage. Such
a message sits in the broker's unacked set that no live worker holds; once it is older
than a few heartbeat TTLs, ``sweep_untracked`` puts it back (the job record answers a
second delivery of a job that already finished), instead of it waiting for the
visibility timeout.
"""

from __future__ import annotations

import json
import logging
import time

import redis
from celery import Celery

from core import connection, settings
from core.celery_app import QUEUE_PREFIX, group_members, priority_queue_names
from core.store import keys
from core.store.hints import PrefixHints

SWEEP_S = 60.0  # how long a dead worker's queue is swept (late sends from stale fleet views)
# kombu's Redis transport keeps each exchange's bindings in these sets (one per own queue)
BINDING_PREFIX = "_kombu.binding."
PERMANENT_BINDING_PREFIX = "_kombu.binding_permanent."

# Move every message of a dead worker's own queue to its backend's shared queue, oldest
# nearest the consuming end, pointing each message's routing key at the shared queue so
# that a later restore (kombu re-routes by it) does not send it back.
_MOVE = """
local n = 0
while true do
  local m = redis.call('LPOP', KEYS[1])
  if not m then break end
  local s, e = string.find(m, ARGV[1], 1, true)
  if s then m = string.sub(m, 1, s - 1) .. ARGV[2] .. string.sub(m, e + 1) end
  redis.call('RPUSH', KEYS[2], m)
  n = n + 1
end
return n
"""

log = logging.getLogger(__name__)


def restore_tags(app: Celery, tags: list[str]) -> None:
    """Put reserved messages back at the head of their queues (and out of the unacked set).
    Redis transport only: RabbitMQ requeues a dead consumer's unacked messages itself."""
    if not tags or not connection.is_redis_broker(app.conf.broker_url):
        return
    with app.connection_for_write() as conn:
        qos = conn.default_channel.qos
        for tag in tags:
            qos.restore_by_tag(tag)


def settle_tags(client: redis.Redis, app: Celery, tags: list[str]) -> tuple[list[str], list[str]]:
    """Unacked messages nobody holds any more: restore those whose job has not finished,
    drop (ack) those whose job has, so a finished job is not delivered again just to be
    answered from its record. Only this fleet's messages (queues ``ib.*``) are touched: a
    shared Redis database may hold other Celery apps' unacked messages. Returns
    (restored, dropped) tags."""
    tags = list(dict.fromkeys(tags))  # a group message's tag is recorded once per job
    if not tags or not connection.is_redis_broker(app.conf.broker_url):
        return [], []
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        unacked_key, index_key = channel.unacked_key, channel.unacked_index_key
    ours: list[tuple[str, list[str]]] = []  # (tag, the job ids its message carries)
    for tag, raw in zip(tags, client.hmget(unacked_key, tags)):
        if raw is None:
            continue  # acked or restored meanwhile
        message, _exchange, routing_key = json.loads(raw)
        if str(routing_key).startswith(QUEUE_PREFIX):
            headers = message.get("headers") or {}
            ours.append((tag, group_members(headers) or [headers.get("id") or "-"]))
    pipe = client.pipeline(transaction=False)
    for _, job_ids in ours:
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "final")
    answers = iter(pipe.execute())
    finished = [all([next(answers) is not None for _ in job_ids]) for _, job_ids in ours]  # [...]: each read
    dropped = [tag for (tag, _), done in zip(ours, finished) if done]
    restored = [tag for (tag, _), done in zip(ours, finished) if not done]
    if dropped:
        pipe = client.pipeline(transaction=True)
        pipe.zrem(index_key, *dropped)
        pipe.hdel(unacked_key, *dropped)
        pipe.execute()
    restore_tags(app, restored)
    return restored, dropped


def dead_workers(client: redis.Redis, me: str) -> list[str]:
    ids = [m.decode() for m in client.smembers(keys.WORKERS)]
    others = [i for i in ids if i != me]
    if not others:
        return []
    alive = client.mget([keys.worker(i) for i in others])
    return [i for i, beat in zip(others, alive) if beat is None]


def judging_is_safe(client: redis.Redis, grace_s: float, link_up_s: float | None) -> bool:
    """Whether a missing heartbeat now means a dead worker: the broker has been up, and
    this process connected to it (``link_up_s``: seconds since it reconnected after an
    outage, None if it never lost it), for at least ``grace_s``. After a broker outage
    longer than the heartbeat TTL every heartbeat key has expired; the live workers beat
    again within an interval of reconnecting, and must not be reaped by the first to
    come back."""
    if link_up_s is not None and link_up_s < grace_s:
        return False
    try:
        uptime = float(client.info("server").get("uptime_in_seconds", grace_s))
    except redis.ResponseError:  # INFO refused (some managed Redis): the link's age decides
        return True
    return uptime >= grace_s


def reap(
    client: redis.Redis,
    app: Celery,
    me: str,
    untracked_after_s: float | None = None,
    grace_s: float = 0.0,
    link_up_s: float | None = None,
) -> dict[str, int]:
    """Restore every dead worker's reserved messages. Returns {worker: messages restored}.
    With ``untracked_after_s``, also the unacked messages no live worker holds. With
    ``grace_s`` (the heartbeat TTL), nobody is judged dead until the broker and this
    process's link to it have been up that long (``judging_is_safe``)."""
    restored: dict[str, int] = {}
    dead_ones = dead_workers(client, me)
    if (dead_ones or untracked_after_s) and grace_s and not judging_is_safe(client, grace_s, link_up_s):
        if dead_ones:
            log.info("%d worker(s) without a heartbeat: judged once the broker is up %.0f s", len(dead_ones), grace_s)
        return restored
    for dead in dead_ones:
        if not client.set(keys.reap_lock(dead), me, nx=True, ex=60):
            continue  # another worker is on it
        tags = client.hgetall(keys.inflight(dead))
        settle_tags(client, app, [t.decode() for t in tags.values()])
        pipe = client.pipeline()
        pipe.delete(keys.inflight(dead))
        pipe.srem(keys.WORKERS, dead)
        pipe.zadd(keys.ORPHANED, {dead: time.time()})
        pipe.execute()
        dropped = PrefixHints(client).drop_worker(dead)
        restored[dead] = len(tags)
        log.warning("worker %s is gone: redelivered %d job(s), dropped %d prefix hint(s)", dead, len(tags), dropped)
    sweep_orphans(client)
    if untracked_after_s:
        sweep_untracked(client, app, me, untracked_after_s)
    return restored


def sweep_untracked(client: redis.Redis, app: Celery, me: str, min_age_s: float) -> list[str]:
    """Restore unacked messages older than ``min_age_s`` that no live worker has recorded
    as reserved (one worker sweeps per ``min_age_s / 4``). Returns the restored tags."""
    if not connection.is_redis_broker(app.conf.broker_url):
        return []  # RabbitMQ tracks its own unacked messages per connection
    if not client.set(keys.UNTRACKED_SWEEP, me, nx=True, ex=max(1, int(min_age_s / 4))):
        return []
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        index_key = channel.unacked_index_key
    old = [t.decode() for t in client.zrangebyscore(index_key, "-inf", time.time() - min_age_s, start=0, num=1000)]
    if not old:
        return []
    workers = [m.decode() for m in client.smembers(keys.WORKERS)]
    pipe = client.pipeline(transaction=False)
    for w in workers:
        pipe.hvals(keys.inflight(w))
    held = {t.decode() for tags in pipe.execute() for t in tags}
    restored, dropped = settle_tags(client, app, [t for t in old if t not in held])
    if restored or dropped:
        log.warning(
            "unacked message(s) no live worker holds, older than %.0f s: put back %d, dropped %d (job finished)",
            min_age_s,
            len(restored),
            len(dropped),
        )
    return restored


# A job a previous process with this worker id was running goes back to queued, so a
# redelivery is not taken for a duplicate of a run that no longer exists.
_RELEASE = """
for i, job_key in ipairs(KEYS) do
  local state = redis.call('HMGET', job_key, 'status', 'worker', 'final')
  if state[1] == 'running' and state[2] == ARGV[1] and not state[3] then
    redis.call('HSET', job_key, 'status', 'queued')
  end
end
return #KEYS
"""


def recover_own(client: redis.Redis, app: Celery, me: str) -> int:
    """At start: what a previous process with this worker id had reserved (it died, and
    this one took its id before its heartbeat expired) goes back to the queues now.
    Returns the messages looked at."""
    held = {k.decode(): v.decode() for k, v in client.hgetall(keys.inflight(me)).items()}
    if not held:
        return 0
    client.eval(_RELEASE, len(held), *[keys.job(job_id) for job_id in held], me)
    restored, dropped = settle_tags(client, app, list(held.values()))
    client.delete(keys.inflight(me))
    log.warning("previous %s held %d job(s): put back %d, %d had finished", me, len(held), len(restored), len(dropped))
    return len(held)


def leave(client: redis.Redis, me: str) -> int:
    """A worker shutting down cleanly: what waits in its own queue moves to the shared
    queue now, and late sends (stale fleet views) are swept by the others for a while."""
    client.zadd(keys.ORPHANED, {me: time.time()})
    return sweep_orphans(client)


def move_own_queue(client: redis.Redis, worker: str, own_queue: str, priorities: list[int], why: str) -> int:
    """Move what waits in ``worker``'s own queue (every priority level) to its backend's
    shared queue, where any worker takes it; returns how many messages moved."""
    shared = own_queue.rsplit(".", 1)[0] if own_queue.endswith(f".{worker}") else None
    if shared is None:
        return 0
    moved = 0
    for src, dest in zip(priority_queue_names(own_queue, priorities), priority_queue_names(shared, priorities)):
        n = int(client.eval(_MOVE, 2, src, dest, f'"routing_key": "{own_queue}"', f'"routing_key": "{shared}"'))
        if n:
            log.warning("worker %s %s: moved %d job(s) from its own queue to %s", worker, why, n, dest)
        moved += n
    return moved


def sweep_orphans(client: redis.Redis) -> int:
    """Move what waits in recently dead workers' own queues (prefix-affinity sends) to
    their backends' shared queues; each is swept for ``SWEEP_S`` after its death."""
    now = time.time()
    moved = 0
    orphans = [o.decode() for o in client.zrangebyscore(keys.ORPHANED, now - SWEEP_S, "+inf")]
    if orphans:  # one back with the same id (a restarted pod) consumes its own queue again
        orphans = [w for w, beat in zip(orphans, client.mget([keys.worker(w) for w in orphans])) if beat is None]
    priorities = settings.fleet_config().priorities.steps() if orphans else []
    for worker in orphans:
        own = client.hget(keys.WORKER_QUEUES, worker)
        if own is not None:
            moved += move_own_queue(client, worker, own.decode(), priorities, "is gone")
    expired = [w.decode() for w in client.zrangebyscore(keys.ORPHANED, "-inf", now - SWEEP_S)]
    if expired:
        pipe = client.pipeline()
        pipe.zrem(keys.ORPHANED, *expired)
        # one back under the same id (a restarted pod) keeps its queue and its bindings
        gone = [w for w, beat in zip(expired, client.mget([keys.worker(w) for w in expired])) if beat is None]
        own_queues = [q.decode() for q in client.hmget(keys.WORKER_QUEUES, gone) if q] if gone else []
        if gone:
            pipe.hdel(keys.WORKER_QUEUES, *gone)
        for queue in own_queues:  # kombu's binding tables of its own queue: one pair per worker id ever
            pipe.delete(f"{BINDING_PREFIX}{queue}", f"{PERMANENT_BINDING_PREFIX}{queue}")
        pipe.execute()
    return moved
