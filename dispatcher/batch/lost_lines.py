"""Jobs whose message was lost between the broker's pop and the worker's record.

On the Redis broker a worker takes a message with BRPOP, which removes it from the queue,
and records it (kombu's unacked set, the fleet's in-flight hash) in its next round trip.
A worker killed between the two (SIGKILL, OOM) takes the message with it: it is in no
queue, no unacked set and no in-flight record, so neither the reaper nor the visibility
timeout can give it back, and its job record stays ``queued`` for ever. A batch would
never finish. The batch still holds every line's request (its staged input), so the
feeder can send such a line again: when a batch has had no line finish for
``batch.lost_line_check_s``, its fed lines with no record whose job never started (or
is "running" on a worker whose heartbeat is gone) are looked for in their queues and in
the unacked set, and the feeder decides and sends
again those found nowhere (dispatcher.batch.feeder). A line sent again that was in fact
still on its way to a live worker is answered once all the same (the job record lets one
delivery run it).

An interactive job has no staged input, but its waiter (the Python client's
``JobHandle.result``, the gateway's request) holds the job: it asks ``missing`` the same
question every ``client.lost_check_s`` while the job is still queued, and sends it again
if its message is nowhere (dispatcher.client.Client.resend_if_lost).

RabbitMQ keeps a dead consumer's unacked messages itself: nothing to do there.
"""

from __future__ import annotations

import redis
from celery import Celery

from core.celery_app import priority_queue_names
from core.connection import is_redis_broker
from core.records import line_job_id
from core.store import keys
from core.store.batchstore import BatchStore

# KEYS: the lists to look in, then the unacked hash. ARGV: the jobs' ids, quoted as they
# appear in a message's headers (so "b-2" does not match "b-20"). Returns those in none.
_MISSING = """
local found = {}
local function look(message)
  for i = 1, #ARGV do
    if not found[i] and string.find(message, ARGV[i], 1, true) then found[i] = true end
  end
end
for k = 1, #KEYS - 1 do
  for _, m in ipairs(redis.call('LRANGE', KEYS[k], 0, -1)) do look(m) end
end
for _, m in ipairs(redis.call('HVALS', KEYS[#KEYS])) do look(m) end
local missing = {}
for i = 1, #ARGV do if not found[i] then missing[#missing + 1] = ARGV[i] end end
return missing
"""


def shared_queue(queue: str) -> str:
    """The shared queue that a worker's own queue (``celery_app.own_queue_of``: the shared
    name, a dot, the worker id) falls back to; the reaper moves a dead worker's own queue
    there. For a shared queue this names no queue (an empty list to look in)."""
    return queue.rsplit(".", 1)[0]


class LostLines:
    def __init__(self, client: redis.Redis, app: Celery, batches: BatchStore, steps: list[int]) -> None:
        """``app``: the broker (its unacked set is looked in); ``steps``: the priority steps
        a queue is kept in."""
        self.r = client
        self.app = app
        self.batches = batches
        self.steps = steps
        self.chunk = 1000  # staged lines read at a time
        self._missing = self.r.register_script(_MISSING)

    def find(self, batch_id: str, fed: int) -> list[tuple[int, str]]:
        """The fed lines (line, job JSON) of a batch whose message is lost."""
        if not is_redis_broker(self.app.conf.broker_url):
            return []
        with self.app.connection_for_write() as conn:
            unacked = conn.default_channel.unacked_key
        lost: list[tuple[int, str]] = []
        for start in range(0, fed, self.chunk):
            staged = self.batches.staged(batch_id, start, min(fed, start + self.chunk))
            lost += self._lost_among(batch_id, staged, unacked)
        return lost

    def _lost_among(self, batch_id: str, staged: list[tuple[int, str]], unacked: str) -> list[tuple[int, str]]:
        """Of these staged lines (line, job JSON): those with no record whose job never
        started and whose message is in no queue and no unacked set."""
        lines = [line for line, _ in staged]
        recorded = self.r.hmget(keys.batch_out(batch_id), [str(n) for n in lines])
        open_ids = [line_job_id(batch_id, n) for n, rec in zip(lines, recorded) if rec is None]
        if not open_ids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for job_id in open_ids:
            pipe.hmget(keys.job(job_id), "status", "queue", "worker")
        states = dict(zip(open_ids, pipe.execute()))
        # "running" on a worker that is gone: its run ended with it; if its message was not
        # held anywhere (its ack landed, or it was lost with the worker) nothing runs it again
        runners = {w for status, _, w in states.values() if status == b"running" and w}
        gone_workers = {
            w for w, beat in zip(runners, self.r.mget([keys.worker(w.decode()) for w in runners])) if not beat
        }
        waiting = {
            job_id: q.decode()
            for job_id, (status, q, worker) in states.items()
            if q and (status == b"queued" or (status == b"running" and worker in gone_workers))
        }
        if not waiting:
            return []
        gone = self.missing(waiting, unacked)
        return [(line, job_json) for line, job_json in staged if line_job_id(batch_id, line) in gone]

    def missing(self, waiting: dict[str, str], unacked: str | None = None) -> set[str]:
        """Of these jobs (id → the queue it was sent to), those whose message is in none of
        its queues (every priority level, and the shared queue an own queue falls back to)
        and not in the broker's unacked set: lost. Redis broker only (else none)."""
        if not waiting or not is_redis_broker(self.app.conf.broker_url):
            return set()
        if unacked is None:
            with self.app.connection_for_write() as conn:
                unacked = conn.default_channel.unacked_key
        queues = {
            name
            for q in waiting.values()
            for base in (q, shared_queue(q))
            for name in priority_queue_names(base, self.steps)
        }
        missing = self._missing(keys=[*sorted(queues), unacked], args=[f'"{job_id}"' for job_id in waiting])
        return {m.decode().strip('"') for m in missing}
