"""Per-key limit on queued work: how many interactive requests one API key may have queued
or running at once, across every gateway replica (the count lives in Redis).

Each request holds a member of ``ib:gateway-inflight:<tenant>`` scored by its deadline; a
replica that died mid-request leaks nothing for longer than that deadline, because every
acquire first drops members past theirs.
"""

from __future__ import annotations

import time

import redis

from core.store import keys

_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class Quota:
    """Synchronous on purpose: acquire runs in the thread that then submits the job (one hop
    off the event loop for both), release after the response has been sent."""

    def __init__(self, client: redis.Redis, limit: int, hold_s: float) -> None:
        self.r, self.limit, self.hold_s = client, limit, hold_s
        self._acquire = client.register_script(_ACQUIRE)

    def acquire(self, tenant: str, job_id: str) -> bool:
        now = time.time()
        args = [now, self.limit, now + self.hold_s, job_id, int(self.hold_s) + 60]
        return bool(self._acquire(keys=[keys.owner_inflight(tenant)], args=args))

    def release(self, tenant: str, job_id: str) -> None:
        self.r.zrem(keys.owner_inflight(tenant), job_id)
