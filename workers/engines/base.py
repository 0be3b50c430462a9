"""The one engine interface every backend implements.

A worker process holds one Engine, loaded once at start. Celery task threads call
``generate(job)``; the engine's own scheduler (static / dynamic / continuous batching)
decides how jobs share the hardware. Cancellation is cooperative: the engine asks
``cancel_source`` between decoding steps which of its running jobs were cancelled.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import numpy as np

from core.backends import BackendSpec, SpeculativeConfig
from core.errors import EngineError, JobTimeoutError, JobValidationError, UnsupportedByBackendError
from core.jobs import SEED_MAX, GenerationJob, check_context
from core.registry import ModelSpec
from workers.engines.decoding import stop_cut
from workers.engines.prefix_cache import common_prefix_len
from workers.engines.request import CancelSource, EngineOutput, EngineRequest, never_cancelled

log = logging.getLogger(__name__)


def speculative_counts(r: EngineRequest, method: str) -> dict[str, Any]:
    """What a speculative job's result says of its run: target passes, tokens accepted
    beyond one a pass, and tokens drafted where the engine knows it."""
    return {
        "method": method,
        "target_passes": r.target_passes,
        "accepted_tokens": max(0, len(r.tokens) - r.target_passes),
        "drafted_tokens": r.drafted_tokens,
    }


class ModelArtifactError(ValueError):
    """A model artifact exists but cannot be what the engine needs (wrong file type)."""


SpecT = TypeVar("SpecT", bound=BackendSpec)


class Engine(ABC, Generic[SpecT]):
    """``config`` is the backend's typed spec (config/backends.yaml) with what the worker
    filled in at start (device, format, max_model_len)."""

    backend: str = ""

    def __init__(
        self,
        model: ModelSpec,
        config: SpecT,
        threads: int,
        cancel_source: CancelSource = never_cancelled,
    ) -> None:
        self.model = model
        self.config = config
        self.threads = threads
        self.cancel_source = cancel_source
        self.max_model_len = config.max_model_len or model.context_length
        self._in_flight = 0
        self._lock = threading.Lock()

    # ---------------------------------------------------------- lifecycle

    @abstractmethod
    def load(self) -> None:
        """Load weights and start the scheduler. Called once per worker process."""

    def close(self) -> None:
        """Stop the scheduler and free the model."""

    @property
    def capacity(self) -> int:
        """How many jobs the engine wants in flight at once (the worker's concurrency)."""
        return 1

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "model": self.model.name, "max_model_len": self.max_model_len}

    def stats(self) -> dict[str, Any]:
        """The engine's own counters, published in the worker's heartbeat."""
        return {}

    # ---------------------------------------------------------- requests

    @abstractmethod
    def encode(self, job: GenerationJob) -> list[int]:
        """The job's prompt (chat template applied to messages) as token ids."""

    @abstractmethod
    def submit(self, request: EngineRequest) -> None:
        """Hand a request to the scheduler; it completes ``request.future``."""

    @abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Generated token ids as text (special tokens skipped)."""

    eos_ids: list[int] = []

    def deliver(self, r: EngineRequest) -> None:
        """Complete a request with its text: EOS dropped, cut at the first stop string."""
        text = self.decode([t for t in r.tokens if t not in self.eos_ids])
        cut = stop_cut(text, r.sampling)
        text = text if cut is None else text[:cut]
        if r.on_text is not None and len(text) > r.streamed:
            r.on_text(text[r.streamed :])  # what streaming held back
            r.streamed = len(text)
        r.future.set_result(
            EngineOutput(
                token_ids=list(r.tokens),
                text=text,
                finish_reason=r.finish_reason or "length",
                prompt_tokens=len(r.prompt_ids),
                first_token_at=r.first_token_at,
                finished_at=time.time(),
                cached_tokens=r.cached_tokens,
                speculative=None if r.speculative is None else speculative_counts(r, r.speculative.method),
                logprobs=r.logprobs,
                prompt_logprobs=r.prompt_logprobs,
                echo_text=self.decode(r.prompt_ids) if r.echo else None,
            )
        )

    def drop_cancelled(self, batch: list[EngineRequest]) -> list[EngineRequest]:
        """Answer the requests cancelled (or given up on) while they waited for a batch;
        returns the rest."""
        cancelled = self.cancelled([r.job_id for r in batch])
        for r in batch:
            if r.job_id in cancelled or r.aborted:
                r.finish_reason = "cancelled"
                self.deliver(r)
        return [r for r in batch if not r.future.done()]

    supports_speculative = False  # engines that verify drafted tokens set this

    def speculative_for(self, job: GenerationJob) -> SpeculativeConfig | None:
        """The engine's speculative config if it applies: the engine verifies drafts, the
        job did not opt out (and asked, unless the config is on by default), greedy."""
        cfg = self.config.speculative
        if cfg is None or not self.supports_speculative or job.speculative is False or not job.sampling.greedy:
            return None
        if job.sampling.shapes_logits or job.sampling.logprobs is not None:  # each draft would need them
            return None
        return cfg if (job.speculative or cfg.by_default) else None

    def check_context(self, job: GenerationJob, prompt_ids: list[int]) -> None:
        check_context(job, len(prompt_ids), self.max_model_len)  # the submit-time check's rule, as the last guard

    def generate(
        self, job: GenerationJob, timeout: float | None = None, on_text: Callable[[str], None] | None = None
    ) -> EngineOutput:
        """Run one job to completion (blocking the calling task thread); past ``timeout``
        the job is dropped from the engine and JobTimeoutError raised. ``on_text`` gets
        the text as it is generated, in deltas."""
        requests = self.requests_for(job, on_text)
        with self.counted_in_flight():
            for request in requests:
                self.submit(request)
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                outs = [
                    r.future.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                    for r in requests
                ]
            except FutureTimeout:
                for r in requests:
                    r.aborted = True
                raise JobTimeoutError(
                    f"job {job.id} exceeded the {timeout:g} s time limit", {"time_limit_s": timeout}
                ) from None
        if len(outs) > 1:
            outs[0].choices = outs
        return outs[0]

    def requests_for(self, job: GenerationJob, on_text: Callable[[str], None] | None = None) -> list[EngineRequest]:
        """The job's requests: one, or one per answer when it asks for n (each its own
        seed, seed + i, when it gives one). The engine runs them as any requests: those
        that keep prefixes evaluate the shared prompt once (llama.cpp holds the others
        back until the first's prompt state is saved, then loads it)."""
        s = job.sampling
        if s.n == 1:
            return [self.request_for(job, on_text)]
        requests = []
        for i in range(s.n):
            seed = None if s.seed is None else (s.seed + i) % (SEED_MAX + 1)
            one = job.model_copy(update={"sampling": s.model_copy(update={"n": 1, "seed": seed})})
            request = self.request_for(one, on_text if i == 0 else None)
            request.index = i
            requests.append(request)
        return requests

    def request_for(self, job: GenerationJob, on_text: Callable[[str], None] | None = None) -> EngineRequest:
        """The job as the scheduler's request: its prompt encoded and checked against the
        window (JobError if it does not fit)."""
        missing = self.config.lacks(job.sampling.features())
        if missing:  # the dispatcher routes around this; a job sent here by hand is refused
            raise UnsupportedByBackendError(
                f"{self.backend} does not serve {', '.join(missing)}", {"backend": self.backend, "unsupported": missing}
            )
        prompt_ids = self.prompt_of(job)
        self.check_context(job, prompt_ids)
        return EngineRequest(
            job_id=job.id,
            prompt_ids=prompt_ids,
            sampling=job.sampling,
            on_text=on_text,
            speculative=self.speculative_for(job),
            echo=job.echo,
            logprobs=None if job.sampling.logprobs is None else [],
            prompt_logprobs=None if job.sampling.prompt_logprobs is None else [None],
            cache_salt=job.cache_salt,
            public_tokens=self.public_tokens(job, prompt_ids),
        )

    def public_tokens(self, job: GenerationJob, prompt_ids: list[int]) -> int:
        """Leading prompt tokens of the job's public messages (core.tenancy): those of the
        shared messages rendered alone, as far as they agree with the whole prompt's."""
        if not job.public_messages or job.messages is None or job.cache_salt is None:
            return 0
        alone = self.encode(job.model_copy(update={"messages": job.messages[: job.public_messages]}))
        return common_prefix_len(np.asarray(alone), np.asarray(prompt_ids))

    @property
    def vocab_size(self) -> int | None:
        """Token ids this model has (None: the engine cannot say; its server checks)."""
        return None

    def prompt_of(self, job: GenerationJob) -> list[int]:
        """The job's prompt ids: encoded, or as given (checked against the vocabulary: an id
        past it would fail the whole batch it joins, not just this job)."""
        if job.prompt_ids is None:
            return self.encode(job)
        size = self.vocab_size
        if size is not None and max(job.prompt_ids) >= size:
            raise JobValidationError(
                f"prompt: token id {max(job.prompt_ids)} is not in this model's vocabulary ({size} tokens)",
                {"errors": [{"field": "prompt", "message": "token id out of range"}]},
            )
        return list(job.prompt_ids)

    def start(self, job: GenerationJob, on_text: Callable[[str], None] | None = None) -> EngineRequest:
        """Hand one job to the scheduler without waiting for it (the jobs of a group
        message start together: workers.running.group). It counts as in flight until its future
        completes; the caller waits on ``request.future`` and sets ``aborted`` to give up."""
        if job.sampling.n > 1:  # the dispatcher sends such a job alone (dispatcher.grouping)
            raise EngineError(f"job {job.id} asks for n={job.sampling.n}: it runs alone, not in a group")
        request = self.request_for(job, on_text)
        with self._lock:
            self._in_flight += 1
        request.future.add_done_callback(self._ended)
        try:
            self.submit(request)
        except BaseException as exc:
            if not request.future.done():
                request.future.set_exception(exc)
            raise
        return request

    def _ended(self, _future: Any) -> None:
        with self._lock:
            self._in_flight -= 1

    @contextmanager
    def counted_in_flight(self) -> Iterator[None]:
        """Count a job as in flight (the heartbeat's load figure) while the block runs."""
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def cancelled(self, job_ids: list[str]) -> set[str]:
        """Ask the cancel source; a broken source (Redis blip) cancels nothing."""
        try:
            return self.cancel_source(job_ids) if job_ids else set()
        except Exception:
            log.warning("cancel check failed; continuing", exc_info=True)
            return set()
