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


def test_a_job_sent_to_a_workers_own_queue_does_not_wait_behind_the_shared_queue(client, redis_url):
    """Prefix affinity sends a job to its holder's own queue to save its prefill: the
    worker reads that queue before the shared one at each priority."""
    import uuid

    from core.celery_app import own_queue_for
    from core.jobs import GenerationJob

    assert not client.workers(max_age_s=0).live(backend="llamacpp")  # all wait for the worker below
    worker_id = f"llamacpp-{uuid.uuid4().hex[:8]}"

    def job() -> GenerationJob:
        return GenerationJob(model="smollm2-135m", prompt="Say hi.", sampling={"max_tokens": 2}, backend="llamacpp")

    shared = [job() for _ in range(3)]
    mine = job()
    sel = client.decide(shared[0], client.workers())
    client.enqueue([(j, sel) for j in shared])
    client.enqueue([(mine, sel.model_copy(update={"queue": own_queue_for("llamacpp", worker_id)}))])
    worker = start_worker(
        redis_url, "llamacpp", worker_id=worker_id, extra_args=["--threads=1", "--concurrency=1"],
        env={"IB_CELERY_PREFETCH_MULTIPLIER": "1"},
    )  # fmt: skip
    try:
        first = client.result(mine.id, timeout=120)
        rest = [client.result(j.id, timeout=120) for j in shared]
    finally:
        worker.stop()
    assert all(first.timings.started < r.timings.started for r in rest)
