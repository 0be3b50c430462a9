"""What the `ib` commands share, the way Celery's ``celery/bin/base.py`` serves its commands:
the console, the broker connection with its one-line refusal, SIGTERM handling, result
printing and the batch progress bar. Commands import this, never each other; a typed
fleet error they let through is one red line at the entry point (ops.user_errors)."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from core import connection
from core.jobs import JobResult
from dispatcher.client import Client

console = Console()
ModelOpt = Annotated[str, typer.Option("--model", help="registered model name")]
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON on stdout, for scripts (nothing truncated)")]


def print_rows(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """A table on a terminal; in a pipe, a header and one tab-separated line per row with
    nothing truncated (a table squeezed to 80 columns would cut the ids `grep` looks for)."""
    if console.is_terminal:
        table = Table(title=title)
        for col in columns:
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    out = ["\t".join(columns), *("\t".join(cell.replace("\t", " ") for cell in row) for row in rows)]
    sys.stdout.write("\n".join(out) + "\n")


def print_json(value: object) -> None:
    """``value`` as JSON on stdout (plain: no colours, no wrapping)."""
    sys.stdout.write(json.dumps(value, ensure_ascii=False, indent=2) + "\n")


def broker_url() -> str:
    """The broker, or one line saying how to get one and exit 2."""
    url = connection.redis_url()
    if not url:
        console.print("[red]no broker:[/] set REDIS_URL, or start the embedded one with `ib broker`")
        raise typer.Exit(2)
    return url


def client() -> Client:
    return Client(broker_url())


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """SIGTERM (kill, a supervisor) unwinds like Ctrl-C, so what a command started stops too."""
    signal.signal(signal.SIGTERM, _interrupt)


def print_results(results: list[JobResult], prompts: list[str] | None = None) -> None:
    """One block per job: readable at any terminal width."""
    for i, r in enumerate(results, 1):
        ttft = r.timings.ttft_s
        path = " → ".join(f"{s.check} {s.answer}" for s in r.path if s.check != "formats")
        cached = f", {r.usage.cached_tokens} prompt tokens from the prefix cache" if r.usage.cached_tokens else ""
        if prompts:
            console.print(f"[bold][{i}][/] {prompts[i - 1]}")
        console.print(f"    [green]{escape(r.text.strip())}[/]")
        console.print(
            f"    {r.backend} on {r.worker} · queue wait {r.timings.queue_wait_s * 1000:.0f} ms · "
            f"TTFT {'-' if ttft is None else f'{ttft * 1000:.0f} ms'} · {r.tokens_per_s:.1f} tok/s · "
            f"{r.finish_reason} ({r.usage.completion_tokens} tokens{cached})",
            highlight=False,
        )
        console.print(f"    [dim]path: {escape(path)}[/]")


class _Rate(ProgressColumn):
    """Generated tokens per second since the batch started running."""

    def render(self, task: Task) -> Text:
        rate = task.fields.get("tok_s")
        return Text(f"{rate:,.1f} tok/s" if rate else "- tok/s", style="cyan")


def watch_batch(client: Client, batch_id: str, interval_s: float = 1.0) -> None:
    """A progress bar (lines done / total, tok/s, ETA) until the batch ends."""
    batch = client.batches.retrieve(batch_id)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _Rate(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(batch.status, total=batch.request_counts.total or None)
        while True:
            started = batch.in_progress_at or batch.created_at
            elapsed = max(1e-3, time.time() - started)
            progress.update(
                task,
                description=batch.status,
                completed=batch.done,
                total=batch.request_counts.total or None,
                tok_s=batch.completion_tokens / elapsed if batch.in_progress_at else None,
            )
            if batch.is_final:
                break
            time.sleep(interval_s)
            batch = client.batches.retrieve(batch_id)
