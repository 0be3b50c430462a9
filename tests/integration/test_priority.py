"""Priorities: an interactive job queued after a batch job is served first."""

from __future__ import annotations

import pytest

from conftest import start_worker

pytestmark = pytest.mark.integration


def test_interactive_jobs_jump_ahead_of_batch_jobs(client, redis_url, hf_dir):
    def job(priority: str) -> dict:
        return {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "Say hi."}],
            "sampling": {"max_tokens": 4},
            "backend": "pytorch",
            "priority": priority,
        }

    assert not client.workers(max_age_s=0).live(backend="pytorch")  # both wait in the queue
    batch = [client.submit(job("batch")) for _ in range(3)]
    interactive = client.submit(job("interactive"))
    worker = start_worker(redis_url, "pytorch", extra_args=["--threads=1", "--concurrency=1"])
    try:
        first = interactive.result(timeout=120)
        rest = [h.result(timeout=120) for h in batch]
    finally:
        worker.stop()
    assert all(first.timings.started < r.timings.started for r in rest)
    assert [r.timings.started for r in rest] == sorted(r.timings.started for r in rest)  # FIFO within a priority
