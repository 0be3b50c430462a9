"""The batch feeder: staged batch lines → the engines' queues, with backpressure.

One feeder works at a time in the whole fleet, holding a lease in Redis that it renews
as it goes: every worker runs one in a thread (``batch.feeder_in_workers``) and
``ib batch feed`` runs one alone, so batches move on whichever processes are alive. A
feeder that dies stops renewing; another takes over within ``lease_s`` and a quarter
(the others ask for the lease that often).

Each tick, per active batch, oldest first:
- in_progress: decide the next lines with the dispatcher's decision tree (per line, on
  the live fleet as it is now) and enqueue them, while the lines of all batches waiting
  in queues stay under ``max_queued``: the broker's queues never hold a whole file;
- cancelling: record ``batch_cancelled`` for lines never fed (the cancel call usually has);
  after ``cancel_grace_s``, for any line no worker has answered;
- past its completion window: ``expired``, unfinished lines recorded ``batch_expired``;
- validating with no progress for ``validation_stale_s``: the submitter is gone, ``failed``;
- in_progress with lines out and none finished for ``lost_line_check_s``: lines whose
  message a dying worker took with it are sent again (dispatcher.batch.lost_lines).

A line is fed as: claim its job record (id ``<batch>-<line>``: never two records), send it,
mark it sent, move the cursor. A feeder that dies in between leaves the cursor where it
was; the next one re-reads those lines and sends only those never marked sent.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from core.errors import JobError, NoLiveWorkerError
from core.jobs import GenerationJob, Selection
from core.records import job_error_record
from core.store.batchstore import FINAL_STATUSES
from core.store.faults import WAIT_OUT, Episode
from core.store.keys import FEEDER_LEASE
from dispatcher.fleet_state import route
from dispatcher.routing.affinity import Sent

if TYPE_CHECKING:
    from dispatcher.parts import DispatchParts

log = logging.getLogger(__name__)

_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class BatchFeeder:
    def __init__(self, parts: DispatchParts, owner: str) -> None:
        """``parts``: the submitting side's (it decides with the router and sends with the
        sender, as a submit does); ``owner``: who holds the lease (a worker id)."""
        self.parts = parts
        self.batches = parts.batches
        self.store = parts.batches.store
        self.owner = owner
        cfg = self.batches.cfg
        self.max_queued = cfg.max_queued
        self.chunk = cfg.feed_chunk
        self.interval_s = cfg.feed_interval_s
        self.idle_interval_s = cfg.feed_idle_interval_s
        self.lease_ms = int(cfg.feeder_lease_s * 1000)
        self.stale_s = cfg.validation_stale_s
        self.cancel_grace_s = cfg.cancel_grace_s
        self.lost_check_s = cfg.lost_line_check_s
        self.lost_lines = parts.lost_jobs
        self.active = 0  # active batches the last tick saw
        self._progress: dict[str, tuple[int, float]] = {}  # batch → (lines done, since when)
        self._lease = parts.redis.register_script(_LEASE)
        self._release = parts.redis.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fault = Episode(log, "batch feeder", parts.redis)  # logged once per Redis fault

    # ------------------------------------------------------------- the loop

    def holds_lease(self) -> bool:
        return bool(self._lease(keys=[FEEDER_LEASE], args=[self.owner, self.lease_ms]))

    def run(self, once: bool = False) -> None:
        """Feed until stopped; ``once``: until a tick finds nothing to do."""
        failures = 0
        while not self._stop.is_set():
            holder = False
            try:
                holder = self.holds_lease()
                worked = self.tick() if holder else 0
                failures = 0
            except WAIT_OUT as exc:  # Redis restarting, failing over or full: wait for it
                failures += 1
                self._fault.failed(exc, "feeding")
                worked = 0
            except Exception as exc:  # noqa: BLE001 - anything else: said each time, then tried again
                failures += 1
                log.warning("batch feeder: %s: %s; retrying", type(exc).__name__, exc)
                worked = 0
            else:
                self._fault.succeeded()
            if once and not worked:
                break
            self._stop.wait(self.next_wait_s(holder, worked, failures))
        try:
            self._release(keys=[FEEDER_LEASE], args=[self.owner])
        except redis.RedisError:
            pass  # the lease lapses by itself

    def next_wait_s(self, holder: bool, worked: int, failures: int) -> float:
        """How long the loop sleeps after a step. Every worker runs a feeder, so what an
        idle one does between steps is paid by every worker of the fleet: measured on
        an idle vLLM worker, the feeder's thread at 5 steps a second was its largest
        CPU user (0.11 CPU s per 30 s, a lease script and a ZRANGE each step)."""
        if worked:
            return 0.0
        if failures:
            return min(self.interval_s * (1 + failures), 5.0)
        if not holder:  # the lease can change hands only when it lapses
            return max(self.interval_s, self.lease_ms / 4000)
        if not self.active:  # nothing to feed: a new batch waits at most this long
            return max(self.interval_s, self.idle_interval_s)
        return self.interval_s

    def start(self) -> BatchFeeder:
        self._thread = threading.Thread(target=self._run_logged, name="batch-feeder", daemon=True)
        self._thread.start()
        return self

    def _run_logged(self) -> None:
        try:
            self.run()
        except Exception:  # a feeder bug must not take the worker down
            log.exception("batch feeder stopped")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------- one tick

    def tick(self) -> int:
        """One pass over the active batches; returns how much it did (lines fed or recorded)."""
        ids = self.store.ids(active_only=True, newest_first=False)
        self.active = len(ids)
        if not ids:
            return 0
        records = self.store.get_many(ids)
        now = time.time()
        queued = sum(_outstanding(h) for h in records if h.get("status") == "in_progress")
        room = self.max_queued - queued
        work = 0
        for batch_id, h in zip(ids, records):
            status = h.get("status")
            if not h:
                self.store.forget(batch_id)  # its record expired
            elif status in FINAL_STATUSES:
                self.store.deactivate(batch_id)
            elif now > float(h["expires_at"]):
                work += self.expire(batch_id)
            elif "total" not in h:  # still being validated
                self.check_validating(batch_id, h, now)
            elif status == "cancelling":
                work += self.finish_cancel(batch_id, h, now)
            elif status == "in_progress":
                if room > 0:
                    fed = self.feed(batch_id, h, min(room, self.chunk))
                    room -= fed
                    work += fed
                work += self.check_stalled(batch_id, h, now)
        active = set(ids)
        self._progress = {b: p for b, p in self._progress.items() if b in active}  # ended batches go
        return work

    def check_validating(self, batch_id: str, h: dict[str, str], now: float) -> None:
        """A batch validating with no progress for ``stale_s``: its submitter is gone."""
        if now - float(h["touched"]) > self.stale_s:
            log.warning("batch %s: validation stalled; the submitter is gone", batch_id)
            reason = f"validation stopped after line {h.get('max_line', 0)}: the submitting client went away"
            self.store.fail(batch_id, [{"code": "validation_abandoned", "message": reason}])

    def check_stalled(self, batch_id: str, h: dict[str, str], now: float) -> int:
        """Lines out and none finished for ``lost_check_s``: send again those lost with a
        worker that died taking them (each check restarts the clock)."""
        done = int(h.get("fed_done", 0))
        last_done, since = self._progress.get(batch_id, (-1, now))
        if done != last_done or _outstanding(h) <= 0:
            self._progress[batch_id] = (done, now)
            return 0
        if now - since < self.lost_check_s:
            return 0
        self._progress[batch_id] = (done, now)
        lost = self.lost_lines.find(batch_id, int(h.get("fed", 0)))
        if not lost:
            return 0
        ready, refused = self._decide(lost, keep_order=False)
        self.parts.sender.resend(ready)
        self._record_refused(batch_id, refused)
        log.warning(
            "batch %s: %d line(s) lost with a worker that died taking them: %d sent again, %d refused, "
            "%d wait for a live worker (next check in %g s)",
            batch_id,
            len(lost),
            len(ready),
            len(refused),
            len(lost) - len(ready) - len(refused),
            self.lost_check_s,
        )
        return len(ready) + len(refused)

    def feed(self, batch_id: str, h: dict[str, str], n: int) -> int:
        """Decide and enqueue the next ``n`` staged lines of a batch, in order."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        fed, staged = int(h.get("fed", 0)), int(h.get("staged", 0))
        lines = self.store.staged(batch_id, fed, min(staged, fed + n))
        if not lines:
            return 0
        ready, refused = self._decide(lines)
        taken = len(ready) + len(refused)
        if not taken:
            return 0
        self.parts.sender.enqueue(ready, resume=True)
        self._record_refused(batch_id, refused)
        backends: dict[str, int] = {}
        for _, sel in ready:
            backends[sel.backend] = backends.get(sel.backend, 0) + 1
        self.store.advance(
            batch_id, fed + taken, backends, feed_s=time.perf_counter() - t0, feed_cpu_s=time.thread_time() - cpu0
        )
        return taken

    def _decide(
        self, lines: list[tuple[int, str]], keep_order: bool = True
    ) -> tuple[list[tuple[GenerationJob, Selection]], list[tuple[GenerationJob, JobError]]]:
        """Staged lines' jobs decided on the live fleet, in order: (ready, refused). A line no
        live worker can take stops a feed there (the rest wait, keeping the order, and the
        cursor stays on it); lines sent again (``keep_order=False``) were fed long ago, so
        one that must wait does not hold back the others behind it."""
        fleet = self.parts.fleet.view()
        now = time.time()
        ready: list[tuple[GenerationJob, Selection]] = []
        sent = Sent()  # what this feed sends each worker (prefix routing counts it in)
        refused: list[tuple[GenerationJob, JobError]] = []
        jobs = [GenerationJob.model_validate_json(job_json) for _, job_json in lines]
        for job in jobs:
            job.submitted_at = now  # queue wait and TTFT count from the feed, not from upload
        for job, outcome in zip(jobs, route(self.parts.router, self.parts.fleet, jobs, fleet, sent)):
            if isinstance(outcome, NoLiveWorkerError):
                if keep_order:
                    break
            elif isinstance(outcome, JobError):
                refused.append((job, outcome))
            else:
                ready.append((job, outcome))
        return ready, refused

    def _record_refused(self, batch_id: str, refused: list[tuple[GenerationJob, JobError]]) -> None:
        """Fed lines the decision refused: each one's error record (it counts as fed)."""
        for job, exc in refused:
            record = job_error_record(job.custom_id or "", job.id, exc)
            self.store.record_line(batch_id, job.batch_line or 0, record, "failed", fed=True)

    def finish_cancel(self, batch_id: str, h: dict[str, str], now: float) -> int:
        if "drained_at" not in h:
            return self.batches.drop_unfed(batch_id)
        if now - float(h.get("cancelling_at", now)) > self.cancel_grace_s:
            message = f"the batch was cancelled and no worker answered this request within {self.cancel_grace_s:g} s"
            return self.batches.record_staged(batch_id, "batch_cancelled", message)
        return 0

    def expire(self, batch_id: str) -> int:
        """Past the completion window: what finished stays; the rest is recorded expired."""
        log.warning("batch %s: completion window over; expiring the unfinished lines", batch_id)
        self.store.transition(batch_id, "expired", ("validating", "in_progress", "cancelling"))
        self.parts.store.request_cancel(batch_id)
        recorded = self.batches.record_staged(
            batch_id, "batch_expired", "the batch's completion window ended before this request ran"
        )
        self.store.drop_staged(batch_id)  # every unrun line has its record now
        return recorded or 1


def _outstanding(h: dict[str, str]) -> int:
    """Lines of a batch handed to the queues and not recorded yet."""
    return int(h.get("fed", 0)) - int(h.get("fed_done", 0))
