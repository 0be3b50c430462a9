"""Python client: submit jobs to the fleet, wait for results, cancel.

    from dispatcher.client import Client
    client = Client()                      # REDIS_URL from the environment
    handle = client.submit(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}])
    print(handle.backend, handle.result(timeout=60).text)

Validation, the registry look-up and the decision tree all run here, before anything is
enqueued: a bad job raises a typed JobError and nothing reaches the queue. The client is
a facade over the submitting side's parts (dispatcher.parts): the router decides, the
sender claims and publishes, the job store answers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

from core.errors import JobCancelledError, JobError, JobTimeoutError, UnknownBackendError
from core.fleet import FleetView
from core.jobs import BACKENDS, GenerationJob, JobResult, PathStep, Selection, parse_job, result_of
from core.openai_bodies import default_max_tokens, endpoint_of, parse_request
from core.registry import ModelRegistry
from core.store.streams import read_stream
from dispatcher.batch.api import Batches
from dispatcher.fleet_state import route
from dispatcher.parts import DispatchParts
from dispatcher.routing.affinity import Sent

log = logging.getLogger(__name__)


class JobHandle:
    """What submit returns: where the job went and why, and how to get its result."""

    def __init__(
        self,
        client: Client,
        job_id: str,
        selection: Selection | None,
        streaming: bool | None = None,
        job: GenerationJob | None = None,
    ) -> None:
        self.client = client
        self.id = job_id
        self.selection = selection
        self.streaming = streaming  # submitted with stream=True (None: not known here)
        self.job = job  # as submitted: sent again if its message is lost (Client.resend_if_lost)

    @property
    def backend(self) -> str | None:
        return self.selection.backend if self.selection else None

    @property
    def path(self) -> list[PathStep]:
        return self.selection.path if self.selection else []

    def result(self, timeout: float | None = None, raise_on_cancel: bool = False) -> JobResult:
        """``Client.result``; while it waits, a job whose message was lost on its way to a
        worker (dispatcher.batch.lost_lines) is sent again, every ``client.lost_check_s``."""
        sent = (self.job, self.selection) if self.job is not None and self.selection is not None else None
        return self.client.result(self.id, timeout=timeout, raise_on_cancel=raise_on_cancel, sent=sent)

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """The answer's text as it is generated, in deltas (the job must be submitted with
        ``stream=True``); ends when the job ends. ``result()`` then has the whole answer."""
        if self.streaming is False:
            raise ValueError(f"job {self.id} was submitted without stream=True: use result()")
        return read_stream(self.client.redis, self.id, timeout=timeout)

    def status(self) -> str:
        return self.client.status(self.id)

    def cancel(self) -> None:
        self.client.cancel(self.id)

    def __repr__(self) -> str:
        return f"JobHandle(id={self.id!r}, backend={self.backend!r})"


class Client:
    def __init__(
        self,
        redis_url: str | None = None,
        registry: ModelRegistry | None = None,
        resilient: bool = False,
        retry_s: float | None = None,
    ) -> None:
        """``resilient``: ride out a broker restart (retry with backoff) instead of failing;
        ``retry_s``: for this long (default ``redis.retry_s``)."""
        self.parts = parts = DispatchParts.connect(redis_url, registry, resilient, retry_s)
        self.redis, self.app, self.registry, self.store = parts.redis, parts.app, parts.registry, parts.store
        self.fleet, self.router, self.sender = parts.fleet, parts.router, parts.sender

    @property
    def batches(self) -> Batches:
        """Offline batch jobs (OpenAI Batch JSONL): create, retrieve, list, cancel, results."""
        return self.parts.batches

    # ------------------------------------------------------------- deciding

    def workers(self, max_age_s: float | None = None) -> FleetView:
        """The live fleet, from heartbeats (a snapshot up to the config's ``client.fleet_cache_s`` old)."""
        return self.fleet.view(max_age_s)

    def explain(self, job: GenerationJob | dict[str, Any] | None = None, **fields: Any) -> Selection:
        """The decision for a job, without running it."""
        return self.decide(self._parse(job, fields), self.workers(max_age_s=0))

    def decide(self, job: GenerationJob, fleet: FleetView, sent: Sent | None = None) -> Selection:
        """The tree's backend, then (for backends that keep prompt KV state) the worker for
        its prompt's prefix, on ``fleet``; a refused job raises its JobError."""
        outcome = self.decide_each([job], fleet, sent)[0]
        if isinstance(outcome, JobError):
            raise outcome
        return outcome

    def decide_each(
        self, jobs: list[GenerationJob], fleet: FleetView, sent: Sent | None = None
    ) -> list[Selection | JobError]:
        """``decide`` for the jobs of one dispatch, in order, a refused job's error in its place."""
        return route(self.router, self.fleet, jobs, fleet, sent)

    @staticmethod
    def _parse(job: GenerationJob | dict[str, Any] | None, fields: dict[str, Any]) -> GenerationJob:
        raw = job if job is not None else fields
        backend = raw.get("backend") if isinstance(raw, dict) else None
        if isinstance(backend, str) and backend not in BACKENDS:
            raise UnknownBackendError(
                f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}", {"known": list(BACKENDS)}
            )
        return parse_job(raw)

    # ------------------------------------------------------------- submitting

    def submit(self, job: GenerationJob | dict[str, Any] | None = None, **fields: Any) -> JobHandle:
        return self.submit_many([self._parse(job, fields)])[0]

    def create(self, body: dict[str, Any], url: str | None = None, max_tokens: int | None = None) -> JobHandle:
        """Submit an OpenAI chat or text completion body (``url``: its endpoint; by default
        chat if it has messages), read exactly as ``ib serve`` and a batch line read it:
        OpenAI's defaults (temperature 1), vLLM's extensions, the same refusals
        (JobValidationError naming the field). ``max_tokens``: what a body that names none
        gets (None: ``gateway.default_max_tokens``, as over HTTP).
        ``core.records.response_body(handle.result(), url)`` is the OpenAI response."""
        job = parse_request(url or endpoint_of(body), body).to_job(max_tokens or default_max_tokens())
        return self.submit(job)

    def submit_many(self, jobs: Iterable[GenerationJob | dict[str, Any]]) -> list[JobHandle]:
        """Validate and decide every job first (one fleet view); enqueue only if all pass.

        Jobs whose push finds the fleet changed since the view was read are decided again
        on a fresh read and sent then; if that decision refuses one, the error is raised
        with the others already sent."""
        parsed = [self._parse(j, {}) for j in jobs]
        fleet, aged = self.fleet.for_submit()
        try:
            selections = self._decide_all(parsed, fleet)
        except JobError:
            if not aged:
                raise
            fleet = self.workers(max_age_s=0)  # the refusal may be the old view's
            selections = self._decide_all(parsed, fleet)
        pairs = list(zip(parsed, selections))
        changed = self.sender.enqueue(pairs, fleet=fleet)
        if changed:
            fresh = self.workers(max_age_s=0)
            again = dict(zip((j.id for j, _ in changed), self._decide_all([j for j, _ in changed], fresh)))
            self.sender.enqueue([(j, again[j.id]) for j, _ in changed])  # no premise: a send after a read
            pairs = [(j, again.get(j.id, s)) for j, s in pairs]
        return [JobHandle(self, job.id, sel, job.stream, job) for job, sel in pairs]

    def _decide_all(self, jobs: list[GenerationJob], fleet: FleetView) -> list[Selection]:
        """Every job's decision, or the first refusal raised."""
        outcomes = self.decide_each(jobs, fleet)
        refused = next((o for o in outcomes if isinstance(o, JobError)), None)
        if refused is not None:
            raise refused
        return [o for o in outcomes if isinstance(o, Selection)]

    def enqueue(self, pairs: list[tuple[GenerationJob, Selection]]) -> None:
        """Send jobs already decided (a known id is never sent twice): a test's or a
        tool's way to put a job on a queue of its choosing."""
        self.sender.enqueue(pairs)

    # ------------------------------------------------------------- results

    def result(
        self,
        job_id: str,
        timeout: float | None = None,
        raise_on_cancel: bool = False,
        sent: tuple[GenerationJob, Selection] | None = None,
    ) -> JobResult:
        """Wait for the job; raises its typed JobError if it failed, JobTimeoutError if slow
        (``timeout`` None: ``client.result_timeout_s``, two hours; ``math.inf``: for ever),
        UnknownJobError if its record is gone (expired: no outcome will come). ``sent``:
        the job as sent and its decision, to send it again if its message is lost on its
        way to a worker (checked every ``client.lost_check_s``: ``resend_if_lost``).

        A cancelled job returns its partial result (status ``cancelled``), or with
        ``raise_on_cancel`` raises JobCancelledError carrying that result in ``details``."""
        if timeout is None:
            timeout = self.parts.result_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            wait = min(remaining, self.parts.lost_check_s) if sent is not None else remaining
            final = self.store.wait(job_id, timeout=None if math.isinf(wait) else max(wait, 0.0))
            if final is not None:
                break
            if time.monotonic() >= deadline:
                raise JobTimeoutError(f"job {job_id} not finished after {timeout} s", {"job_id": job_id})
            if sent is not None:
                self.resend_if_lost(*sent)
        status, payload = final
        if status == "cancelled" and raise_on_cancel:
            raise JobCancelledError(f"job {job_id} was cancelled", {"result": payload})
        return result_of(status, payload)

    def resend_if_lost(self, job: GenerationJob, selection: Selection) -> bool:
        """Send ``job`` again if it is still queued and its message is in no queue and no
        unacked set: a worker killed between the broker's pop and its record took it
        (dispatcher.batch.lost_lines). A message that was in fact still in a worker's hand
        is answered once all the same: the job record lets one delivery run it."""
        record = self.store.get(job.id)
        queue = record.get("queue")
        if record.get("status") != "queued" or not queue or not self.parts.lost_jobs.missing({job.id: queue}):
            return False
        log.warning("job %s: its message is in no queue and held by no worker: sent again", job.id)
        self.sender.resend([(job, selection)])
        return True

    def status(self, job_id: str) -> str:
        """queued | running | completed | failed | cancelled | unknown"""
        return self.store.get(job_id).get("status", "unknown")

    def record(self, job_id: str) -> dict[str, str]:
        return self.store.get(job_id)

    def cancel(self, job_id: str) -> None:
        """Cooperative: the engine sees the flag between decoding steps and ends the job
        with status cancelled and the tokens so far; a job still queued ends at pickup."""
        self.store.request_cancel(job_id)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
