"""`ib demo`: the whole fleet on this host, real prompts, a batch, the OpenAI API."""

from __future__ import annotations

from typing import Annotated

import typer

from ops.console import stop_on_sigterm


def demo(
    prompts: Annotated[int, typer.Option(help="how many demo prompts to run")] = 12,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 48,
) -> None:
    """Start a broker (unless REDIS_URL is set), a worker per backend, run real prompts and a batch, stop everything."""
    from ops.demo import run_demo

    stop_on_sigterm()
    raise typer.Exit(run_demo(prompts, max_tokens))
