"""`ib bench profiles`: measure every backend and write the profile and its docs table."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from core import connection, settings
from core.registry import ModelRegistry
from dispatcher.client import Client
from dispatcher.routing import profiles
from ops.console import console
from ops.local.broker import EmbeddedBroker
from ops.local.processes import WorkerProcess
from ops.profiles.bench import measure_backend
from ops.profiles.docs import write as write_docs
from ops.subprocesses import free_port
from workers.models.prepare import prepare

app = typer.Typer(help="Benchmarks that feed the fleet's own decisions.", no_args_is_help=True)
# What `--start` runs here, one at a time (a CPU host: the GPU-only engines need a server or a GPU).
START_ORDER = ["pytorch", "llamacpp", "onnx", "vllm"]
START_ARGS = {"onnx": ["--format=onnx-int4"]}  # the ONNX format a deployment serves (fastest on CPU)
START_FORMAT = {"pytorch": "hf", "vllm": "hf", "onnx": "onnx-int4", "llamacpp": "gguf"}


@app.command("profiles")
def profiles_cmd(
    backend: Annotated[list[str] | None, typer.Option("--backend", help="measure only these (repeatable)")] = None,
    start: Annotated[
        bool,
        typer.Option(
            help=f"start each backend's worker here in turn ({', '.join(START_ORDER)}) instead of measuring live ones"
        ),
    ] = False,
    model: Annotated[str, typer.Option(help="registered model name")] = "smollm2-135m",
    max_tokens: Annotated[int, typer.Option(help="tokens per job")] = 64,
    saturate: Annotated[int, typer.Option(help="jobs submitted at once for the saturated figure")] = 32,
    out: Annotated[Path | None, typer.Option(help="the profile (default: config/profiles.json)")] = None,
    docs: Annotated[Path | None, typer.Option(help="the markdown to update (default: docs/BENCHMARKS.md)")] = None,
    rewrite: Annotated[
        bool, typer.Option(help="measure nothing: recompute the 7B estimates and rewrite the docs table")
    ] = False,
) -> None:
    """Run the reference workload on each backend; update the profile and docs/BENCHMARKS.md."""
    docs = docs or settings.REPO_ROOT / "docs" / "BENCHMARKS.md"
    if rewrite:
        book = profiles.load(out) or profiles.ProfileBook()
        book = profiles.ProfileBook(rows=[profiles.with_current_estimate(r) for r in book.rows])
        console.print(f"rewrote {profiles.save(book, out)} and {write_docs(book, docs)}")
        return

    command = "ib bench profiles " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "ib bench profiles"
    rows = []
    with console.status("measuring...") as status:
        if start:
            rows = _measure_started(backend or START_ORDER, model, max_tokens, saturate, command, status.update)
        else:
            with Client() as client:
                live = sorted({w.backend for w in client.workers().live(model=model)})
                todo = [b for b in (backend or live)]
                if not todo:
                    console.print("[red]no live worker[/]: start a fleet (`ib up`) or pass --start")
                    raise typer.Exit(1)
                for b in todo:
                    rows.append(measure_backend(client, b, model, max_tokens, saturate, command, status.update))
    book = (profiles.load(out) or profiles.ProfileBook()).merged(rows)
    path = profiles.save(book, out)
    md = write_docs(book, docs)
    table = Table(title=f"backend profiles ({path}, {md})")
    for col in ("backend", "hardware", "TTFT p50/p95 ms", "tok/s single/saturated", "memory MB", "7B estimate"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.backend,
            r.hardware,
            f"{r.ttft_p50_ms:.0f} / {r.ttft_p95_ms:.0f}",
            f"{r.single_stream_tok_s:.1f} / {r.saturated_tok_s:.1f}",
            f"{r.memory_mb:.0f} ({r.memory_kind})",
            r.estimate_7b.render(),
        )
    console.print(table)


def _measure_started(
    backends: list[str], model: str, max_tokens: int, saturate: int, command: str, progress: Callable[[str], None]
) -> list[profiles.BackendProfile]:
    spec = ModelRegistry.from_config().get(model)
    url = connection.redis_url()
    broker = None if url else EmbeddedBroker(port=free_port()).start(announce=False)
    url = url or broker.url
    rows = []
    try:
        with Client(url) as client:
            for b in backends:
                progress(f"{b}: preparing {START_FORMAT[b]} and starting a worker")
                prepare(spec, START_FORMAT[b])
                worker = WorkerProcess(b, url, model=model, extra_args=START_ARGS.get(b)).start()
                try:
                    worker.wait_ready(900)
                    rows.append(measure_backend(client, b, model, max_tokens, saturate, command, progress))
                finally:
                    worker.stop()
    finally:
        if broker is not None:
            broker.stop()
    return rows
