"""A simulated engine for capacity work: it sleeps where a real engine computes.

Measuring how the fleet's own cost (broker, dispatcher, job records, streams, heartbeats)
grows with 50-200 workers needs that many worker processes, and 200 real engines do not
fit on two cores. This engine keeps the real worker around it (Celery, the job store,
the heartbeat, the reaper, cancels, streaming) and replaces only the model: a continuous
batch of up to ``IB_SIM_CAPACITY`` requests, where a step admits what waits (one prefill
of ``IB_SIM_PREFILL_S``) and then gives every running request one token after
``IB_SIM_TOKEN_S``. The tokens are fixed (a cycle of words), the finish reason is
``length``, and a cancelled request ends at the next step, as in the real engines.

It lives in bench/ and is never offered to users: ``python -m bench.sim_worker`` starts
`ib worker` with it in place of the backend's engine (bench.sim_worker).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from core.backends import BackendSpec
from core.jobs import GenerationJob
from workers.engines.base import Engine
from workers.engines.request import EngineRequest, fail_requests

WORDS = [" the", " sea", " is", " wide", " and", " calm", " today", "."]


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


class SimulatedEngine(Engine[BackendSpec]):
    """Continuous batching with sleeps for compute (see the module's docstring)."""

    backend = "simulated"

    def load(self) -> None:
        self.prefill_s = _env_float("IB_SIM_PREFILL_S", 0.02)
        self.token_s = _env_float("IB_SIM_TOKEN_S", 0.01)
        self._capacity = int(_env_float("IB_SIM_CAPACITY", 8))
        self._waiting: deque[EngineRequest] = deque()
        self._work = threading.Condition()
        self._stop = False
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="sim-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._work:
            self._stop = True
            self._work.notify_all()
        self._thread.join(timeout=5)

    @property
    def capacity(self) -> int:
        return self._capacity

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "simulated": {"prefill_s": self.prefill_s, "token_s": self.token_s}}

    def stats(self) -> dict[str, object]:
        return {"steps": self.steps}

    def encode(self, job: GenerationJob) -> list[int]:
        """About a token per four bytes of the prompt, as a BPE tokenizer gives English."""
        text = "".join(m.content for m in job.messages) if job.messages is not None else job.prompt or ""
        return list(range(max(1, len(text.encode()) // 4)))

    def decode(self, token_ids: list[int]) -> str:
        return "".join(WORDS[t % len(WORDS)] for t in token_ids)

    def submit(self, request: EngineRequest) -> None:
        with self._work:
            self._waiting.append(request)
            self._work.notify_all()

    def _run(self) -> None:
        running: list[EngineRequest] = []  # the batch: this thread's alone
        while True:
            with self._work:
                while not (self._stop or self._waiting or running):
                    self._work.wait()
                if self._stop:
                    fail_requests(running + list(self._waiting), RuntimeError("engine closed"))
                    return
                admitted = []
                while self._waiting and len(running) + len(admitted) < self._capacity:
                    admitted.append(self._waiting.popleft())
            if admitted:
                time.sleep(self.prefill_s)  # one prefill for what was admitted together
                running += admitted
            time.sleep(self.token_s)
            self.steps += 1
            running = self.drop_cancelled(running)
            for r in running:
                r.tokens.append(len(r.tokens))
                if r.first_token_at is None:
                    r.first_token_at = time.time()
                if r.on_text is not None:
                    word = self.decode(r.tokens[-1:])
                    r.on_text(word)
                    r.streamed += len(word)
                if len(r.tokens) >= r.sampling.max_tokens or r.aborted:
                    r.finish_reason = "cancelled" if r.aborted else "length"
                    self.deliver(r)
            running = [r for r in running if not r.future.done()]
