"""A local server that never answers in time is stopped, not left running: the start
that raised is the only place that holds its process (a vLLM server once outlived a CI
run this way, holding 0.78 GB, after its fixture failed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ops.subprocesses import free_port, wait_http


def test_a_server_that_stays_silent_is_stopped_before_the_timeout_is_raised(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with pytest.raises(TimeoutError, match="not answering"):
            wait_http(proc, f"http://127.0.0.1:{free_port()}/health", "silent", tmp_path / "x.log", timeout=1)
        assert proc.poll() is not None, "the silent server is still running"
    finally:
        proc.kill()
        proc.wait()
