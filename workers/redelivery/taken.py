"""The worker's QoS on the fleet's Redis transport: each message it takes is recorded in
the worker's own bookkeeping within kombu's unacked write, and a group message holds as
many prefetch slots as it carries jobs.

The write that makes a taken message recoverable (kombu's unacked index and hash) then
also says which worker holds it (workers.redelivery.inflight), in the same round trip,
before Celery sees the message, instead of a thread of its own woken for it (~0.1 ms of
the hand-over to the task's thread on 2 cores: that thread took the idle CPU the task's
thread needed). The worker's consumer hands this QoS to the connection it consumes on
(``recording_consumer``, core.transport.consume_with), each time it connects: nothing in
module state, and only the consuming connection records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from core.celery_app import group_members
from core.store.faults import Episode, wait_out
from core.transport import consume_with

log = logging.getLogger(__name__)
_episode = Episode(log, "broker bookkeeping")  # one per process: every QoS of the worker


def watch(client: redis.Redis) -> None:
    """The worker's Redis client: a full Redis is logged with its memory numbers."""
    _episode.client = client


def _stopping() -> bool:
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


def riding_out(what: str, call: Callable[[], T]) -> T:
    """kombu's writes for a taken message, waited out through a full or read-only Redis
    (core.store.faults) instead of raised: raised, Celery's consumer calls the error
    unrecoverable and the worker process exits, and a message popped by BRPOP whose
    unacked write failed is lost. The writes are MULTI/EXEC pipelines and one-key
    deletes: a refused one changed nothing, so trying again is safe. A connection loss
    is kombu's own to handle (it reconnects and restores): that is raised at once."""
    return wait_out(_episode, what, call, stop=_stopping, faults=FULL_OR_READONLY)


T = TypeVar("T")
FULL_OR_READONLY = (redis.ReadOnlyError, redis.exceptions.OutOfMemoryError)

TakenRecorder = Callable[[Any, str, str, list[str] | None], None]
"""Adds its writes for one taken message to a redis-py pipeline: (pipeline, task id,
delivery tag, the ids of the jobs a group message carries or None)."""


def taken_recorded(message: Any) -> bool:
    """Whether the recorder's writes for this kombu message ran with its unacked write
    (False for any other transport or path: the caller records it its own way)."""
    return getattr(message, "ib_taken_recorded", False)


class RecordingQoS(kombu_redis.QoS):
    """kombu's QoS, whose unacked write (ZADD to the index, HSET of the message, one
    pipeline, as kombu writes them) also carries ``recorder``'s writes.

    It also counts the prefetch limit in jobs, not messages: a group message holds as
    many of the worker's slots as it carries jobs (until acked), so a worker takes no
    more jobs at once than its capacity, grouped or not."""

    recorder: TakenRecorder | None = None  # set on the subclass recording_qos makes

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
        riding_out("an ack", lambda: super(RecordingQoS, self).ack(delivery_tag))

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self._extra_jobs.pop(delivery_tag, None)
        riding_out("a reject", lambda: super(RecordingQoS, self).reject(delivery_tag, requeue=requeue))

    def restore_unacked(self, client: Any = None) -> Any:
        self._extra_jobs.clear()
        return riding_out("restoring unacked messages", lambda: super(RecordingQoS, self).restore_unacked(client))

    def append(self, message: Any, delivery_tag: str) -> None:
        recorder = self.recorder
        task_id = (message.headers or {}).get("id")
        members = group_members(message.headers)
        if members and len(members) > 1:
            self._extra_jobs[delivery_tag] = len(members) - 1
        if recorder is None or task_id is None:
            return riding_out(
                "a taken message's unacked write", lambda: super(RecordingQoS, self).append(message, delivery_tag)
            )
        delivery = message.delivery_info
        raw = kombu_redis.dumps([message._raw, delivery["exchange"], delivery["routing_key"]])

        def write() -> None:
            with self.pipe_or_acquire() as pipe:
                pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()}).hset(self.unacked_key, delivery_tag, raw)
                recorder(pipe, task_id, delivery_tag, members)
                pipe.execute()

        riding_out("a taken message's unacked write", write)
        virtual.QoS.append(self, message, delivery_tag)  # kombu's in-process record of it
        message.ib_taken_recorded = True  # the message that Celery's request will carry
        return None


def recording_qos(recorder: TakenRecorder) -> type[RecordingQoS]:
    """The QoS class for a worker whose taken messages ``recorder`` writes down."""
    return type("RecordingQoS", (RecordingQoS,), {"recorder": staticmethod(recorder)})


def recording_consumer(base: type[Consumer], recorder: TakenRecorder) -> type[Consumer]:
    """Celery's consumer (``base``), whose connection to consume on (made again after a
    broker restart) takes each message with a RecordingQoS for ``recorder``."""
    qos = recording_qos(recorder)

    class RecordingConsumer(base):  # type: ignore[valid-type,misc]
        def connection_for_read(self, heartbeat: float | None = None) -> Any:
            return self.ensure_connected(consume_with(self.app.connection_for_read(heartbeat=heartbeat), qos))

    return RecordingConsumer
