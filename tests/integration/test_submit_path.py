"""The client's submit path on a real Redis and real Celery publishing (a database of its
own, no worker process: what a submit leaves in Redis is read back directly; heartbeats
are written by the workers' own Heartbeat class).

Two shortcuts it takes, and what they must never cost: the record claim runs inside the
message's push (no id sent twice, no record without its message, none lost when some
pushes fail), and a cached fleet view is decided on with its premise checked in the same
push (the fleet epoch and every worker's heartbeat), so a worker that started, changed or
died since is never missed."""

from __future__ import annotations

import time

import pytest
import redis

from conftest import own_database
from core.errors import EnqueueError
from core.fleet import HardwareInfo, WorkerInfo
from core.settings import HeartbeatSettings
from core.store import keys
from dispatcher.client import Client
from workers.lifecycle.heartbeat import Heartbeat

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
JOB = {"model": MODEL, "backend": "pytorch", "prompt": "Hi there.", "sampling": {"max_tokens": 4}}


@pytest.fixture
def client(redis_url, hf_dir):  # hf_dir: the model's hf format is prepared
    with own_database(redis_url, 8) as url, Client(url) as c:
        yield c


def messages(r: redis.Redis, queue: str) -> list[bytes]:
    """Every message waiting on a queue, over its priority lists."""
    return [m for k in r.scan_iter(f"{queue}*") if r.type(k) == b"list" for m in r.lrange(k, 0, -1)]


def heartbeat(r: redis.Redis, backend: str) -> Heartbeat:
    """A live worker's heartbeat, beaten once by the workers' own code."""
    info = WorkerInfo(
        worker_id=f"{backend}-fake",
        backend=backend,
        hostname="h",
        pid=1,
        hardware=HardwareInfo(kind="cpu", cpu_cores=2, ram_gb=8),
        models=[MODEL],
        queues=[f"ib.{backend}"],
        started_at=time.time(),
    )
    beat = Heartbeat(r, info, HeartbeatSettings(interval_s=3, ttl_s=60), in_flight=lambda: 0)
    beat.beat()
    return beat


def lacked_a_worker(handle) -> bool:
    """The decision found no live worker for its choice (its "live workers" step counts
    them, or says "none" or "fallback ...")."""
    return any(step.check == "live workers" and not step.answer.isdigit() for step in handle.path)


def drain_behind_the_epochs_back(r: redis.Redis, beat: Heartbeat) -> None:
    """Change the worker's heartbeat without bumping the epoch, as no worker does: only a
    decision on the cached view still sees it ready."""
    info = beat.info.model_copy(update={"status": "draining"})
    r.set(keys.worker(info.worker_id), info.model_dump_json(), px=60_000)


# ------------------------------------------------------------------ the claim in the push


def test_a_submit_pushes_one_message_and_writes_its_record(client):
    handle = client.submit(**JOB)
    [raw] = messages(client.redis, handle.selection.queue)
    assert handle.id.encode() in raw  # Celery's message for this job, where a worker reads it
    record = client.record(handle.id)
    assert record["status"] == "queued" and record["backend"] == "pytorch"
    assert record["queue"] == handle.selection.queue
    assert 0 < client.redis.ttl(keys.job(handle.id)) <= client.store.ttl_s


def test_a_known_id_is_never_pushed_again(client):
    first = client.submit(**JOB, id="known-1")
    queue = first.selection.queue
    client.submit(**{**JOB, "sampling": {"max_tokens": 9}}, id="known-1")
    client.submit_many([{**JOB, "id": "known-2"}, {**JOB, "id": "known-2"}])
    assert len(messages(client.redis, queue)) == 2  # known-1 once, known-2 once
    assert client.record("known-1")["status"] == "queued"


def test_pushes_that_fail_midway_leave_a_record_exactly_where_a_message_went(client):
    client.redis.set(keys.job("poisoned"), "not a hash")  # its claim errors inside the pipeline
    jobs = [{**JOB, "id": "before"}, {**JOB, "id": "poisoned"}, {**JOB, "id": "after"}]
    with pytest.raises(EnqueueError, match="1 of 3 jobs were not enqueued") as raised:
        client.submit_many(jobs)
    assert raised.value.details["sent"] == ["before", "after"]
    assert list(raised.value.details["not_sent"]) == ["poisoned"]
    queue = client.explain(**JOB).queue
    pushed = messages(client.redis, queue)
    assert len(pushed) == 2 and not any(b'"poisoned"' in m for m in pushed)
    assert client.status("before") == client.status("after") == "queued"
    # The user resubmits the whole list once the bad record is gone: only the lost job goes.
    client.redis.delete(keys.job("poisoned"))
    client.submit_many(jobs)
    assert len(messages(client.redis, queue)) == 3
    assert client.status("poisoned") == "queued"


# ------------------------------------------------------------------ the cached fleet view


def test_a_cached_view_is_decided_on_while_the_fleet_is_unchanged(client):
    client.fleet.cache_s = 0.0  # every view is past the plain cache at once
    beat = heartbeat(client.redis, "pytorch")
    assert not lacked_a_worker(client.submit(**JOB))  # read first: there was no view
    drain_behind_the_epochs_back(client.redis, beat)
    assert not lacked_a_worker(client.submit(**JOB))  # no read: the cached view has it ready
    beat.set_status("draining")  # what a worker does: the beat bumps the epoch
    handle = client.submit(**JOB)
    assert lacked_a_worker(handle)  # the push refused the old view; decided on a fresh read
    assert len(messages(client.redis, handle.selection.queue)) == 3  # each job pushed once


def test_a_worker_whose_heartbeat_expired_fails_the_views_premise(client):
    client.fleet.cache_s = 0.0
    beat = heartbeat(client.redis, "pytorch")
    client.submit(**JOB)
    client.redis.delete(keys.worker(beat.info.worker_id))  # it died: its key expired, no beat
    handle = client.submit(**JOB)
    assert lacked_a_worker(handle)
    assert len(messages(client.redis, handle.selection.queue)) == 2


def test_a_view_older_than_the_stale_limit_is_read_first(client):
    client.fleet.cache_s, client.fleet.stale_s = 0.0, 0.05
    beat = heartbeat(client.redis, "pytorch")
    client.submit(**JOB)
    drain_behind_the_epochs_back(client.redis, beat)
    time.sleep(0.1)
    assert lacked_a_worker(client.submit(**JOB))


@pytest.mark.parametrize("policy", ["fallback", "queue", "reject"])
def test_a_worker_that_started_since_the_view_was_read_is_not_missed(client, policy):
    client.fleet.cache_s = 0.0
    client.router.policy = client.router.policy.model_copy(update={"no_worker_policy": policy})
    heartbeat(client.redis, "onnx")
    client.workers()  # the view: an ONNX worker only
    heartbeat(client.redis, "pytorch")  # its first beat bumps the epoch
    handle = client.submit(**JOB)  # on the view: queued for none, or refused (reject)
    assert not lacked_a_worker(handle) and handle.backend == "pytorch"
    assert len(messages(client.redis, handle.selection.queue)) == 1
