"""A worker SIGKILLed mid-generation loses nothing: the job is redelivered and completes once."""

from __future__ import annotations

import time

import pytest

from conftest import start_worker
from dispatcher.fleet import inflight_key

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
        assert client.redis.hexists(inflight_key(first.worker_id), handle.id)
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
        assert not client.redis.exists(inflight_key(first.worker_id))
    finally:
        second.stop()
