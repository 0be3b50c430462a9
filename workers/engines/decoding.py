"""Per-row bookkeeping shared by the engines that decode a whole batch step by step.

Each row is a job with its own max_tokens, stop strings and cancel flag. After every
decoding step the engine hands the new token of every row to ``BatchProgress.step``;
a row that ends (EOS, stop string, max_tokens, cancelled, time limit) is answered at
once, while the rest of its batch decodes on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from workers.engines.base import Engine, EngineRequest


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in ``text``, if any appeared."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def batch_key(request: EngineRequest) -> Hashable:
    """Requests that can share one batch: same sampling; a seeded one runs alone."""
    s = request.sampling
    if s.greedy:
        return ("greedy",)
    return ("sample", s.temperature, s.top_p, s.seed if s.seed is None else (s.seed, request.job_id))


def append_token(engine: Engine, req: EngineRequest, tok: int, eos: set[int], now: float | None = None) -> str | None:
    """Record one generated token (produced at ``now``: one time for a whole batch step);
    returns why the request ends ("stop" / "length"), if it does."""
    req.tokens.append(tok)
    if req.first_token_at is None:
        req.first_token_at = now or time.time()
    if tok in eos:
        return "stop"
    if req.sampling.stop and first_stop(engine.decode(req.tokens), req.sampling.stop) is not None:
        return "stop"
    if len(req.tokens) >= req.sampling.max_tokens:
        return "length"
    return None


class BatchProgress:
    def __init__(self, engine: Engine, requests: list[EngineRequest]) -> None:
        self.engine = engine
        self.requests = requests
        self.done = [False] * len(requests)
        self.eos = set(engine.eos_ids)

    @property
    def all_done(self) -> bool:
        return all(self.done)

    def step(self, tokens: list[int]) -> list[bool]:
        """Record one new token per row; returns which rows are done."""
        now = time.time()
        for i, (req, tok) in enumerate(zip(self.requests, tokens)):
            if not self.done[i] and (reason := append_token(self.engine, req, tok, self.eos, now)):
                self._finish(i, reason)
        running = [r.job_id for r, d in zip(self.requests, self.done) if not d]
        cancelled = self.engine.cancelled(running)
        for i, req in enumerate(self.requests):
            if not self.done[i] and (req.job_id in cancelled or req.aborted):
                self._finish(i, "cancelled")
        return list(self.done)

    def finish_rest(self, reason: str = "length") -> None:
        """Answer the rows the engine stopped without the monitor (its own length limit)."""
        for i, done in enumerate(self.done):
            if not done:
                self._finish(i, reason)

    def _finish(self, i: int, reason: str) -> None:
        self.done[i] = True
        self.requests[i].finish_reason = reason
        self.engine.deliver(self.requests[i])
