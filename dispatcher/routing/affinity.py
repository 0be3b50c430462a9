"""Prefix affinity: which worker's own queue a job goes to, for the KV state of its
prompt's prefix (docs/routing.md). Pure: the caller read the hints, loads and queue
depths (dispatcher.router)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from core.celery_app import own_queue_of
from core.fleet import FleetView, WorkerInfo
from core.jobs import PathStep, Selection
from core.settings import DecisionPolicy


@dataclass
class Sent:
    """What one dispatch (a submit_many, a batch feed) has sent each worker so far: jobs
    not in its load yet, and new prefixes' blocks not in its hints yet. The dispatch reads
    the fleet once; without this, 8 jobs of one burst would all see the same loads."""

    jobs: Counter[str] = field(default_factory=Counter)
    blocks: Counter[str] = field(default_factory=Counter)


def affinity_cost(matched: int, blocks: int, worker: WorkerInfo, load_weight: float) -> float:
    """What sending a job to a worker costs, in full prefills of its prompt: the share of
    the prompt it must still evaluate, plus ``load_weight`` × its load (in flight ÷
    capacity): a full worker costs a whole prefill more than an idle one.

    Dynamo's router scores the same two terms (uncached prefill blocks + active decode
    blocks); with them divided by the prompt's blocks the first is SGLang's match ratio.
    Load counts per slot, not per job: below capacity a job starts at once (continuous
    batching), so a holder running one job must not lose it to an idle worker that would
    evaluate the whole prompt again."""
    return (blocks - matched) / max(1, blocks) + load_weight * worker.load


def apply_affinity(
    sel: Selection,
    hashes: list[str],
    matched: dict[str, int],
    fleet: FleetView,
    policy: DecisionPolicy,
    cached: dict[str, int] | None = None,
) -> Selection:
    """Which worker's own queue the job goes to, for the KV state of its prompt; pure (the
    caller read the hints, loads and ``cached``: how many blocks each worker holds).

    1. Some live worker holds at least ``prefix_min_blocks`` of the prompt's leading
       blocks: the worker where it costs least (affinity_cost), holder or not.
    2. Nobody does, but the prompt is that long: a new prefix. It goes to the worker
       holding the fewest blocks among those not full (SGLang: the smallest tree), so
       distinct prefixes spread over the fleet instead of wherever the shared queue's
       first free worker was.
    3. Otherwise (a short prompt, or every worker full): the shared queue, where
       whichever worker is free takes it."""
    if not hashes or sel.backend not in policy.prefix_affinity_backends:
        return sel
    live = fleet.live(backend=sel.backend, model=sel.model)
    n, cached = len(hashes), cached or {}
    update: dict[str, Any] = {"prefix_hashes": hashes}
    holders = [w for w in live if matched.get(w.worker_id, 0) >= policy.prefix_min_blocks]

    def to(w: WorkerInfo, detail: str) -> Selection:
        step = PathStep(check="prefix affinity", answer=w.worker_id, detail=detail)
        own = {"queue": own_queue_of(sel.queue, w.worker_id), "affinity_worker": w.worker_id}
        return sel.model_copy(update={**update, **own, "path": [*sel.path, step]})

    if holders:
        best, detail = _least_cost(live, holders, matched, n, policy)
        return to(best, detail)
    room = [w for w in live if w.in_flight < w.capacity]
    if n >= policy.prefix_min_blocks and room:
        best = min(room, key=lambda w: (cached.get(w.worker_id, 0), w.load))
        return to(
            best,
            f"a new prefix ({n} blocks, nobody holds {policy.prefix_min_blocks}): the worker holding "
            f"the fewest blocks ({cached.get(best.worker_id, 0)}), load {best.in_flight}/{best.capacity}",
        )
    if n >= policy.prefix_min_blocks:
        why = "a new prefix and every worker is full: the first free one takes it"
    else:
        why = f"{n} blocks, shorter than prefix_min_blocks ({policy.prefix_min_blocks})"
    step = PathStep(check="prefix affinity", answer="shared queue", detail=why)
    return sel.model_copy(update={**update, "path": [*sel.path, step]})


def _least_cost(
    live: list[WorkerInfo], holders: list[WorkerInfo], matched: dict[str, int], n: int, policy: DecisionPolicy
) -> tuple[WorkerInfo, str]:
    """The live worker where the job costs least (affinity_cost), and why, said against
    the holder of the longest match when that is another worker."""

    def cost(w: WorkerInfo) -> tuple[float, int]:
        got = matched.get(w.worker_id, 0)
        return affinity_cost(got, n, w, policy.prefix_load_weight), -got  # a tie: the longer match

    best = min(live, key=cost)
    got = matched.get(best.worker_id, 0)
    load = f"load {best.in_flight}/{best.capacity}, cost {cost(best)[0]:.2f}"
    if best in holders:
        return best, f"holds {got}/{n} leading blocks, {load}"
    top = max(holders, key=lambda w: matched.get(w.worker_id, 0))
    return best, (
        f"holds {got}/{n} blocks, but {top.worker_id} (holds {matched.get(top.worker_id, 0)}) "
        f"is at {top.in_flight}/{top.capacity}: {load}"
    )


def cap_affinity(sel: Selection, queued: int, capacity: int, policy: DecisionPolicy) -> Selection:
    """A job sent to a holder's own queue goes to the shared queue instead when that
    queue already holds ``prefix_max_queued_per_slot`` jobs per slot of the holder: the
    prefix saves prefill, not the wait behind a backlog. ``queued``: jobs in the own queue."""
    if sel.affinity_worker is None or queued < policy.prefix_max_queued_per_slot * max(capacity, 1):
        return sel
    step = PathStep(
        check="prefix affinity",
        answer="shared queue",
        detail=f"{sel.affinity_worker}'s own queue holds {queued} job(s), its cap for {capacity} slot(s)",
    )
    shared = sel.queue.rsplit(".", 1)[0]
    return sel.model_copy(update={"queue": shared, "affinity_worker": None, "path": [*sel.path, step]})
