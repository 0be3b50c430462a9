"""BatchQueue: grouping by key, size and wait limits, order, shutdown."""

from __future__ import annotations

import threading
import time

from workers.engines.batching import BatchQueue


def test_batches_group_by_key_and_keep_order():
    q: BatchQueue[tuple[str, int]] = BatchQueue(key=lambda item: item[0])
    for item in [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("b", 5)]:
        q.put(item)
    assert q.next_batch(2, 0) == [("a", 1), ("a", 3)]
    assert q.next_batch(8, 0) == [("b", 2), ("b", 5)]
    assert q.next_batch(8, 0) == [("a", 4)]


def test_waits_for_company_up_to_max_wait():
    q: BatchQueue[int] = BatchQueue(key=lambda _: 0)
    q.put(1)
    threading.Timer(0.05, q.put, args=(2,)).start()
    t0 = time.monotonic()
    assert q.next_batch(8, 0.5) == [1, 2] and time.monotonic() - t0 >= 0.45


def test_a_full_batch_does_not_wait():
    q: BatchQueue[int] = BatchQueue(key=lambda _: 0)
    for i in range(4):
        q.put(i)
    t0 = time.monotonic()
    assert q.next_batch(4, 5) == [0, 1, 2, 3] and time.monotonic() - t0 < 1


def test_close_drains_then_ends():
    q: BatchQueue[int] = BatchQueue(key=lambda _: 0)
    q.put(7)
    q.close()
    assert q.next_batch(4, 5) == [7]
    assert q.next_batch(4, 5) is None
