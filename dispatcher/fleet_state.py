"""What the submitting side reads of the fleet: the live view from heartbeats, cached, and
for each dispatch what the router's prefix affinity needs (hints, own queues' depths).

The router (dispatcher.router) decides on what it is handed; the reads it needs are made
here (the hints of a dispatch's prompts in one round trip, an own queue's depth once per
queue a job is sent to), and ``route`` puts the steps together for the client and the
batch feeder alike.
"""

from __future__ import annotations

import time

import redis

from core.celery_app import queued
from core.errors import JobError
from core.fleet import FleetView, read_fleet
from core.jobs import GenerationJob, Selection
from core.store.hints import PrefixHints
from dispatcher.router import NO_READS, Plan, Router, RouteReads
from dispatcher.routing.affinity import Sent


class FleetState:
    def __init__(
        self,
        client: redis.Redis,
        hints: PrefixHints | None,
        steps: list[int],
        cache_s: float,
        stale_s: float,
        checks_premise: bool = False,
    ) -> None:
        """``steps``: the priority steps a queue is kept in; ``cache_s``: how old a view a
        submit reuses; ``stale_s``: how old one it reuses when the push checks the view's
        premise (``checks_premise``: the sender's transport does, dispatcher.push_guard)."""
        self.redis = client
        self.hints = hints
        self.steps = steps
        self.cache_s = cache_s
        self.stale_s = max(stale_s, cache_s)
        self.checks_premise = checks_premise
        self._view: tuple[float, FleetView] | None = None

    def view(self, max_age_s: float | None = None) -> FleetView:
        """The live fleet. Submissions reuse a snapshot up to ``cache_s`` old (far below the
        heartbeat TTL), which saves two round trips per submit."""
        max_age = self.cache_s if max_age_s is None else max_age_s
        if self._view is None or time.monotonic() - self._view[0] > max_age:
            self._view = (time.monotonic(), read_fleet(self.redis))
        return self._view[1]

    def last(self) -> FleetView | None:
        """The view read last, whatever its age (how many workers read a queue, for
        grouping: dispatcher.grouping); None before the first read."""
        return self._view[1] if self._view is not None else None

    def for_submit(self) -> tuple[FleetView, bool]:
        """The view a submit decides on, and whether it is older than ``cache_s``. With a
        broker that checks a decision's premise in the push (the Redis transport: the
        fleet epoch is unchanged and every worker in the view still beats), a cached view
        up to ``stale_s`` old is as good as a fresh read, and costs none."""
        max_age = self.stale_s if self.checks_premise else self.cache_s
        if self._view is not None:
            age = time.monotonic() - self._view[0]
            if age <= max_age:
                return self._view[1], age > self.cache_s
        return self.view(max_age_s=0), False

    def reads_for(self, router: Router, plans: list[Plan | JobError]) -> RouteReads:
        """What the plans' prefix affinity needs: every prompt's hints in one round trip
        (one per job was 64 round trips of a 64-job submit), and an own queue's depth in
        one more at its first use (only queues a job is sent to are read)."""
        asks = router.asks(plans)
        if self.hints is None or not asks:
            return NO_READS
        depths: dict[str, int] = {}

        def depth(queue: str) -> int:
            if queue not in depths:
                depths[queue] = queued(self.redis, queue, self.steps)
            return depths[queue]

        return RouteReads(self.hints.lookup_many(asks), depth)


def route(
    router: Router, state: FleetState, jobs: list[GenerationJob], fleet: FleetView, sent: Sent | None = None
) -> list[Selection | JobError]:
    """Decide the jobs of one dispatch, in order, a refused job's error in its place: plan
    them (pure), read what their affinity needs, place them (pure). ``sent``: what this
    dispatch has sent so far, counted in; a job sent to a worker here is added to it."""
    plans = router.plan_each(jobs, fleet)
    return router.place_each(plans, state.reads_for(router, plans), fleet, Sent() if sent is None else sent)
