"""Group messages (``ib.generate_group``, dispatcher.grouping) on a real Redis, real Celery
publishing and a real llama.cpp worker: jobs of one queue travel several to a message,
and each job is still its own (its record, answer, cancel, failure, exactly-once
outcome), also when the worker holding the group dies halfway.

The client here groups llama.cpp's jobs (the fleet's default groups vLLM's only): its
worker starts in seconds and runs 8 jobs at once, where a vLLM worker takes a minute."""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Iterator

import pytest
import redis

from conftest import drop_a_message, own_database, queue_lists, start_worker, wait_for
from core.celery_app import GENERATE_GROUP_TASK, GROUP_HEADER
from core.errors import InvalidMessageError
from core.fleet import HardwareInfo, WorkerInfo
from core.settings import HeartbeatSettings
from core.store import keys
from core.store.dead_letters import DeadLetters
from dispatcher.client import Client
from workers.lifecycle.heartbeat import Heartbeat

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"


def job(text: str, max_tokens: int = 12, **extra: object) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "sampling": {"max_tokens": max_tokens},
        "backend": "llamacpp",
        **extra,
    }


@pytest.fixture(scope="module")
def grouping_env() -> Iterator[None]:
    """Clients made meanwhile group llama.cpp's jobs, 4 to a message at most."""
    env = pytest.MonkeyPatch()
    env.setenv("IB_CELERY_GROUP_BACKENDS", '["llamacpp"]')
    env.setenv("IB_CELERY_GROUP_JOBS", "4")
    yield
    env.undo()


@contextlib.contextmanager
def grouping_client(redis_url: str, db: int) -> Iterator[Client]:
    """A grouping client on a database of its own (no other test's worker takes its messages)."""
    with own_database(redis_url, db) as url, Client(url) as c:
        yield c


@pytest.fixture(scope="module")
def fleet(redis_url, grouping_env, hf_dir):
    """A grouping client and one llama.cpp worker (2 threads) on database 10."""
    with grouping_client(redis_url, 10) as c:
        w = start_worker(_url(redis_url, 10), "llamacpp", extra_args=["--threads=2"])
        yield c, w
        w.kill()


def _url(redis_url: str, db: int) -> str:
    return f"{redis_url.rpartition('/')[0]}/{db}"


def beating(r: redis.Redis, worker_id: str) -> Heartbeat:
    """A live llama.cpp worker's heartbeat (the workers' own code), with no process behind it."""
    info = WorkerInfo(
        worker_id=worker_id,
        backend="llamacpp",
        hostname="h",
        pid=1,
        hardware=HardwareInfo(kind="cpu", cpu_cores=2, ram_gb=8),
        models=[MODEL],
        queues=["ib.llamacpp"],
        started_at=time.time(),
    )
    beat = Heartbeat(r, info, HeartbeatSettings(interval_s=3, ttl_s=60), in_flight=lambda: 0)
    beat.beat()
    return beat


def queued_messages(r: redis.Redis) -> list[dict]:
    return [json.loads(m) for k in r.scan_iter("ib.llamacpp*") if r.type(k) == b"list" for m in r.lrange(k, 0, -1)]


def test_a_queue_gets_one_message_per_group_split_over_its_live_readers(redis_url, grouping_env, hf_dir):
    with grouping_client(redis_url, 7) as c:
        beating(c.redis, "llamacpp-a")
        handles = c.submit_many([job(f"Question {i}?") for i in range(6)])
        groups = [m["headers"][GROUP_HEADER] for m in queued_messages(c.redis)]
        assert sorted(map(len, groups)) == [2, 4]  # one reader: 4 at most, in send order
        assert sorted(i for g in groups for i in g) == sorted(h.id for h in handles)
        assert all(c.status(h.id) == "queued" for h in handles)  # each job has its record
        for message in queued_messages(c.redis):  # the body: a [job, selection] pair per listed id
            args, _, _ = json.loads(base64.b64decode(message["body"]))
            assert [entry["id"] for entry, _ in args] == message["headers"][GROUP_HEADER]

        beating(c.redis, "llamacpp-b")  # a second reader: 6 jobs as 3 + 3, not 4 + 2
        c.redis.delete(*[k for k in c.redis.scan_iter("ib.llamacpp*") if c.redis.type(k) == b"list"])
        c.workers(max_age_s=0)
        more = c.submit_many([job(f"Other {i}?") for i in range(6)])
        assert sorted(len(m["headers"][GROUP_HEADER]) for m in queued_messages(c.redis)) == [3, 3]
        assert len(more) == 6


