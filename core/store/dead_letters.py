"""Dead letters: broker messages no worker could run, kept with the reason, not dropped.

A message a worker cannot decode (not JSON, a refused content type), one for a task this
fleet does not have, or an ``ib.generate`` whose arguments do not validate (schema drift
in a rolling upgrade, a foreign or corrupt message) used to be acked and forgotten, its
job left ``queued`` forever. Workers now keep each such message here as it was received
(body, content type, headers, queue), so ``ib dead-letters`` can list it and, once the
cause is fixed (the new workers are rolled out), put it back on its queue unchanged.

Bounded: at most ``cap`` letters and ``max_bytes`` of them (a message may be 8 MiB:
10,000 of those would be 80 GB), the oldest dropped first; the newest always stays. The
letter keeps the message body, which holds the prompt: it lives in the same Redis as the
job itself, and nothing of it is logged.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from celery import Celery

from core.store import keys

DEFAULT_CAP = 10_000
DEFAULT_MAX_BYTES = 256 << 20

# Add one letter, then drop the oldest while over either bound. The byte count is kept in
# its own key (recounted from the letters if it is missing), so no add reads them all.
_ADD = """
if redis.call('EXISTS', KEYS[3]) == 0 then
  local total = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[1])) do total = total + #v end
  redis.call('SET', KEYS[3], total)
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local total = redis.call('INCRBY', KEYS[3], #ARGV[2])
local n = redis.call('ZCARD', KEYS[2])
local dropped = 0
while n > 1 and (n > tonumber(ARGV[4]) or total > tonumber(ARGV[5])) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  total = total - redis.call('HSTRLEN', KEYS[1], oldest)
  redis.call('HDEL', KEYS[1], oldest)
  redis.call('ZREM', KEYS[2], oldest)
  n = n - 1
  dropped = dropped + 1
end
redis.call('SET', KEYS[3], math.max(total, 0))
return dropped
"""
_REMOVE = """
local gone, size = 0, 0
for _, id in ipairs(ARGV) do
  size = size + redis.call('HSTRLEN', KEYS[1], id)
  gone = gone + redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('DECRBY', KEYS[3], size) end
return gone
"""


@dataclass
class DeadLetter:
    reason: str  # undecodable | unknown_task | invalid_task | invalid_arguments
    detail: str  # what went wrong, without the message body
    queue: str | None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    at: float = field(default_factory=time.time)
    task: str | None = None
    task_id: str | None = None
    body: str = ""  # as received: text, or base64 when it is not UTF-8 (body_encoding)
    body_encoding: str = "utf-8"
    content_type: str | None = None
    content_encoding: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None

    def raw_body(self) -> bytes:
        return base64.b64decode(self.body) if self.body_encoding == "base64" else self.body.encode()


def letter_from_message(reason: str, detail: str, message: Any) -> DeadLetter:
    """A dead letter from a kombu message, whatever state its body is in."""
    raw = message.body if isinstance(message.body, bytes) else str(message.body or "").encode()
    try:
        body, encoding = raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        body, encoding = base64.b64encode(raw).decode(), "base64"
    headers = message.headers if isinstance(message.headers, dict) else {}
    info = message.delivery_info or {}
    props = message.properties or {}
    return DeadLetter(
        reason=reason,
        detail=detail[:500],
        queue=info.get("routing_key"),
        task=_str_or_none(headers.get("task")),
        task_id=_str_or_none(headers.get("id")),
        body=body,
        body_encoding=encoding,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        headers=json.loads(json.dumps(headers, default=str)),
        priority=props.get("priority"),
    )


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


class DeadLetters:
    """The fleet's dead-letter list (``ib:dead-letters``, ``ib:dead-letters:index``)."""

    KEYS = (keys.DEAD_LETTERS, keys.DEAD_LETTER_INDEX, keys.DEAD_LETTER_BYTES)

    def __init__(self, client: redis.Redis, cap: int = DEFAULT_CAP, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.r = client
        self.cap, self.max_bytes = cap, max_bytes
        self._add = client.register_script(_ADD)
        self._remove = client.register_script(_REMOVE)

    def add(self, letter: DeadLetter) -> int:
        """Keep ``letter``; returns how many of the oldest were dropped for it."""
        args = [letter.id, json.dumps(asdict(letter)), letter.at, self.cap, self.max_bytes]
        return int(self._add(keys=list(self.KEYS), args=args))

    def bytes(self) -> int:
        return int(self.r.get(keys.DEAD_LETTER_BYTES) or 0)

    def list(self, limit: int = 100) -> list[DeadLetter]:
        """Newest first."""
        ids = [m.decode() for m in self.r.zrevrange(keys.DEAD_LETTER_INDEX, 0, limit - 1)]
        values = self.r.hmget(keys.DEAD_LETTERS, ids) if ids else []
        return [DeadLetter(**json.loads(v)) for v in values if v]

    def get(self, letter_id: str) -> DeadLetter | None:
        value = self.r.hget(keys.DEAD_LETTERS, letter_id)
        return DeadLetter(**json.loads(value)) if value else None

    def remove(self, *letter_ids: str) -> int:
        if not letter_ids:
            return 0
        return int(self._remove(keys=list(self.KEYS), args=list(letter_ids)))

    def count(self) -> int:
        return int(self.r.zcard(keys.DEAD_LETTER_INDEX))

    def requeue(self, app: Celery, letter: DeadLetter) -> None:
        """Publish the message again, byte for byte, on the queue it came from, and drop
        the letter. A job that was failed for it (``invalid_message``) is queued again."""
        if not letter.queue:
            raise ValueError(f"dead letter {letter.id} names no queue to put it back on")
        if letter.task_id:  # before the send: the next delivery must find the job open
            self._reopen(letter.task_id)
        if letter.reason == "invalid_arguments":  # kept as the task's arguments: sent anew
            call = json.loads(letter.body)
            app.send_task(
                letter.task or "",
                args=call["args"],
                kwargs=call["kwargs"],
                task_id=letter.task_id,
                queue=letter.queue,
                priority=letter.priority,
                ignore_result=True,
            )
        else:
            self._publish(app, letter)
        self.remove(letter.id)

    def _publish(self, app: Celery, letter: DeadLetter) -> None:
        with app.producer_or_acquire() as producer:
            producer.publish(
                letter.raw_body(),
                routing_key=letter.queue,
                exchange="",
                content_type=letter.content_type,
                content_encoding=letter.content_encoding,
                headers=letter.headers,
                priority=letter.priority,
                serializer=None,
                retry=True,
            )

    # A job failed only because its message was dead-lettered goes back to queued, so
    # the next delivery runs it (begin() returns a final outcome otherwise).
    _REOPEN = """
    local err = redis.call('HGET', KEYS[1], 'error')
    if redis.call('HGET', KEYS[1], 'final') ~= 'failed' or not err then return 0 end
    if not string.find(err, '"code": "invalid_message"', 1, true) then return 0 end
    redis.call('HDEL', KEYS[1], 'final', 'error', 'finished_at')
    redis.call('HSET', KEYS[1], 'status', 'queued')
    redis.call('DEL', KEYS[2])
    return 1
    """

    def _reopen(self, job_id: str) -> bool:
        return bool(self.r.eval(self._REOPEN, 2, keys.job(job_id), keys.done(job_id)))
