"""Static and dynamic batching for engines that lack their own scheduler.

A batch starts with the oldest waiting request and takes more requests with the same
batch key (same sampling configuration) until it is full or ``max_wait_s`` has passed
since the first one was taken. Requests with another key wait for a later batch, in order.
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
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: T) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is shut down")
            self._items.append(item)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def next_batch(self, max_size: int, max_wait_s: float) -> list[T] | None:
        """Block for the next batch; None once closed and drained."""
        with self._cond:
            while not self._items:
                if self._closed:
                    return None
                self._cond.wait()
            key = self._key(self._items[0])
            deadline = time.monotonic() + max_wait_s
            while True:
                batch = [i for i in self._items if self._key(i) == key][:max_size]
                remaining = deadline - time.monotonic()
                if len(batch) >= max_size or remaining <= 0 or self._closed:
                    break
                self._cond.wait(remaining)
            for item in batch:
                self._items.remove(item)
            return batch
