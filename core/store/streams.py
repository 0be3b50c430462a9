"""Token streaming: text deltas from the worker to any client, through a Redis stream.

A job submitted with ``stream=True`` gets a Redis stream ``ib:stream:<job id>``: the
worker appends each text delta as it is generated, then one end entry. A client reads it
from the beginning with XREAD, so it misses nothing however late it starts reading, and
any number of clients can read the same job. The stream expires with the job record.

The worker side never writes on the decoding path: deltas go into a list that one
thread drains with pipelined XADDs, so a batch step is not slowed by Redis round trips.

A job redelivered after its worker died is generated again from the start, into the same
stream. Every entry carries its attempt, and a reader stays on one text: it skips the
new attempt's text up to what it has already given out and goes on from there; if the
new text differs from what was given out (sampling without a seed), the reader ends with
``StreamRestartedError`` rather than show the caller two answers spliced together.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import NamedTuple

import redis
import redis.asyncio

from core.errors import JobError
from core.store import keys

log = logging.getLogger(__name__)

END_FIELD = b"end"
ATTEMPT_FIELD = b"a"


class StreamRestartedError(JobError):
    """The job was redelivered and its new text differs from what was already streamed."""

    code = "stream_restarted"


class OneAttempt:
    """Keeps a reader on one attempt's text across redeliveries (see the module doc)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.attempt = 0
        self.sent = ""  # what was given out
        self.pos = 0  # characters of the current attempt seen so far

    def feed(self, attempt: int, text: str) -> str:
        """The part of an entry to give out ("" for text already given out)."""
        if attempt < self.attempt:
            return ""  # a late entry of an earlier attempt
        if attempt > self.attempt:
            self.attempt, self.pos = attempt, 0
        overlap = max(0, min(len(text), len(self.sent) - self.pos))
        if overlap and text[:overlap] != self.sent[self.pos : self.pos + overlap]:
            raise StreamRestartedError(
                f"job {self.job_id} was restarted on another worker (attempt {attempt}) and its new text "
                "differs from what was already streamed; its final result has the new text",
                {"job_id": self.job_id, "attempt": attempt},
            )
        self.pos += len(text)
        new = text[overlap:]
        self.sent += new
        return new

    def ends(self, attempt: int) -> bool:
        return attempt >= self.attempt


Entry = tuple[str, str, str, int]  # job id, field ("d" text / "end" status), value, attempt
FLUSH_S = 0.02  # a worker writes stream entries at most this often (each write wakes Redis and every reader)


