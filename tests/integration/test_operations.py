"""Operating the fleet: `ib up` with Flower (in a real browser) and Prometheus metrics,
and a worker that is unhealthy stops taking jobs without losing any."""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from conftest import ARTIFACTS, wait_for
from core.fleet import read_fleet
from core.jobs import GenerationJob, Selection
from ops.local.processes import WorkerProcess
from ops.subprocesses import free_port

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
SECRET = "zebra-quartz-marker"  # in every prompt here: it must never reach Flower
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


class UpProcess:
    """`ib up` as a user runs it, in its own process group."""

    def __init__(self, redis_url: str) -> None:
        self.flower_port, self.metrics_port, self.serve_port = free_port(), free_port(), free_port()
        self.auth = f"ops:{secrets.token_urlsafe(8)}"
        self.log = ARTIFACTS / "logs" / "ib-up.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "REDIS_URL": redis_url, "IB_FLOWER_BASIC_AUTH": self.auth, "COLUMNS": "200"}
        env["IB_API_KEYS"] = self.api_key = secrets.token_urlsafe(16)
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ops.cli",
                    "up",
                    "--backend",
                    "llamacpp",
                    "--backend",
                    "onnx",
                    f"--flower-port={self.flower_port}",
                    f"--metrics-port={self.metrics_port}",
                    "--serve",
                    f"--serve-port={self.serve_port}",
                ],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.flower = f"http://127.0.0.1:{self.flower_port}"
        self.metrics = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.gateway = f"http://127.0.0.1:{self.serve_port}/v1"
        self.header = {"Authorization": "Basic " + base64.b64encode(self.auth.encode()).decode()}

    def wait_up(self, redis_url: str) -> list:
        def up():
            assert self.proc.poll() is None, self.log.read_text()
            return "fleet up" in self.log.read_text() and read_fleet(redis.Redis.from_url(redis_url)).live()

        return wait_for(up, 600, "ib up to start two workers and Flower")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ib up` stops what it started
            try:
                return self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                raise
        return self.proc.returncode


@pytest.fixture(scope="module")
def fleet_up(redis_url, onnx_dir):
    up = UpProcess(redis_url)
    try:
        workers = up.wait_up(redis_url)
        assert {w.backend for w in workers} == {"llamacpp", "onnx"}
        yield up, workers
    finally:
        code = up.stop()
    assert code == 0, up.log.read_text()[-3000:]  # SIGTERM: a clean stop of everything it started


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lbl), v in samples.items() if n == name and all((k, v2) in lbl for k, v2 in labels.items()))


def run_jobs(client, backend: str, n: int, max_tokens: int = 16) -> list:
    handles = [
        client.submit(
            model=MODEL,
            messages=[{"role": "user", "content": f"{SECRET}: count to {i + 3}."}],
            sampling={"max_tokens": max_tokens},
            backend=backend,
        )
        for i in range(n)
    ]
    return [h.result(timeout=180) for h in handles]


def test_metrics_of_every_worker_move_with_real_jobs(client, fleet_up):
    up, workers = fleet_up
    before = scrape(up.metrics)
    results = {b: run_jobs(client, b, n) for b, n in (("llamacpp", 3), ("onnx", 2))}
    time.sleep(2.5)  # a heartbeat samples the gauges
    after = scrape(up.metrics)
    for backend, rs in results.items():

        def moved(name: str, backend: str = backend, **lbl: str) -> float:
            return total(after, name, backend=backend, **lbl) - total(before, name, backend=backend, **lbl)

        assert moved("ib_jobs_total", status="completed") == len(rs)
        assert moved("ib_tokens_total", kind="completion") == sum(r.usage.completion_tokens for r in rs)
        assert moved("ib_tokens_total", kind="prompt") == sum(r.usage.prompt_tokens for r in rs)
        assert moved("ib_ttft_seconds_count") == len(rs) and moved("ib_ttft_seconds_sum") > 0
        assert moved("ib_queue_wait_seconds_count") == len(rs)
        assert moved("ib_time_per_output_token_seconds_count") == sum(r.usage.completion_tokens > 1 for r in rs)
        worker_id = next(w.worker_id for w in workers if w.backend == backend)
        assert total(after, "ib_worker_healthy", worker=worker_id) == 1
        assert total(after, "ib_engine_memory_bytes", worker=worker_id, kind="rss") > 50 * 2**20
        assert total(after, "ib_capacity_sequences", worker=worker_id) >= 1
        labels = {"backend": backend, "worker": worker_id, "model": MODEL}  # every series names the model
        assert ("ib_running_sequences", frozenset(labels.items())) in after


def test_flower_refuses_requests_without_credentials(fleet_up):
    up, _ = fleet_up
    assert httpx.get(f"{up.flower}/workers", timeout=10).status_code == 401
    assert httpx.get(f"{up.flower}/api/workers", auth=("ops", "wrong"), timeout=10).status_code == 401
    assert httpx.get(f"{up.flower}/workers", headers=up.header, timeout=10).status_code == 200


def _browser():
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("IB_REQUIRE_BROWSER"):
            pytest.fail("chromium and chromium-driver are required here (scripts/browser.sh installs them)")
        pytest.skip("no chromium + chromium-driver (scripts/browser.sh installs them; CI requires them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--window-size=1400,1000",
    ):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def test_flower_dashboard_in_a_real_browser_shows_both_backends_and_a_finished_task(client, fleet_up):
    up, workers = fleet_up

    def flower_saw_a_success():
        run_jobs(client, "llamacpp", 1, max_tokens=8)  # Flower switches task events on shortly after it starts
        tasks = httpx.get(f"{up.flower}/api/tasks", headers=up.header, timeout=10).json()
        return [t for t in tasks.values() if t.get("state") == "SUCCESS" and t.get("name") == "ib.generate"]

    done = wait_for(flower_saw_a_success, 120, "Flower to record a finished ib.generate task")
    assert all(SECRET not in str(t) for t in done)  # summaries only: model, backend, token counts
    assert "backend=llamacpp" in done[0]["args"] and "completion_tokens" in done[0]["result"]

    driver = _browser()
    shots = ARTIFACTS / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": up.header})
        driver.get(f"{up.flower}/workers")
        nodes = {w.backend: f"{w.worker_id}@{w.backend}-cpu" for w in workers}
        wait_for(lambda: all(n in driver.page_source for n in nodes.values()), 60, f"the dashboard to list {nodes}")
        driver.save_screenshot(str(shots / "flower-workers.png"))
        driver.get(f"{up.flower}/tasks")
        wait_for(lambda: "ib.generate" in driver.page_source and "SUCCESS" in driver.page_source, 60, "a finished task")
        assert SECRET not in driver.page_source
        driver.save_screenshot(str(shots / "flower-tasks.png"))
        driver.get(f"{up.flower}/task/{done[0]['uuid']}")  # its page: the summary, not the prompt
        wait_for(
            lambda: "backend=llamacpp" in driver.page_source and "completion_tokens" in driver.page_source,
            30,
            "the task page",
        )
        assert SECRET not in driver.page_source
        driver.save_screenshot(str(shots / "flower-task.png"))
        driver.get(f"{up.flower}/broker")
        own = next(q for w in workers for q in w.queues if w.backend == "llamacpp" and q.count(".") == 2)
        wait_for(
            lambda: "ib.llamacpp" in driver.page_source and own in driver.page_source,
            60,
            "the queues in the broker view",
        )
        driver.save_screenshot(str(shots / "flower-broker.png"))
    finally:
        driver.quit()
    assert (shots / "flower-workers.png").stat().st_size > 10_000


def test_an_unhealthy_worker_stops_taking_jobs_and_loses_none(client, fleet_up, redis_url):
    sick = WorkerProcess(
        "llamacpp",
        redis_url,
        extra_args=["--threads=1"],
        env={"IB_HEALTH_MAX_RSS_MB": "1", "IB_HEALTH_OWN_QUEUE_GRACE_S": "3"},
        log_dir=ARTIFACTS / "logs",
    ).start()
    try:
        sick.wait_ready(timeout=300, healthy=False)
        wait_for(lambda: "not taking new jobs" in sick.log_path.read_text(), 60, "the worker to stop consuming")
        info = next(w for w in client.workers().workers if w.worker_id == sick.worker_id)
        assert not info.health.ok and info.health.reasons[0].startswith("worker memory")
        listing = subprocess.run(
            [sys.executable, "-m", "ops.cli", "workers"],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "400"},
            timeout=60,
        )
        assert "UNHEALTHY: worker memory" in listing.stdout, listing.stdout
        # Nothing routes to it; a job already sent to its own queue is not stranded there
        # while it lives: past the grace its queue goes to the backend's shared queue, and
        # the healthy llama.cpp worker of the fleet runs it.
        job = GenerationJob(model=MODEL, prompt=f"{SECRET} hello", sampling={"max_tokens": 4}, backend="llamacpp")
        sel = client.decide(job, client.workers())
        assert sel.affinity_worker != sick.worker_id
        own = next(q for q in info.queues if q.endswith(sick.worker_id))
        client.enqueue([(job, Selection(**{**sel.model_dump(), "queue": own}))])
        result = client.result(job.id, timeout=120)
        assert result.status == "completed" and result.worker != sick.worker_id
        assert sick.proc.poll() is None  # alive all along: not the dead-worker sweep
        assert f"worker {sick.worker_id} unhealthy for" in sick.log_path.read_text()
    finally:
        sick.stop()


def test_explain_under_the_profile_policy_says_where_it_differs_from_the_tree(fleet_up):
    from dispatcher.routing import profiles

    book = profiles.load()
    assert book is not None, "config/profiles.json is measured by `make bench-profiles`"
    live = {"llamacpp", "onnx"}  # what `ib up` runs here; the tree's CPU default is llama.cpp
    rows = [r for r in book.rows if r.backend in live and r.hardware_kind == "cpu" and r.ttft_p50_ms <= 1000]
    expected = max(rows, key=lambda r: r.saturated_tok_s).backend
    out = subprocess.run(
        [sys.executable, "-m", "ops.cli", "explain", "--prompt", "hi"],
        capture_output=True,
        text=True,
        env={**os.environ, "IB_DECISION_POLICY": "profile", "COLUMNS": "400"},
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"decision for smollm2-135m: {expected}" in out.stdout
    verdict = "agrees with the tree" if expected == "llamacpp" else "differs from the tree (llamacpp)"
    assert verdict in out.stdout and "measured" in out.stdout
    plain = subprocess.run(
        [sys.executable, "-m", "ops.cli", "explain", "--prompt", "hi"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
        timeout=60,
    )
    # the tree stays the default
    assert "decision for smollm2-135m: llamacpp" in plain.stdout and "profile" not in plain.stdout


def test_ib_up_serve_starts_the_openai_gateway_in_front_of_its_workers(fleet_up):
    import openai

    up, _ = fleet_up
    sdk = openai.OpenAI(base_url=up.gateway, api_key=up.api_key, max_retries=0, timeout=120)
    assert sdk.models.retrieve(MODEL).model_extra["backends"] == {"llamacpp": 1, "onnx": 1}
    ask = [{"role": "user", "content": f"{SECRET}: say hi."}]
    answer = sdk.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, extra_body={"latency_target_ms": 50})
    assert answer.choices[0].message.content and answer.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=up.gateway, api_key="wrong", max_retries=0).models.list()
    assert SECRET not in up.log.read_text()  # ib up's own log: no prompt
