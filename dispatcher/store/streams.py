"""Token streaming: text deltas from the worker to any client, through a Redis stream.

A job submitted with ``stream=True`` gets a Redis stream ``ib:stream:<job id>``: the
worker appends each text delta as it is generated, then one end entry. A client reads it
from the beginning with XREAD, so it misses nothing however late it starts reading, and
any number of clients can read the same job. The stream expires with the job record.

The worker side never writes on the decoding path: deltas go into a queue that one
thread drains with pipelined XADDs, so a batch step is not slowed by Redis round trips.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator

import redis
import redis.asyncio

from dispatcher.store import keys

log = logging.getLogger(__name__)

END_FIELD = b"end"


class StreamPublisher:
    """One per worker process: ``delta``/``end`` are cheap, the thread does the writes."""

    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self.r = client
        self.ttl_s = ttl_s
        self._queue: queue.Queue[tuple[str, str, str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="stream-publisher", daemon=True)
        self._thread.start()

    def delta(self, job_id: str, text: str) -> None:
        if text:
            self._queue.put((job_id, "d", text))

    def end(self, job_id: str, status: str) -> None:
        self._queue.put((job_id, "end", status))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        stop = False
        while not stop:
            items = []
            for item in [self._queue.get(), *drain(self._queue)]:
                if item is None:
                    stop = True
                else:
                    items.append(item)
            if not items:
                continue
            try:
                pipe = self.r.pipeline(transaction=False)
                for job_id, field, value in items:
                    pipe.xadd(keys.stream(job_id), {field: value})
                    if field == "end":
                        pipe.expire(keys.stream(job_id), self.ttl_s)
                pipe.execute()
            except redis.RedisError:
                log.warning("could not publish %d stream entries", len(items), exc_info=True)


def drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def _entries(reply: list | None, last: bytes | str) -> tuple[bytes | str, list[str], bool]:
    """One XREAD reply: (the last entry id seen, its text deltas, whether the end entry came)."""
    deltas: list[str] = []
    for _, entries in reply or []:
        for entry_id, fields in entries:
            last = entry_id
            if END_FIELD in fields:
                return last, deltas, True
            deltas.append(fields[b"d"].decode())
    return last, deltas, False


def read_stream(client: redis.Redis, job_id: str, timeout: float | None = None) -> Iterator[str]:
    """Yield the job's text deltas from the first one until its end entry."""
    key, last = keys.stream(job_id), "0-0"
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        block_ms = 1000 if deadline is None else max(1, int(min(1.0, deadline - time.monotonic()) * 1000))
        last, deltas, ended = _entries(client.xread({key: last}, block=block_ms, count=256), last)
        yield from deltas
        if ended:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id}: stream not finished after {timeout} s")


async def read_stream_async(
    client: redis.asyncio.Redis, job_id: str, block_s: float = 1.0
) -> AsyncIterator[str | None]:
    """``read_stream`` for an asyncio server: yields each delta, and None whenever
    ``block_s`` passes with nothing new (so the caller can look at its own deadline or
    its client), until the end entry."""
    key, last = keys.stream(job_id), "0-0"
    while True:
        reply = await client.xread({key: last}, block=max(1, int(block_s * 1000)), count=256)
        if not reply:
            yield None
        last, deltas, ended = _entries(reply, last)
        for delta in deltas:
            yield delta
        if ended:
            return
