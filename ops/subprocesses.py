"""Child processes as `ib` starts them: with a log file, waited for until their HTTP
answers (or reported with where their log is), stopped with SIGTERM then SIGKILL.
Shared by what ops/local/ and ops/flower/ start."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx


def spawn_logged(args: list[str], log_path: Path, **popen: Any) -> subprocess.Popen:
    """Start a server process with stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, **popen)


def wait_http(proc: subprocess.Popen, url: str, what: str, log_path: Path, timeout: float) -> None:
    """Until ``url`` answers 200, while ``proc`` (the server behind it) is alive; a server
    that exits or stays silent is reported with where its log is, one that stays silent
    stopped first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    # Stopped before the error: the caller never gets the process to stop (a test
    # fixture's start raised, so its teardown, which would, is never reached).
    terminate(proc)
    raise TimeoutError(f"{what} not answering at {url} after {timeout} s; see {log_path}")


def terminate(proc: subprocess.Popen | None, timeout: float = 30) -> None:
    """SIGTERM a server and wait for it; SIGKILL it if it does not stop in ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
