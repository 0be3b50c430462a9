"""A job that runs past the time limit fails with a typed timeout and leaves the engine."""

from __future__ import annotations

import pytest

from conftest import start_worker
from core.errors import JobTimeoutError

pytestmark = pytest.mark.integration


def test_job_over_the_time_limit_fails_with_timeout_and_the_worker_keeps_serving(client, redis_url, hf_dir):
    worker = start_worker(redis_url, "pytorch", extra_args=["--threads=1"], env={"IB_CELERY_JOB_TIME_LIMIT_S": "2"})
    try:
        messages = [{"role": "user", "content": "Write a very long story about a dragon."}]
        handle = client.submit(
            model="smollm2-135m", messages=messages, sampling={"max_tokens": 1500}, backend="pytorch"
        )
        with pytest.raises(JobTimeoutError, match="exceeded the 2 s time limit"):
            handle.result(timeout=120)
        assert handle.status() == "failed"
        short = client.submit(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Hi"}],
            sampling={"max_tokens": 4},
            backend="pytorch",
        )
        assert short.result(timeout=60).status == "completed"
    finally:
        worker.stop()
