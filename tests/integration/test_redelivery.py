"""A worker SIGKILLed mid-generation loses nothing: the job is redelivered and completes once."""

from __future__ import annotations

import json
import time

import pytest

from conftest import own_database, start_worker, wait_for
from core.store import keys

pytestmark = pytest.mark.integration


# A consumer that takes messages and dies before it acks, rejects or restores them (and
# before any in-flight record): they stay in the broker's unacked set. Prints, per message,
# its task id and delivery tag.
_TAKER = (
    "import os, sys\n"
    "from core.celery_app import get_app\n"
    "with get_app(sys.argv[1]).connection_for_read() as conn:\n"
    "    for _ in range(int(sys.argv[3])):\n"
    "        m = conn.default_channel.basic_get(sys.argv[2], no_ack=False)\n"
    "        print(m.headers['id'], m.delivery_tag, flush=True)\n"
    "    os._exit(0)\n"
)


def take_and_die(url: str, queue: str, n: int = 1) -> list[tuple[str, str]]:
    """(task id, delivery tag) of the ``n`` messages a dying consumer took from ``queue``."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TAKER, url, queue, str(n)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return [tuple(line.split()) for line in out.stdout.splitlines()]


def test_job_of_a_killed_worker_is_redelivered_and_completes_exactly_once(client, redis_url, hf_dir, reference):
    messages = [{"role": "user", "content": "Write a long poem about the ocean."}]
    first = start_worker(redis_url, "pytorch", extra_args=["--threads=1"])
    try:
        handle = client.submit(model="smollm2-135m", messages=messages, sampling={"max_tokens": 96}, backend="pytorch")
        deadline = time.monotonic() + 120
        while client.record(handle.id).get("status") != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.record(handle.id)["worker"] == first.worker_id
        time.sleep(1.0)  # mid-generation
        assert client.redis.hexists(keys.inflight(first.worker_id), handle.id)
        first.kill()
        assert client.status(handle.id) == "running"  # nobody finished it
    finally:
        first.kill()

    second = start_worker(redis_url, "pytorch", extra_args=["--threads=1"])
    try:
        result = handle.result(timeout=300)
        record = client.record(handle.id)
        assert result.worker == second.worker_id
        assert result.attempt == 2 and record["attempts"] == "2"
        assert record["completions"] == "1"
        assert result.token_ids == reference(messages, 96)  # the full answer, not a stitched one
        # the dead worker left the fleet and its in-flight list is gone
        assert first.worker_id not in [w.worker_id for w in client.workers().workers]
        assert not client.redis.exists(keys.inflight(first.worker_id))
    finally:
        second.stop()


def test_a_message_taken_but_never_recorded_is_put_back(client, redis_url):
    """A consumer that dies between taking a message and recording it (the window the
    in-flight records cannot cover) leaves it unacked and untracked: a live worker's
    sweep puts it back after two heartbeat TTLs, not the 2 h visibility timeout."""
    import uuid

    from core.jobs import GenerationJob, Selection

    # The job goes to the own queue of a worker that starts later, so that the message the
    # "dying consumer" takes is this one, whatever else earlier tests left in shared queues.
    worker_id = f"llamacpp-{uuid.uuid4().hex[:8]}"
    own = f"ib.llamacpp.{worker_id}"
    job = GenerationJob(model="smollm2-135m", prompt="Say hi.", sampling={"max_tokens": 4}, backend="llamacpp")
    sel = client.decide(job, client.workers())
    client.enqueue([(job, Selection(**{**sel.model_dump(), "queue": own}))])
    assert [task_id for task_id, _ in take_and_die(redis_url, own)] == [job.id]
    assert client.status(job.id) == "queued"
    worker = start_worker(redis_url, "llamacpp", worker_id=worker_id, extra_args=["--threads=1"])
    try:
        # within two heartbeat TTLs (8 s here) and a pickup, not the broker's 2 h visibility timeout
        result = client.result(job.id, timeout=120)
        assert result.status == "completed" and result.worker == worker_id
    finally:
        worker.stop()


def aof_rewritten(r) -> bool:
    """No append-only file rewrite running or waiting: the hints are on disk."""
    info = r.info("persistence")
    return not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]


def reaper_passes(r, worker_id: str) -> int:
    """The worker's reaper passes, as its last beat published them (0 with no beat)."""
    beat = r.get(keys.worker(worker_id))
    return 0 if beat is None else json.loads(beat)["reaper_passes"]


