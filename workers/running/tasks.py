"""The ``ib.generate`` task: one job through the worker's engine, exactly once.

The task checks the job record first (a redelivered job that already finished returns the
stored outcome), marks it running, runs the engine, and writes the one final outcome.
Typed errors (context overflow, engine failure) are recorded and raised; the worker keeps
serving. What a worker process holds (engine, stores, its id) is one Runtime, made at
start-up by workers.worker and handed to ``register``: no module state.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun, task_received

from core.celery_app import GENERATE_TASK, group_members
from core.errors import EngineError, InvalidMessageError, JobError
from core.jobs import Choice, GenerationJob, JobResult, Selection, Timings, ToolCall, Usage
from core.records import line_record
from core.store.dead_letters import DeadLetters
from core.store.hints import PrefixHints
from core.store.jobstore import Begin, JobStore
from core.store.streams import StreamPublisher
from core.tool_calls import read_calls
from workers.engines.base import Engine, EngineOutput
from workers.lifecycle.metrics import WorkerMetrics
from workers.redelivery.dead_letter import dead_letter_task, parse_arguments
from workers.redelivery.inflight import InflightLedger
from workers.redelivery.taken import taken_recorded
from workers.running.cancel_watch import CancelWatcher
from workers.running.outage import best_effort, until_reachable

log = logging.getLogger(__name__)

DUPLICATE_WAIT_S = 2.0  # a duplicate delivery looks again this often whether the first run lives


@dataclass
class Runtime:
    """What a worker process holds, made once by workers.worker before consuming."""

    engine: Engine
    store: JobStore
    redis: redis.Redis
    worker_id: str
    cancels: CancelWatcher
    inflight: InflightLedger  # the messages this worker holds, for the reaper (workers.redelivery.inflight)
    streams: StreamPublisher | None = None  # text deltas of jobs submitted with stream=True
    time_limit_s: float | None = None  # a job running longer fails with JobTimeoutError
    hints: PrefixHints | None = None  # prefix hints: this worker now holds a finished prompt's blocks
    metrics: WorkerMetrics | None = None
    dead_letters: DeadLetters | None = None  # where a message this worker cannot run is kept


def run_job(rt: Runtime, job: GenerationJob, selection: Selection) -> dict:
    started = time.time()
    begin = _begin_or_wait(rt, job)
    if isinstance(begin, dict):  # another delivery's outcome
        return begin
    if begin.final is not None:
        log.info("job %s already finished (%s): returning the recorded outcome", job.id, begin.final[0])
        return _outcome(*begin.final)
    attempt = begin.attempt
    log.info("job %s: model=%s attempt=%d max_tokens=%d", job.id, job.model, attempt, job.sampling.max_tokens)
    if rt.hints is not None and selection.prefix_hashes:
        # This worker is about to hold the prompt's blocks: jobs sharing them that are
        # dispatched from now on come here (confirmed again when the job completes).
        best_effort("prefix hints", lambda: rt.hints.record(rt.worker_id, selection.prefix_hashes))
    out = _generate(rt, job, begin)
    result = build_result(job, selection, out, started, rt.worker_id, attempt)
    payload = result.model_dump(mode="json")
    if rt.metrics is not None:
        rt.metrics.observe(result)
    line = line_record(job, result)
    if not until_reachable(job.id, "its outcome", lambda: rt.store.finish(job.id, result.status, payload, line=line)):
        return _outcome(*until_reachable(job.id, "the read", lambda: rt.store.final(job.id)))  # another finished first
    if rt.hints is not None and selection.prefix_hashes and result.status == "completed":
        best_effort("prefix hints", lambda: rt.hints.record(rt.worker_id, selection.prefix_hashes))
    return payload


def _begin_or_wait(rt: Runtime, job: GenerationJob) -> Begin | dict:
    """This delivery's begin; or, for a duplicate delivery of a job that runs on a live
    worker, that run's outcome once it ends."""
    begin = _begin(rt, job)
    if begin.running_on is not None:
        log.info("job %s runs on %s: this delivery waits for its outcome", job.id, begin.running_on)
    while begin.running_on is not None:
        # A duplicate delivery: the job runs on a live worker. Starting it again would
        # repeat the engine's work and could record an error over the good run (vLLM
        # refuses a request id it already runs), so wait for that run's outcome; if its
        # worker dies meanwhile, the next begin makes this delivery the next attempt.
        if (final := until_reachable(job.id, "the wait", lambda: rt.store.wait(job.id, DUPLICATE_WAIT_S))) is not None:
            return _outcome(*final)
        begin = _begin(rt, job)
    return begin


def _generate(rt: Runtime, job: GenerationJob, begin: Begin) -> EngineOutput:
    """The engine's output for the job (watched for cancels, streamed if asked); a failure
    is recorded as the job's typed error and raised."""
    attempt = begin.attempt
    rt.cancels.watch(job.id, scope=job.batch_id)
    streams = rt.streams if job.stream else None
    status = "failed"
    try:
        if begin.cancelled:  # cancelled while queued: never reaches the model
            out = cancelled_unrun(rt, job)
        else:
            on_text = (lambda delta: streams.delta(job.id, delta, attempt)) if streams else None
            out = rt.engine.generate(job, timeout=rt.time_limit_s, on_text=on_text)
        status = "cancelled" if out.finish_reason == "cancelled" else "completed"
        return out
    except JobError as exc:
        record_failure(rt, job, exc)
        raise
    except Exception as exc:  # any engine bug becomes the job's typed failure
        log.exception("job %s: engine failure", job.id)
        err = engine_failure(rt, exc)
        record_failure(rt, job, err)
        raise err from None
    finally:
        rt.cancels.unwatch(job.id)
        if streams:
            streams.end(job.id, status, attempt)


