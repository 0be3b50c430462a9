"""Redis faults for the chaos run (bench.chaos) and the tests: a full Redis, and a Redis
stop under a gateway's open streams, with what a user sees measured.

- ``Filler``: another client that fills Redis to its ``maxmemory`` and keeps it full,
  taking back whatever the fleet frees, until it lets go (then deletes its keys).
- ``LagProbe``: asks ``/health/live`` every 50 ms; its slowest answer is the gateway's
  event-loop stall (anything that blocks the loop blocks that route too).
- ``gateway_through_a_stop``: ``streams`` streamed chat requests through ``ib serve``,
  Redis stopped for ``stop_s`` while they run, new requests sent all along: how many got
  a 503 and how fast, how each stream ended, the loop's longest stall.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import redis


class Filler:
    def __init__(self, url: str, chunk: int = 256 << 10) -> None:
        self.r = redis.Redis.from_url(url)
        self.chunk = chunk
        self.full, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.n = 0

    def _run(self) -> None:
        size = self.chunk
        while not self._stop.is_set():
            try:
                self.r.set(f"filler:{self.n}", b"x" * size)
                self.n += 1
            except redis.exceptions.OutOfMemoryError:
                if size > 64:
                    size //= 4  # the last gaps with smaller values
                else:
                    self.full.set()
                    self._stop.wait(0.02)

    def __enter__(self) -> Filler:
        self._thread.start()
        if not self.full.wait(120):
            raise TimeoutError("Redis never filled up")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for start in range(0, self.n, 1000):
            self.r.delete(*[f"filler:{i}" for i in range(start, min(self.n, start + 1000))])


def _probe(url: str, every_s: float, stop: Any, worst: Any, failures: Any) -> None:
    with httpx.Client(timeout=120) as http:
        while not stop.wait(every_s):
            start = time.monotonic()
            if http.get(f"{url}/health/live").status_code != 200:
                failures.value += 1
            worst.value = max(worst.value, time.monotonic() - start)


class LagProbe:
    """In a process of its own: in the caller's, the caller's own threads (dozens of
    streams) would take the GIL and the probe would time them, not the gateway."""

    def __init__(self, url: str, every_s: float = 0.05) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._worst, self._failures = ctx.Value("d", 0.0), ctx.Value("i", 0)
        self._proc = ctx.Process(target=_probe, args=(url, every_s, self._stop, self._worst, self._failures))

    @property
    def worst(self) -> float:
        return float(self._worst.value)

    @property
    def failures(self) -> int:
        return int(self._failures.value)

    def __enter__(self) -> LagProbe:
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(timeout=130)


def stream_chat(url: str, key: str, body: dict[str, Any], events: list[dict], timeout_s: float = 300) -> None:
    """One streamed chat request read as raw SSE, every event appended to ``events``."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=httpx.Timeout(timeout_s)) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
            if r.status_code != 200:
                events.append({"error": {"type": f"http {r.status_code}"}})
                return
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))


def ending(events: list[dict]) -> str:
    """How a stream ended: finished, an error event's type, or cut (neither)."""
    if not events:
        return "nothing"
    last = events[-1]
    if "error" in last:
        return str(last["error"].get("type"))
    choices = last.get("choices") or [{}]
    return "finished" if choices[0].get("finish_reason") or last.get("usage") else "cut"


def gateway_through_a_stop(
    url: str, key: str, model: str, stop: Callable[[], None], start: Callable[[], None], streams: int, stop_s: float
) -> dict[str, Any]:
    """``streams`` streams opened, Redis stopped (``stop``) for ``stop_s`` once a quarter of
    them are generating, then started again (``start``); new requests all along."""
    events: list[list[dict]] = [[] for _ in range(streams)]
    body = {"model": model, "max_tokens": 256, "ignore_eos": True}
    threads = [
        threading.Thread(
            target=stream_chat,
            args=(url, key, {**body, "messages": [{"role": "user", "content": f"Story {i}:"}]}, events[i]),
            daemon=True,
        )
        for i in range(streams)
    ]
    asks: list[tuple[float, int]] = []  # (seconds to the answer, status) of requests sent during the stop
    with LagProbe(url) as probe, httpx.Client(timeout=120, headers={"Authorization": f"Bearer {key}"}) as http:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while sum(len(e) > 2 for e in events) < max(1, streams // 4) and time.monotonic() < deadline:
            time.sleep(0.1)
        stop()
        stopped = time.monotonic()
        ask = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        while time.monotonic() - stopped < stop_s:
            t0 = time.monotonic()
            status = http.post(f"{url}/v1/chat/completions", json=ask).status_code
            asks.append((time.monotonic() - t0, status))
            time.sleep(0.5)
        ended_during = sum(not t.is_alive() for t in threads)
        start()
        for t in threads:
            t.join(timeout=300)
    answered = [s for _, s in asks]
    return {
        "streams": streams,
        "stop_s": stop_s,
        "stream_endings": dict(Counter(ending(e) for e in events)),
        "streams_ended_during_stop": ended_during,
        "streams_hung": sum(t.is_alive() for t in threads),
        "requests_during_stop": len(asks),
        "answered_503": answered.count(503),
        "other_answers": dict(Counter(s for s in answered if s != 503)),
        "slowest_503_s": round(max((d for d, s in asks if s == 503), default=0.0), 2),
        "event_loop_max_stall_s": round(probe.worst, 3),
        "health_live_failures": probe.failures,
    }
