"""Per-job records in Redis: status, attempts, the one final outcome, and cancel flags.

The final outcome is written once (HSETNX on ``final``): a job redelivered after its
worker died, or run twice by a race, still completes exactly once, and the second run
returns the first one's result instead of generating again.
"""

from __future__ import annotations

import json
import time
from typing import Any, NamedTuple

import redis
import redis.asyncio

from core.errors import UnknownJobError
from core.jobs import JobStatus
from core.store import job_scripts, keys
from core.store.batchstore import line_keys
from core.store.cancels import CancelAnnouncements
from core.store.fields import flat_fields

# BLMOVE waits in slices shorter than redis-py's default socket timeout (5 s), which
# would otherwise cut a longer blocking call as a TimeoutError.
WAIT_SLICE_S = 2.0


class LineRecord(NamedTuple):
    """The batch line a job answers, and its output (or error) record."""

    batch_id: str
    line: int
    record: dict[str, Any]
    kind: str  # completed | failed
    tokens: int = 0  # completion tokens, counted in the batch's usage
    prompt_tokens: int = 0


class Begin(NamedTuple):
    """What a delivery learns when it starts: its attempt number, whether the job was
    cancelled before it ran, or the outcome of an earlier delivery that finished it."""

    attempt: int
    cancelled: bool
    final: tuple[str, dict[str, Any]] | None = None
    running_on: str | None = None  # a duplicate delivery: this live worker runs the job now


