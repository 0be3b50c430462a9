"""The router: where each job of a dispatch goes, decided from what it is handed, with no
I/O of its own.

As vLLM v1 splits its engine core from its client, the decision is kept apart from the
reads and the sends around it. A dispatch is decided in two steps with the reads between
them, which the caller makes (dispatcher.fleet_state.route):

1. ``plan_each``: the seed's tree and its constraints (dispatcher.routing.decision),
   the context check, and the prompt's block hashes where prefix affinity applies;
2. the caller reads what those plans ask for, the workers' hints, loads and cached blocks
   (``asks``), in one round trip, and hands them over as a RouteReads, with a function
   that tells an own queue's depth;
3. ``place_each``: prefix affinity on those reads, each job counting the ones before it
   (``Sent``: the hints in Redis change only once the dispatch has sent).

An own queue's depth is asked for only once a job is about to be sent there (to cap a
holder's backlog): reading every live worker's own queue up front would cost each
dispatch a read per worker of the fleet, for the one or two queues it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from core.backends import BackendSpec
from core.errors import JobError
from core.fleet import FleetView
from core.jobs import GenerationJob, Selection, check_context
from core.registry import ModelRegistry
from core.settings import DecisionPolicy
from core.store.hints import Lookup
from dispatcher.routing.affinity import Sent, apply_affinity, cap_affinity
from dispatcher.routing.context import might_overflow, serving_window
from dispatcher.routing.decision import decide
from dispatcher.routing.prefix import PrefixHasher
from dispatcher.routing.profiles import ProfileBook


class Plan(NamedTuple):
    """A job's decision before prefix affinity: the tree's selection, the prompt's block
    hashes where affinity applies (None: it does not), the live workers it may go to."""

    selection: Selection
    hashes: list[str] | None
    live: list[str]


@dataclass(frozen=True)
class RouteReads:
    """What a dispatch's prefix affinity needs from Redis, read by the caller: one Lookup
    per plan that asks (``Router.asks``, in order), and the jobs waiting in an own queue
    (``depth``: read by the caller once per queue, when the router first asks)."""

    lookups: list[Lookup]
    depth: Callable[[str], int]


def _unread(queue: str) -> int:
    raise AssertionError(f"{queue}: no job of this dispatch asked for prefix affinity")


NO_READS = RouteReads([], _unread)


class Router:
    """Decides jobs on a fleet view; everything it reads is handed to it."""

    def __init__(
        self,
        registry: ModelRegistry,
        policy: DecisionPolicy,
        backends: dict[str, BackendSpec],
        tokens: PrefixHasher,
        profile: ProfileBook | None = None,
        affinity: bool = True,
    ) -> None:
        """``tokens``: the models' tokenizers, which count prompts (context overflow) and
        hash their blocks; ``affinity``: prefix affinity on (hints kept, and a broker
        whose workers have their own queues)."""
        self.registry = registry
        self.policy = policy
        self.backends = backends
        self.tokens = tokens
        self.profile = profile
        self.affinity = affinity

    def plan(self, job: GenerationJob, fleet: FleetView) -> Plan:
        """The tree's decision, the context check, and the prompt's block hashes where
        prefix affinity applies; a refused job raises its JobError."""
        model = self.registry.get(job.model)
        sel = decide(job, model, fleet, self.policy, self.backends, self.profile)
        window = serving_window(model, sel.config)
        affinity = self.affinity and sel.backend in self.policy.prefix_affinity_backends
        ids = self.tokens.prompt_ids(job, model) if affinity or might_overflow(job, window) else None
        if ids is not None:  # refused here, not after a trip through a queue to a worker
            check_context(job, len(ids), window)
        if not affinity:
            return Plan(sel, None, [])
        hashes = self.tokens.hashes(job, model, self.backends[sel.backend].prefix_block_tokens, ids=ids)
        return Plan(sel, hashes, [w.worker_id for w in fleet.live(backend=sel.backend, model=sel.model)])

    def plan_each(self, jobs: list[GenerationJob], fleet: FleetView) -> list[Plan | JobError]:
        """``plan`` for each job, a refused job's error in its place."""
        plans: list[Plan | JobError] = []
        for job in jobs:
            try:
                plans.append(self.plan(job, fleet))
            except JobError as exc:
                plans.append(exc)
        return plans

    @staticmethod
    def asks(plans: list[Plan | JobError]) -> list[tuple[list[str], list[str]]]:
        """The hint look-ups the plans need: (block hashes, live workers) per plan that has
        hashes, in order (core.store.hints.PrefixHints.lookup_many)."""
        return [(p.hashes, p.live) for p in plans if isinstance(p, Plan) and p.hashes is not None]

    def place_each(
        self, plans: list[Plan | JobError], reads: RouteReads, fleet: FleetView, sent: Sent
    ) -> list[Selection | JobError]:
        """Each plan's final selection (prefix affinity on ``reads`` and what this dispatch
        has sent so far, ``sent``, which it adds to), a refused job's error in its place."""
        found = iter(reads.lookups)
        return [
            plan
            if isinstance(plan, JobError)
            else plan.selection
            if plan.hashes is None
            else self._affine(plan, next(found), fleet, sent, reads.depth)
            for plan in plans
        ]

    def _affine(
        self, plan: Plan, found: Lookup, fleet: FleetView, sent: Sent, depth: Callable[[str], int]
    ) -> Selection:
        """Prefix affinity on what the hints say (``found``) and what this dispatch sent."""
        hashes = plan.hashes or []
        fleet = fleet.with_in_flight({w: n + sent.jobs[w] for w, n in found.in_flight.items()})
        cached = {w: n + sent.blocks[w] for w, n in found.cached.items()}
        sel = apply_affinity(plan.selection, hashes, found.matched, fleet, self.policy, cached)
        if sel.affinity_worker is None:
            return sel
        holder = next((w for w in fleet.workers if w.worker_id == sel.affinity_worker), None)
        waiting = depth(sel.queue) + sent.jobs[sel.affinity_worker]
        sel = cap_affinity(sel, waiting, holder.capacity if holder else 1, self.policy)
        if sel.affinity_worker:  # it will hold the blocks it lacked: the next decisions count them
            sent.jobs[sel.affinity_worker] += 1
            sent.blocks[sel.affinity_worker] += len(hashes) - found.matched.get(sel.affinity_worker, 0)
        return sel
