"""The ``ib.generate_group`` task: the jobs of one group message, started together.

The client sends jobs of one queue as one message where that saves the worker's CPU
(dispatcher.grouping). Here they share everything a job costs outside the engine except
its own encoding and result: one message, one Celery task, one round trip for all their
starts (``JobStore.begin_many``), one for the outcomes of the jobs that end together
(``finish_many``), one prefix-hint record. Each job is still its own: its own attempt,
cancel flag, stream, time limit, typed failure and exactly-once outcome, as in
``workers.running.tasks.run_job``.

The message is acked when its last job has ended. A worker that dies before leaves it
unacked: the reaper puts it back, and the next delivery's starts find the jobs that had
finished (their outcomes stay, nothing runs twice); the rest run again, as a single
job's message would. A job that another live worker is running (a duplicate delivery)
is waited for after the others, through ``run_job``'s own wait.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from celery import Celery

from core.celery_app import GENERATE_GROUP_TASK
from core.errors import InvalidMessageError, JobError, JobTimeoutError
from core.jobs import GenerationJob, JobStatus, Selection
from core.records import line_record
from core.store.jobstore import Begin, LineRecord
from workers.engines.base import EngineOutput
from workers.engines.request import EngineRequest
from workers.redelivery.dead_letter import parse_group_arguments
from workers.running.outage import UNREACHABLE, best_effort, until_reachable
from workers.running.tasks import (
    Runtime,
    build_result,
    cancelled_unrun,
    dead_letter,
    engine_failure,
    record_failure,
    run_job,
)

log = logging.getLogger(__name__)

Outcome = tuple[str, JobStatus, dict[str, Any], LineRecord | None]


@dataclass
class _Run:
    """One job of the group that this delivery runs."""

    job: GenerationJob
    selection: Selection
    attempt: int
    cancelled: bool  # while queued: it ends unrun
    request: EngineRequest | None = None
    ended: bool = False


def run_group(rt: Runtime, items: list[tuple[GenerationJob, Selection]]) -> dict[str, int]:
    """Run the group's jobs; returns how many ended how (the outcomes are in the records)."""
    started = time.time()
    first = items[0][0].id
    starts = [(job.id, job.batch_id, rt.cancels.watching(job.id)) for job, _ in items]
    begins: list[Begin] = until_reachable(first, "the group's start", lambda: rt.store.begin_many(starts, rt.worker_id))
    counts: Counter[str] = Counter()
    runs, duplicates = _sort_begins(items, begins, counts)
    log.info("group of %d jobs (%s): running %d", len(items), items[0][1].backend, len(runs))
    _record_hints(rt, [r for r in runs if not r.cancelled])
    try:
        pending = _start(rt, runs, started, counts)
        _wait(rt, pending, started, counts)
    except UNREACHABLE:
        raise  # Redis gone while the worker stops (workers.running.outage): nothing can be written
    except Exception as exc:  # a bug here fails the jobs it left, never loses them
        left = [r for r in runs if not r.ended]
        if left:
            log.exception("group: %d job(s) failed with the group's run", len(left))
            err = engine_failure(rt, exc)
            for run in left:
                _fail(rt, run, err, counts)
        raise
    finally:
        for run in runs:  # each job's watch ends with it; these are what an error left
            rt.cancels.unwatch(run.job.id)
    for job, sel in duplicates:  # rare: another live worker runs it; its outcome is awaited
        try:
            counts[run_job(rt, job, sel).get("status", "completed")] += 1
        except JobError:
            counts["failed"] += 1
    return {"jobs": len(items), **counts}


def _sort_begins(
    items: list[tuple[GenerationJob, Selection]], begins: list[Begin], counts: Counter[str]
) -> tuple[list[_Run], list[tuple[GenerationJob, Selection]]]:
    """The jobs this delivery runs, and the duplicates that another live worker runs; jobs
    an earlier delivery finished are only counted."""
    runs: list[_Run] = []
    duplicates: list[tuple[GenerationJob, Selection]] = []
    for (job, sel), begin in zip(items, begins):
        if begin.running_on is not None:
            duplicates.append((job, sel))
        elif begin.final is not None:
            counts[begin.final[0]] += 1  # finished by an earlier delivery: nothing to run
        else:
            runs.append(_Run(job, sel, begin.attempt, begin.cancelled))
    return runs, duplicates


def _record_hints(rt: Runtime, runs: list[_Run]) -> None:
    """This worker is about to hold these prompts' blocks (one record for the group)."""
    if rt.hints is None:
        return
    hashes = list(dict.fromkeys(h for r in runs for h in r.selection.prefix_hashes))
    if hashes:
        best_effort("prefix hints", lambda: rt.hints.record(rt.worker_id, hashes))