class JobStore:
    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self.r = client
        self.ttl_s = ttl_s
        self._begin = client.register_script(job_scripts.BEGIN)
        self._finish = client.register_script(job_scripts.FINISH)
        self._finish_with_line = client.register_script(job_scripts.FINISH_WITH_LINE)
        self._claim = client.register_script(job_scripts.CLAIM)

    def group_claim_call(
        self, records: list[tuple[str, dict[str, Any]]], premise: list[str], epoch: str
    ) -> tuple[list[str], list[Any]]:
        """CLAIM_GROUP_AND_PUSH's keys and arguments past the queue and the message: the
        premise (the epoch's key then heartbeat keys, as ``FleetView.premise``), then the
        records ((job id, submit-time fields), in order)."""
        args: list[Any] = [epoch, len(premise) - 1, self.ttl_s]
        for _, fields in records:
            args += [len(fields), *flat_fields(fields)]
        return [*premise, *(keys.job(job_id) for job_id, _ in records)], args

    def claim_call(self, job_id: str, fields: dict[str, Any]) -> tuple[list[str], list[Any]]:
        """The claim's keys and arguments for one job (the record, then its TTL and fields)."""
        return [keys.job(job_id)], [self.ttl_s, *flat_fields(fields)]

    def claim(self, records: list[tuple[str, dict[str, Any]]]) -> list[bool]:
        """Create the records of new jobs ((job id, submit-time fields), in order) in one
        round trip; False for an id that is already known, or repeated in ``records``.

        One record is one EVALSHA: redis-py's pipeline asks SCRIPT EXISTS first on every
        execute, a second round trip on each single submit."""
        calls = [self.claim_call(job_id, fields) for job_id, fields in records]
        if len(calls) == 1:
            return [bool(self._claim(keys=calls[0][0], args=calls[0][1]))]
        pipe = self.r.pipeline(transaction=False)
        for script_keys, args in calls:
            self._claim(keys=script_keys, args=args, client=pipe)
        return [bool(created) for created in pipe.execute()]

    def begin(self, job_id: str, worker: str, scope: str | None = None, running_here: bool = False) -> Begin:
        """``scope``: a batch id whose cancel flag cancels this job too. ``running_here``:
        this process is running the job already (so this delivery is a duplicate)."""
        names, args = self._begin_call(job_id, worker, scope, running_here)
        return _begin_of(self._begin(keys=names, args=args))

    def begin_many(self, starts: list[tuple[str, str | None, bool]], worker: str) -> list[Begin]:
        """``begin`` for the jobs of one message ((job id, scope, running here), in order),
        in one round trip. By EVAL: a pipeline holding a registered script asks SCRIPT
        EXISTS first, a round trip of its own (Redis compiles the text once and keeps it)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id, scope, running_here in starts:
            names, args = self._begin_call(job_id, worker, scope, running_here)
            pipe.eval(job_scripts.BEGIN, len(names), *names, *args)
        return [_begin_of(out) for out in pipe.execute()]

    def _begin_call(
        self, job_id: str, worker: str, scope: str | None, running_here: bool
    ) -> tuple[list[str], list[Any]]:
        names = [keys.job(job_id), keys.cancel(job_id), keys.cancel(scope or job_id)]
        return names, [worker, time.time(), self.ttl_s, int(running_here), keys.worker("")]

    def finish(self, job_id: str, status: JobStatus, payload: dict[str, Any], line: LineRecord | None = None) -> bool:
        """Write the final outcome if none exists yet; False means another run already did.
        ``line``: the batch line this job answers, recorded with it."""
        names, args = self._finish_call(job_id, status, payload, line)
        script = self._finish if line is None else self._finish_with_line
        return bool(script(keys=names, args=args))

    def finish_many(self, outcomes: list[tuple[str, JobStatus, dict[str, Any], LineRecord | None]]) -> list[bool]:
        """``finish`` for jobs that ended together ((job id, status, payload, line), in
        order), in one round trip (by EVAL, as ``begin_many``)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id, status, payload, line in outcomes:
            names, args = self._finish_call(job_id, status, payload, line)
            pipe.eval(job_scripts.FINISH if line is None else job_scripts.FINISH_WITH_LINE, len(names), *names, *args)
        return [bool(done) for done in pipe.execute()]

    def _finish_call(
        self, job_id: str, status: JobStatus, payload: dict[str, Any], line: LineRecord | None
    ) -> tuple[list[str], list[Any]]:
        field = "error" if status == "failed" else "result"
        args: list[Any] = [status, field, json.dumps(payload), time.time(), self.ttl_s]
        names = [keys.job(job_id), keys.done(job_id)]
        if line is not None:
            names += line_keys(line.batch_id)
            args += [line.batch_id, line.line, json.dumps(line.record), line.kind, line.tokens, line.prompt_tokens]
        return names, args

    def final(self, job_id: str) -> tuple[str, dict[str, Any]] | None:
        """(status, result-or-error) if the job has finished."""
        return _final(self.r.hmget(keys.job(job_id), "final", "result", "error"))

    def wait(self, job_id: str, timeout: float | None = None) -> tuple[str, dict[str, Any]] | None:
        """Block until the job has its final outcome; None after ``timeout`` seconds,
        UnknownJobError if no such job was submitted (checked in the same first read).

        The finisher pushes one token on ``ib:done:<id>``. A waiter blocks on it with
        BLMOVE from the list to itself, which hands the token over without removing it, so
        any number of waiters wake and no process needs a pub/sub listener; the record is
        read in the same pipeline, by Redis right after the BLMOVE returns, so a waiter
        has the outcome one round trip after the finish (a pop, then a push-back and a
        read, took two).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(keys.job(job_id), "final", "result", "error")
        pipe.exists(keys.job(job_id))
        values, known = pipe.execute()
        if not known:
            raise UnknownJobError(
                f"unknown job {job_id!r} (never submitted, or its record expired)", {"job_id": job_id}
            )
        final = _final(values)
        while final is None:
            remaining = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
            if remaining <= 0:
                return None
            pipe = self.r.pipeline(transaction=False)
            _wake_then_read(pipe, job_id, remaining)
            final = _still_known(job_id, pipe.execute())
        return final

    def unsent(self, job_ids: list[str]) -> list[bool]:
        """For each job: its record exists but it was never marked sent nor finished."""
        pipe = self.r.pipeline(transaction=False)
        for j in job_ids:
            pipe.hmget(keys.job(j), "sent", "final")
        return [sent is None and final is None for sent, final in pipe.execute()]

    def mark_sent(self, job_ids: list[str]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for j in job_ids:
            pipe.hset(keys.job(j), "sent", 1)
        pipe.execute()

    def release(self, job_ids: list[str]) -> None:
        """Drop records claimed for jobs that were never enqueued, so a retry can submit them."""
        if job_ids:
            self.r.delete(*[keys.job(j) for j in job_ids])

    def get(self, job_id: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(keys.job(job_id)).items()}

    def request_cancel(self, job_id: str, ttl_s: int | None = None) -> None:
        """Flag a job, or a whole batch (its id is the scope of its lines' jobs), and
        announce it on the cancel channel in the same transaction: workers subscribed to
        it (core.store.cancels) read their flags at once instead of polling them."""
        pipe = self.r.pipeline(transaction=True)
        pipe.set(keys.cancel(job_id), "1", ex=ttl_s or self.ttl_s)
        pipe.publish(keys.CANCELS, job_id)
        pipe.execute()

    def cancel_announcements(self) -> CancelAnnouncements:
        """A subscription to every cancel's announcement (one connection of its own)."""
        return CancelAnnouncements(self.r)

    def cancelled(self, jobs: dict[str, str | None]) -> set[str]:
        """Which of these jobs (job id → its scope, a batch id or None) have a cancel flag,
        their own or their scope's: one MGET, cheap enough to poll."""
        if not jobs:
            return set()
        ids = sorted({*jobs, *(s for s in jobs.values() if s)})
        flagged = {i for i, f in zip(ids, self.r.mget([keys.cancel(i) for i in ids])) if f}
        return {j for j, scope in jobs.items() if j in flagged or scope in flagged}


async def wait_async(
    client: redis.asyncio.Redis, job_id: str, timeout: float | None = None
) -> tuple[str, dict[str, Any]] | None:
    """``JobStore.wait`` for an asyncio server (the HTTP gateway): the same protocol, so
    thousands of waiting requests hold no thread each. None after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    final = _final(await client.hmget(keys.job(job_id), "final", "result", "error"))
    while final is None:
        remaining = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
        if remaining <= 0:
            return None
        pipe = client.pipeline(transaction=False)
        _wake_then_read(pipe, job_id, remaining)
        final = _still_known(job_id, await pipe.execute())
    return final


def _wake_then_read(pipe: Any, job_id: str, timeout: float) -> None:
    """Wait up to ``timeout`` for the job's done token (rotated in place: it stays for the
    other waiters and expires with the record), then read the record. Redis runs a
    client's commands in order, so the read waits for the BLMOVE in the server."""
    done = keys.done(job_id)
    pipe.blmove(done, done, max(timeout, 0.01), "LEFT", "RIGHT")
    pipe.hmget(keys.job(job_id), "final", "result", "error")
    pipe.exists(keys.job(job_id))


def _still_known(job_id: str, replies: list[Any]) -> tuple[str, dict[str, Any]] | None:
    """The outcome a wake-then-read found; UnknownJobError if the record is gone (it
    expired, or was deleted, while waiting): no outcome will ever come, so no wait."""
    values, known = replies[-2], replies[-1]
    if not known:
        raise UnknownJobError(f"job {job_id!r}: its record expired while waiting for it", {"job_id": job_id})
    return _final(values)


def _begin_of(out: list[Any]) -> Begin:
    """The begin script's reply as a Begin."""
    if len(out) == 4:
        return Begin(attempt=0, cancelled=False, final=(out[2].decode(), json.loads(out[3]) if out[3] else {}))
    if int(out[0]) == -1:
        return Begin(attempt=0, cancelled=False, running_on=out[1].decode())
    return Begin(attempt=int(out[0]), cancelled=bool(out[1]))


def _final(values: list[bytes | None]) -> tuple[str, dict[str, Any]] | None:
    status, result, error = values
    if not status:
        return None
    body = error if status == b"failed" else result
    return status.decode(), json.loads(body) if body else {}
