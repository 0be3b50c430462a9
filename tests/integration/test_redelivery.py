"""A worker SIGKILLed mid-generation loses nothing: the job is redelivered and completes once."""

from __future__ import annotations

import time

import pytest

from conftest import start_worker
from dispatcher.store import keys

pytestmark = pytest.mark.integration


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
    import subprocess
    import sys
    import uuid

    from dispatcher.jobs import GenerationJob, Selection

    # The job goes to the own queue of a worker that starts later, so that the message the
    # "dying consumer" takes is this one, whatever else earlier tests left in shared queues.
    worker_id = f"llamacpp-{uuid.uuid4().hex[:8]}"
    own = f"ib.llamacpp.{worker_id}"
    job = GenerationJob(model="smollm2-135m", prompt="Say hi.", sampling={"max_tokens": 4}, backend="llamacpp")
    sel = client.decide(job, client.workers())
    client.enqueue([(job, Selection(**{**sel.model_dump(), "queue": own}))])
    taker = (
        "import os, sys\n"
        "from dispatcher.celery_app import get_app\n"
        "with get_app(sys.argv[1]).connection_for_read() as conn:\n"
        "    m = conn.default_channel.basic_get(sys.argv[2], no_ack=False)\n"
        "    print(m.headers['id'] if m is not None else '', flush=True)\n"
        "    os._exit(0)  # no ack, no reject, no restore: the message stays in the unacked set\n"
    )
    taken = subprocess.run([sys.executable, "-c", taker, redis_url, own], capture_output=True, text=True, timeout=60)
    assert taken.returncode == 0 and taken.stdout.strip() == job.id, taken.stdout + taken.stderr
    assert client.status(job.id) == "queued"
    worker = start_worker(redis_url, "llamacpp", worker_id=worker_id, extra_args=["--threads=1"])
    try:
        # within two heartbeat TTLs (8 s here) and a pickup, not the broker's 2 h visibility timeout
        result = client.result(job.id, timeout=120)
        assert result.status == "completed" and result.worker == worker_id
    finally:
        worker.stop()
