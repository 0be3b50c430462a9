"""The one place `ib` turns a user's mistake into one red line and a non-zero exit.

A traceback is for a bug. What a user can fix (a typed fleet error, a broker that does
not answer or refuses the password, a config value of the wrong type, a path that is
missing or not allowed) is printed as one line naming the fix, exit 1 (2 for a broker
that cannot be reached, as ``ops.console.broker_url``). Anything else still raises, so a
real bug keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import redis
from kombu.utils.url import maybe_sanitize_url
from pydantic import ValidationError
from rich.markup import escape

from core import connection
from core.errors import JobError
from core.models.sources import SourceError
from core.store.memory_policy import EvictingRedisError
from ops.console import console
from workers.models.prepare import PreparationError


def broker_hint() -> str:
    where = maybe_sanitize_url(connection.redis_url() or "") or "not set"
    return f"start it (`ib broker`, or `ib up`) or point REDIS_URL at one; REDIS_URL is {where}"


def explain(exc: BaseException) -> tuple[str, int] | None:
    """(the line to print, exit code) for a user's mistake; None for a bug."""
    if isinstance(exc, JobError):
        return f"[red]{type(exc).__name__}:[/] {escape(str(exc))}", 1
    if isinstance(exc, EvictingRedisError):
        return f"[red]refused:[/] {escape(str(exc))}", 1
    if isinstance(exc, SourceError):
        return f"[red]refused:[/] {escape(str(exc))}", 1
    if isinstance(exc, PreparationError):
        return f"[red]preparation failed:[/] {escape(str(exc))}", 1
    if isinstance(exc, redis.AuthenticationError):
        return f"[red]the broker refused the password:[/] {escape(str(exc))}; check REDIS_URL or REDIS_PASSWORD", 2
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return f"[red]cannot reach the broker:[/] {escape(str(exc).rstrip('.'))}; {escape(broker_hint())}", 2
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        variable = "IB_" + "_".join(str(p) for p in first["loc"]).upper()
        # the value itself is left out: it may be a secret
        return (
            f"[red]bad configuration:[/] {escape(where or exc.title)}: {escape(first['msg'])}; "
            f"fix {escape(variable)} or {escape(where)} in the config file",
            1,
        )
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        if exc.filename is None:  # raised with a message of ours (it names the fix)
            return f"[red]{type(exc).__name__}:[/] {escape(str(exc))}", 1
        return f"[red]{escape(exc.strerror or type(exc).__name__)}:[/] {escape(str(exc.filename))}", 1
    return None


def run(app: Callable[[], object]) -> None:
    """Run a typer app, with a user's mistakes as one line instead of a traceback."""
    try:
        app()
    except Exception as exc:  # sorted below: a bug re-raises
        known = explain(exc)
        if known is None:
            raise
        line, code = known
        console.print(line, soft_wrap=True)
        sys.exit(code)
