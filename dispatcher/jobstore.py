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

    # One script per job, all jobs in one pipeline: create the record only if the id is
    # new, so resubmitting a job id never enqueues it twice.
    _CLAIM = """
    if redis.call('HSETNX', KEYS[1], 'status', 'queued') == 0 then return 0 end
    for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    redis.call('EXPIRE', KEYS[1], ARGV[1])
    return 1
    """

    def claim(self, records: dict[str, dict[str, Any]]) -> list[bool]:
        """Create the records of new jobs (job id → submit-time fields) in one round trip;
        False for an id that is already known."""
        script = self.r.register_script(self._CLAIM)
        pipe = self.r.pipeline(transaction=False)
        for job_id, fields in records.items():
            flat = [x for k, v in fields.items() for x in (k, _enc(v))]
            script(keys=[job_key(job_id)], args=[self.ttl_s, *flat], client=pipe)
        return [bool(created) for created in pipe.execute()]

    # A delivery either finds the final outcome (a redelivered job that already finished)
    # or becomes the next attempt, in one round trip.
    _BEGIN = """
    local final = redis.call('HGET', KEYS[1], 'final')
    if final then
        local field = 'result'
        if final == 'failed' then field = 'error' end
        return {final, redis.call('HGET', KEYS[1], field)}
    end
    local attempt = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
    redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'started_at', ARGV[2])
    redis.call('EXPIRE', KEYS[1], ARGV[3])
    return attempt
    """

    def begin(self, job_id: str, worker: str) -> int | tuple[str, dict[str, Any]]:
        """The attempt number (1 for the first delivery), or (status, outcome) if the job
        already finished."""
        out = self.r.eval(self._BEGIN, 1, job_key(job_id), worker, time.time(), self.ttl_s)
        if isinstance(out, list):
            return out[0].decode(), json.loads(out[1]) if out[1] else {}
        return int(out)

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
