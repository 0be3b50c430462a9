"""`ib serve` (the OpenAI-compatible HTTP gateway) and `ib keys add` (its API keys)."""

from __future__ import annotations

import ipaddress
import logging
from typing import Annotated

import typer

from core import connection, settings
from core.store import memory_policy
from ops.console import broker_url, console, stop_on_sigterm

keys_app = typer.Typer(help="API keys of the HTTP gateway (`ib serve`).", no_args_is_help=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    host: Annotated[str | None, typer.Option(help="address to bind (default: gateway.host, loopback)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default: gateway.port)")] = None,
    loglevel: str = "INFO",
) -> None:
    """Serve the OpenAI API (chat, completions, files, batches, models) in front of the fleet."""
    import uvicorn

    from gateway.app import create_app
    from gateway.auth import KEYS_ENV, KeyRing, keys_file

    cfg = settings.fleet_config().gateway
    host, port = host or cfg.host, cfg.port if port is None else port
    url = broker_url()
    memory_policy.check(connection.redis_client(url), "gateway")  # one line, before uvicorn's start-up
    ring = KeyRing.load()
    if ring.open and not is_loopback(host):
        console.print(
            f"[red]refused:[/] no API keys, so the gateway serves loopback only; set {KEYS_ENV} "
            f"or run `ib keys add` to serve on {host}"
        )
        raise typer.Exit(2)
    if ring.open:
        console.print(f"[yellow]no API keys ({KEYS_ENV}, {keys_file()}):[/] open to anyone on this host, loopback only")
    else:
        console.print(f"{len(ring.digests)} API key(s); each sees only its own files and batches")
    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    console.print(f"OpenAI API at http://{host}:{port}/v1 (Ctrl-C stops it)")
    stop_on_sigterm()
    try:
        uvicorn.run(
            create_app(url, cfg, ring),
            host=host,
            port=port,
            access_log=False,  # gateway.observe logs requests, without their bodies
            log_level=loglevel.lower(),
            timeout_graceful_shutdown=30,
        )
    except KeyboardInterrupt:
        pass


@keys_app.command("add")
def add(label: Annotated[str, typer.Option(help="a note kept beside the key's hash")] = "") -> None:
    """Make a new API key: printed once here, only its SHA-256 is kept."""
    from gateway.auth import add_key

    key, path = add_key(label)
    console.print(f"new API key (shown once; its hash is in {path}):")
    print(key)
