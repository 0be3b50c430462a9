"""``ib:inflight:<worker>``, the messages this worker holds, written off the consumer thread.

Each reserved message is recorded (task id → broker delivery tag) so that the reaper can
put it back if this process dies, and dropped when its task ends; prefix routing reads
the hash's size as the worker's load. Written from Celery's ``task_received`` signal, the
record cost one Redis round trip in the consumer thread before the job could reach a
task thread (0.2 ms of the fleet path per job on 2 cores). Here the signal only queues
the change; one daemon thread writes whatever has queued up in one pipeline, in order.

On the Redis broker the record is not queued at all: ``record`` adds it to kombu's own
unacked write of the message (workers.redelivery.taken), which lands it
before the task can start and wakes no thread (waking this one per job cost the task's
thread ~0.1 ms of its hand-over on 2 cores). The removals still go through the thread.

A record written that way can overtake a queued removal of the same task id (a second
delivery of a job that has just ended here, its removal not yet written): ``record``
drops such a queued removal, and waits for one already being written, so the fresh
record is never deleted by the old delivery's end.

What this moves: a record lands about a round trip later than before. A process killed
in that gap leaves the message in the broker's unacked set untracked, which the reaper's
``sweep_untracked`` already covers (the same gap existed between taking the message and
the synchronous write). A failed write (broker down) is retried, in order, until it lands
or the ledger closes, where the old signal handler dropped it.
"""

from __future__ import annotations

import logging
import threading

import redis

from core.store import keys

log = logging.getLogger(__name__)

RETRY_S = 0.5  # a failed write is tried again this often

Change = tuple[str, str | None]  # (job id, delivery tag; None: the job's message ended)


class InflightLedger:
    def __init__(self, client: redis.Redis, worker_id: str, retry_s: float = RETRY_S) -> None:
        self.r = client
        self.key = keys.inflight(worker_id)
        self.retry_s = retry_s
        self._pending: list[Change] = []
        self._cond = threading.Condition()
        self._writing = False
        self._writing_removals: frozenset[str] = frozenset()  # job ids the write in progress drops
        # A group message's task id -> the job ids it carries: each job is an entry of
        # the hash (its size is the worker's load in jobs; the reaper releases each job),
        # all with the message's delivery tag.
        self._members: dict[str, list[str]] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="inflight-ledger", daemon=True)
        self._thread.start()

    def record(
        self, pipe: redis.client.Pipeline, task_id: str, delivery_tag: str, members: list[str] | None = None
    ) -> None:
        """A taken message's record, added to a pipeline of the broker's own: the Redis
        transport's unacked write (workers.redelivery.taken), which lands
        it before the task can start and without waking this ledger's thread.

        A removal of the same task id still queued here would land after it and delete it:
        it is dropped (the record replaces the entry it would remove), and one already
        being written is waited for (at most ``retry_s``: the broker is failing then, and
        the caller's own write with it).

        ``members``: the job ids of a group message, recorded one entry each."""
        ids = self._entries(task_id, members)
        with self._cond:
            if self._pending and any(t in ids for t, _ in self._pending):
                self._pending = [c for c in self._pending if c[0] not in ids]
            if self._writing_removals.intersection(ids):
                self._cond.wait_for(lambda: not self._writing_removals.intersection(ids), self.retry_s)
        pipe.hset(self.key, mapping=dict.fromkeys(ids, delivery_tag))

    def add(self, task_id: str, delivery_tag: str, members: list[str] | None = None) -> None:
        for job_id in self._entries(task_id, members):
            self._queue((job_id, delivery_tag))

    def remove(self, task_id: str) -> None:
        with self._cond:
            ids = self._members.pop(task_id, None) or [task_id]
        for job_id in ids:
            self._queue((job_id, None))

    def _entries(self, task_id: str, members: list[str] | None) -> list[str]:
        """The hash's entries for a message: its task id, or a group's job ids (kept
        until the message ends, so ``remove`` drops them all)."""
        if not members:
            return [task_id]
        with self._cond:
            self._members[task_id] = members
        return members

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every change queued so far is in Redis (False: not within ``timeout``).
        Readers of the hash in this process (the reconnect restore) call this first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._writing, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is still queued (tried until ``timeout``), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=1)

    def _queue(self, change: Change) -> None:
        with self._cond:
            self._pending.append(change)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if self._closing:
                    return
                changes, self._pending, self._writing = self._pending, [], True
                self._writing_removals = frozenset(t for t, tag in changes if tag is None)
            while not self._write(changes):
                with self._cond:  # wait, but leave at once when closing
                    if self._cond.wait_for(lambda: self._closing, self.retry_s):
                        return
            with self._cond:
                self._writing, self._writing_removals = False, frozenset()
                self._cond.notify_all()

    def _write(self, changes: list[Change]) -> bool:
        pipe = self.r.pipeline(transaction=False)
        for task_id, tag in changes:
            if tag is None:
                pipe.hdel(self.key, task_id)
            else:
                pipe.hset(self.key, task_id, tag)
        try:
            pipe.execute()
        except redis.RedisError:
            log.warning("could not record %d in-flight change(s); retrying", len(changes), exc_info=True)
            return False
        return True
