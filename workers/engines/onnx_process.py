"""onnxruntime-genai's Generator in a child process of the worker.

Why a process: ``Generator.generate_next_token`` holds the GIL for its whole step (~40 ms
for 16 rows of SmolLM2 on 2 cores; measured: another thread woke once per step). In the
worker that starved every other thread: Celery's consumer took one message per step or
so while a batch decoded, a job's hand-over (a few Redis round trips, each waiting for
the GIL) took hundreds of milliseconds, and a burst of 32 jobs reached the engine as
batches of 16, 15 and 1. In its own process the model steps without the worker's GIL.

The child is a plain ``python -m workers.engines.onnx_process`` (not multiprocessing's
spawn, which would import the worker's whole command line again in the child), given one
end of a socket pair; it imports numpy, onnxruntime-genai and the engines package's own
light imports, not the worker's command line, Celery or transformers.
The protocol is JSON over that socket (never pickle), one message each way per event:
parent → child ``{"ids": [[...]], "options": {...}}`` (a batch; right-padded rows),
``{"stop": true}`` (every row has ended: the batch stops at the next step), ``{"close":
true}``; child → parent ``{"ready": true}`` once loaded, ``{"tokens": [...]}`` per step,
``{"done": true}`` when the batch ended, ``{"error": "..."}`` when it failed. The child
does not wait for the parent between steps; a stop arrives a step late at most, and the
parent drops what comes after it.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 300


class GeneratorFailed(RuntimeError):
    """The child could not load the model, failed a batch, or exited; the engine turns
    it into the job's EngineError."""


def send(conn: Connection, **message: Any) -> None:
    conn.send_bytes(json.dumps(message).encode())


def receive(conn: Connection) -> dict[str, Any]:
    return json.loads(conn.recv_bytes())


def load_model(path: str | Path, threads: int) -> Any:
    """An onnxruntime-genai model with ``threads`` intra-op threads (the child's, and the
    benchmarks' in-process baseline: the same settings both sides)."""
    import onnxruntime_genai as og

    cfg = og.Config(str(path))
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og.Model(cfg)


def special_ids(path: Path) -> tuple[list[int], int]:
    """(EOS ids, pad id) from the folder's genai_config.json; pad defaults to the first EOS."""
    genai = json.loads((path / "genai_config.json").read_text())["model"]
    eos = genai["eos_token_id"]
    eos_ids = list(eos) if isinstance(eos, list) else [eos]
    return eos_ids, int(genai.get("pad_token_id", eos_ids[0]))


def serve(conn: Connection, path: str, threads: int) -> None:
    """The child: load the model, then run batch after batch until told to close."""
    import numpy as np
    import onnxruntime_genai as og

    try:
        model = load_model(path, threads)
    except Exception as exc:
        log.exception("onnx generator process: loading %s failed", path)
        send(conn, error=f"{type(exc).__name__}: {exc}")
        return
    send(conn, ready=True)
    while True:
        try:
            msg = receive(conn)
        except EOFError:  # the worker is gone
            return
        if msg.get("close"):
            return
        if "ids" not in msg:
            continue  # a stop that came after its batch had ended
        try:
            params = og.GeneratorParams(model)
            params.set_search_options(**msg["options"])
            if msg.get("guidance"):  # a structured output: llguidance inside onnxruntime-genai
                params.set_guidance(*msg["guidance"])
            generator = og.Generator(model, params)
            generator.append_tokens(np.array(msg["ids"], dtype=np.int32))
            while not generator.is_done():
                if conn.poll() and receive(conn).get("stop"):
                    break
                generator.generate_next_token()
                send(conn, tokens=[int(t) for t in generator.get_next_tokens()])
            del generator
            send(conn, done=True)
        except Exception as exc:  # a bad batch fails that batch, not the process
            log.exception("onnx generator process: a batch failed")
            send(conn, error=f"{type(exc).__name__}: {exc}")


class GeneratorProcess:
    """The parent's handle: one batch at a time (the engine's scheduler thread)."""

    def __init__(self, path: Path, threads: int) -> None:
        mine, theirs = socket.socketpair()
        fd = theirs.fileno()
        cmd = [sys.executable, "-m", __name__, f"--fd={fd}", f"--path={path}", f"--threads={threads}"]
        # Same process group as the worker: a kill of the worker's group takes it too;
        # if only the worker dies, the child reads EOF and exits.
        self.proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(mine.detach())
        if not self.conn.poll(LOAD_TIMEOUT_S):
            self.close()
            raise GeneratorFailed(f"the ONNX generator process did not load {path} in {LOAD_TIMEOUT_S} s")
        msg = self._receive()
        if "error" in msg:
            self.close()
            raise GeneratorFailed(f"the ONNX generator process could not load {path}: {msg['error']}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _receive(self) -> dict[str, Any]:
        try:
            return receive(self.conn)
        except (EOFError, OSError):
            raise GeneratorFailed(f"the ONNX generator process exited (code {self.proc.poll()})") from None

    def run(
        self,
        ids: list[list[int]],
        options: dict[str, Any],
        on_step: Callable[[list[int]], bool],
        guidance: tuple[str, str] | None = None,
    ) -> None:
        """Decode one batch; ``on_step`` gets each step's tokens (one per row) and says
        whether every row has ended, which stops the batch; ``guidance``: the batch's
        grammar (type, data), as onnxruntime-genai's set_guidance takes it."""
        if self.proc.poll() is not None:
            raise GeneratorFailed(f"the ONNX generator process exited (code {self.proc.returncode})")
        send(self.conn, ids=ids, options=options, guidance=guidance)
        stopped = False
        while True:
            msg = self._receive()
            if "error" in msg:
                raise GeneratorFailed(f"onnxruntime-genai: {msg['error']}")
            if msg.get("done"):
                return
            if not stopped and on_step(msg["tokens"]):
                send(self.conn, stop=True)
                stopped = True

    def close(self) -> None:
        try:
            send(self.conn, close=True)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="onnxruntime-genai's Generator for one ONNX worker (internal)")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    serve(Connection(args.fd), args.path, args.threads)


if __name__ == "__main__":
    main()
