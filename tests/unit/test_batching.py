"""BatchQueue: grouping by key, size and wait limits, order, shutdown."""

from __future__ import annotations

import threading
import time

from workers.engines.batched import BatchQueue


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


def feed(q: BatchQueue[int], items: range, every_s: float) -> threading.Thread:
    """Put ``items`` one every ``every_s`` from a thread, as a worker's task threads do."""

    def run() -> None:
        for i in items:
            q.put(i)
            time.sleep(every_s)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_burst_spread_wider_than_the_gap_forms_one_batch():
    # Five jobs 0.2 s apart: a fixed 0.35 s window from the first would cut them 2 + 3;
    # the gap keeps the batch open while they keep coming, and closes it once they pause.
    q: BatchQueue[int] = BatchQueue(key=lambda _: 0)
    t0 = time.monotonic()
    feed(q, range(5), 0.2)
    assert q.next_batch(16, 0.35, 10) == [0, 1, 2, 3, 4]
    assert 0.8 + 0.3 <= time.monotonic() - t0 < 5


def test_the_oldest_job_waits_at_most_max_wait():
    q: BatchQueue[int] = BatchQueue(key=lambda _: 0)
    t0 = time.monotonic()
    feeder = feed(q, range(30), 0.1)  # never pauses for the gap: 3 s of arrivals
    batch = q.next_batch(64, 0.3, 0.6)
    waited = time.monotonic() - t0
    assert 0.55 <= waited < 2 and batch == list(range(len(batch))) and 3 <= len(batch) < 30
    feeder.join()


def test_a_job_that_already_waited_goes_at_once():
    # It sat in the queue while a batch decoded: the arrivals have paused, no more waiting.
    q: BatchQueue[int] = BatchQueue(key=lambda _: 0)
    q.put(1)
    time.sleep(0.4)
    t0 = time.monotonic()
    assert q.next_batch(8, 0.3, 10) == [1] and time.monotonic() - t0 < 0.2
