"""`ib`: the command line of InferenceBackend (typer + rich).

This module only puts the commands together: each command group is a module of
ops/commands/ (as Celery's ``celery/bin/``), and they never import each other.

Broker: ``REDIS_URL`` (any Redis or Valkey; ``REDIS_PASSWORD`` and ``rediss://`` for TLS),
else an embedded Valkey started by ``ib broker``.
"""

from __future__ import annotations

import typer

from ops.commands import batch, bench, broker, dead_letters, demo, jobs, models, serve, up, worker
from ops.user_errors import run as run_cli

app = typer.Typer(help="InferenceBackend: one job queue in front of five LLM engines.", no_args_is_help=True)
for command in (jobs.explain, jobs.submit, jobs.result, jobs.status, jobs.cancel, worker.workers, worker.worker):
    app.command()(command)
app.add_typer(models.app, name="models")
app.add_typer(batch.app, name="batch")
app.add_typer(dead_letters.app, name="dead-letters")
app.add_typer(bench.app, name="bench")
for command in (up.up, up.flower, serve.serve, broker.broker, demo.demo):
    app.command()(command)
app.add_typer(serve.keys_app, name="keys")


def main() -> None:
    """The `ib` entry point: the app, with a user's mistakes as one line (ops.user_errors)."""
    run_cli(app)


if __name__ == "__main__":
    main()
