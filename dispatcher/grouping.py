"""Which jobs of one dispatch travel together as one group message (``ib.generate_group``).

A worker spends about as much CPU taking a message (the consumer, Celery's trace, the
start's and the ack's round trips) as on everything else a job costs it outside the
engine. On a CPU host that time is taken from the engine's own threads, so a vLLM worker
fed 64 jobs one message each ran ~5 % below vLLM in-process (docs/BENCHMARKS.md). A group
message carries several jobs of one queue and priority, and the worker starts and
finishes them together: one message, one task, one round trip for their starts.

Grouping never changes where a job goes: only jobs decided onto the same queue share a
message. So that one worker does not take what several would share, a shared queue's
jobs are split into at least as many messages as it has live workers; a worker's own
queue (prefix affinity) has one reader. Jobs whose id repeats within the dispatch go
alone, so a group's claim (all new or none sent) is not refused for its own duplicate.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from math import ceil

from core.fleet import FleetView
from core.jobs import GenerationJob, Selection

Pair = tuple[GenerationJob, Selection]


def group_sends(
    pairs: list[Pair], fleet: FleetView | None, max_jobs: int, backends: list[str], level: dict[str, int]
) -> list[list[Pair]]:
    """``pairs`` in send units, in the order of each unit's first job: lists of one job
    (its own message) or of 2 to ``max_jobs`` jobs with the same queue and priority level
    (``level``: the job's priority name -> its level) on a backend in ``backends``."""
    if max_jobs < 2 or len(pairs) < 2:
        return [[pair] for pair in pairs]
    seen: set[str] = set()
    lanes: dict[tuple[str, int], list[Pair]] = defaultdict(list)
    units: list[list[Pair]] = []
    for job, sel in pairs:
        if sel.backend not in backends or job.id in seen or job.sampling.n > 1:  # n answers: one message each
            units.append([(job, sel)])
        else:
            lane = lanes[(sel.queue, level[job.priority.value])]
            if not lane:
                units.append(lane)  # the lane's place: its jobs are split below
            lane.append((job, sel))
        seen.add(job.id)
    out: list[list[Pair]] = []
    for unit in units:
        if len(unit) == 1:
            out.append(unit)
            continue
        size = min(max_jobs, ceil(len(unit) / _readers(unit[0][1], fleet)))
        out += [unit[i : i + size] for i in range(0, len(unit), size)]
    return out


def units_id(unit: list[Pair]) -> str:
    """A send unit's message id: its job's id, or a fresh id for a group (its task id in
    Celery and the broker's books; the job ids travel in its header)."""
    return unit[0][0].id if len(unit) == 1 else f"group-{uuid.uuid4().hex}"


def _readers(sel: Selection, fleet: FleetView | None) -> int:
    """How many workers read the job's queue: one for a worker's own queue, else the live
    workers serving its backend and model in the view (at least one)."""
    if sel.affinity_worker is not None or fleet is None:
        return 1
    return max(1, len(fleet.live(backend=sel.backend, model=sel.model)))
