"""The job record on a real Redis: one final outcome, waiters woken, timeouts honoured."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis

from conftest import wait_for
from core.errors import JobError
from core.store import keys
from core.store.jobstore import JobStore

pytestmark = pytest.mark.integration


@pytest.fixture
def store(redis_url):
    return JobStore(redis.Redis.from_url(redis_url), ttl_s=60)


def test_first_outcome_wins_and_later_deliveries_see_it(store):
    job = uuid.uuid4().hex
    assert store.claim([(job, {"model": "m"}), (job, {"model": "m"})]) == [True, False]
    assert store.claim([(job, {"model": "m"})]) == [False]
    assert store.begin(job, "w1") == (1, False, None, None)
    assert store.finish(job, "completed", {"text": "first"})
    assert not store.finish(job, "completed", {"text": "second"})
    assert store.begin(job, "w2").final == ("completed", {"text": "first"})
    assert store.get(job)["completions"] == "1"


def test_begin_sees_a_cancel_that_came_while_queued(store):
    job = uuid.uuid4().hex
    store.claim([(job, {})])
    store.request_cancel(job)
    assert store.begin(job, "w1") == (1, True, None, None)


def test_every_cancel_is_announced_to_a_watching_worker_and_sets_the_flag_it_reads(store):
    from workers.running.cancel_watch import CancelWatcher

    job, batch, line = (uuid.uuid4().hex for _ in range(3))
    reads: list[int] = []

    def flags(jobs: dict[str, str | None]) -> set[str]:
        reads.append(len(jobs))
        return store.cancelled(jobs)

    # No full read for 60 s: only the announcement can make the watcher read the flags.
    watcher = CancelWatcher(flags, interval_s=0.01, announcements=store.cancel_announcements(), full_every_s=60).start()
    try:
        watcher.watch(job)
        watcher.watch(line, scope=batch)
        wait_for(lambda: reads, 5, "the watched jobs' first flag read")
        woke = watcher.wakeups
        wait_for(lambda: watcher.wakeups >= woke + 2, 5, "two more wake-ups of the watcher")
        assert len(reads) == 1  # it woke, and nothing announced: it read nothing
        store.request_cancel(job)
        wait_for(lambda: watcher.cancelled([job]) == {job}, 5, "the job's cancel")
        store.request_cancel(batch, ttl_s=30)  # a batch's flag cancels its lines
        wait_for(lambda: watcher.cancelled([job, line]) == {job, line}, 5, "both cancels seen")
        assert 0 < store.r.ttl(keys.cancel(batch)) <= 30
    finally:
        watcher.stop()


def test_a_second_delivery_of_a_job_running_on_a_live_worker_is_a_duplicate(store):
    from core.store import keys

    job = uuid.uuid4().hex
    store.claim([(job, {})])
    assert store.begin(job, "w1").attempt == 1
    assert store.begin(job, "w2").attempt == 2  # w1 has no heartbeat: it is gone, w2 takes over
    store.r.set(keys.worker("w2"), "{}", px=5000)
    assert store.begin(job, "w3") == (0, False, None, "w2")  # w2 lives: a duplicate, nothing changes
    assert store.get(job)["attempts"] == "2" and store.get(job)["worker"] == "w2"
    assert store.begin(job, "w2", running_here=True).running_on == "w2"  # its own process runs it
    assert store.begin(job, "w2").attempt == 3  # a restarted w2 (same id, not running it) runs it again
    store.r.delete(keys.worker("w2"))


def test_released_records_can_be_claimed_again(store):
    job = uuid.uuid4().hex
    assert store.claim([(job, {})]) == [True]
    store.release([job])
    assert store.claim([(job, {})]) == [True]


def test_every_waiter_wakes_when_the_job_finishes(store):
    job = uuid.uuid4().hex
    store.claim([(job, {})])
    got: list = []
    waiters = [threading.Thread(target=lambda: got.append(store.wait(job, timeout=20))) for _ in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    store.finish(job, "failed", {"code": "engine_failure"})
    for w in waiters:
        w.join(timeout=20)
    assert got == [("failed", {"code": "engine_failure"})] * 3
    assert time.monotonic() - t0 < 2  # woken, not polled at the 2 s slice
    # the token the waiters passed on expires: a waited-on job leaves nothing behind for good
    assert 0 < store.r.ttl(keys.done(job)) <= 60


def test_wait_times_out_with_none(store):
    job = uuid.uuid4().hex
    store.claim([(job, {})])
    t0 = time.monotonic()
    assert store.wait(job, timeout=0.5) is None
    assert 0.4 < time.monotonic() - t0 < 2.5


def test_a_wait_notices_a_record_that_expires_meanwhile(store):
    """Before, a waiter whose job record expired (or was deleted) waited for ever."""
    from core.errors import UnknownJobError

    job = uuid.uuid4().hex
    store.claim([(job, {})])
    store.r.pexpire(keys.job(job), 300)
    t0 = time.monotonic()
    with pytest.raises(UnknownJobError, match="expired while waiting"):
        store.wait(job, timeout=None)
    assert time.monotonic() - t0 < 5  # at the next wait slice, not never


def test_client_result_waits_a_finite_time_unless_told(redis_url):
    """``result()`` used to default to timeout=None: for ever."""
    import math

    from core.errors import JobTimeoutError
    from dispatcher.client import Client

    with Client(redis_url) as client:
        assert client.parts.result_timeout_s == 7200  # client.result_timeout_s
        job = uuid.uuid4().hex
        client.store.claim([(job, {})])
        client.parts.result_timeout_s = 0.3  # as IB_CLIENT_RESULT_TIMEOUT_S=0.3 would set it
        with pytest.raises(JobTimeoutError, match="not finished after 0.3 s"):
            client.result(job)
        done = threading.Timer(0.5, lambda: client.store.finish(job, "failed", {"code": "engine_failure"}))
        done.start()
        with pytest.raises(JobError):
            client.result(job, timeout=math.inf)  # for ever, on request: until it ends
        done.join()  # its finish call has returned before the client closes
