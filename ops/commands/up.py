"""`ib up` and `ib flower`: run the fleet on this host, and its monitoring UI."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from core import settings
from core.jobs import BACKENDS
from ops.console import broker_url, console, stop_on_sigterm
from ops.flower.process import FlowerProcess, configured_auth, generated_auth
from ops.local.fleet import LocalFleet

CPU_BACKENDS = ["llamacpp", "onnx"]


def up(
    backend: Annotated[
        list[str] | None,
        typer.Option(
            "--backend", help=f"one of {', '.join(BACKENDS)}; repeat for more (default: {', '.join(CPU_BACKENDS)})"
        ),
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(help="registered model name; repeat to serve several (a worker each)"),
    ] = None,
    flower: Annotated[bool, typer.Option(help="start Flower")] = True,
    flower_port: Annotated[int | None, typer.Option(help="Flower's port (default: flower.port)")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Prometheus /metrics of all workers (default: metrics.host_port)")
    ] = None,
    serve: Annotated[bool, typer.Option(help="start the OpenAI-compatible HTTP gateway (`ib serve`) too")] = False,
    host: Annotated[
        str, typer.Option(help="address Flower, /metrics and the gateway bind (default: loopback only)")
    ] = "127.0.0.1",
    serve_port: Annotated[int | None, typer.Option(help="the gateway's port (default: gateway.port)")] = None,
) -> None:
    """Run a fleet here until Ctrl-C: broker (unless REDIS_URL), workers, Flower, metrics, gateway."""
    cfg = settings.fleet_config()
    auth = configured_auth()
    shown_auth = None
    if flower and auth is None:
        auth = shown_auth = generated_auth()
    fleet = LocalFleet(
        backends=backend or CPU_BACKENDS,
        models=model or ["smollm2-135m"],
        flower_port=(flower_port or cfg.flower.port) if flower else None,
        flower_auth=auth,
        metrics_port=cfg.metrics.host_port if metrics_port is None else metrics_port,
        serve_port=(serve_port or cfg.gateway.port) if serve else None,
        host=host,
    )
    stop_on_sigterm()
    try:
        with console.status(f"starting {', '.join(fleet.backends)} worker(s)..."):
            fleet.start()
        table = Table(title="fleet up (Ctrl-C stops it)")
        table.add_column("service")
        table.add_column("where")
        table.add_row("broker", fleet.redis_url.split("@")[-1])
        for w in fleet.workers:
            table.add_row(f"{w.backend} worker ({w.model})", f"{w.worker_id} (log {w.log_path})")
        if fleet.flower is not None:
            table.add_row("Flower", fleet.flower.url + ("" if shown_auth is None else f" (user:password {shown_auth})"))
        table.add_row("metrics", f"http://127.0.0.1:{fleet.metrics_port}/metrics")
        if fleet.gateway is not None:
            table.add_row("OpenAI API", f"{fleet.gateway.url}/v1 (log {fleet.gateway.log_path})")
        console.print(table)
        if fleet.broker is not None:
            console.print(f"submit with: REDIS_URL={fleet.redis_url} ib submit -m 'Hello'")
        while all(w.proc is not None and w.proc.poll() is None for w in fleet.workers):
            time.sleep(1)
        console.print("[red]a worker exited[/]; stopping the fleet")
    except KeyboardInterrupt:
        console.print("stopping: workers finish their running jobs first")
    finally:
        fleet.stop()


def flower(
    port: Annotated[int | None, typer.Option(help="default: flower.port")] = None,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="serve without basic auth (only behind your own auth proxy)")
    ] = False,
    host: Annotated[str, typer.Option(help="address to bind (default: loopback; a container: 0.0.0.0)")] = "127.0.0.1",
) -> None:
    """Run Flower against the broker (basic auth from IB_FLOWER_BASIC_AUTH=user:password)."""
    url = broker_url()
    auth = configured_auth()
    if auth is None and not no_auth:
        console.print("[red]refused:[/] set IB_FLOWER_BASIC_AUTH=user:password (or pass --no-auth on purpose)")
        raise typer.Exit(2)
    proc = FlowerProcess(url, port or settings.fleet_config().flower.port, auth, address=host)
    stop_on_sigterm()
    try:
        proc.start()
        console.print(f"Flower at {proc.url} (log {proc.log_path}); Ctrl-C stops it")
        while proc.proc is not None and proc.proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        proc.stop()
