"""Redis at its limits: stopped under HTTP load, full (maxmemory under noeviction), an
evicting policy. Each on a Redis of its own (the embedded Valkey, or a redis-server with a
tiny maxmemory), with a real llama.cpp worker, `ib serve` and real HTTP clients."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import ARTIFACTS, start_worker, wait_for
from ops.local.processes import GatewayProcess
from ops.subprocesses import free_port

pytestmark = pytest.mark.integration

KEY = "test-key-limits"
MODEL = "smollm2-135m"


def gateway_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"IB_API_KEYS": KEY, "IB_API_KEYS_FILE": str(tmp_path / "no-keys"), **extra}


class LagProbe:
    """Asks /health/live every 50 ms from a thread: the longest answer is the gateway's
    event-loop stall (a route that blocks the loop blocks this one too)."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.wait(0.05):
                start = time.monotonic()
                assert http.get(f"{self.url}/health/live").status_code == 200
                self.worst = max(self.worst, time.monotonic() - start)

    def __enter__(self) -> LagProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=130)


def read_stream(url: str, index: int, events: dict[int, list[dict]], ended: dict[int, float]) -> None:
    """One streamed chat request read as raw SSE: every event kept, and when it ended."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Story {index}: tell a very long story."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    got = events.setdefault(index, [])
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        with httpx.Client(timeout=httpx.Timeout(120, read=120)) as http:
            with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        got.append(json.loads(line[6:]))
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
        assert probe.worst < 1.0, f"the event loop stalled {probe.worst:.2f} s"
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
