"""Per-key limit on queued work: how many interactive requests one API key may have queued
or running at once, across every gateway replica (the count lives in Redis).

Each request holds a member of ``ib:gateway-inflight:<tenant>`` scored by its deadline; a
replica that died mid-request leaks nothing for longer than that deadline, because every
acquire first drops members past theirs.
"""

from __future__ import annotations

import time

import redis.asyncio

from dispatcher.store import keys

_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class Quota:
    def __init__(self, client: redis.asyncio.Redis, limit: int, hold_s: float) -> None:
        self.r, self.limit, self.hold_s = client, limit, hold_s
        self._acquire = client.register_script(_ACQUIRE)

    async def acquire(self, tenant: str, job_id: str) -> bool:
        now = time.time()
        args = [now, self.limit, now + self.hold_s, job_id, int(self.hold_s) + 60]
        return bool(await self._acquire(keys=[keys.owner_inflight(tenant)], args=args))

    async def release(self, tenant: str, job_id: str) -> None:
        await self.r.zrem(keys.owner_inflight(tenant), job_id)
