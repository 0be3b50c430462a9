"""`ib worker` (start one) and `ib workers` (the live fleet)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from core import settings
from core.errors import JobError
from core.jobs import BACKENDS
from dispatcher.batch.feeder import BatchFeeder
from dispatcher.parts import DispatchParts
from ops.console import JsonOpt, ModelOpt, broker_url, console, print_json, print_rows
from ops.console import client as _client


def workers(as_json: JsonOpt = False) -> None:
    """The live fleet, from worker heartbeats."""
    fleet = _client().workers()
    if as_json:
        print_json([w.model_dump(mode="json") for w in fleet.workers])
        return
    rows = []
    for w in fleet.workers:
        gpus = ", ".join(f"{g.name} {g.memory_total_mb // 1024} GiB" for g in w.hardware.gpus)
        hw = gpus or f"CPU {w.hardware.cpu_cores} cores, {w.hardware.ram_gb} GiB"
        load = f"{w.in_flight}/{w.capacity}"
        rows.append(
            (w.worker_id, w.backend, hw, ", ".join(w.models), w.status, w.health.describe(), load, ", ".join(w.queues))
        )
    columns = ("worker", "backend", "hardware", "models", "status", "health", "load", "queues")
    print_rows(f"{len(fleet.workers)} live worker(s)", columns, rows)


def worker(
    backend: Annotated[str, typer.Option(help=f"one of {', '.join(BACKENDS)}")],
    model: ModelOpt = "smollm2-135m",
    threads: Annotated[
        int | None, typer.Option(help="engine threads (default: the cores this process may use)")
    ] = None,
    concurrency: Annotated[int | None, typer.Option(help="jobs in flight (default: what the engine wants)")] = None,
    worker_id: Annotated[str | None, typer.Option(help="stable id (default: backend-kind-host-pid)")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="run on the CPU even if a GPU is present")] = False,
    fmt: Annotated[str | None, typer.Option("--format", help="artifact format to serve, e.g. onnx-int4")] = None,
    endpoint: Annotated[
        str | None, typer.Option(help="tgi: the server's URL (OpenAI-compatible API), or IB_TGI_ENDPOINT")
    ] = None,
    loglevel: str = "INFO",
    metrics_port: Annotated[
        int | None, typer.Option(help="serve Prometheus /metrics here (default: metrics.port; 0: off)")
    ] = None,
) -> None:
    """Start a worker: load one engine, heartbeat, consume ib.<backend>."""
    from workers.engines.base import ModelArtifactError
    from workers.worker import WorkerOptions, run_worker

    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    broker_url()  # without one: a line saying how to get one, exit 2
    options = WorkerOptions(
        backend,
        model,
        threads=threads,
        concurrency=concurrency,
        worker_id=worker_id,
        use_gpu=False if cpu else None,
        fmt=fmt,
        endpoint=endpoint,
        loglevel=loglevel,
        metrics_port=metrics_port,
    )
    sidecars = [batch_feeder] if settings.fleet_config().batch.feeder_in_workers else []
    try:
        run_worker(options, sidecars=sidecars)
    except (FileNotFoundError, ModelArtifactError, JobError) as exc:
        console.print(f"[red]worker not started:[/] {exc}")
        raise typer.Exit(2) from None


def batch_feeder(url: str, worker_id: str) -> BatchFeeder:
    """Every worker process runs a batch feeder (one at a time holds the lease), so
    batches move on whichever workers are alive."""
    return BatchFeeder(DispatchParts.connect(url, resilient=True), owner=worker_id).start()
