"""KV prefix hints in Redis: which workers hold which of a prompt's blocks.

One sorted set per block hash (``ib:prefix:<hash>``: worker id → last time it held the
block), with a TTL. A dispatch looks up every block of a prompt in one pipelined round
trip (a holder not confirmed within the TTL does not count); a worker that starts or
finishes a job confirms its blocks; a dead or restarted worker's hints are dropped
(``ib:prefix-blocks:<id>`` lists them). The hashes themselves are made by
dispatcher.routing.prefix.

Bounded while jobs flow: a worker's list keeps the blocks confirmed within the TTL, at
most ``max_worker_blocks`` of them (its prefix cache holds far fewer), the oldest
trimmed at each confirmation; each block's set expires a TTL after its last confirmation.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import redis

from dispatcher.store import keys


class Lookup(NamedTuple):
    matched: dict[str, int]  # worker -> leading blocks of the prompt it holds
    in_flight: dict[str, int]  # worker -> messages it holds now
    cached: dict[str, int]  # worker -> blocks it holds in all


class PrefixHints:
    def __init__(self, client: redis.Redis, ttl_s: int = 3600, max_worker_blocks: int = 65536) -> None:
        self.r = client
        self.ttl_s = ttl_s
        self.max_worker_blocks = max_worker_blocks

    def lookup(self, hashes: list[str]) -> dict[str, int]:
        """Worker → number of consecutive leading blocks it holds (one round trip)."""
        return self.lookup_for(hashes, []).matched

    def lookup_for(self, hashes: list[str], workers: list[str]) -> Lookup:
        """The blocks each worker holds of these, and for each of ``workers`` the messages
        it holds now (``ib:inflight:<id>``: received, not finished; a heartbeat's load is
        seconds old) and how many blocks it holds in all: one round trip."""
        if not hashes:
            return Lookup({}, {}, {})
        pipe = self.r.pipeline(transaction=False)
        fresh = time.time() - self.ttl_s
        for h in hashes:
            pipe.zrangebyscore(keys.prefix_block(h), fresh, "+inf")
        for w in workers:
            pipe.hlen(keys.inflight(w))
            pipe.zcard(keys.worker_blocks(w))
        replies = pipe.execute()
        counts = replies[len(hashes) :]
        in_flight = {w: int(counts[2 * i]) for i, w in enumerate(workers)}
        cached = {w: int(counts[2 * i + 1]) for i, w in enumerate(workers)}
        holders = [{w.decode() for w in ws} for ws in replies[: len(hashes)]]
        matched: dict[str, int] = {}
        for worker in holders[0]:
            n = 0
            while n < len(holders) and worker in holders[n]:
                n += 1
            matched[worker] = n
        return Lookup(matched, in_flight, cached)

    def record(self, worker_id: str, hashes: list[str], client: Any = None) -> None:
        """``worker_id`` holds these blocks now (a dispatch to it, or a finished job);
        ``client``: a pipeline to add the writes to (the caller executes it)."""
        if not hashes:
            return
        execute = client is None
        pipe = client if client is not None else self.r.pipeline(transaction=False)
        now = time.time()
        for h in hashes:
            pipe.zadd(keys.prefix_block(h), {worker_id: now})
            pipe.expire(keys.prefix_block(h), self.ttl_s)
        own = keys.worker_blocks(worker_id)
        pipe.zadd(own, dict.fromkeys(hashes, now))
        pipe.zremrangebyscore(own, "-inf", now - self.ttl_s)
        pipe.zremrangebyrank(own, 0, -(self.max_worker_blocks + 1))
        pipe.expire(own, self.ttl_s)
        if execute:
            pipe.execute()

    def drop_worker(self, worker_id: str) -> int:
        """Forget every block a worker was said to hold (it died, or restarted empty)."""
        hashes = [h.decode() for h in self.r.zrange(keys.worker_blocks(worker_id), 0, -1)]
        pipe = self.r.pipeline(transaction=False)
        for h in hashes:
            pipe.zrem(keys.prefix_block(h), worker_id)
        pipe.delete(keys.worker_blocks(worker_id))
        pipe.execute()
        return len(hashes)
