"""CancelWatcher: flags polled in the background, answered from memory."""

from __future__ import annotations

import time

from workers.cancel_watch import CancelWatcher


def test_flags_of_watched_jobs_are_seen_after_a_poll():
    flagged = {"a", "x"}
    polls: list[list[str]] = []

    def poll(ids: list[str]) -> set[str]:
        polls.append(ids)
        return flagged & set(ids)

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

    def poll(ids: list[str]) -> set[str]:
        calls.append(1)
        raise ConnectionError("redis blip")

    watcher = CancelWatcher(poll, interval_s=0.01).start()
    watcher.watch("a")
    time.sleep(0.1)
    watcher.stop()
    assert len(calls) > 1 and watcher.cancelled(["a"]) == set()