def test_a_broker_outage_longer_than_the_heartbeat_ttl_reaps_no_live_worker(tmp_path):
    """Every heartbeat key expires during an outage longer than the TTL. The worker that
    comes back first must not reap a live peer that is a second slower (here: frozen with
    SIGSTOP through the outage), nor drop its prefix hints; a worker that really died is
    still reaped once the broker has been up a TTL."""
    import os
    import signal

    from core.store.hints import PrefixHints
    from dispatcher.client import Client
    from ops.local.broker import EmbeddedBroker
    from ops.subprocesses import free_port

    ttl = float(os.environ["IB_HEARTBEAT_TTL_S"])
    port, data = free_port(), tmp_path / "valkey"
    broker = EmbeddedBroker(port=port, data_dir=data).start(announce=False)
    fast = start_worker(broker.url, "llamacpp", extra_args=["--threads=1"])
    slow = start_worker(broker.url, "llamacpp", extra_args=["--threads=1"])
    try:
        with Client(broker.url, resilient=True) as client:
            PrefixHints(client.redis).record(slow.worker_id, ["block-a", "block-b"])
            client.redis.execute_command("BGREWRITEAOF")
            wait_for(lambda: aof_rewritten(client.redis), 10, "the append-only file rewritten")
            os.kill(slow.proc.pid, signal.SIGSTOP)
            broker.server.stop()
            time.sleep(2 * ttl)  # every heartbeat key has expired when the broker returns
            broker = EmbeddedBroker(port=port, data_dir=data).start(announce=False)
            wait_for(lambda: client.redis.exists(keys.worker(fast.worker_id)), 30, "the fast worker to beat again")
            passes = reaper_passes(client.redis, fast.worker_id)
            # the slow one is still silent through a pass of the fast one's reaper (its grace
            # is a TTL: the slow one has about 3 s to beat again once it is woken)
            wait_for(lambda: reaper_passes(client.redis, fast.worker_id) > passes, 10, "a reaper pass")
            assert not client.redis.exists(keys.worker(slow.worker_id))
            os.kill(slow.proc.pid, signal.SIGCONT)
            wait_for(lambda: client.redis.exists(keys.worker(slow.worker_id)), 30, "the slow worker to beat again")
            # past the grace (a TTL of broker uptime), where a silent worker would be judged dead
            wait_for(lambda: client.redis.info("server")["uptime_in_seconds"] >= 2 * ttl, 30, "the broker up 2 TTLs")
            passes = reaper_passes(client.redis, fast.worker_id)
            wait_for(lambda: reaper_passes(client.redis, fast.worker_id) >= passes + 2, 10, "two more reaper passes")
            members = {m.decode() for m in client.redis.smembers(keys.WORKERS)}
            assert {fast.worker_id, slow.worker_id} <= members
            assert PrefixHints(client.redis).lookup(["block-a"]) == {slow.worker_id: 1}
            assert "is gone: redelivered" not in fast.log_path.read_text() + slow.log_path.read_text()
            slow.kill()  # now really dead: reaped once its heartbeat is a TTL old
            wait_for(lambda: slow.worker_id not in {m.decode() for m in client.redis.smembers(keys.WORKERS)},
                     6 * ttl, "the dead worker reaped")  # fmt: skip
            # The reaper logs after it has removed the worker and dropped its hints: wait for the line.
            wait_for(lambda: f"worker {slow.worker_id} is gone" in fast.log_path.read_text(), 10, "the reap logged")
    finally:
        for w in (fast, slow):
            try:
                os.kill(w.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            w.kill()
        broker.stop()


def test_jobs_running_through_an_outage_longer_than_the_retry_budget_record_their_outcome_once(tmp_path):
    """The worker's Redis client gives up after ``redis.retry_s`` (1 s here) and the broker
    stays down while jobs run: at least 6 s, and until a job's write has waited for it.
    Their tasks wait for Redis (workers.running.outage) and record the outcome once it is back:
    every job completes, and none ran twice (a task that raised had its job either run
    again or left "running" with its message acked)."""
    from dispatcher.client import Client
    from ops.local.broker import EmbeddedBroker
    from ops.subprocesses import free_port

    port, data = free_port(), tmp_path / "valkey"
    broker = EmbeddedBroker(port=port, data_dir=data).start(announce=False)
    worker = start_worker(
        broker.url, "llamacpp", extra_args=["--threads=2", "--concurrency=4"], env={"IB_REDIS_RETRY_S": "1"}
    )
    try:
        with Client(broker.url, resilient=True) as client:
            handles = [
                client.submit(model="smollm2-135m", prompt=f"Story {i}: once upon a time", sampling={"max_tokens": 64})
                for i in range(8)
            ]
            ids = [h.id for h in handles]
            running = lambda: sum(client.record(i).get("status") == "running" for i in ids)  # noqa: E731
            wait_for(lambda: running() >= 2, 120, "two jobs running")
            broker.server.stop()
            time.sleep(6)
            # The path under test: a job's write outlives the client's own retries. On a slow
            # machine no job may have finished in 6 s, so the outage lasts until one has.
            unreachable = lambda: "waits for it" in worker.log_path.read_text()  # noqa: E731
            wait_for(unreachable, 120, "a job's write waiting for Redis")
            broker = EmbeddedBroker(port=port, data_dir=data).start(announce=False)
            results = [client.result(i, timeout=120) for i in ids]
            assert [r.status for r in results] == ["completed"] * 8
            assert [int(client.record(i)["attempts"]) for i in ids] == [1] * 8
    finally:
        worker.kill()
        broker.stop()


def test_the_unacked_sweep_drops_finished_jobs_and_leaves_other_apps_messages_alone(redis_url):
    """An ack lost in an outage leaves a finished job's message unacked: the sweep drops it
    instead of delivering the job again; an unfinished one goes back to its queue; another
    Celery app's unacked message in the same database is not touched."""
    import json
    import uuid

    from core.jobs import GenerationJob, Selection
    from dispatcher.client import Client
    from workers.redelivery import reaper

    with own_database(redis_url, 12) as url, Client(url) as client:
        own = f"ib.llamacpp.sweep-{uuid.uuid4().hex[:6]}"
        jobs = [GenerationJob(model="smollm2-135m", prompt=f"p{i}", backend="llamacpp") for i in range(2)]
        sel = client.decide(jobs[0], client.workers())
        client.enqueue([(j, Selection(**{**sel.model_dump(), "queue": own})) for j in jobs])
        assert len(take_and_die(url, own, 2)) == 2
        r = client.redis

        def waiting() -> list[str]:  # every priority level of the queue
            return [json.loads(m)["headers"]["id"] for q in r.scan_iter(f"{own}*") for m in r.lrange(q, 0, -1)]

        assert waiting() == [] and r.hlen("unacked") == 2
        foreign = json.dumps([{"headers": {"id": "theirs"}, "body": ""}, "", "their.queue"])
        r.hset("unacked", "foreign-tag", foreign)
        r.zadd("unacked_index", {"foreign-tag": 1.0})
        client.store.finish(jobs[0].id, "completed", {"id": jobs[0].id})  # its ack was lost
        r.delete(keys.UNTRACKED_SWEEP)
        restored = reaper.sweep_untracked(r, client.app, "sweeper", min_age_s=0.001)
        assert len(restored) == 1
        assert waiting() == [jobs[1].id]  # the unfinished one is back; the finished one is not
        assert r.hkeys("unacked") == [b"foreign-tag"]  # only the other app's message is left


def test_the_unacked_sweep_drops_a_group_only_when_all_its_jobs_finished(redis_url):
    """A group message (ib.generate_group) nobody holds goes back to its queue while any of
    its jobs is unfinished (the next delivery runs only those), and is dropped once every
    one of them has its outcome."""
    import json
    import uuid

    from core.jobs import GenerationJob, Selection
    from dispatcher.client import Client
    from workers.redelivery import reaper

    with own_database(redis_url, 12) as url, Client(url) as client:
        own = f"ib.vllm.sweep-{uuid.uuid4().hex[:6]}"
        jobs = [GenerationJob(model="smollm2-135m", prompt=f"p{i}", backend="vllm") for i in range(4)]
        sel = client.decide(jobs[0], client.workers())
        sel = Selection(**{**sel.model_dump(), "queue": own, "backend": "vllm"})
        client.enqueue([(j, sel) for j in jobs])  # vLLM jobs of one queue: one group message
        r = client.redis

        def waiting() -> list[list[str]]:
            return [json.loads(m)["headers"]["ib_jobs"] for q in r.scan_iter(f"{own}*") for m in r.lrange(q, 0, -1)]

        groups = waiting()
        assert sorted(len(g) for g in groups) == [4]
        assert len(take_and_die(url, own, 1)) == 1
        assert waiting() == [] and r.hlen("unacked") == 1
        for job in jobs[:3]:
            client.store.finish(job.id, "completed", {"id": job.id})
        r.delete(keys.UNTRACKED_SWEEP)
        assert len(reaper.sweep_untracked(r, client.app, "sweeper", min_age_s=0.001)) == 1
        assert waiting() == groups  # one job unfinished: the whole message is back
        assert len(take_and_die(url, own, 1)) == 1
        client.store.finish(jobs[3].id, "completed", {"id": jobs[3].id})
        r.delete(keys.UNTRACKED_SWEEP)
        assert reaper.sweep_untracked(r, client.app, "sweeper", min_age_s=0.001) == []
        assert waiting() == [] and r.hlen("unacked") == 0  # all finished: dropped, not delivered


def test_a_duplicate_delivery_waits_for_the_live_run_and_takes_over_only_if_its_worker_dies(client, redis_url):
    """A second delivery of a job that runs on a live worker (a visibility-timeout restore,
    a peer wrongly thought dead) must not start the engine again: it waits for the first
    run's outcome. If that worker dies instead, the waiting delivery becomes the next attempt."""
    import uuid

    from core.jobs import GenerationJob

    worker_id = f"llamacpp-{uuid.uuid4().hex[:8]}"
    worker = start_worker(redis_url, "llamacpp", worker_id=worker_id, extra_args=["--threads=1"])
    ghost = f"llamacpp-ghost-{uuid.uuid4().hex[:6]}"  # "runs" the jobs: a live heartbeat, no process
    r = client.redis
    try:
        r.set(keys.worker(ghost), "{}", px=120_000)
        jobs = [GenerationJob(model="smollm2-135m", prompt="Say hi.", sampling={"max_tokens": 4}) for _ in range(2)]
        sel = client.decide(jobs[0].model_copy(update={"backend": "llamacpp"}), client.workers())
        own = f"ib.llamacpp.{worker.worker_id}"
        for job in jobs:
            assert client.store.claim([(job.id, {"model": job.model})]) == [True]
            assert client.store.begin(job.id, ghost).attempt == 1  # the first delivery runs on the ghost
            args = [job.model_dump(mode="json"), sel.model_copy(update={"queue": own}).model_dump(mode="json")]
            client.app.send_task("ib.generate", args=args, task_id=job.id, queue=own)
        wait_for(lambda: worker.log_path.read_text().count(f"runs on {ghost}") >= 2, 60, "both deliveries waiting")
        time.sleep(1.0)
        assert [client.record(j.id)["attempts"] for j in jobs] == ["1", "1"]  # no engine run started
        # The first run finishes: the waiting delivery returns its outcome, runs nothing.
        assert client.store.finish(jobs[0].id, "completed", {"id": jobs[0].id, "by": ghost})
        wait_for(lambda: not r.hexists(keys.inflight(worker.worker_id), jobs[0].id), 30, "the duplicate to end")
        first = client.record(jobs[0].id)
        assert (first["worker"], first["attempts"], first["completions"]) == (ghost, "1", "1")
        # The second one's worker dies: the waiting delivery takes over as attempt 2.
        r.delete(keys.worker(ghost))
        result = client.result(jobs[1].id, timeout=60)
        assert result.worker == worker.worker_id and result.attempt == 2 and result.status == "completed"
    finally:
        r.delete(keys.worker(ghost))
        worker.stop()


def test_a_worker_restarted_under_the_same_id_puts_back_what_its_previous_process_held(client, redis_url):
    """A pod restarted with the same name before its heartbeat expired: the old process's
    reserved job is neither held forever (its in-flight record says a live worker has it)
    nor taken for a duplicate of a run that no longer exists."""
    import uuid

    from core.jobs import GenerationJob, Selection

    worker_id = f"llamacpp-{uuid.uuid4().hex[:8]}"
    own = f"ib.llamacpp.{worker_id}"
    job = GenerationJob(model="smollm2-135m", prompt="Say hi.", sampling={"max_tokens": 4}, backend="llamacpp")
    sel = client.decide(job, client.workers())
    client.enqueue([(job, Selection(**{**sel.model_dump(), "queue": own}))])
    # the previous process: took the message, recorded it, started the job, died
    ((taken_id, tag),) = take_and_die(redis_url, own)
    assert taken_id == job.id
    client.redis.hset(keys.inflight(worker_id), job.id, tag)
    assert client.store.begin(job.id, worker_id).attempt == 1
    client.redis.set(keys.worker(worker_id), "{}", px=60_000)  # its heartbeat has not expired yet
    worker = start_worker(redis_url, "llamacpp", worker_id=worker_id, extra_args=["--threads=1"])
    try:
        result = client.result(job.id, timeout=60)
        assert result.status == "completed" and result.worker == worker_id and result.attempt == 2
    finally:
        worker.stop()
