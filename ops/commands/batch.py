"""`ib batch ...`: submit, watch, collect, list and cancel offline batches (typer + rich)."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Annotated

import typer

from dispatcher.batch.feeder import BatchFeeder
from dispatcher.batch.objects import Batch
from ops.console import JsonOpt, console, print_json, print_rows, stop_on_sigterm, watch_batch
from ops.console import client as _client

app = typer.Typer(help="Offline batch jobs: OpenAI Batch JSONL in, JSONL out.", no_args_is_help=True)


@app.command("submit")
def submit(
    input_file: Annotated[
        Path, typer.Argument(help="JSONL: OpenAI Batch request lines, or plain {custom_id, prompt|messages, ...}")
    ],
    model: Annotated[str | None, typer.Option(help="model for lines that name none")] = None,
    priority: Annotated[str, typer.Option(help="interactive | normal | batch")] = "batch",
    completion_window: Annotated[str | None, typer.Option(help="e.g. 24h (default from config)")] = None,
    endpoint: Annotated[str | None, typer.Option(help="require every line to use this url")] = None,
    metadata: Annotated[list[str] | None, typer.Option(help="key=value (repeatable)")] = None,
    watch: Annotated[bool, typer.Option(help="follow the batch with a progress bar")] = False,
) -> None:
    """Validate and submit a batch; prints its id and returns (the fleet runs it)."""
    client = _client()
    bad = [m for m in metadata or [] if not m.partition("=")[0] or "=" not in m]
    if bad:
        raise typer.BadParameter(f"{bad[0]!r}: write it as key=value", param_hint="--metadata")
    meta = dict(m.partition("=")[::2] for m in metadata) if metadata else None
    with console.status("validating...") as spinner:
        batch = client.batches.create(
            input_file,
            model=model,
            priority=priority,
            completion_window=completion_window,
            endpoint=endpoint,
            metadata=meta,
            progress=lambda n: spinner.update(f"validating: {n} lines read"),
        )
    counts = batch.request_counts
    console.print(
        f"batch [bold]{batch.id}[/]: {batch.status}, {counts.total} request(s), {counts.failed} refused at validation"
    )
    if batch.errors and batch.errors.data:
        for err in batch.errors.data:
            console.print(f"  [red]{err['code']}[/]: {err['message']}")
        raise typer.Exit(1)
    if watch:
        watch_batch(client, batch.id)
    else:
        console.print(f"follow it: ib batch status {batch.id} --watch")


@app.command("status")
def status(
    batch_id: str,
    watch: Annotated[bool, typer.Option(help="a progress bar with tok/s and ETA until the batch ends")] = False,
    as_json: JsonOpt = False,
) -> None:
    """A batch's status and request counts."""
    client = _client()
    if watch:
        watch_batch(client, batch_id)
    batch = client.batches.retrieve(batch_id)
    if as_json:
        print_json(batch.model_dump(mode="json"))
        return
    _show(batch)


@app.command("results")
def results(
    batch_id: str,
    output: Annotated[Path, typer.Option("--output", "-o", help="output JSONL (one line per input line, input order)")],
    errors: Annotated[Path | None, typer.Option(help="errors JSONL (default: errors go to --output too)")] = None,
) -> None:
    """Write a batch's results (written atomically; partial while the batch runs)."""
    client = _client()
    batch = client.batches.retrieve(batch_id)
    n_out, n_err = client.batches.write_results(batch_id, output, errors)
    where = f"{n_out} line(s) → {output}" + (f", {n_err} error(s) → {errors}" if errors else "")
    console.print(where)
    if not batch.is_final:
        console.print(
            f"[yellow]the batch is {batch.status}: "
            f"{batch.done} of {batch.request_counts.total} lines are done so far[/]"
        )


@app.command("list")
def list_(limit: Annotated[int, typer.Option(help="how many, newest first")] = 20, as_json: JsonOpt = False) -> None:
    """Recent batches."""
    found = _client().batches.list(limit=limit)
    if as_json:
        print_json([b.model_dump(mode="json") for b in found])
        return
    rows = []
    for b in found:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.created_at))
        c = b.request_counts
        rows.append(
            (b.id, b.status, created, str(c.total), str(c.completed), str(c.failed), str(b.completion_tokens),
             b.input_file or "-")
        )  # fmt: skip
    print_rows("batches", ("id", "status", "created", "total", "completed", "failed", "tokens", "input"), rows)


@app.command("cancel")
def cancel(
    batch_id: str,
    wait: Annotated[bool, typer.Option(help="wait until the running lines have stopped")] = False,
) -> None:
    """Cancel a batch: pending lines are dropped, running ones aborted, finished ones kept."""
    client = _client()
    batch = client.batches.cancel(batch_id)
    while wait and not batch.is_final:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch_id)
    console.print(f"batch {batch_id}: {batch.status} ({batch.request_counts.completed} completed lines kept)")


@app.command("feed")
def feed(
    once: Annotated[bool, typer.Option(help="stop when there is nothing to feed (backpressure or all fed)")] = False,
) -> None:
    """Run a batch feeder here (workers run one too; one at a time holds the lease)."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop_on_sigterm()
    feeder = BatchFeeder(_client().parts, owner=f"feeder-{socket.gethostname()}-{os.getpid()}")
    try:
        feeder.run(once=once)
    except KeyboardInterrupt:
        pass


def _show(batch: Batch) -> None:
    c = batch.request_counts
    console.print(f"batch [bold]{batch.id}[/]: [bold]{batch.status}[/]")
    console.print(
        f"  requests: {c.total} total, {c.completed} completed, {c.failed} failed, {c.total - batch.done} to go"
    )
    if batch.backends:
        console.print("  backends: " + ", ".join(f"{b} {n}" for b, n in sorted(batch.backends.items())))
    console.print(f"  generated tokens: {batch.completion_tokens}")
    for key in (
        "created_at",
        "in_progress_at",
        "completed_at",
        "cancelling_at",
        "cancelled_at",
        "failed_at",
        "expired_at",
        "expires_at",
    ):
        value = getattr(batch, key)
        if value:
            console.print(f"  {key}: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(value))}")
    if batch.errors and batch.errors.data:
        for err in batch.errors.data:
            console.print(f"  [red]{err['code']}[/]: {err['message']}")