def _start(rt: Runtime, runs: list[_Run], started: float, counts: Counter[str]) -> dict[Future, _Run]:
    """Hand every job to the engine (a job cancelled while queued ends here, unrun)."""
    pending: dict[Future, _Run] = {}
    ended: list[tuple[_Run, EngineOutput]] = []
    for run in runs:
        job = run.job
        rt.cancels.watch(job.id, scope=job.batch_id)
        try:
            if run.cancelled:
                ended.append((run, cancelled_unrun(rt, job)))
                continue
            on_text = _on_text(rt, run)
            run.request = rt.engine.start(job, on_text=on_text)
            pending[run.request.future] = run
        except Exception as exc:  # noqa: BLE001 - the job's typed failure (_typed logs an engine bug)
            _fail(rt, run, _typed(rt, job, exc), counts)
    _conclude(rt, ended, started, counts)
    return pending


def _on_text(rt: Runtime, run: _Run) -> Any:
    streams = rt.streams if run.job.stream else None
    if streams is None:
        return None
    job_id, attempt = run.job.id, run.attempt
    return lambda delta: streams.delta(job_id, delta, attempt)


def _wait(rt: Runtime, pending: dict[Future, _Run], started: float, counts: Counter[str]) -> None:
    """Conclude jobs as they end, those ending together in one write; past the time
    limit (counted from the group's start, when every job was handed over) the jobs
    still running are dropped from the engine and fail with JobTimeoutError."""
    deadline = None if rt.time_limit_s is None else time.monotonic() + rt.time_limit_s
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        if not done:
            limit = rt.time_limit_s or 0.0
            for run in pending.values():
                assert run.request is not None
                run.request.aborted = True
                err = JobTimeoutError(f"job {run.job.id} exceeded the {limit:g} s time limit", {"time_limit_s": limit})
                _fail(rt, run, err, counts)
            return
        ended: list[tuple[_Run, EngineOutput]] = []
        for future in done:
            run = pending.pop(future)
            try:
                ended.append((run, future.result()))
            except Exception as exc:  # noqa: BLE001 - the job's typed failure (_typed logs an engine bug)
                _fail(rt, run, _typed(rt, run.job, exc), counts)
        _conclude(rt, ended, started, counts)


def _conclude(rt: Runtime, ended: list[tuple[_Run, EngineOutput]], started: float, counts: Counter[str]) -> None:
    """Write the outcomes of jobs that ended together, in one round trip."""
    if not ended:
        return
    outcomes: list[Outcome] = []
    for run, out in ended:
        job = run.job
        result = build_result(job, run.selection, out, started, rt.worker_id, run.attempt)
        if job.stream and rt.streams is not None:
            rt.streams.end(job.id, result.status, run.attempt)
        if rt.metrics is not None:
            rt.metrics.observe(result)
        outcomes.append((job.id, result.status, result.model_dump(mode="json"), line_record(job, result)))
    until_reachable(outcomes[0][0], "the group's outcomes", lambda: rt.store.finish_many(outcomes))
    for run, _ in ended:
        run.ended = True
        rt.cancels.unwatch(run.job.id)
    counts.update(status for _, status, _, _ in outcomes)
    # Confirmed held (skipped within the hints' refresh time: a record at the start)
    _record_hints(rt, [run for (run, _), o in zip(ended, outcomes) if o[1] == "completed"])


def _fail(rt: Runtime, run: _Run, exc: JobError, counts: Counter[str]) -> None:
    if run.job.stream and rt.streams is not None:
        rt.streams.end(run.job.id, "failed", run.attempt)
    record_failure(rt, run.job, exc)
    run.ended = True
    rt.cancels.unwatch(run.job.id)
    counts["failed"] += 1


def _typed(rt: Runtime, job: GenerationJob, exc: Exception) -> JobError:
    """A job's failure as its typed error (any engine bug becomes an EngineError)."""
    if isinstance(exc, JobError):
        return exc
    log.error("job %s: engine failure", job.id, exc_info=exc)
    return engine_failure(rt, exc)


def register(app: Celery, rt: Runtime) -> None:
    """Register ``ib.generate_group`` on the worker's app (workers.running.tasks registers the
    single job's task and the broker bookkeeping both share)."""

    def generate_group(task: Any, *args: Any, **kwargs: Any) -> dict:
        try:
            items = parse_group_arguments(args, kwargs)
        except InvalidMessageError as exc:
            dead_letter(rt, task.request, args, kwargs, exc)
            raise
        return run_group(rt, items)  # counts only: what Celery's events (Flower) show of it

    app.task(name=GENERATE_GROUP_TASK, bind=True, typing=False, throws=(JobError,), acks_late=True, ignore_result=True)(
        generate_group
    )
