"""The sender: claim each job's record and publish its message, a job never sent twice.

On the fleet's Redis transport a message's record claim and its decision's premise run
in its push (dispatcher.push_guard: one script per message, all in one round trip), so
neither costs a round trip of its own and a record exists exactly where a message was
pushed; elsewhere (RabbitMQ, and the batch feeder's resumable sends) the claim is a
round trip of its own before the publish. Jobs of one queue may share a message
(dispatcher.grouping); what a message carries is dispatcher.messages'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

from core.errors import EnqueueError
from core.fleet import FleetView
from core.jobs import GenerationJob, Priority, Selection
from core.settings import CelerySettings
from core.store import job_scripts, keys
from core.store.hints import PrefixHints
from core.store.jobstore import JobStore
from dispatcher.grouping import group_sends, units_id
from dispatcher.messages import Pair, Publisher
from dispatcher.push_guard import PushGuard


class Sender:
    def __init__(
        self,
        publisher: Publisher,
        store: JobStore,
        hints: PrefixHints | None,
        celery: CelerySettings,
        last_view: Callable[[], FleetView | None],
        checks_premise: bool,
    ) -> None:
        """``celery``: how many jobs a message may carry, on which backends;
        ``last_view``: the fleet view read last (a queue's readers, for grouping);
        ``checks_premise``: the broker's pushes can be guarded (dispatcher.push_guard), so
        the fleet's own Redis transport carries the messages."""
        self.publisher = publisher
        self.app: Celery = publisher.app
        self.store = store
        self.hints = hints
        self.group_jobs = celery.group_jobs  # jobs per message at most (dispatcher.grouping)
        self.group_backends = celery.group_backends
        self.last_view = last_view
        self.levels = {p.value: publisher.priorities.level(p.value) for p in Priority}
        self.checks_premise = checks_premise

    def enqueue(self, pairs: list[Pair], resume: bool = False, fleet: FleetView | None = None) -> list[Pair]:
        """Create the job records and send the new jobs (a known id is never sent twice).
        ``fleet``: the view the jobs were decided on; where the broker can check it in the
        push, jobs it no longer describes are not sent but returned, to decide again.

        ``resume`` (the batch feeder): also send jobs whose record exists but was never
        marked sent (a feeder died between the two), and mark what was sent."""
        if not pairs:
            return []
        changed: list[Pair] = []
        with self.app.producer_or_acquire() as producer:
            if not resume and hasattr(producer.channel, "guard_push"):
                sent, changed = self._claim_in_push(pairs, producer, fleet)
            else:
                sent = self._claim_then_publish(pairs, producer, resume, fleet)
        if self.hints is not None and any(sel.affinity_worker for _, sel in sent):
            pipe = self.store.r.pipeline(transaction=False)
            for _, sel in sent:
                if sel.affinity_worker:  # sent to that worker: it will hold these blocks
                    self.hints.record(sel.affinity_worker, sel.prefix_hashes, client=pipe)
            pipe.execute()
        return changed

    def resend(self, pairs: list[Pair]) -> None:
        """Send jobs whose record exists again, without a claim: their message was lost
        with a worker that died taking it (dispatcher.batch.lost_lines). A second message
        for a job that is in fact still on its way is answered once: the job record lets
        one delivery run it."""
        with self.app.producer_or_acquire() as producer:
            for job, sel in pairs:
                self.publisher.job(job, sel, producer)

    def _claim_in_push(
        self, pairs: list[Pair], producer: Any, fleet: FleetView | None, group_jobs: int | None = None
    ) -> tuple[list[Pair], list[Pair]]:
        """Each message's record claims and its decision's premise run in its push, also
        when some pushes fail. Jobs of one queue may share a message (``group_jobs``: at
        most this many, the config's if None). Returns (the jobs sent, those whose fleet
        changed)."""
        channel = producer.channel
        premise, epoch = fleet.premise() if fleet is not None else ([keys.FLEET_EPOCH], "")
        readers = fleet or self.last_view()  # a send after a fresh read carries no premise, but has a view
        units = group_sends(pairs, readers, group_jobs or self.group_jobs, self.group_backends, self.levels)
        unit_ids = [units_id(unit) for unit in units]
        try:
            for unit_id, unit in zip(unit_ids, units):
                channel.guard_push(unit_id, self._claim_guard(unit, premise, epoch))
                self.publisher.unit(unit_id, unit, producer, declare=[])
            replies = channel.push_held()
        finally:
            unused = channel.drop_guards(unit_ids)
        if unused:  # published without its guard's script: kombu changed how it pushes
            raise RuntimeError(f"messages {unused} were published without their record claim")
        # one held push per unit, in order (by position: a repeated job id repeats its unit's id)
        answers = [reply for _, reply in replies]
        _raise_failed(units, answers, len(pairs))
        sent, changed, known = [], [], []
        for unit, reply in zip(units, answers):
            (sent if reply == 1 else changed if reply == -1 else known if len(unit) > 1 else []).extend(unit)
        if known:  # a group with an id already known: its jobs one by one, the known ones skipped
            more_sent, more_changed = self._claim_in_push(known, producer, fleet, group_jobs=1)
            sent += more_sent
            changed += more_changed
        return sent, changed

    def _claim_guard(self, unit: list[Pair], premise: list[str], epoch: str) -> PushGuard:
        """The push guard of one message: one job's claim, or a group's (all or none)."""
        if len(unit) == 1:
            job, sel = unit[0]
            record, args = self.store.claim_call(job.id, _record_fields(job, sel))
            return PushGuard(job_scripts.CLAIM_AND_PUSH, [*record, *premise], [epoch, *args])
        records = [(job.id, _record_fields(job, sel)) for job, sel in unit]
        group_keys, args = self.store.group_claim_call(records, premise, epoch)
        return PushGuard(job_scripts.CLAIM_GROUP_AND_PUSH, group_keys, args)

    def _claim_then_publish(
        self, pairs: list[Pair], producer: Any, resume: bool, fleet: FleetView | None
    ) -> list[Pair]:
        """The claim in a round trip of its own, then the new jobs' messages (RabbitMQ;
        the batch feeder, which also sends claimed jobs a dead feeder never sent). On the
        Redis broker jobs of one queue share messages as in a submit (dispatcher.grouping;
        the readers of a queue counted on ``fleet``, else on the last view read)."""
        fresh = self.store.claim([(j.id, _record_fields(j, s)) for j, s in pairs])
        todo = [pair for pair, new in zip(pairs, fresh) if new]
        if resume and not all(fresh):
            known = [pair for pair, new in zip(pairs, fresh) if not new]
            todo += [pair for pair, unsent in zip(known, self.store.unsent([j.id for j, _ in known])) if unsent]
        # Only through this fleet's Redis transport, whose worker side counts a group as its
        # jobs against the prefetch limit (RabbitMQ's and kombu's own count messages).
        group_jobs = self.group_jobs if self.checks_premise else 1
        units = group_sends(todo, fleet or self.last_view(), group_jobs, self.group_backends, self.levels)
        try:
            with producer.batch():
                for unit in units:
                    self.publisher.unit(units_id(unit), unit, producer)
        except Exception:
            if not resume:  # the caller gets the error: resubmitting these jobs must work
                created = {j.id for (j, _), new in zip(pairs, fresh) if new}
                self.store.release([j.id for j, _ in todo if j.id in created])
            raise  # resume: the records stay unmarked, so the next feed sends them
        if resume:
            self.store.mark_sent([j.id for j, _ in todo])
        return todo


def _record_fields(job: GenerationJob, sel: Selection) -> dict[str, Any]:
    return {"model": job.model, "backend": sel.backend, "queue": sel.queue, "submitted_at": job.submitted_at}


def _raise_failed(units: list[list[Pair]], answers: list[Any], total: int) -> None:
    """EnqueueError if some pushes failed in Redis, naming the jobs sent and those not."""
    failed = {
        job.id: str(reply) for unit, reply in zip(units, answers) if isinstance(reply, Exception) for job, _ in unit
    }
    if failed:
        sent = [job.id for unit, reply in zip(units, answers) if reply == 1 for job, _ in unit]
        raise EnqueueError(
            f"{len(failed)} of {total} jobs were not enqueued ({next(iter(failed.values()))}); "
            "the others were: submit the same ids again to send only the missing ones",
            {"sent": sent, "not_sent": failed},
        )
