"""kombu's Redis transport, with one Redis client per channel instead of one per command.

kombu's Redis channel makes a new ``redis.Redis`` for every publish, every ack and every
reserve (``conn_or_acquire``): each one copies redis-py's table of ~170 response
callbacks, 0.1-0.3 ms of Python on the fleet path's hot spots (the client's publish, the
worker's unacked-set write before a job can start, its ack). A ``redis.Redis`` is
thread-safe over its connection pool, so one per channel serves them all; it is made
again whenever the channel's pool is (kombu drops the pool after a connection error).
The consuming connection (BRPOP) and everything else are kombu's own.

A worker can also have each message it takes recorded in its own bookkeeping within
kombu's unacked write (``record_taken``): the write that makes a taken message
recoverable then also says which worker holds it, in the same round trip, before Celery
sees the message, instead of a thread of its own woken for it (~0.1 ms of the hand-over
to the task's thread on 2 cores: that thread took the idle CPU the task's thread needed).

The channel also takes a *push guard* per message (``guard_push``): a Lua script run in
place of the message's LPUSH, which pushes only if its own checks pass, all of them in
one pipeline (``push_held``) whose replies come back. The client claims a job's record
and checks its decision's premise (the fleet it decided on is unchanged) that way, in
the push itself instead of round trips before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import redis
from kombu.transport import TRANSPORT_ALIASES, virtual
from kombu.transport import redis as kombu_redis

TakenRecorder = Callable[[Any, str, str, list[str] | None], None]
"""Adds its writes for one taken message to a redis-py pipeline: (pipeline, task id,
delivery tag, the ids of the jobs a group message carries or None)."""

GROUP_HEADER = "ib_jobs"
"""The message header listing the job ids of a group message (ib.generate_group)."""


def group_members(headers: dict[str, Any] | None) -> list[str] | None:
    """The job ids a message carries as a group, from its headers (None: one job, or
    not ours)."""
    members = (headers or {}).get(GROUP_HEADER)
    return [m for m in members if isinstance(m, str)] if isinstance(members, list) else None


_record_taken: TakenRecorder | None = None


def taken_recorded(message: Any) -> bool:
    """Whether ``record_taken``'s writes for this kombu message ran with its unacked write
    (False for any other transport or path: the caller records it its own way)."""
    return getattr(message, "ib_taken_recorded", False)


def record_taken(recorder: TakenRecorder | None) -> None:
    """In this process, run ``recorder`` in every unacked write of a task message (one with a
    task id) that this transport's channels take; None stops it. One worker per process."""
    global _record_taken
    _record_taken = recorder


