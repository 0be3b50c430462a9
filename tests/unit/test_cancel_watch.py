"""CancelWatcher: flags polled in the background, answered from memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from conftest import wait_for
from workers.running.cancel_watch import CancelWatcher


def test_flags_of_watched_jobs_are_seen_after_a_poll():
    flagged = {"a", "x"}
    polls: list[dict] = []

    def poll(jobs: dict[str, str | None]) -> set[str]:
        polls.append(jobs)
        return flagged & set(jobs)

    watcher = CancelWatcher(poll, interval_s=0.02).start()
    try:
        watcher.watch("a")
        watcher.watch("b")
        assert watcher.cancelled(["a", "b"]) == set()  # nothing polled yet: memory only
        deadline = time.monotonic() + 2
        while not watcher.cancelled(["a", "b"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.cancelled(["a", "b"]) == {"a"}
        assert all(set(ids) <= {"a", "b"} for ids in polls)  # only watched jobs are asked about
        watcher.unwatch("a")
        assert watcher.cancelled(["a"]) == set()
    finally:
        watcher.stop()


def test_a_failing_poll_cancels_nothing_and_keeps_going():
    calls = []

    def poll(jobs: dict[str, str | None]) -> set[str]:
        calls.append(1)
        raise ConnectionError("redis blip")

    watcher = CancelWatcher(poll, interval_s=0.01).start()
    watcher.watch("a")
    time.sleep(0.1)
    watcher.stop()
    assert len(calls) > 1 and watcher.cancelled(["a"]) == set()


def test_a_job_is_polled_with_its_scope():
    """A batch line's job is watched with its batch id, so one batch flag cancels them all."""

    def poll(jobs: dict[str, str | None]) -> set[str]:
        return {j for j, scope in jobs.items() if scope == "batch_1"}

    watcher = CancelWatcher(poll, interval_s=0.02).start()
    try:
        watcher.watch("batch_1-3", scope="batch_1")
        watcher.watch("solo")
        deadline = time.monotonic() + 2
        while not watcher.cancelled(["batch_1-3", "solo"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.cancelled(["batch_1-3", "solo"]) == {"batch_1-3"}
    finally:
        watcher.stop()


class Flags:
    """A cancel store in memory: flags, announcements of them, and how often each was read."""

    def __init__(self, broken: bool = False) -> None:
        self.flags: set[str] = set()
        self.polls = 0
        self.waits = 0
        self.broken = broken  # the subscription fails (Redis unreachable)
        self._announced = 0
        self._cond = threading.Condition()

    def cancel(self, job_id: str, announce: bool = True) -> None:
        self.flags.add(job_id)
        with self._cond:
            self._announced += announce
            self._cond.notify_all()

    def poll(self, jobs: dict[str, str | None]) -> set[str]:
        self.polls += 1
        return {j for j, scope in jobs.items() if j in self.flags or scope in self.flags}

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        if self.broken:
            raise ConnectionError("redis blip")
        with self._cond:
            heard = self._cond.wait_for(lambda: self._announced, timeout)
            self._announced = 0
            return bool(heard)

    def close(self) -> None:
        pass


@contextmanager
def running(store: Flags, full_every_s: float = 60) -> Iterator[CancelWatcher]:
    """A watcher on ``store``'s announcements (10 ms interval), stopped after the block."""
    watcher = CancelWatcher(store.poll, interval_s=0.01, announcements=store, full_every_s=full_every_s).start()
    try:
        yield watcher
    finally:
        watcher.stop()


def test_with_announcements_the_flags_are_read_only_when_a_cancel_is_announced_or_a_job_was_watched():
    store = Flags()
    with running(store) as watcher:
        watcher.watch("a")
        wait_for(lambda: store.polls == 1, 2, "the new job's flag read")  # its flag may predate the watch
        waits = store.waits
        time.sleep(0.3)
        assert store.polls == 1  # nothing announced: no flag read
        assert store.waits <= waits + 2  # blocked on the subscription, not ticking every 10 ms
        store.cancel("a")
        wait_for(lambda: watcher.cancelled(["a"]) == {"a"}, 2, "the cancel")  # long before the 60 s full read
        assert store.polls == 2
        watcher.watch("b")
        wait_for(lambda: store.polls == 3, 2, "the second job's flag read")
        stopping = time.monotonic()
        watcher.stop()
        assert time.monotonic() - stopping < 2  # not held by the 60 s full read it was waiting for


def test_a_job_cancelled_before_it_is_watched_is_seen_without_an_announcement():
    store = Flags()
    with running(store) as watcher:
        watcher.watch("other")
        wait_for(lambda: store.polls == 1, 2, "the first flag read")
        store.cancel("late", announce=False)  # flagged while queued, before its worker watched it
        watcher.watch("late")
        wait_for(lambda: watcher.cancelled(["late"]) == {"late"}, 2, "the late job's cancel")


def test_a_flag_that_was_not_announced_is_still_seen_within_the_full_read_interval():
    store = Flags()
    with running(store, full_every_s=1.0) as watcher:
        watcher.watch("a")
        wait_for(lambda: store.polls == 1, 2, "the first flag read")  # seen within 0.25 s of it
        store.cancel("a", announce=False)  # e.g. announced while the subscription was down
        time.sleep(0.1)
        assert watcher.cancelled(["a"]) == set()  # not yet: nothing was announced
        wait_for(lambda: watcher.cancelled(["a"]) == {"a"}, 2.0, "the full read's cancel")


def test_a_subscription_that_fails_falls_back_to_reading_the_flags_every_interval():
    store = Flags(broken=True)
    with running(store) as watcher:
        watcher.watch("a")
        wait_for(lambda: store.polls >= 1, 2, "a flag read")
        store.cancel("a", announce=False)
        wait_for(lambda: watcher.cancelled(["a"]) == {"a"}, 2, "the cancel")
        wait_for(lambda: store.polls >= 5, 2, "a flag read every interval")


def test_with_nothing_watched_the_watcher_sleeps_until_a_job_is_and_stops_at_once():
    store = Flags()
    with running(store) as watcher:
        time.sleep(0.3)
        assert store.waits == 0  # an idle worker's watcher neither wakes nor reads
        watcher.watch("a")
        wait_for(lambda: store.polls == 1, 2, "the new job's flag read")
        watcher.unwatch("a")
        time.sleep(0.6)  # back to sleep after at most one more wait
        waits = store.waits
        time.sleep(0.6)
        assert store.waits == waits
        stopping = time.monotonic()
        watcher.stop()
        assert time.monotonic() - stopping < 0.5