def cancelled_unrun(rt: Runtime, job: GenerationJob) -> EngineOutput:
    """The output of a job cancelled while queued: no tokens, its prompt counted."""
    return EngineOutput([], "", "cancelled", len(rt.engine.prompt_of(job)), None, time.time())


def engine_failure(rt: Runtime, exc: BaseException) -> EngineError:
    """An engine bug (any exception that is not a JobError) as the job's typed failure."""
    return EngineError(f"{type(exc).__name__}: {exc}", {"backend": rt.engine.backend})


def dead_letter(rt: Runtime, request: Any, args: tuple, kwargs: dict, exc: InvalidMessageError) -> None:
    """Keep a message whose arguments do not validate and fail its jobs
    (workers.redelivery.dead_letter); a reader of their streams stops waiting."""
    if rt.dead_letters is None:
        return
    for failed in dead_letter_task(rt.dead_letters, rt.store, request, args, kwargs, exc):
        if rt.streams is not None:
            rt.streams.end(failed, "failed")


def _begin(rt: Runtime, job: GenerationJob) -> Begin:
    """This delivery's start, waiting out an outage (workers.running.outage): a begin that failed
    would fail the task and ack its message with the job never run."""
    return until_reachable(
        job.id,
        "its start",
        lambda: rt.store.begin(job.id, rt.worker_id, scope=job.batch_id, running_here=rt.cancels.watching(job.id)),
    )


def build_result(
    job: GenerationJob, selection: Selection, out: EngineOutput, started: float, worker: str, attempt: int
) -> JobResult:
    completion_tokens = sum(tokens_of(o) for o in out.choices or [out])
    return JobResult(
        id=job.id,
        status="cancelled" if out.finish_reason == "cancelled" else "completed",
        model=job.model,
        text=out.text,
        token_ids=out.token_ids,
        finish_reason=out.finish_reason,  # type: ignore[arg-type]
        usage=Usage(
            prompt_tokens=out.prompt_tokens, completion_tokens=completion_tokens, cached_tokens=out.cached_tokens
        ),
        timings=Timings(
            submitted=job.submitted_at, started=started, first_token=out.first_token_at, finished=out.finished_at
        ),
        backend=selection.backend,
        worker=worker,
        path=selection.path,
        attempt=attempt,
        batch_id=job.batch_id,
        custom_id=job.custom_id,
        batch_line=job.batch_line,
        speculative=out.speculative,
        logprobs=out.logprobs,
        tool_calls=calls_of(job, out),
        echo_text=out.echo_text,
        prompt_logprobs=out.prompt_logprobs,
        choices=None if out.choices is None else [choice_of(job, i, o) for i, o in enumerate(out.choices)],
    )


def tokens_of(out: EngineOutput) -> int:
    return len(out.token_ids) if out.completion_tokens is None else out.completion_tokens


def choice_of(job: GenerationJob, index: int, out: EngineOutput) -> Choice:
    return Choice(
        index=index,
        text=out.text,
        token_ids=out.token_ids,
        finish_reason=out.finish_reason,  # type: ignore[arg-type]
        logprobs=out.logprobs,
        tool_calls=calls_of(job, out),
    )


def calls_of(job: GenerationJob, out: EngineOutput) -> list[ToolCall] | None:
    """The answer read back as the job's tool calls (None for a job without them)."""
    if job.tool_calling is None or out.finish_reason != "stop":
        return None
    return read_calls(out.text, job.tool_calling, job.id)


def record_failure(rt: Runtime, job: GenerationJob, exc: JobError) -> None:
    if rt.metrics is not None:
        rt.metrics.observe_failure()
    line = line_record(job, exc)
    until_reachable(job.id, "its failure", lambda: rt.store.finish(job.id, "failed", exc.to_dict(), line=line))


def _outcome(status: str, payload: dict) -> dict:
    if status == "failed":
        raise JobError.from_dict(payload)
    return payload


def event_summary(payload: dict) -> dict:
    """What Celery's task events (and so Flower) carry of a result: counts, not the text."""
    usage = payload.get("usage") or {}
    keep = ("status", "backend", "worker", "finish_reason", "batch_id", "custom_id")
    return {
        **{k: payload.get(k) for k in keep if payload.get(k) is not None},
        **{k: usage.get(k, 0) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")},
    }


def register(app: Celery, rt: Runtime, show_text: bool = False) -> None:
    """Register the task and the in-flight bookkeeping on the worker's app.

    The task's return value is only seen by Celery's events (the outcome lives in the job
    record), so it is a summary unless ``show_text`` (``flower.show_text``) is on."""

    def generate(task: Any, *args: Any, **kwargs: Any) -> dict:
        # Any arguments are taken, so a message from another version of the fleet reaches
        # the check below (and the dead-letter list) instead of failing in Celery's call.
        try:
            job, selection = parse_arguments(args, kwargs)
        except InvalidMessageError as exc:
            dead_letter(rt, task.request, args, kwargs, exc)
            raise
        payload = run_job(rt, job, selection)
        return payload if show_text else event_summary(payload)

    app.task(name=GENERATE_TASK, bind=True, typing=False, throws=(JobError,), acks_late=True, ignore_result=True)(
        generate
    )

    @task_received.connect(weak=False)
    def _reserved(request: Any = None, **_: object) -> None:
        # Remember the broker delivery tag: if this process dies, the reaper restores it.
        # The Redis transport wrote it already, with the message's unacked write; otherwise
        # it is queued, written off this (the consumer's) thread.
        if request is not None and not taken_recorded(request.message):
            rt.inflight.add(request.id, request.message.delivery_tag, group_members(request.message.headers))

    @task_postrun.connect(weak=False)
    def _done(task_id: str | None = None, **_: object) -> None:
        if task_id:
            rt.inflight.remove(task_id)
