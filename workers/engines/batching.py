"""Static and dynamic batching for engines that lack their own scheduler.

A batch starts with the oldest waiting request and takes more requests with the same
batch key (same sampling configuration) until it is full, or until no new one has come
for ``gap_s`` (the arrivals have paused), or ``window_s`` has passed since the oldest
one arrived. Requests with another key wait for a later batch, in order.

Why a gap and not a fixed window: jobs reach the engine one task thread at a time, a few
milliseconds apart (a worker's threads parse, record and tokenize each one first), so a
burst of 32 jobs takes tens of milliseconds to arrive. A fixed 10 ms window from the
first one cut such a burst into batches of 1-3 rows and then the rest; waiting while
they keep coming forms full batches, and a lone job still waits only ``gap_s``. A job
that already waited (behind a batch that was decoding) waits no longer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class BatchQueue(Generic[T]):
    def __init__(self, key: Callable[[T], Hashable]) -> None:
        self._key = key
        self._items: deque[tuple[float, T]] = deque()  # (arrival, item), oldest first
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: T) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is shut down")
            self._items.append((time.monotonic(), item))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def next_batch(self, max_size: int, gap_s: float, window_s: float | None = None) -> list[T] | None:
        """Block for the next batch; None once closed and drained. ``window_s`` (at least
        ``gap_s``; default ``gap_s``): the longest the oldest request waits for company."""
        window_s = max(gap_s, window_s if window_s is not None else gap_s)
        with self._cond:
            while not self._items:
                if self._closed:
                    return None
                self._cond.wait()
            first_at, first = self._items[0]
            key = self._key(first)
            while True:
                batch = [(at, i) for at, i in self._items if self._key(i) == key][:max_size]
                deadline = min(first_at + window_s, batch[-1][0] + gap_s)
                remaining = deadline - time.monotonic()
                if len(batch) >= max_size or remaining <= 0 or self._closed:
                    break
                self._cond.wait(remaining)
            for entry in batch:
                self._items.remove(entry)
            return [i for _, i in batch]