class RecordingQoS(kombu_redis.QoS):
    """kombu's QoS, whose unacked write (ZADD to the index, HSET of the message, one
    pipeline, as kombu writes them) also carries ``record_taken``'s writes.

    It also counts the prefetch limit in jobs, not messages: a group message holds as
    many of the worker's slots as it carries jobs (until acked), so a worker takes no
    more jobs at once than its capacity, grouped or not."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._extra_jobs: dict[str, int] = {}  # delivery tag -> jobs beyond the first it carries

    def held_jobs(self) -> int:
        """Jobs in the messages taken and not yet acked or rejected."""
        dirty = self._dirty
        # list(): task threads ack while the consumer's thread asks (one C call: no switch)
        extra = sum(n for tag, n in list(self._extra_jobs.items()) if tag not in dirty) if self._extra_jobs else 0
        return len(self._delivered) - len(dirty) + extra

    def can_consume(self) -> bool:
        return not self.prefetch_count or self.held_jobs() < self.prefetch_count

    def can_consume_max_estimate(self) -> int | None:
        return max(self.prefetch_count - self.held_jobs(), 0) if self.prefetch_count else None

    def ack(self, delivery_tag: str) -> None:
        self._extra_jobs.pop(delivery_tag, None)
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self._extra_jobs.pop(delivery_tag, None)
        super().reject(delivery_tag, requeue=requeue)

    def restore_unacked(self, client: Any = None) -> Any:
        self._extra_jobs.clear()
        return super().restore_unacked(client)

    def append(self, message: Any, delivery_tag: str) -> None:
        recorder = _record_taken
        task_id = (message.headers or {}).get("id")
        members = group_members(message.headers)
        if members and len(members) > 1:
            self._extra_jobs[delivery_tag] = len(members) - 1
        if recorder is None or task_id is None:
            return super().append(message, delivery_tag)
        delivery = message.delivery_info
        raw = kombu_redis.dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()}).hset(self.unacked_key, delivery_tag, raw)
            recorder(pipe, task_id, delivery_tag, members)
            pipe.execute()
            virtual.QoS.append(self, message, delivery_tag)  # kombu's in-process record of it
        message.ib_taken_recorded = True  # the message that Celery's request will carry
        return None


class SharedClientMixin:
    """Overrides the one factory kombu calls for a pooled (not the polling) client."""

    _shared_client: redis.Redis | None = None
    pool: Any  # kombu's Channel.pool

    def _create_client(self, asynchronous: bool = False) -> redis.Redis:
        if asynchronous:  # the polling client: a dedicated connection, kombu's own
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
        client = self._shared_client
        if client is None or client.connection_pool is not self.pool:
            client = self._shared_client = super()._create_client()  # type: ignore[misc]
        return client


class PushGuard(NamedTuple):
    """A script that pushes the message (ARGV[1]) onto the queue's list (KEYS[1]) only if
    its own checks on the rest of its keys and arguments pass; its reply says which."""

    script: str
    keys: list[str]
    args: list[Any]


class PushGuardMixin:
    """Holds a guarded message's push (its guard's script in place of LPUSH) until
    ``push_held`` runs them all in one pipeline and returns their replies, which kombu's
    own publish path would drop."""

    _guards: dict[str, PushGuard] | None = None
    _held: list[tuple[str, tuple[Any, ...]]] | None = None
    _expires: dict[str, int]

    def guard_push(self, task_id: str, guard: PushGuard) -> None:
        """Guard the next message published with this task id (one thread per channel:
        kombu's producer pool hands a channel to one thread at a time)."""
        if self._guards is None:
            self._guards = {}
        self._guards[task_id] = guard

    def push_held(self) -> list[tuple[str, Any]]:
        """Run the held pushes, in order, in one round trip: (task id, its script's reply,
        an exception object where the script failed) for each. A connection error raises: which
        pushes ran is then unknown (a guard that claims the id makes a resend safe)."""
        held, self._held = self._held or [], None
        if not held:
            return []
        with self.conn_or_acquire() as client:  # type: ignore[attr-defined]
            pipe = client.pipeline(transaction=False)
            for _, command in held:
                pipe.eval(*command)
            replies = pipe.execute(raise_on_error=False)
        return [(task_id, reply) for (task_id, _), reply in zip(held, replies)]

    def drop_guards(self, task_ids: list[str]) -> list[str]:
        """Forget these ids' guards and held pushes (a send that failed before pushing);
        returns the ids whose guard was never used: published without it."""
        guards = self._guards or {}
        if self._held:
            self._held = [h for h in self._held if h[0] not in set(task_ids)]
        return [task_id for task_id in task_ids if guards.pop(task_id, None) is not None]

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        task_id = message.get("headers", {}).get("id")
        guard = self._guards.pop(task_id, None) if self._guards else None
        if guard is None:
            return super()._put(queue, message, **kwargs)  # type: ignore[misc]
        if self._expires and queue in self._expires:  # kombu's queue expiry: the fleet sets none
            raise ValueError(f"queue {queue} expires: a guarded push is not supported there")
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))  # type: ignore[attr-defined]
        if self._held is None:
            self._held = []
        self._held.append(
            (task_id, (guard.script, 1 + len(guard.keys), key, *guard.keys, kombu_redis.dumps(message), *guard.args))
        )
        return None


class Channel(PushGuardMixin, SharedClientMixin, kombu_redis.Channel):
    QoS = RecordingQoS


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    """Resolve kombu's ``redis`` transport name to this module's Transport, in this process.

    Through kombu's own table of transport names, not Celery's ``broker_transport``: with
    that set, kombu writes the class path as the URL scheme (``Connection.as_uri``), and
    readers of the broker URL (Flower's broker view) no longer know the broker. ``rediss://``
    keeps kombu's transport (kombu infers TLS from that scheme's name); Sentinel, socket
    URLs and RabbitMQ are untouched."""
    TRANSPORT_ALIASES["redis"] = f"{__name__}:Transport"
