"""Per-job records in Redis: status, attempts, the one final outcome, and cancel flags.

The final outcome is written once (HSETNX on ``final``): a job redelivered after its
worker died, or run twice by a race, still completes exactly once, and the second run
returns the first one's result instead of generating again.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from dispatcher.jobs import JobStatus


def job_key(job_id: str) -> str:
    return f"ib:job:{job_id}"


def cancel_key(job_id: str) -> str:
    return f"ib:cancel:{job_id}"


class JobStore:
    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self.r = client
        self.ttl_s = ttl_s

    def claim_ids(self, job_ids: list[str]) -> list[bool]:
        """Create the records of new jobs in one round trip; False for an id already known,
        so resubmitting the same job id never enqueues it twice."""
        pipe = self.r.pipeline()
        for job_id in job_ids:
            pipe.hsetnx(job_key(job_id), "status", "queued")
        return [bool(created) for created in pipe.execute()]

    def record_submitted(self, pipe: Any, job_id: str, fields: dict[str, Any]) -> None:
        """Queue the submit-time fields on a pipeline (one round trip for many jobs)."""
        pipe.hset(job_key(job_id), mapping={k: _enc(v) for k, v in fields.items()})
        pipe.expire(job_key(job_id), self.ttl_s)

    def mark_running(self, job_id: str, worker: str) -> int:
        """Returns the attempt number (1 for the first delivery)."""
        pipe = self.r.pipeline()
        pipe.hincrby(job_key(job_id), "attempts", 1)
        pipe.hset(job_key(job_id), mapping={"status": "running", "worker": worker, "started_at": time.time()})
        pipe.expire(job_key(job_id), self.ttl_s)
        return int(pipe.execute()[0])

    # HSETNX decides who finishes; the rest of the write happens in the same script, so
    # a reader never sees ``final`` without its result.
    _FINISH = """
    if redis.call('HSETNX', KEYS[1], 'final', ARGV[1]) == 0 then return 0 end
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3], 'finished_at', ARGV[4])
    redis.call('HINCRBY', KEYS[1], 'completions', 1)
    redis.call('EXPIRE', KEYS[1], ARGV[5])
    return 1
    """

    def finish(self, job_id: str, status: JobStatus, payload: dict[str, Any]) -> bool:
        """Write the final outcome if none exists yet; False means another run already did."""
        field = "error" if status == "failed" else "result"
        args = [status, field, json.dumps(payload), time.time(), self.ttl_s]
        return bool(self.r.eval(self._FINISH, 1, job_key(job_id), *args))

    def final(self, job_id: str) -> tuple[str, dict[str, Any]] | None:
        """(status, result-or-error) if the job has finished."""
        status, result, error = self.r.hmget(job_key(job_id), "final", "result", "error")
        if not status:
            return None
        body = result if status.decode() != "failed" else error
        return status.decode(), json.loads(body) if body else {}

    def get(self, job_id: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(job_key(job_id)).items()}

    def request_cancel(self, job_id: str) -> None:
        self.r.set(cancel_key(job_id), "1", ex=self.ttl_s)

    def cancelled(self, job_ids: list[str]) -> set[str]:
        """Which of these jobs have a cancel flag: one MGET, cheap enough per decode step."""
        if not job_ids:
            return set()
        flags = self.r.mget([cancel_key(j) for j in job_ids])
        return {j for j, f in zip(job_ids, flags) if f}


def _enc(value: Any) -> str | int | float:
    return value if isinstance(value, (str, int, float)) else json.dumps(value)