class StreamPublisher:
    """One per worker process: ``delta``/``end`` are cheap, the thread does the writes.

    While text flows the thread writes once per ``flush_s`` (it is not woken per token),
    each stream's TTL set on its first write and at its end rather than on every write.
    A first delta after a pause and every end entry go out at once: the first token and
    the end of a job are never held back (holding the end back cost a one-stream reader
    up to 20 ms after the last token: 9-10 ms median on the llama.cpp worker, 2.3 ms now)."""

    def __init__(self, client: redis.Redis, ttl_s: int, flush_s: float = FLUSH_S) -> None:
        self.r = client
        self.ttl_s = ttl_s
        self.flush_s = flush_s
        self._pending: list[Entry] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = True  # the thread waits for a first entry (not pacing a flow)
        self._closing = False
        self._expiring: set[str] = set()  # streams whose TTL this publisher has set
        self._thread = threading.Thread(target=self._run, name="stream-publisher", daemon=True)
        self._thread.start()

    def delta(self, job_id: str, text: str, attempt: int = 1) -> None:
        if text:
            self._add((job_id, "d", text, attempt), urgent=False)

    def end(self, job_id: str, status: str, attempt: int = 1) -> None:
        self._add((job_id, "end", status, attempt), urgent=True)

    def close(self) -> None:
        """Write what is still pending, then stop the thread."""
        with self._lock:
            self._closing = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _add(self, entry: Entry, urgent: bool) -> None:
        with self._lock:
            self._pending.append(entry)
            wake, self._idle = urgent or self._idle, False
        if wake:
            self._wake.set()

    def _take(self) -> list[Entry]:
        with self._lock:
            items, self._pending = self._pending, []
            self._idle = not items
            return items

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            # One write now, then one per flush_s while entries keep coming (an end entry
            # or close cuts the wait short); back to waiting once a pause leaves nothing.
            while items := self._take():
                self._write(items)
                if self._wake.wait(self.flush_s):
                    self._wake.clear()
            if self._closing:
                self._write(self._take())
                return

    def _write(self, items: list[Entry]) -> None:
        if not items:
            return
        entries = merged(items)
        # The TTL is set on a stream's first write (one whose worker dies before its end
        # entry still expires) and again at its end (it lives as long as the job record).
        ended = {e[0] for e in entries if e[1] == "end"}
        started = {e[0] for e in entries if e[0] not in self._expiring} - ended
        try:
            pipe = self.r.pipeline(transaction=False)
            for job_id, field, value, attempt in entries:
                pipe.xadd(keys.stream(job_id), {field: value, "a": attempt})
            for job_id in ended | started:
                pipe.expire(keys.stream(job_id), self.ttl_s)
            pipe.execute()
        except redis.RedisError:  # the next write of a stream sets its TTL again
            log.warning("could not publish %d stream entries", len(entries), exc_info=True)
            self._expiring -= ended
            return
        self._expiring = (self._expiring | started) - ended


def merged(items: list[Entry]) -> list[Entry]:
    """Consecutive text deltas of one job and attempt as one entry (fewer entries for
    each reader to parse; the text is the same)."""
    out: list[Entry] = []
    for item in items:
        prev = out[-1] if out else None
        if prev is not None and item[1] == "d" and prev[1] == "d" and (item[0], item[3]) == (prev[0], prev[3]):
            out[-1] = (prev[0], "d", prev[2] + item[2], prev[3])
        else:
            out.append(item)
    return out


class _Read(NamedTuple):
    last: bytes | str  # the last entry id seen
    deltas: list[str]  # text to give out
    ended: bool  # the end entry came
    error: StreamRestartedError | None  # raise after giving out ``deltas``


def _entries(reply: list | None, last: bytes | str, follow: OneAttempt) -> _Read:
    """One XREAD reply, read on one attempt's text."""
    deltas: list[str] = []
    for _, entries in reply or []:
        for entry_id, fields in entries:
            last = entry_id
            attempt = int(fields.get(ATTEMPT_FIELD, 1))
            if END_FIELD in fields:
                if follow.ends(attempt):
                    return _Read(last, deltas, True, None)
                continue  # an earlier attempt's end: the current one goes on
            try:
                delta = follow.feed(attempt, fields[b"d"].decode())
            except StreamRestartedError as exc:
                return _Read(last, deltas, True, exc)
            if delta:
                deltas.append(delta)
    return _Read(last, deltas, False, None)


def read_stream(client: redis.Redis, job_id: str, timeout: float | None = None) -> Iterator[str]:
    """Yield the job's text deltas from the first one until its end entry."""
    key, last, follow = keys.stream(job_id), "0-0", OneAttempt(job_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        block_ms = 1000 if deadline is None else max(1, int(min(1.0, deadline - time.monotonic()) * 1000))
        last, deltas, ended, error = _entries(client.xread({key: last}, block=block_ms, count=256), last, follow)
        yield from deltas
        if error is not None:
            raise error
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
    key, last, follow = keys.stream(job_id), "0-0", OneAttempt(job_id)
    while True:
        reply = await client.xread({key: last}, block=max(1, int(block_s * 1000)), count=256)
        if not reply:
            yield None
        last, deltas, ended, error = _entries(reply, last, follow)
        for delta in deltas:
            yield delta
        if error is not None:
            raise error
        if ended:
            return
