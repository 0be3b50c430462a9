"""Python client: submit jobs to the fleet, wait for results, cancel.

    from dispatcher.client import Client
    client = Client()                      # REDIS_URL from the environment
    handle = client.submit(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}])
    print(handle.backend, handle.result(timeout=60).text)

Validation, the registry look-up and the decision tree all run here, before anything is
enqueued: a bad job raises a typed JobError and nothing reaches the queue.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import Any, NamedTuple

from dispatcher import connection, settings
from dispatcher.batch.api import Batches
from dispatcher.broker_transport import GROUP_HEADER, PushGuard
from dispatcher.celery_app import (
    GENERATE_GROUP_TASK,
    GENERATE_TASK,
    BrokerNotConfigured,
    get_app,
    message_priority,
    queued,
)
from dispatcher.fleet import FleetView, read_fleet
from dispatcher.grouping import group_sends, units_id
from dispatcher.jobs import (
    BACKENDS,
    EnqueueError,
    GenerationJob,
    JobCancelledError,
    JobError,
    JobResult,
    JobTimeoutError,
    PathStep,
    Priority,
    Selection,
    UnknownBackendError,
    check_context,
    parse_job,
    result_of,
)
from dispatcher.registry import LiveRegistry, ModelRegistry, load_backends
from dispatcher.routing import profiles
from dispatcher.routing.context import might_overflow, serving_window
from dispatcher.routing.decision import Sent, apply_affinity, cap_affinity, decide
from dispatcher.routing.prefix import PrefixHasher
from dispatcher.store import keys
from dispatcher.store.hints import Lookup, PrefixHints
from dispatcher.store.jobstore import JobStore
from dispatcher.store.streams import read_stream


class _Plan(NamedTuple):
    """A job's decision before prefix affinity: the tree's selection, the prompt's block
    hashes where affinity applies (None: it does not), the live workers it may go to."""

    selection: Selection
    hashes: list[str] | None
    live: list[str]


class JobHandle:
    """What submit returns: where the job went and why, and how to get its result."""

    def __init__(self, client: Client, job_id: str, selection: Selection | None, streaming: bool | None = None) -> None:
        self.client = client
        self.id = job_id
        self.selection = selection
        self.streaming = streaming  # submitted with stream=True (None: not known here)

    @property
    def backend(self) -> str | None:
        return self.selection.backend if self.selection else None

    @property
    def path(self) -> list[PathStep]:
        return self.selection.path if self.selection else []

    def result(self, timeout: float | None = None, raise_on_cancel: bool = False) -> JobResult:
        return self.client.result(self.id, timeout=timeout, raise_on_cancel=raise_on_cancel)

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
        self, redis_url: str | None = None, registry: ModelRegistry | None = None, resilient: bool = False
    ) -> None:
        """``resilient``: ride out a broker restart (retry with backoff) instead of failing."""
        # REDIS_PASSWORD applies to a given URL too
        url = connection.with_password(redis_url) if redis_url else connection.redis_url()
        if not url:
            raise BrokerNotConfigured("no broker configured: pass redis_url or set REDIS_URL")
        self.redis = connection.redis_client(url, resilient=resilient)
        self.app = get_app(url)
        self.registry = registry or LiveRegistry()  # picks up `ib models add` while it runs
        cfg = settings.fleet_config()
        self.policy = cfg.decision
        self.backends = load_backends()
        self.priorities = cfg.priorities
        self.show_text = cfg.flower.show_text
        # Prefix affinity sends to workers' own queues, which the reaper sweeps to the shared
        # queue when a worker dies: Redis lists only. With RabbitMQ jobs use the shared queues.
        self.own_queues = connection.is_redis_broker(self.app.conf.broker_url)
        self.store = JobStore(self.redis, ttl_s=cfg.celery.result_expires_s)
        self.fleet_cache_s = cfg.client.fleet_cache_s
        self.fleet_stale_s = max(cfg.client.fleet_stale_s, self.fleet_cache_s)
        with self.app.connection_for_write() as conn:  # the transport's class: no connection made
            self.checks_premise = hasattr(getattr(conn.transport, "Channel", None), "guard_push")
        # The model's tokenizer counts prompts at submit (context overflow) and hashes their
        # blocks (prefix affinity): one per client, each model's loaded once.
        self.tokens = PrefixHasher(cfg.prefix.block_tokens, cfg.prefix.max_blocks)
        self.hints = (
            PrefixHints(self.redis, cfg.prefix.hint_ttl_s, cfg.prefix.max_worker_blocks) if cfg.prefix.enabled else None
        )
        self._fleet: tuple[float, FleetView] | None = None
        self.profile = profiles.load() if self.policy.policy == "profile" else None
        self.group_jobs = cfg.celery.group_jobs  # jobs per message at most (dispatcher.grouping)
        self.group_backends = cfg.celery.group_backends
        self.levels = {p.value: self.priorities.level(p.value) for p in Priority}

    @cached_property
    def batches(self) -> Batches:
        """Offline batch jobs (OpenAI Batch JSONL): create, retrieve, list, cancel, results."""
        return Batches(self.redis, self.registry, self.store, self.tokens)

    # ------------------------------------------------------------- deciding

    def workers(self, max_age_s: float | None = None) -> FleetView:
        """The live fleet. Submissions reuse a snapshot up to ``fleet_cache_s`` old (far
        below the heartbeat TTL), which saves two round trips per submit."""
        max_age = self.fleet_cache_s if max_age_s is None else max_age_s
        if self._fleet is None or time.monotonic() - self._fleet[0] > max_age:
            self._fleet = (time.monotonic(), read_fleet(self.redis))
        return self._fleet[1]

    def _last_view(self) -> FleetView | None:
        """The fleet view read last, whatever its age (how many workers read a queue, for
        grouping: dispatcher.grouping); None before the first read."""
        return self._fleet[1] if self._fleet is not None else None

    def _view_for_submit(self) -> tuple[FleetView, bool]:
        """The view a submit decides on, and whether it is older than ``fleet_cache_s``.
        With a broker that checks a decision's premise in the push (the Redis transport:
        the fleet epoch is unchanged and every worker in the view still beats), a cached
        view up to ``fleet_stale_s`` old is as good as a fresh read, and costs none."""
        max_age = self.fleet_stale_s if self.checks_premise else self.fleet_cache_s
        if self._fleet is not None:
            age = time.monotonic() - self._fleet[0]
            if age <= max_age:
                return self._fleet[1], age > self.fleet_cache_s
        return self.workers(max_age_s=0), False

    def explain(self, job: GenerationJob | dict[str, Any] | None = None, **fields: Any) -> Selection:
        """The decision for a job, without running it."""
        return self.decide(self._parse(job, fields), self.workers(max_age_s=0))

    def _parse(self, job: GenerationJob | dict[str, Any] | None, fields: dict[str, Any]) -> GenerationJob:
        raw = job if job is not None else fields
        backend = raw.get("backend") if isinstance(raw, dict) else None
        if isinstance(backend, str) and backend not in BACKENDS:
            raise UnknownBackendError(
                f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}", {"known": list(BACKENDS)}
            )
        return parse_job(raw)

    def decide(self, job: GenerationJob, fleet: FleetView, sent: Sent | None = None) -> Selection:
        """The tree's backend, then (for backends that keep prompt KV state) the worker
        for its prompt's prefix (apply_affinity: the blocks each worker holds and its
        load, read live in one Redis round trip). ``sent``: what this dispatch has sent
        so far, counted in; a job sent to a worker here is added to it."""
        outcome = self.decide_each([job], fleet, sent)[0]
        if isinstance(outcome, JobError):
            raise outcome
        return outcome

    def decide_each(
        self, jobs: list[GenerationJob], fleet: FleetView, sent: Sent | None = None
    ) -> list[Selection | JobError]:
        """``decide`` for the jobs of one dispatch, in order, a refused job's error in its
        place. The prefix hints of all of them are read in one round trip (one per job
        was 64 round trips of a 64-job submit), each worker's own queue's depth once;
        the decisions are still made one after another, each counting the ones before
        (``sent``): the hints in Redis change only once the dispatch has sent."""
        sent = Sent() if sent is None else sent
        plans: list[_Plan | JobError] = []
        for job in jobs:
            try:
                plans.append(self._plan(job, fleet))
            except JobError as exc:
                plans.append(exc)
        asks = [p for p in plans if isinstance(p, _Plan) and p.hashes is not None]
        found = iter(self.hints.lookup_many([(p.hashes or [], p.live) for p in asks]) if self.hints and asks else [])
        depths: dict[str, int] = {}  # an own queue's waiting jobs, read at its first use
        return [
            plan
            if isinstance(plan, JobError)
            else plan.selection
            if plan.hashes is None
            else self._affine(plan, next(found), fleet, sent, depths)
            for plan in plans
        ]

    def _plan(self, job: GenerationJob, fleet: FleetView) -> _Plan:
        """The tree's decision, the context check, and the prompt's block hashes where
        prefix affinity applies (None: it does not)."""
        model = self.registry.get(job.model)
        sel = decide(job, model, fleet, self.policy, self.backends, self.profile)
        window = serving_window(model, sel.config)
        affinity = self.hints is not None and self.own_queues and sel.backend in self.policy.prefix_affinity_backends
        ids = self.tokens.prompt_ids(job, model) if affinity or might_overflow(job, window) else None
        if ids is not None:  # refused here, not after a trip through a queue to a worker
            check_context(job, len(ids), window)
        if not affinity:
            return _Plan(sel, None, [])
        hashes = self.tokens.hashes(job, model, self.backends[sel.backend].prefix_block_tokens, ids=ids)
        return _Plan(sel, hashes, [w.worker_id for w in fleet.live(backend=sel.backend, model=sel.model)])

    def _affine(self, plan: _Plan, found: Lookup, fleet: FleetView, sent: Sent, depths: dict[str, int]) -> Selection:
        """Prefix affinity on what the hints say (``found``) and what this dispatch sent."""
        hashes = plan.hashes or []
        fleet = fleet.with_in_flight({w: n + sent.jobs[w] for w, n in found.in_flight.items()})
        cached = {w: n + sent.blocks[w] for w, n in found.cached.items()}
        sel = apply_affinity(plan.selection, hashes, found.matched, fleet, self.policy, cached)
        if sel.affinity_worker is None:
            return sel
        holder = next((w for w in fleet.workers if w.worker_id == sel.affinity_worker), None)
        if sel.queue not in depths:
            depths[sel.queue] = queued(self.redis, sel.queue, self.priorities.steps())
        waiting = depths[sel.queue] + sent.jobs[sel.affinity_worker]
        sel = cap_affinity(sel, waiting, holder.capacity if holder else 1, self.policy)
        if sel.affinity_worker:  # it will hold the blocks it lacked: the next decisions count them
            sent.jobs[sel.affinity_worker] += 1
            sent.blocks[sel.affinity_worker] += len(hashes) - found.matched.get(sel.affinity_worker, 0)
        return sel

    # ------------------------------------------------------------- submitting

    def submit(self, job: GenerationJob | dict[str, Any] | None = None, **fields: Any) -> JobHandle:
        return self.submit_many([self._parse(job, fields)])[0]

    def submit_many(self, jobs: Iterable[GenerationJob | dict[str, Any]]) -> list[JobHandle]:
        """Validate and decide every job first (one fleet view); enqueue only if all pass.

        Jobs whose push finds the fleet changed since the view was read are decided again
        on a fresh read and sent then; if that decision refuses one, the error is raised
        with the others already sent."""
        parsed = [self._parse(j, {}) for j in jobs]
        fleet, aged = self._view_for_submit()
        try:
            selections = self._decide_all(parsed, fleet)
        except JobError:
            if not aged:
                raise
            fleet = self.workers(max_age_s=0)  # the refusal may be the old view's
            selections = self._decide_all(parsed, fleet)
        pairs = list(zip(parsed, selections))
        changed = self.enqueue(pairs, fleet=fleet)
        if changed:
            fresh = self.workers(max_age_s=0)
            again = dict(zip((j.id for j, _ in changed), self._decide_all([j for j, _ in changed], fresh)))
            self.enqueue([(j, again[j.id]) for j, _ in changed])  # no premise: a send after a read
            pairs = [(j, again.get(j.id, s)) for j, s in pairs]
        return [JobHandle(self, job.id, sel, job.stream) for job, sel in pairs]

    def _decide_all(self, jobs: list[GenerationJob], fleet: FleetView) -> list[Selection]:
        """Every job's decision, or the first refusal raised."""
        outcomes = self.decide_each(jobs, fleet)
        refused = next((o for o in outcomes if isinstance(o, JobError)), None)
        if refused is not None:
            raise refused
        return [o for o in outcomes if isinstance(o, Selection)]

    def enqueue(
        self, pairs: list[tuple[GenerationJob, Selection]], resume: bool = False, fleet: FleetView | None = None
    ) -> list[tuple[GenerationJob, Selection]]:
        """Create the job records and send the new jobs (a known id is never sent twice).
        ``fleet``: the view the jobs were decided on; where the broker can check it in the
        push, jobs it no longer describes are not sent but returned, to decide again.

        ``resume`` (the batch feeder): also send jobs whose record exists but was never
        marked sent (a feeder died between the two), and mark what was sent."""
        if not pairs:
            return []
        changed: list[tuple[GenerationJob, Selection]] = []
        with self.app.producer_or_acquire() as producer:
            if not resume and hasattr(producer.channel, "guard_push"):
                sent, changed = self._claim_in_push(pairs, producer, fleet)
            else:
                sent = self._claim_then_publish(pairs, producer, resume, fleet)
        if self.hints is not None and any(sel.affinity_worker for _, sel in sent):
            pipe = self.redis.pipeline(transaction=False)
            for _, sel in sent:
                if sel.affinity_worker:  # sent to that worker: it will hold these blocks
                    self.hints.record(sel.affinity_worker, sel.prefix_hashes, client=pipe)
            pipe.execute()
        return changed

    @staticmethod
    def _record_fields(job: GenerationJob, sel: Selection) -> dict[str, Any]:
        return {"model": job.model, "backend": sel.backend, "queue": sel.queue, "submitted_at": job.submitted_at}

    def _claim_in_push(
        self,
        pairs: list[tuple[GenerationJob, Selection]],
        producer: Any,
        fleet: FleetView | None,
        group_jobs: int | None = None,
    ) -> tuple[list[tuple[GenerationJob, Selection]], list[tuple[GenerationJob, Selection]]]:
        """Each message's record claims and its decision's premise run in its push (the
        Redis broker: one script per message, all in one round trip), so neither costs a
        round trip of its own, and a record exists exactly where a message was pushed,
        also when some pushes fail. Jobs of one queue may share a message
        (dispatcher.grouping; ``group_jobs``: at most this many, the config's if None).
        Returns (the jobs sent, those whose fleet changed)."""
        channel = producer.channel
        premise, epoch = fleet.premise() if fleet is not None else ([keys.FLEET_EPOCH], "")
        readers = fleet or self._last_view()  # a send after a fresh read carries no premise, but has a view
        units = group_sends(pairs, readers, group_jobs or self.group_jobs, self.group_backends, self.levels)
        unit_ids = [units_id(unit) for unit in units]
        try:
            for unit_id, unit in zip(unit_ids, units):
                channel.guard_push(unit_id, self._claim_guard(unit, premise, epoch))
                self._publish(unit_id, unit, producer, declare=[])
            replies = channel.push_held()
        finally:
            unused = channel.drop_guards(unit_ids)
        if unused:  # published without its guard's script: kombu changed how it pushes
            raise RuntimeError(f"messages {unused} were published without their record claim")
        # one held push per unit, in order (by position: a repeated job id repeats its unit's id)
        answers = [reply for _, reply in replies]
        failed = {
            job.id: str(reply) for unit, reply in zip(units, answers) if isinstance(reply, Exception) for job, _ in unit
        }
        if failed:
            sent = [job.id for unit, reply in zip(units, answers) if reply == 1 for job, _ in unit]
            raise EnqueueError(
                f"{len(failed)} of {len(pairs)} jobs were not enqueued ({next(iter(failed.values()))}); "
                "the others were: submit the same ids again to send only the missing ones",
                {"sent": sent, "not_sent": failed},
            )
        sent_pairs, changed, known = [], [], []
        for unit, reply in zip(units, answers):
            (sent_pairs if reply == 1 else changed if reply == -1 else known if len(unit) > 1 else []).extend(unit)
        if known:  # a group with an id already known: its jobs one by one, the known ones skipped
            more_sent, more_changed = self._claim_in_push(known, producer, fleet, group_jobs=1)
            sent_pairs += more_sent
            changed += more_changed
        return sent_pairs, changed

    def _claim_guard(self, unit: list[tuple[GenerationJob, Selection]], premise: list[str], epoch: str) -> PushGuard:
        """The push guard of one message: one job's claim, or a group's (all or none)."""
        if len(unit) == 1:
            job, sel = unit[0]
            record, args = self.store.claim_call(job.id, self._record_fields(job, sel))
            return PushGuard(JobStore.CLAIM_AND_PUSH, [*record, *premise], [epoch, *args])
        records = [(job.id, self._record_fields(job, sel)) for job, sel in unit]
        group_keys, args = self.store.group_claim_call(records, premise, epoch)
        return PushGuard(JobStore.CLAIM_GROUP_AND_PUSH, group_keys, args)

    def _claim_then_publish(
        self, pairs: list[tuple[GenerationJob, Selection]], producer: Any, resume: bool, fleet: FleetView | None
    ) -> list[tuple[GenerationJob, Selection]]:
        """The claim in a round trip of its own, then the new jobs' messages (RabbitMQ;
        the batch feeder, which also sends claimed jobs a dead feeder never sent). On the
        Redis broker jobs of one queue share messages as in a submit (dispatcher.grouping;
        the readers of a queue counted on ``fleet``, else on the last view read)."""
        fresh = self.store.claim([(j.id, self._record_fields(j, s)) for j, s in pairs])
        todo = [pair for pair, new in zip(pairs, fresh) if new]
        if resume and not all(fresh):
            known = [pair for pair, new in zip(pairs, fresh) if not new]
            todo += [pair for pair, unsent in zip(known, self.store.unsent([j.id for j, _ in known])) if unsent]
        # Only through this fleet's Redis transport, whose worker side counts a group as its
        # jobs against the prefetch limit (RabbitMQ's and kombu's own count messages).
        group_jobs = self.group_jobs if self.checks_premise else 1
        units = group_sends(todo, fleet or self._last_view(), group_jobs, self.group_backends, self.levels)
        try:
            with producer.batch():
                for unit in units:
                    self._publish(units_id(unit), unit, producer)
        except Exception:
            if not resume:  # the caller gets the error: resubmitting these jobs must work
                created = {j.id for (j, _), new in zip(pairs, fresh) if new}
                self.store.release([j.id for j, _ in todo if j.id in created])
            raise  # resume: the records stay unmarked, so the next feed sends them
        if resume:
            self.store.mark_sent([j.id for j, _ in todo])
        return todo

    def resend(self, pairs: list[tuple[GenerationJob, Selection]]) -> None:
        """Send jobs whose record exists again, without a claim: their message was lost
        with a worker that died taking it (dispatcher.batch.lost_lines). A second message
        for a job that is in fact still on its way is answered once: the job record lets
        one delivery run it."""
        with self.app.producer_or_acquire() as producer:
            for job, sel in pairs:
                self._enqueue(job, sel, producer)

    def _publish(
        self, unit_id: str, unit: list[tuple[GenerationJob, Selection]], producer: Any, declare: list[Any] | None = None
    ) -> None:
        """One send unit's message (dispatcher.grouping): its one job's, or its group's."""
        if len(unit) == 1:
            self._enqueue(*unit[0], producer, declare=declare)
        else:
            self._enqueue_group(unit_id, unit, producer)

    def _enqueue_group(self, group_id: str, unit: list[tuple[GenerationJob, Selection]], producer: Any) -> None:
        """Publish one message for jobs of one queue and priority (dispatcher.grouping).
        Its header lists their ids: the worker's broker bookkeeping counts and records
        each job (dispatcher.broker_transport.GROUP_HEADER) without parsing the body."""
        job, sel = unit[0]
        self.app.send_task(
            GENERATE_GROUP_TASK,
            args=[[j.model_dump(mode="json"), s.model_dump(mode="json")] for j, s in unit],
            task_id=group_id,
            queue=sel.queue,
            priority=message_priority(self.app, self.priorities.level(job.priority.value)),
            ignore_result=True,
            argsrepr=f"{len(unit)} jobs: model={job.model} backend={sel.backend}",
            kwargsrepr="{}",
            headers={GROUP_HEADER: [j.id for j, _ in unit]},
            producer=producer,
            declare=[],
        )

    def _enqueue(
        self, job: GenerationJob, sel: Selection, producer: Any = None, declare: list[Any] | None = None
    ) -> None:
        """Publish the job's message. ``declare=[]`` skips kombu's per-publish queue
        declaration, which the Redis transport never needs: Celery publishes to the
        default exchange, which kombu's virtual transport delivers straight to the list
        named by the routing key (no binding read), and LPUSH creates the list. kombu still
        binds a copy of the queue to the channel and wraps the declare in its retry policy on
        every publish, its cache notwithstanding (~0.1 ms of the submit). RabbitMQ must
        declare (an undeclared queue drops the message): None keeps Celery's default."""
        # argsrepr is what logs and Flower show: a summary, never the prompt text.
        summary = f"model={job.model} backend={sel.backend} max_tokens={job.sampling.max_tokens}"
        if job.batch_id:
            summary += f" batch={job.batch_id} custom_id={job.custom_id}"
        if self.show_text:  # flower.show_text: a debugging aid, off by default
            text = job.prompt if job.prompt is not None else " | ".join(m.content for m in job.messages or [])
            summary += f" prompt={text[:200]!r}"
        self.app.send_task(
            GENERATE_TASK,
            args=[job.model_dump(mode="json"), sel.model_dump(mode="json")],
            task_id=job.id,
            queue=sel.queue,
            priority=message_priority(self.app, self.priorities.level(job.priority.value)),
            ignore_result=True,  # the outcome lives in the job record (dispatcher.store.jobstore)
            argsrepr=summary,
            kwargsrepr="{}",
            producer=producer,
            declare=declare,
        )

    # ------------------------------------------------------------- results

    def result(self, job_id: str, timeout: float | None = None, raise_on_cancel: bool = False) -> JobResult:
        """Wait for the job; raises its typed JobError if it failed, JobTimeoutError if slow.

        A cancelled job returns its partial result (status ``cancelled``), or with
        ``raise_on_cancel`` raises JobCancelledError carrying that result in ``details``."""
        final = self.store.wait(job_id, timeout=timeout)
        if final is None:
            raise JobTimeoutError(f"job {job_id} not finished after {timeout} s", {"job_id": job_id})
        status, payload = final
        if status == "cancelled" and raise_on_cancel:
            raise JobCancelledError(f"job {job_id} was cancelled", {"result": payload})
        return result_of(status, payload)

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
