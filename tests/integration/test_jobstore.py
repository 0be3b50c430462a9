"""The job record on a real Redis: one final outcome, waiters woken, timeouts honoured."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis

from dispatcher.store.jobstore import JobStore

pytestmark = pytest.mark.integration


@pytest.fixture
def store(redis_url):
    return JobStore(redis.Redis.from_url(redis_url), ttl_s=60)


def test_first_outcome_wins_and_later_deliveries_see_it(store):
    job = uuid.uuid4().hex
    assert store.claim([(job, {"model": "m"}), (job, {"model": "m"})]) == [True, False]
    assert store.claim([(job, {"model": "m"})]) == [False]
    assert store.begin(job, "w1") == (1, False, None)
    assert store.finish(job, "completed", {"text": "first"})
    assert not store.finish(job, "completed", {"text": "second"})
    assert store.begin(job, "w2").final == ("completed", {"text": "first"})
    assert store.get(job)["completions"] == "1"


def test_begin_sees_a_cancel_that_came_while_queued(store):
    job = uuid.uuid4().hex
    store.claim([(job, {})])
    store.request_cancel(job)
    assert store.begin(job, "w1") == (1, True, None)


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


def test_wait_times_out_with_none(store):
    job = uuid.uuid4().hex
    store.claim([(job, {})])
    t0 = time.monotonic()
    assert store.wait(job, timeout=0.5) is None
    assert 0.4 < time.monotonic() - t0 < 2.5
