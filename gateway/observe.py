"""Request metrics (Prometheus) and the access log: method, route, status, latency, the
tenant and the job. Never a prompt or an answer: bodies are not looked at here."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("gateway.access")


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "ib_gateway_requests_total", "HTTP requests answered", ["method", "route", "status"], registry=registry
        )
        self.latency = Histogram(
            "ib_gateway_request_seconds",
            "Time from request to the end of the response (streams included)",
            ["method", "route"],
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )


class Observe:
    """ASGI middleware around the whole app, so a streamed response is timed to its end."""

    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status, job = 500, ""

        async def sending(message: Message) -> None:
            nonlocal status, job
            if message["type"] == "http.response.start":
                status = message["status"]
                job = dict(message.get("headers") or []).get(b"x-ib-job-id", b"").decode()
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            elapsed = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(scope["method"], route, str(status)).inc()
            self.metrics.latency.labels(scope["method"], route).observe(elapsed)
            tenant = scope.get("state", {}).get("tenant") or "-"
            log.info(
                "%s %s %s %.1fms tenant=%s job=%s", scope["method"], route, status, elapsed * 1000, tenant, job or "-"
            )
