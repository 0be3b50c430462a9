"""KV prefix hints in Redis: which workers hold which of a prompt's blocks.

One sorted set per block hash (``ib:prefix:<hash>``: worker id → last time it held the
block), with a TTL. A dispatch looks up every block of a prompt in one pipelined round
trip (a holder not confirmed within the TTL does not count); a worker that starts or
finishes a job confirms its blocks (not again within ``refresh_s``); a dead or restarted
worker's hints are dropped (``ib:prefix-blocks:<id>`` lists them). The hashes themselves
are made by dispatcher.routing.prefix.

Bounded while jobs flow: a worker's list keeps the blocks confirmed within the TTL, at
most ``max_worker_blocks`` of them (its prefix cache holds far fewer), the oldest
trimmed at each confirmation; each block's set expires a TTL after its last confirmation.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, NamedTuple

import redis

from core.store import keys


class Lookup(NamedTuple):
    matched: dict[str, int]  # worker -> leading blocks of the prompt it holds
    in_flight: dict[str, int]  # worker -> messages it holds now
    cached: dict[str, int]  # worker -> blocks it holds in all


class PrefixHints:
    # ``record``'s writes, run by Redis: one command from Python instead of two per block
    # plus four (a worker records every job twice, as it starts and as it finishes; the
    # commands' packing and replies were ~0.3 ms of the task thread's Python each time).
    # KEYS[1]: the worker's block list, KEYS[2..]: each block's set; ARGV: the worker,
    # now, the TTL, the list's cap, then the blocks' hashes (ARGV[i + 3] for KEYS[i]).
    _RECORD = """
    local worker, now, ttl, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
    for i = 2, #KEYS do
        redis.call('ZADD', KEYS[i], ARGV[2], worker)
        redis.call('EXPIRE', KEYS[i], ttl)
        redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i + 3])
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(cap + 1))
    redis.call('EXPIRE', KEYS[1], ttl)
    """

    def __init__(
        self, client: redis.Redis, ttl_s: int = 3600, max_worker_blocks: int = 65536, refresh_s: float = 0.0
    ) -> None:
        """``refresh_s``: a worker's own ``record`` of blocks that it recorded itself less
        than this long ago writes nothing (0: every record writes). A job confirms its
        blocks as it starts and again as it finishes, seconds apart: against an hour's
        TTL the second write only moves a timestamp by those seconds."""
        self.r = client
        self.ttl_s = ttl_s
        self.max_worker_blocks = max_worker_blocks
        self.refresh_s = refresh_s
        self._record = client.register_script(self._RECORD)
        self._recent: OrderedDict[tuple[str, str], float] = OrderedDict()  # (worker, block) -> when written
        self._recent_lock = threading.Lock()

    def lookup(self, hashes: list[str]) -> dict[str, int]:
        """Worker → number of consecutive leading blocks it holds (one round trip)."""
        return self.lookup_for(hashes, []).matched

    def lookup_for(self, hashes: list[str], workers: list[str]) -> Lookup:
        """The blocks each worker holds of these, and for each of ``workers`` the jobs
        it holds now (``ib:inflight:<id>``: received, not finished; a heartbeat's load is
        seconds old) and how many blocks it holds in all: one round trip."""
        return self.lookup_many([(hashes, workers)])[0]

    def lookup_many(self, asks: list[tuple[list[str], list[str]]]) -> list[Lookup]:
        """``lookup_for`` for many prompts ((hashes, workers) each) in one round trip, each
        block and each worker read once: a dispatch of 64 jobs made 64 round trips."""
        blocks = list(dict.fromkeys(h for hashes, _ in asks for h in hashes))
        workers = list(dict.fromkeys(w for _, ws in asks for w in ws))
        if not blocks:
            return [Lookup({}, {}, {}) for _ in asks]
        pipe = self.r.pipeline(transaction=False)
        fresh = time.time() - self.ttl_s
        for h in blocks:
            pipe.zrangebyscore(keys.prefix_block(h), fresh, "+inf")
        for w in workers:
            pipe.hlen(keys.inflight(w))
            pipe.zcard(keys.worker_blocks(w))
        replies = pipe.execute()
        holders_of = {h: {w.decode() for w in ws} for h, ws in zip(blocks, replies)}
        counts = replies[len(blocks) :]
        in_flight = {w: int(counts[2 * i]) for i, w in enumerate(workers)}
        cached = {w: int(counts[2 * i + 1]) for i, w in enumerate(workers)}
        return [
            Lookup(
                _leading(holders_of, hashes) if hashes else {},
                {w: in_flight[w] for w in ws},
                {w: cached[w] for w in ws},
            )
            for hashes, ws in asks
        ]

    def record(self, worker_id: str, hashes: list[str], client: Any = None) -> None:
        """``worker_id`` holds these blocks now (a dispatch to it, or a finished job);
        ``client``: a pipeline to add the write to (the caller executes it)."""
        if not hashes:
            return
        remember = client is None and self.refresh_s > 0
        if remember and self._all_recent(worker_id, hashes):
            return
        script_keys = [keys.worker_blocks(worker_id), *(keys.prefix_block(h) for h in hashes)]
        args = [worker_id, repr(time.time()), self.ttl_s, self.max_worker_blocks, *hashes]
        if client is None:
            self._record(keys=script_keys, args=args)
        else:
            # EVAL, not the registered script: a pipeline holding one checks that the
            # script is loaded first, a round trip more (Redis caches an EVAL's compiled
            # script by its hash too).
            client.eval(self._RECORD, len(script_keys), *script_keys, *args)
        if remember:
            self._remember(worker_id, hashes)

    def _all_recent(self, worker_id: str, hashes: list[str]) -> bool:
        fresh_after = time.monotonic() - self.refresh_s
        with self._recent_lock:
            return all(self._recent.get((worker_id, h), fresh_after) > fresh_after for h in hashes)

    def _remember(self, worker_id: str, hashes: list[str]) -> None:
        now = time.monotonic()
        with self._recent_lock:
            for h in hashes:
                self._recent[(worker_id, h)] = now
                self._recent.move_to_end((worker_id, h))
            # bounded: what is older than refresh_s would be written again anyway
            while self._recent and (
                len(self._recent) > self.max_worker_blocks or next(iter(self._recent.values())) <= now - self.refresh_s
            ):
                self._recent.popitem(last=False)

    def drop_worker(self, worker_id: str) -> int:
        """Forget every block a worker was said to hold (it died, or restarted empty)."""
        with self._recent_lock:
            for key in [k for k in self._recent if k[0] == worker_id]:
                del self._recent[key]
        hashes = [h.decode() for h in self.r.zrange(keys.worker_blocks(worker_id), 0, -1)]
        pipe = self.r.pipeline(transaction=False)
        for h in hashes:
            pipe.zrem(keys.prefix_block(h), worker_id)
        pipe.delete(keys.worker_blocks(worker_id))
        pipe.execute()
        return len(hashes)


def _leading(holders_of: dict[str, set[str]], hashes: list[str]) -> dict[str, int]:
    """Worker -> how many of the prompt's blocks it holds from the first on, unbroken."""
    matched: dict[str, int] = {}
    for worker in holders_of[hashes[0]]:
        n = 0
        while n < len(hashes) and worker in holders_of[hashes[n]]:
            n += 1
        matched[worker] = n
    return matched
