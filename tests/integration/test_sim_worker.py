"""The capacity benchmarks' simulated worker (bench.capacity, bench.sim_worker) is `ib
worker` with only the engine replaced: it joins the fleet by heartbeat, takes jobs from
the backend's queue through the dispatcher, and answers them through the job store, as
the real one would. If this breaks, bench.capacity measures something else than the fleet."""

from __future__ import annotations

import pytest

from conftest import ARTIFACTS, wait_for

pytestmark = pytest.mark.integration


def test_a_simulated_worker_serves_jobs_through_the_real_path(redis_url, client):
    from bench.capacity import SimWorkerProcess
    from bench.sim_engine import WORDS

    env = {"IB_SIM_PREFILL_S": "0.01", "IB_SIM_TOKEN_S": "0.002", "IB_SIM_CAPACITY": "4"}
    worker = SimWorkerProcess("llamacpp", redis_url, extra_args=["--threads=1"], env=env, log_dir=ARTIFACTS / "logs")
    worker.start()
    try:
        worker.wait_ready(timeout=120)
        jobs = [{"model": "smollm2-135m", "prompt": f"Job {i}", "sampling": {"max_tokens": 5}, "backend": "llamacpp"}
                for i in range(12)]  # fmt: skip
        results = [h.result(timeout=60) for h in client.submit_many(jobs)]
        assert {r.worker for r in results} == {worker.worker_id}
        assert all(r.text == "".join(WORDS[:5]) and r.usage.completion_tokens == 5 for r in results)

        def view():
            return next(w for w in client.workers(max_age_s=0).workers if w.worker_id == worker.worker_id)

        assert view().capacity == 4  # its own batch, four wide
        wait_for(lambda: view().engine_stats.get("steps", 0) >= 5, 10, "the engine's steps in a heartbeat")
    finally:
        worker.stop(timeout=30)
