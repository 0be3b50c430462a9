"""Per-row bookkeeping shared by the engines that decode a whole batch step by step.

Each row is a job with its own max_tokens, stop strings and cancel flag. After every
decoding step the engine hands the new token of every row to ``BatchProgress.step``;
a row that ends (EOS, stop string, max_tokens, cancelled, time limit) is answered at
once, while the rest of its batch decodes on.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Protocol

from core.jobs import SamplingParams
from workers.engines.request import EngineRequest


class Decoder(Protocol):
    """What these helpers need of an engine (workers.engines.base.Engine has it all)."""

    eos_ids: list[int]

    def decode(self, token_ids: list[int]) -> str: ...

    def cancelled(self, job_ids: list[str]) -> set[str]: ...

    def deliver(self, r: EngineRequest) -> None: ...


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in ``text``, if any appeared."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def stop_cut(text: str, s: SamplingParams) -> int | None:
    """Where the answer ends if a stop string appeared: before the earliest one, or after
    it with ``include_stop_str_in_output``."""
    hits = [(i, len(stop)) for stop in s.stop if (i := text.find(stop)) >= 0]
    if not hits:
        return None
    at, size = min(hits)
    return at + size if s.include_stop_str_in_output else at


def batch_key(request: EngineRequest) -> Hashable:
    """Requests that can share one batch: the same batch-wide settings (sampling, and what
    onnxruntime-genai sets per batch: top_k, repetition penalty, a grammar); a seeded one
    runs alone. What each row shapes itself (bias, EOS floor, penalties in PyTorch's
    processor) does not split batches."""
    s = request.sampling
    if request.speculative:  # drafting and verifying are done for one sequence at a time
        return ("speculative", request.job_id)
    structured = None if s.structured is None else s.structured.model_dump_json()
    shared = (s.top_k, s.min_p, s.repetition_penalty, structured)
    if s.greedy:
        return ("greedy", *shared)
    return ("sample", s.temperature, s.top_p, s.seed if s.seed is None else (s.seed, request.request_id), *shared)


def append_token(engine: Decoder, req: EngineRequest, tok: int, eos: set[int], now: float | None = None) -> str | None:
    """Record one generated token (produced at ``now``: one time for a whole batch step);
    returns why the request ends ("stop" / "length"), if it does."""
    req.tokens.append(tok)
    if req.first_token_at is None:
        req.first_token_at = now or time.time()
    # One decode serves both the stream and the stop-string check.
    text = engine.decode([t for t in req.tokens if t not in eos]) if req.on_text or req.sampling.stop else ""
    if req.on_text is not None:
        stream_text(engine, req, text)
    if tok in eos:
        return "stop"
    if req.sampling.stop and first_stop(text, req.sampling.stop) is not None:
        return "stop"
    if len(req.tokens) >= req.sampling.max_tokens:
        return "length"
    return None


def stream_text(engine: Decoder, req: EngineRequest, text: str | None = None) -> None:
    """Send the request's new text (``text``: its tokens decoded, if the caller has it)
    to its on_text, holding back what may still change: a character whose bytes are not
    all generated yet, and a tail that could be the start of a stop string (deliver()
    sends the rest, cut at the stop)."""
    if text is None:
        text = engine.decode([t for t in req.tokens if t not in engine.eos_ids])
    text = text.rstrip("\ufffd")
    stops = req.sampling.stop
    cut = stop_cut(text, req.sampling)
    if cut is not None:
        text = text[:cut]
    elif stops:
        text = text[: max(0, len(text) - (max(map(len, stops)) - 1))]
    if len(text) > req.streamed and req.on_text is not None:
        req.on_text(text[req.streamed :])
        req.streamed = len(text)


class BatchProgress:
    def __init__(self, engine: Decoder, requests: list[EngineRequest]) -> None:
        self.engine = engine
        self.requests = requests
        self.done = [False] * len(requests)
        self.eos = set(engine.eos_ids)

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