def test_an_id_repeated_in_one_submit_is_sent_once(redis_url, grouping_env, hf_dir):
    with grouping_client(redis_url, 7) as c:
        beating(c.redis, "llamacpp-a")
        twice = job("Same?")
        handles = c.submit_many([{**twice, "id": "twice"}, job("Other?"), {**twice, "id": "twice"}])
        sent = [i for m in queued_messages(c.redis) for i in m["headers"].get(GROUP_HEADER, [m["headers"]["id"]])]
        assert sorted(sent) == sorted(["twice", handles[1].id])  # its second copy went alone, and was refused
        assert c.record("twice")["status"] == "queued"


def test_a_group_whose_fleet_changed_since_the_view_is_decided_again_and_sent_once(redis_url, grouping_env, hf_dir):
    with grouping_client(redis_url, 7) as c:
        beating(c.redis, "llamacpp-a")
        c.workers(max_age_s=0)  # the view the next submit decides on
        c.redis.incr(keys.FLEET_EPOCH)  # the fleet changed since
        handles = c.submit_many([job(f"Question {i}?") for i in range(3)])
        groups = [m["headers"][GROUP_HEADER] for m in queued_messages(c.redis)]
        assert sorted(i for g in groups for i in g) == sorted(h.id for h in handles)  # each once


def test_jobs_travel_in_groups_and_each_gets_its_own_answer(fleet):
    client, worker = fleet
    prompts = ["What is 2 plus 2?", "Say hello in French.", "Name a river in Germany.", "Name a red fruit."]
    singles = [client.submit(job(p, 16)).result(timeout=120) for p in prompts]
    handles = client.submit_many([job(p, 16) for p in prompts] + [job("Count to three.", 8)] * 2)
    results = [h.result(timeout=120) for h in handles]
    # each job its own answer: as alone (greedy; llama.cpp's numbers drift with the batch's
    # shape after a few tokens, so the start is compared), run once, by the worker
    assert [x.token_ids[:4] for x in results[:4]] == [x.token_ids[:4] for x in singles]
    assert "4" in results[0].text and "Bonjour" in results[1].text
    assert all(x.status == "completed" and x.attempt == 1 and x.worker == worker.worker_id for x in results)
    r = client.redis
    assert all(r.hget(keys.job(h.id), "completions") == b"1" for h in handles)
    held = keys.inflight(worker.worker_id)
    wait_for(lambda: not r.hlen("unacked") and not r.hlen(held), 10, "the groups' acks and in-flight records")


def test_a_group_with_a_known_id_sends_only_the_new_jobs(fleet):
    client, _ = fleet
    first = client.submit(job("Name a color.", 4))
    first.result(timeout=120)
    again = client.submit_many([{**job("Name a color.", 4), "id": first.id}, job("Name a fish.", 4)])
    assert again[0].id == first.id
    assert again[1].result(timeout=120).status == "completed"
    assert client.redis.hget(keys.job(first.id), "attempts") == b"1"  # not sent a second time


def test_a_cancelled_job_of_a_group_ends_cancelled_and_the_others_complete(fleet):
    client, _ = fleet
    handles = client.submit_many([job("Write a very long story about a lighthouse.", 600)] + [job("Say yes.", 6)] * 2)
    wait_for(lambda: client.status(handles[0].id) == "running", 60, "the long job's start")
    time.sleep(0.5)
    handles[0].cancel()
    long = handles[0].result(timeout=60)
    assert long.status == "cancelled" and 0 < long.usage.completion_tokens < 600
    assert all(h.result(timeout=60).status == "completed" for h in handles[1:])


def test_a_group_message_that_does_not_validate_is_dead_lettered_and_fails_its_jobs(fleet):
    client, _ = fleet
    selection = client.submit(job("Say one.", 4)).selection
    ids = ["bad-group-a", "bad-group-b"]
    client.store.claim([(i, {"model": MODEL, "backend": "llamacpp"}) for i in ids])
    pairs = [[{"id": i, "model": MODEL, "prompt": 5}, selection.model_dump(mode="json")] for i in ids]
    client.app.send_task(
        GENERATE_GROUP_TASK, args=pairs, task_id="group-bad", queue="ib.llamacpp", headers={GROUP_HEADER: ids}
    )
    for i in ids:
        with pytest.raises(InvalidMessageError):
            client.result(i, timeout=60)
    letters = DeadLetters(client.redis).list()
    assert any(letter.task_id == "group-bad" and "[0].job.prompt" in letter.detail for letter in letters)


