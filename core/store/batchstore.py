"""Offline batches in Redis: the batch record, its staged lines, one output record per line.

Keys (each expires at the batch's ``purge_at``: its completion window plus retention):

- ``ib:batch:<id>``        hash: status, timestamps, request counts, the feed cursor
- ``ib:batch:<id>:lines``  list: the valid lines as jobs (``<line>|<job JSON>``), in input order
- ``ib:batch:<id>:out``    hash: line number → its output or error record, written once
- ``ib:batches``           sorted set: every batch by creation time (``ib batch list``)
- ``ib:batches:active``    sorted set: batches the feeder still has to look at

Exactly one record per input line: every record goes through ``record_line`` (HSETNX on
the line number), which also counts it and, with the last line, ends the batch. A worker
writes its job's final outcome and the line record in one script (core.store.jobstore),
so a crash between the two cannot leave a finished job without its line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import redis

from core.store import keys
from core.store.batch_scripts import ADVANCE, CREATE_OWNED, END_VALIDATION, RECORD_LINE, TRANSITION
from core.store.fields import field_value

# As OpenAI names them. ``finalizing`` is never held: results are written line by line,
# so there is nothing left to assemble when the last line is recorded.
STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})


PURGE_SEP = "\n"  # ib:batches:purge members: "<batch id>\n<owner or nothing>"


def line_keys(batch_id: str) -> list[str]:
    """The KEYS of ``record_line``, in its order."""
    return [keys.batch(batch_id), keys.batch_out(batch_id), keys.ACTIVE_BATCHES]


def staged_entry(line: int, job_json: str) -> str:
    return f"{line}|{job_json}"


def parse_staged(entry: bytes | str) -> tuple[int, str]:
    text = entry.decode() if isinstance(entry, bytes) else entry
    line, _, job_json = text.partition("|")
    return int(line), job_json


class BatchStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._record = client.register_script(RECORD_LINE)
        self._end_validation = client.register_script(END_VALIDATION)
        self._transition = client.register_script(TRANSITION)
        self._advance = client.register_script(ADVANCE)
        self._create_owned = client.register_script(CREATE_OWNED)

    # ------------------------------------------------------------- writing

    def create(self, batch_id: str, fields: dict[str, Any], purge_at: int, max_active: int = 0) -> bool:
        """Record a new batch; False (nothing written) if its owner already has
        ``max_active`` batches validating or running (0: no limit)."""
        now = time.time()
        record = {
            **fields,
            "id": batch_id,
            "status": "validating",
            "created_at": now,
            "touched": now,
            "purge_at": purge_at,
        }
        if fields.get("owner"):
            owner = fields["owner"]
            indexes = [keys.BATCHES, keys.ACTIVE_BATCHES, keys.BATCH_PURGES, keys.owner_batches(owner)]
            created = self._create_owned(
                keys=[keys.batch(batch_id), *indexes],
                args=[
                    batch_id, now, purge_at, f"{batch_id}{PURGE_SEP}{owner}", max_active,
                    *(x for k, v in record.items() if v is not None for x in (k, field_value(v))),
                ],
            )  # fmt: skip
            self.prune(now)
            return bool(created)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.batch(batch_id), mapping={k: field_value(v) for k, v in record.items() if v is not None})
        pipe.expireat(keys.batch(batch_id), purge_at)
        pipe.zadd(keys.BATCHES, {batch_id: now})
        pipe.zadd(keys.ACTIVE_BATCHES, {batch_id: now})
        pipe.zadd(keys.BATCH_PURGES, {f"{batch_id}{PURGE_SEP}": purge_at})
        pipe.execute()
        self.prune(now)
        return True

    def prune(self, now: float, limit: int = 1000) -> int:
        """Drop batches whose records have expired (past their window and retention) from
        every index, so the indexes stay bounded as batches flow. Returns how many."""
        due = [m.decode() for m in self.r.zrangebyscore(keys.BATCH_PURGES, "-inf", now, start=0, num=limit)]
        if not due:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for member in due:
            batch_id, _, owner = member.partition(PURGE_SEP)
            pipe.zrem(keys.BATCHES, batch_id)
            pipe.zrem(keys.ACTIVE_BATCHES, batch_id)
            if owner:
                pipe.zrem(keys.owner_batches(owner), batch_id)
        pipe.zrem(keys.BATCH_PURGES, *due)
        pipe.execute()
        return len(due)

    def stage(
        self, batch_id: str, entries: list[str], errors: list[tuple[int, dict]], last_line: int, purge_at: int
    ) -> str:
        """One chunk of validated input: the valid lines' jobs and the bad lines' error
        records, in one round trip. Returns the batch's status (cancelling: stop reading)."""
        pipe = self.r.pipeline(transaction=False)
        if entries:
            pipe.rpush(keys.batch_lines(batch_id), *entries)
            pipe.hincrby(keys.batch(batch_id), "staged", len(entries))
        for line, record in errors:
            self.record_line(batch_id, line, record, "failed", client=pipe)
        pipe.hset(keys.batch(batch_id), mapping={"touched": time.time(), "max_line": last_line})
        if entries:
            pipe.expireat(keys.batch_lines(batch_id), purge_at)
        pipe.hget(keys.batch(batch_id), "status")
        return (pipe.execute()[-1] or b"").decode()

    def end_validation(self, batch_id: str, total: int, errors: list[dict] | None = None) -> str:
        doc = json.dumps({"object": "list", "data": errors or []})
        return self._end_validation(
            keys=[keys.batch(batch_id), keys.ACTIVE_BATCHES], args=[batch_id, total, time.time(), doc]
        ).decode()

    def record_line(
        self,
        batch_id: str,
        line: int,
        record: dict,
        kind: str,
        tokens: int = 0,
        fed: bool = False,
        client: Any = None,
    ) -> bool:
        """Write one line's record if it has none yet; counts it as ``completed`` or ``failed``
        (and its tokens in the batch's usage)."""
        args = [batch_id, line, json.dumps(record), kind, tokens, 0, int(fed), time.time()]  # 0: prompt tokens
        return bool(self._record(keys=line_keys(batch_id), args=args, client=client or self.r))

    def record_missing(self, batch_id: str, lines: list[tuple[int, bool]], make: Any) -> int:
        """Write ``make(line)`` as a failed record for each (line, fed) that has none yet."""
        if not lines:
            return 0
        present = self.r.hmget(keys.batch_out(batch_id), [str(line) for line, _ in lines])
        pipe = self.r.pipeline(transaction=False)
        todo = [(line, fed) for (line, fed), have in zip(lines, present) if have is None]
        for line, fed in todo:
            self.record_line(batch_id, line, make(line), "failed", fed=fed, client=pipe)
        return sum(bool(x) for x in pipe.execute()) if todo else 0

    def transition(self, batch_id: str, to: str, from_: tuple[str, ...]) -> str | None:
        out = self._transition(
            keys=[keys.batch(batch_id), keys.ACTIVE_BATCHES], args=[batch_id, to, time.time(), *from_]
        )
        return out.decode() if out else None

    def fail(self, batch_id: str, errors: list[dict]) -> None:
        """End a batch that could not run (validation stopped), with the reason."""
        self.set_fields(batch_id, errors={"object": "list", "data": errors})
        self.transition(batch_id, "failed", ("validating", "in_progress", "cancelling"))
        self.drop_staged(batch_id)

    def set_fields(self, batch_id: str, **fields: Any) -> None:
        self.r.hset(keys.batch(batch_id), mapping={k: field_value(v) for k, v in fields.items()})

    def advance(
        self, batch_id: str, fed: int, backends: dict[str, int], feed_s: float = 0.0, feed_cpu_s: float = 0.0
    ) -> None:
        """Move the feed cursor to ``fed``; count lines per backend and the feeder's time
        (wall, and CPU: in a busy worker the wall time is mostly waiting for the GIL)."""
        pipe = self.r.pipeline(transaction=False)
        self._advance(keys=[keys.batch(batch_id)], args=[fed], client=pipe)
        pipe.hincrbyfloat(keys.batch(batch_id), "feed_s", feed_s)
        pipe.hincrbyfloat(keys.batch(batch_id), "feed_cpu_s", feed_cpu_s)
        for backend, n in backends.items():
            pipe.hincrby(keys.batch(batch_id), f"backend:{backend}", n)
        pipe.execute()

    # ------------------------------------------------------------- reading

    def get(self, batch_id: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(keys.batch(batch_id)).items()}

    def get_many(self, batch_ids: list[str]) -> list[dict[str, str]]:
        pipe = self.r.pipeline(transaction=False)
        for b in batch_ids:
            pipe.hgetall(keys.batch(b))
        return [{k.decode(): v.decode() for k, v in h.items()} for h in pipe.execute()]

    def ids(self, active_only: bool = False, limit: int | None = None, newest_first: bool = True) -> list[str]:
        key = keys.ACTIVE_BATCHES if active_only else keys.BATCHES
        end = -1 if limit is None else limit - 1
        ids = self.r.zrevrange(key, 0, end) if newest_first else self.r.zrange(key, 0, end)
        return [i.decode() for i in ids]

    def deactivate(self, batch_id: str) -> None:
        """An ended batch leaves the active index, and its staged input goes."""
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem(keys.ACTIVE_BATCHES, batch_id)
        pipe.delete(keys.batch_lines(batch_id))
        pipe.execute()

    def drop_staged(self, batch_id: str) -> None:
        """An ended batch's staged input, once its unrun lines are recorded from it."""
        self.r.delete(keys.batch_lines(batch_id))

    def forget(self, batch_id: str, owner: str | None = None) -> None:
        """Drop a batch that expired from Redis from the indexes."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(keys.BATCHES, batch_id)
        pipe.zrem(keys.ACTIVE_BATCHES, batch_id)
        if owner:
            pipe.zrem(keys.owner_batches(owner), batch_id)
        pipe.execute()

    def owned(self, owner: str, after: str | None, limit: int) -> list[tuple[str, dict[str, str]]]:
        """(id, record) of an owner's batches, newest first, after the batch ``after``."""
        index = keys.owner_batches(owner)
        start = 0
        if after is not None:
            rank = self.r.zrevrank(index, after)
            if rank is None:
                return []
            start = rank + 1
        ids = [i.decode() for i in self.r.zrevrange(index, start, start + limit - 1)]
        return list(zip(ids, self.get_many(ids)))

    def active_owned(self, owner: str) -> int:
        return int(self.r.zintercard(2, [keys.owner_batches(owner), keys.ACTIVE_BATCHES]))

    def staged(self, batch_id: str, start: int, stop: int) -> list[tuple[int, str]]:
        """Staged lines ``start`` .. ``stop - 1`` as (line number, job JSON)."""
        if stop <= start:
            return []
        return [parse_staged(e) for e in self.r.lrange(keys.batch_lines(batch_id), start, stop - 1)]

    def records(self, batch_id: str, max_line: int, chunk: int = 1000) -> Iterator[tuple[int, dict]]:
        """(line, record) in input order; lines with no record yet (or blank) are skipped."""
        for first in range(1, max_line + 1, chunk):
            lines = list(range(first, min(first + chunk, max_line + 1)))
            for line, raw in zip(lines, self.r.hmget(keys.batch_out(batch_id), [str(n) for n in lines])):
                if raw is not None:
                    yield line, json.loads(raw)
