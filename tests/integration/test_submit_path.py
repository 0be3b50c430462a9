"""The client's submit path on a real Redis and real Celery publishing (a database of its
own, no worker: what a submit leaves in Redis is read back directly).

Two shortcuts it takes, and what they must never cost: the record claim runs inside the
message's push (no id sent twice, no record without its message, none lost when the
pipeline fails midway), and a stale fleet view is decided on and read again after the
send (never missing a worker that started since)."""

from __future__ import annotations

import time

import pytest
import redis

from conftest import own_database
from dispatcher.client import Client
from dispatcher.fleet import HardwareInfo, WorkerInfo
from dispatcher.routing.decision import found_live_worker
from dispatcher.store import keys

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


def beat(r: redis.Redis, backend: str) -> str:
    """A live worker's heartbeat, as workers.heartbeat writes it."""
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
    r.set(keys.worker(info.worker_id), info.model_dump_json(), px=60_000)
    r.sadd(keys.WORKERS, info.worker_id)
    return info.worker_id


def gone(r: redis.Redis, worker_id: str) -> None:
    r.delete(keys.worker(worker_id))


def lacked_a_worker(handle) -> bool:
    """The decision found no live worker for its choice (the tree says so in its path)."""
    return not found_live_worker(handle.selection)


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


def test_a_pipeline_that_fails_midway_leaves_a_record_exactly_where_a_message_went(client):
    client.redis.set(keys.job("poisoned"), "not a hash")  # its claim errors inside the pipeline
    jobs = [{**JOB, "id": "before"}, {**JOB, "id": "poisoned"}, {**JOB, "id": "after"}]
    with pytest.raises(Exception, match="delivery is uncertain"):
        client.submit_many(jobs)
    queue = client.explain(**JOB).queue
    pushed = messages(client.redis, queue)
    assert len(pushed) == 2 and not any(b'"poisoned"' in m for m in pushed)
    assert client.status("before") == client.status("after") == "queued"
    # The user resubmits the whole list once the bad record is gone: only the lost job goes.
    client.redis.delete(keys.job("poisoned"))
    client.submit_many(jobs)
    assert len(messages(client.redis, queue)) == 3
    assert client.status("poisoned") == "queued"


# ------------------------------------------------------------------ the stale fleet view


def test_a_stale_view_is_decided_on_then_read_again_after_the_send(client):
    client.fleet_cache_s, client.fleet_stale_s = 0.0, 60.0  # every view is stale at once
    worker = beat(client.redis, "pytorch")
    assert not lacked_a_worker(client.submit(**JOB))  # read first: there was no view
    gone(client.redis, worker)
    assert not lacked_a_worker(client.submit(**JOB))  # decided on the stale view that had it
    assert lacked_a_worker(client.submit(**JOB))  # the view read after that send lacks it


def test_a_view_older_than_the_stale_limit_is_read_first(client):
    client.fleet_cache_s, client.fleet_stale_s = 0.0, 0.05
    worker = beat(client.redis, "pytorch")
    client.submit(**JOB)
    gone(client.redis, worker)
    time.sleep(0.1)
    assert lacked_a_worker(client.submit(**JOB))


@pytest.mark.parametrize("policy", ["fallback", "queue", "reject"])
def test_a_worker_that_started_since_the_stale_view_is_not_missed(client, policy):
    client.fleet_cache_s, client.fleet_stale_s = 0.0, 60.0
    client.policy = client.policy.model_copy(update={"no_worker_policy": policy})
    beat(client.redis, "onnx")
    client.workers()  # the view: an ONNX worker only
    beat(client.redis, "pytorch")
    handle = client.submit(**JOB)  # on the stale view: queued, or refused (reject)
    assert not lacked_a_worker(handle) and handle.backend == "pytorch"
