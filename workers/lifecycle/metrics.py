"""Prometheus metrics of one worker (prometheus-client).

Per job (from its JobResult): jobs by status, queue wait, TTFT, time per output token,
tokens in / out / served from the prefix cache, speculative tokens drafted and accepted.
Per heartbeat: running sequences (the engine's batch), the worker's memory (with its
engine's helper processes), GPU memory, and whether it is healthy.

Served two ways: a worker alone (a Kubernetes pod) serves ``/metrics`` on its own port;
workers started by `ib up` share a ``PROMETHEUS_MULTIPROC_DIR`` and `ib up` serves the
whole host's metrics on one port (prometheus-client's multiprocess mode).
"""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from core.fleet import Health
from core.jobs import JobResult

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_GAUGE = {"multiprocess_mode": "livemax"}  # one series per worker label, gone when it exits


class WorkerMetrics:
    def __init__(self, backend: str, worker: str, model: str, registry: CollectorRegistry = REGISTRY) -> None:
        # a worker serves one model: every series says which (dashboards split by model)
        self.labels = {"backend": backend, "worker": worker, "model": model}
        lbl = ["backend", "worker", "model"]
        r = registry
        self.jobs = Counter("ib_jobs", "Jobs finished, by status", [*lbl, "status"], registry=r)
        self.queue_wait = Histogram(
            "ib_queue_wait_seconds", "Submit to start of run", lbl, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram("ib_ttft_seconds", "Submit to first token", lbl, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "ib_time_per_output_token_seconds",
            "Decode time per output token after the first",
            lbl,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "ib_tokens",
            "Tokens: prompt, completion, and prompt tokens served from the prefix cache",
            [*lbl, "kind"],
            registry=r,
        )
        self.speculative = Counter(
            "ib_speculative_tokens", "Speculative decoding: tokens drafted and accepted", [*lbl, "kind"], registry=r
        )
        self.running = Gauge(
            "ib_running_sequences", "Jobs in the engine at the last heartbeat (its batch)", lbl, registry=r, **_GAUGE
        )
        self.capacity = Gauge("ib_capacity_sequences", "Jobs the worker takes at once", lbl, registry=r, **_GAUGE)
        self.memory = Gauge(
            "ib_engine_memory_bytes",
            "Memory of the worker and its engine: rss, or gpu (used, per device)",
            [*lbl, "kind"],
            registry=r,
            **_GAUGE,
        )
        self.own_queued = Gauge(
            "ib_own_queue_jobs",
            "Jobs waiting in the worker's own queue (prefix-affinity sends), all priorities",
            lbl,
            registry=r,
            **_GAUGE,
        )
        self.healthy = Gauge(
            "ib_worker_healthy",
            "1 while the worker takes jobs, 0 when a health threshold is crossed",
            lbl,
            registry=r,
            **_GAUGE,
        )

    def observe(self, result: JobResult) -> None:
        lbl = self.labels
        self.jobs.labels(**lbl, status=result.status).inc()
        t = result.timings
        self.queue_wait.labels(**lbl).observe(t.queue_wait_s)
        if t.ttft_s is not None:
            self.ttft.labels(**lbl).observe(max(0.0, t.ttft_s))
        u = result.usage
        if u.completion_tokens > 1:
            self.tpot.labels(**lbl).observe(t.decode_s / (u.completion_tokens - 1))
        self.tokens.labels(**lbl, kind="prompt").inc(u.prompt_tokens)
        self.tokens.labels(**lbl, kind="completion").inc(u.completion_tokens)
        self.tokens.labels(**lbl, kind="prefix_cached").inc(u.cached_tokens)
        spec = result.speculative or {}
        for kind in ("drafted", "accepted"):
            if spec.get(f"{kind}_tokens") is not None:
                self.speculative.labels(**lbl, kind=kind).inc(int(spec[f"{kind}_tokens"]))

    def observe_failure(self) -> None:
        self.jobs.labels(**self.labels, status="failed").inc()

    def sample(self, in_flight: int, capacity: int, health: Health, own_queued: int | None = None) -> None:
        lbl = self.labels
        self.running.labels(**lbl).set(in_flight)
        if own_queued is not None:
            self.own_queued.labels(**lbl).set(own_queued)
        self.capacity.labels(**lbl).set(capacity)
        self.healthy.labels(**lbl).set(1 if health.ok else 0)
        if health.facts is not None:
            self.memory.labels(**lbl, kind="rss").set(health.facts.rss_mb * 2**20)
            for g in health.facts.gpus:
                self.memory.labels(**lbl, kind=f"gpu{g.index}").set(g.memory_used_mb * 2**20)


def serve(port: int, addr: str = "0.0.0.0") -> int:
    """Serve this process's metrics; returns the port (0 picks a free one)."""
    server, _ = start_http_server(port, addr=addr)
    return server.server_port


def multiprocess_mode() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))