def test_a_group_of_a_killed_worker_reruns_only_its_unfinished_jobs(redis_url, grouping_env, hf_dir):
    with grouping_client(redis_url, 6) as client:
        first = start_worker(_url(redis_url, 6), "llamacpp", extra_args=["--threads=2"])
        second = None
        try:
            short, long = client.submit_many([job("Say hi.", 4), job("Write a long poem about the sea.", 1900)])
            assert short.result(timeout=120).worker == first.worker_id
            wait_for(lambda: client.status(long.id) == "running", 60, "the long job's start")
            first.kill()  # the group's message is unacked: its long job had not ended
            second = start_worker(_url(redis_url, 6), "llamacpp", extra_args=["--threads=2"])
            again = long.result(timeout=300)
            assert again.worker == second.worker_id and again.attempt == 2
            r = client.redis
            # the finished job was answered from its record on the second delivery: not run again
            assert r.hget(keys.job(short.id), "attempts") == b"1" and r.hget(keys.job(short.id), "completions") == b"1"
            assert r.hget(keys.job(long.id), "completions") == b"1"
        finally:
            first.kill()
            if second is not None:
                second.kill()


def test_a_batchs_lines_travel_in_groups_and_a_group_lost_with_a_dying_worker_is_sent_again(
    redis_url, grouping_env, hf_dir, tmp_path, monkeypatch
):
    """The batch feeder groups a feed's lines as a submit does. A worker killed between
    the broker's pop and its record takes a whole group with it: the feeder finds each of
    its lines in no queue (their ids are in the message's header) and sends them again."""
    import os
    import signal

    from dispatcher.batch.feeder import BatchFeeder

    monkeypatch.setenv("IB_BATCH_LOST_LINE_CHECK_S", "2")
    lines = [{"custom_id": f"c{i}", "prompt": f"Fact {i} about rivers:", "max_tokens": 6} for i in range(6)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with grouping_client(redis_url, 5) as client:
        worker = start_worker(
            _url(redis_url, 5), "llamacpp", extra_args=["--threads=2"], env={"IB_BATCH_FEEDER_IN_WORKERS": "false"}
        )
        feeder = None
        try:
            os.kill(worker.proc.pid, signal.SIGSTOP)  # live for the fleet view a while yet, taking nothing
            batch = client.batches.create(tmp_path / "in.jsonl", model=MODEL)
            feeder = BatchFeeder(client.parts, "test-feeder")
            feeder.run(once=True)
            # the shared queue's and the worker's own (prefix affinity), every priority level
            waiting = [json.loads(m) for q in queue_lists(client) for m in client.redis.lrange(q, 0, -1)]
            # 4 + 2; the stopped worker's BRPOP, sent before it stopped, may hold one of them
            assert sorted(len(m["headers"][GROUP_HEADER]) for m in waiting) in ([2, 4], [2], [4])
            lost = drop_a_message(client)
            os.kill(worker.proc.pid, signal.SIGCONT)
            feeder.start()
            final = wait_for(lambda: (b := client.batches.retrieve(batch.id)).is_final and b, 120, "the batch")
            assert (final.status, final.request_counts.completed, final.request_counts.failed) == ("completed", 6, 0)
            assert [r["custom_id"] for r in client.batches.results(batch.id)] == [f"c{i}" for i in range(6)]
            assert all(client.record(job_id)["attempts"] == "1" for job_id in lost)
        finally:
            if feeder is not None:
                feeder.stop()
            os.kill(worker.proc.pid, signal.SIGCONT)
            worker.kill()


def test_a_job_of_a_group_past_the_time_limit_fails_alone_and_leaves_the_engine(redis_url, grouping_env, hf_dir):
    from core.errors import JobTimeoutError

    with grouping_client(redis_url, 4) as client:
        worker = start_worker(
            _url(redis_url, 4), "llamacpp", extra_args=["--threads=2"], env={"IB_CELERY_JOB_TIME_LIMIT_S": "2"}
        )
        try:
            long, short = client.submit_many([job("Write a very long story about a dragon.", 1900), job("Hi", 4)])
            assert short.result(timeout=60).status == "completed"
            with pytest.raises(JobTimeoutError, match="exceeded the 2 s time limit"):
                long.result(timeout=120)
            wait_for(lambda: not client.redis.hlen(keys.inflight(worker.worker_id)), 10, "the group's end")
            assert client.submit(job("Say yes.", 4)).result(timeout=60).status == "completed"  # the engine is free
        finally:
            worker.kill()
