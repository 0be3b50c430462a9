"""`ib dead-letters ...`: the messages no worker could run, and putting them back.

A message lands here when a worker cannot decode it, has no such task, or finds that its
arguments do not match its schema (a rolling upgrade half done). After the cause is fixed,
``requeue`` publishes it again unchanged; ``drop`` forgets it.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from core.store.dead_letters import DeadLetter, DeadLetters
from dispatcher.client import Client
from ops.console import client as _client
from ops.console import console

app = typer.Typer(help="Messages no worker could run: list, show, requeue, drop.", no_args_is_help=True)


def _letters() -> tuple[DeadLetters, Client]:
    client = _client()
    return DeadLetters(client.redis), client


def _chosen(letters: DeadLetters, ids: list[str] | None, all_: bool) -> list[DeadLetter]:
    if all_:
        return letters.list(limit=letters.cap)
    if not ids:
        raise typer.BadParameter("name one or more letter ids, or --all", param_hint="IDS")
    found = []
    for letter_id in ids:
        letter = letters.get(letter_id)
        if letter is None:
            console.print(f"[red]no dead letter {letter_id}[/] (see `ib dead-letters list`)")
            raise typer.Exit(1)
        found.append(letter)
    return found


@app.command("list")
def list_(limit: Annotated[int, typer.Option(help="how many, newest first")] = 50) -> None:
    """The dead letters, newest first (no message bodies: they hold prompts)."""
    letters, _ = _letters()
    table = Table(title=f"dead letters ({letters.count()})")
    for col in ("id", "when", "reason", "task", "job", "queue", "detail"):
        table.add_column(col, overflow="fold")
    for d in letters.list(limit=limit):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.at))
        table.add_row(d.id, when, d.reason, d.task or "-", d.task_id or "-", d.queue or "-", d.detail)
    console.print(table)


@app.command("show")
def show(letter_id: str, body: Annotated[bool, typer.Option(help="print the message body too")] = False) -> None:
    """One letter: reason, headers, and with --body the message as received."""
    letters, _ = _letters()
    (letter,) = _chosen(letters, [letter_id], False)
    for name in ("id", "reason", "detail", "task", "task_id", "queue", "content_type", "priority"):
        console.print(f"[bold]{name}[/]: {getattr(letter, name)}")
    if body:
        console.print(letter.body, markup=False, soft_wrap=True)


@app.command("requeue")
def requeue(
    ids: Annotated[list[str] | None, typer.Argument(help="letter ids")] = None,
    all_: Annotated[bool, typer.Option("--all", help="every dead letter")] = False,
) -> None:
    """Put letters back on their queues unchanged (after the cause is fixed); a job failed
    only for its dead letter is queued again."""
    letters, client = _letters()
    chosen = _chosen(letters, ids, all_)
    for letter in chosen:
        letters.requeue(client.app, letter)
    console.print(f"requeued {len(chosen)} message(s)")


@app.command("drop")
def drop(
    ids: Annotated[list[str] | None, typer.Argument(help="letter ids")] = None,
    all_: Annotated[bool, typer.Option("--all", help="every dead letter")] = False,
) -> None:
    """Forget letters."""
    letters, _ = _letters()
    chosen = _chosen(letters, ids, all_)
    console.print(f"dropped {letters.remove(*[d.id for d in chosen])} letter(s)")
