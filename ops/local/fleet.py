"""`ib up`: a whole fleet on this host, for as long as the command runs.

Starts (unless ``REDIS_URL`` points at one) the embedded broker, one worker per backend
and model (each worker serves one model; a backend that cannot run a model is skipped),
Flower with basic auth, the OpenAI-compatible gateway (``--serve``), and one Prometheus
endpoint for every worker it started: the workers share a ``PROMETHEUS_MULTIPROC_DIR`` and
this process serves the sum (their own ``worker`` label keeps them apart). Ctrl-C or SIGTERM
stops it all; workers drain first.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, multiprocess, start_http_server

from core import connection
from core.backends import load_backends
from core.errors import UnsupportedByBackendError
from core.registry import ModelRegistry
from ops.flower.process import FlowerProcess
from ops.local.broker import EmbeddedBroker
from ops.local.processes import GatewayProcess, WorkerProcess
from ops.subprocesses import free_port
from workers.lifecycle.metrics import MULTIPROC_ENV


def serve_host_metrics(port: int, multiproc_dir: Path, addr: str = "127.0.0.1") -> int:
    """Serve the metrics of every process writing to ``multiproc_dir``; returns the port."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(multiproc_dir))
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server.server_port


@dataclass
class LocalFleet:
    backends: list[str]
    models: list[str] = field(default_factory=lambda: ["smollm2-135m"])
    flower_port: int | None = None  # None: no Flower
    flower_auth: str | None = None
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    serve_port: int | None = None  # None: no HTTP gateway
    host: str = "127.0.0.1"  # where Flower, /metrics and the gateway listen: loopback unless asked
    worker_args: dict[str, list[str]] = field(default_factory=dict)
    log_dir: Path | None = None
    broker: EmbeddedBroker | None = None
    workers: list[WorkerProcess] = field(default_factory=list)
    flower: FlowerProcess | None = None
    gateway: GatewayProcess | None = None
    redis_url: str = ""
    multiproc_dir: Path | None = None

    def start(self, ready_timeout: float = 600) -> LocalFleet:
        try:
            self._start(ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, ready_timeout: float) -> None:
        url = connection.redis_url()
        if not url:
            self.broker = EmbeddedBroker(port=free_port()).start()
            url = self.broker.url
        self.redis_url = url
        env: dict[str, str] = {}
        if self.metrics_port is not None:
            self.multiproc_dir = Path(tempfile.mkdtemp(prefix="ib-metrics-"))
            env[MULTIPROC_ENV] = str(self.multiproc_dir)
            self.metrics_port = serve_host_metrics(self.metrics_port, self.multiproc_dir, self.host)
        for backend, model in self.pairs():
            w = WorkerProcess(
                backend, url, model=model, extra_args=self.worker_args.get(backend), env=env, log_dir=self.log_dir
            )
            self.workers.append(w.start())
        for w in self.workers:
            w.wait_ready(ready_timeout)
        if self.flower_port is not None:
            # After the workers: Flower inspects them once at start, which is where its
            # broker view learns each worker's own queue (a Refresh in the UI does it later).
            self.flower = FlowerProcess(
                url, self.flower_port, self.flower_auth, address=self.host, log_dir=self.log_dir
            ).start()
        if self.serve_port is not None:
            gateway = GatewayProcess(url, port=self.serve_port or None, host=self.host, log_dir=self.log_dir)
            self.gateway = gateway.start()

    def pairs(self) -> list[tuple[str, str]]:
        """(backend, model) for every worker to start: each model on each backend that can run it."""
        registry, specs = ModelRegistry.from_config(), load_backends()
        runnable = {m: registry.get(m).runnable_on(specs) for m in self.models}
        pairs = [(b, m) for m in self.models for b in self.backends if b in runnable[m]]
        if not pairs:
            backends, models = ", ".join(self.backends), ", ".join(self.models)
            raise UnsupportedByBackendError(f"none of {backends} can run {models} (`ib models show`)")
        return pairs

    def stop(self) -> None:
        if self.gateway is not None:  # first: no new requests while the workers drain
            self.gateway.stop()
        for w in self.workers:
            w.stop()
            if self.multiproc_dir is not None and w.proc is not None:
                multiprocess.mark_process_dead(w.proc.pid, str(self.multiproc_dir))
        if self.flower is not None:
            self.flower.stop()
        if self.broker is not None:
            self.broker.stop()
        if self.multiproc_dir is not None:
            shutil.rmtree(self.multiproc_dir, ignore_errors=True)

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
