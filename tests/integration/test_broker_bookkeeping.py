"""The worker's in-flight ledger and the broker transport's shared client, on a real Redis
(a database of its own): what the reaper and the publish path rely on."""

from __future__ import annotations

import contextlib
import json
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from conftest import own_database
from core import transport as broker_transport
from core.celery_app import GROUP_HEADER, create_app
from core.store import keys
from core.transport import Channel, consume_with
from workers.redelivery.inflight import InflightLedger
from workers.redelivery.taken import RecordingQoS, recording_consumer, recording_qos, taken_recorded

pytestmark = pytest.mark.integration


@pytest.fixture
def url(redis_url):
    with own_database(redis_url, 14) as url:
        yield url


def test_the_ledger_writes_every_change_in_the_order_given(url):
    r = redis.Redis.from_url(url)
    ledger = InflightLedger(r, "w1")
    try:
        ledger.add("a", "tag-a")
        ledger.add("b", "tag-b")
        ledger.remove("a")
        ledger.remove("c")  # never added: nothing to drop
        ledger.add("a", "tag-a2")  # a second delivery of a, after the first ended
        assert ledger.flush(timeout=5)
        assert r.hgetall(keys.inflight("w1")) == {b"b": b"tag-b", b"a": b"tag-a2"}
    finally:
        ledger.close()


def test_a_write_that_fails_is_retried_until_it_lands(url):
    r = redis.Redis.from_url(url)
    key = keys.inflight("w2")
    r.set(key, "not a hash")  # every HSET on it fails (WRONGTYPE) until the key is gone
    ledger = InflightLedger(r, "w2", retry_s=0.05)
    try:
        ledger.add("a", "tag-a")
        assert not ledger.flush(timeout=0.5)  # still failing: not written, still pending
        r.delete(key)
        assert ledger.flush(timeout=5)
        assert r.hgetall(key) == {b"a": b"tag-a"}
    finally:
        ledger.close()


def test_close_writes_what_is_still_queued(url):
    r = redis.Redis.from_url(url)
    ledger = InflightLedger(r, "w3")
    for i in range(200):
        ledger.add(f"job{i}", f"tag{i}")
    ledger.remove("job0")
    ledger.close()
    assert r.hlen(keys.inflight("w3")) == 199
    assert not r.hexists(keys.inflight("w3"), "job0")


@contextlib.contextmanager
def _held_ledger(r: redis.Redis, worker: str) -> Iterator[tuple[InflightLedger, threading.Event, threading.Event]]:
    """A ledger whose thread stops inside its next write, before the write reaches Redis,
    until ``release`` is set (``entered``: it has stopped there); closed on leaving."""
    ledger = InflightLedger(r, worker)
    entered, release = threading.Event(), threading.Event()
    write = ledger._write

    def held_write(changes):
        entered.set()
        release.wait(10)
        return write(changes)

    ledger._write = held_write  # type: ignore[method-assign]
    try:
        yield ledger, entered, release
    finally:
        release.set()
        ledger.close()


def _record_as_the_transport_does(r: redis.Redis, ledger: InflightLedger, task_id: str, tag: str) -> None:
    """The record in a pipeline of its own, executed after it (as kombu's unacked write)."""
    pipe = r.pipeline()
    ledger.record(pipe, task_id, tag)
    pipe.execute()


def test_a_record_in_the_brokers_write_is_not_undone_by_a_queued_removal(url):
    """A job ends here and its message comes back at once (a duplicate delivery): the new
    delivery's record, written with kombu's unacked write, must not be deleted by the old
    delivery's removal, still queued behind a write in progress."""
    r = redis.Redis.from_url(url)
    with _held_ledger(r, "w5") as (ledger, entered, release):
        ledger.remove("other")  # the thread takes this and stops inside its write
        assert entered.wait(5)
        ledger.remove("job-1")  # the first delivery ended: queued behind it
        _record_as_the_transport_does(r, ledger, "job-1", "tag-2")
        release.set()
        assert ledger.flush(timeout=5)
    assert r.hget(keys.inflight("w5"), "job-1") == b"tag-2"


def test_a_record_waits_for_a_removal_of_its_task_being_written(url):
    r = redis.Redis.from_url(url)
    r.hset(keys.inflight("w6"), "job-1", "tag-1")
    with _held_ledger(r, "w6") as (ledger, entered, release):
        ledger.remove("job-1")  # the thread takes the removal and stops before writing it
        assert entered.wait(5)
        recorder = threading.Thread(target=_record_as_the_transport_does, args=(r, ledger, "job-1", "tag-2"))
        recorder.start()
        recorder.join(0.2)
        assert recorder.is_alive()  # held until the removal has landed
        release.set()
        recorder.join(5)
        assert ledger.flush(timeout=5)
    assert r.hget(keys.inflight("w6"), "job-1") == b"tag-2"


def test_the_transport_reuses_one_client_per_channel_and_a_new_one_after_a_pool_reset(url):
    broker_transport.install()
    with Connection(url) as conn:
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        queue = conn.SimpleQueue("ib.test-bookkeeping")
        first = channel._create_client()
        for i in range(3):
            queue.put({"n": i})
        assert channel._create_client() is first  # publishes went through the same client
        assert [queue.get(timeout=5).payload["n"] for _ in range(3)] == [0, 1, 2]
        channel._disconnect_pools()  # what kombu does after a connection error
        fresh = channel._create_client()
        assert fresh is not first and fresh.connection_pool is channel.pool
        queue.put({"n": 3})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 3}
        message.ack()
        queue.close()


