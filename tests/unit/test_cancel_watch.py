"""CancelWatcher: flags polled in the background, answered from memory."""

from __future__ import annotations

import time

from workers.cancel_watch import CancelWatcher


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