def test_the_fleets_app_uses_it_for_redis_and_still_names_the_broker_by_its_scheme(url):
    app = create_app(url)
    with app.connection_for_write() as conn:
        assert isinstance(conn.default_channel, Channel)
        # what Flower's broker view parses to pick its Redis reader
        assert conn.as_uri(include_password=True).startswith("redis://")
    tls = Connection("rediss://127.0.0.1:6379/0?ssl_cert_reqs=none")
    assert not issubclass(tls.transport.Channel, Channel)  # kombu infers TLS from the scheme
    assert create_app("amqp://guest:guest@127.0.0.1:5672//").connection().as_uri().startswith("amqp://")


def test_the_workers_consumer_takes_messages_with_its_recording_qos_on_every_connection(url):
    """What the worker wires (workers.worker): its consumer's connection, and the one it
    makes again after a broker restart, records taken messages; no other connection of
    the process does, and nothing of it is in the transport options (sent as JSON by
    `celery inspect stats`)."""
    from celery.worker.consumer import Consumer

    app = create_app(url)
    ledger = InflightLedger(redis.Redis.from_url(url), "w7")
    controller = types.SimpleNamespace(use_eventloop=False)  # what Celery's worker is to its consumer, here
    consumer = recording_consumer(Consumer, ledger.record)(lambda *_: None, app=app, controller=controller)
    try:
        for _ in range(2):  # a first connection, and a reconnection
            with consumer.connection_for_read() as conn:
                qos = conn.default_channel.qos
                assert isinstance(qos, RecordingQoS) and qos.recorder == ledger.record
                json.dumps(conn.info())  # what `celery inspect stats` sends of it
        with app.connection_for_write() as other:
            assert not isinstance(other.default_channel.qos, RecordingQoS)
    finally:
        ledger.close()


@contextlib.contextmanager
def recording(url: str, worker_id: str, queue_name: str) -> Iterator[tuple[redis.Redis, InflightLedger, Any]]:
    """A kombu queue on the fleet's transport whose taken messages a worker's ledger records."""
    r = redis.Redis.from_url(url)
    broker_transport.install()
    ledger = InflightLedger(r, worker_id)
    try:  # the worker's QoS, handed to the connection it consumes on as the worker's consumer does
        with consume_with(Connection(url), recording_qos(ledger.record)) as conn:
            queue = conn.SimpleQueue(queue_name)
            yield r, ledger, queue
            queue.close()
    finally:
        ledger.close()


def test_a_taken_task_message_is_recorded_in_its_own_unacked_write(url):
    """What the reaper relies on: the moment a message is taken it is both in kombu's
    unacked set (restorable) and in the worker's in-flight hash (whose it is), written
    together, before the consumer gets it; a message without a task id is left to kombu."""
    with recording(url, "w4", "ib.test-taken") as (r, _, queue):
        queue.put({"n": 1}, headers={"id": "job-1"})
        queue.put({"n": 2})  # no task id: not a task message
        first = queue.get(timeout=5)
        tag = first.delivery_tag
        assert taken_recorded(first)
        assert r.hget(keys.inflight("w4"), "job-1") == tag.encode()
        assert r.hexists(first.channel.qos.unacked_key, tag)  # kombu's own record, as before
        assert r.zscore(first.channel.qos.unacked_index_key, tag) is not None
        second = queue.get(timeout=5)
        assert not taken_recorded(second)
        assert r.hexists(second.channel.qos.unacked_key, second.delivery_tag)
        assert r.hlen(keys.inflight("w4")) == 1
        first.ack()
        second.ack()
        assert not r.hexists(first.channel.qos.unacked_key, tag)


def test_a_group_message_is_recorded_and_counted_as_its_jobs(url):
    """A group message (ib.generate_group) holds one in-flight entry per job, each with the
    message's tag (the hash's size is the worker's load; the reaper releases each job),
    and as many prefetch slots as it carries jobs until it is acked; its end drops every
    entry."""
    with recording(url, "w5", "ib.test-group") as (r, ledger, queue):
        queue.put({"n": 1}, headers={"id": "group-1", GROUP_HEADER: ["j1", "j2", "j3"]})
        queue.put({"n": 2}, headers={"id": "single-1"})
        qos = queue.channel.qos
        qos.prefetch_count = 4
        group = queue.get(timeout=5)
        assert r.hgetall(keys.inflight("w5")) == dict.fromkeys([b"j1", b"j2", b"j3"], group.delivery_tag.encode())
        assert qos.held_jobs() == 3 and qos.can_consume()
        single = queue.get(timeout=5)
        assert qos.held_jobs() == 4 and not qos.can_consume()  # 2 messages, 4 jobs: full
        assert qos.can_consume_max_estimate() == 0
        group.ack()
        assert qos.held_jobs() == 1 and qos.can_consume()
        ledger.remove("group-1")  # the group's task ended: all its entries go
        assert ledger.flush(timeout=5)
        assert r.hgetall(keys.inflight("w5")) == {b"single-1": single.delivery_tag.encode()}
        single.ack()
