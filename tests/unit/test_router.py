"""The router decides a dispatch on what it is handed: no Redis, no broker. What it asks
to be read (hints), how it places each job on those reads, and that it asks for an own
queue's depth only where a job is about to go (not for every worker of the fleet)."""

from __future__ import annotations

from core.errors import UnknownModelError
from core.fleet import FleetView
from core.store.hints import Lookup
from dispatcher.router import Plan, Router, RouteReads
from dispatcher.routing.affinity import Sent
from dispatcher.routing.prefix import PrefixHasher
from tests.unit.test_decision import BACKENDS, MODELS, POLICY, job, worker

A, B = "llamacpp-a", "llamacpp-b"
FLEET = FleetView(
    workers=[worker("llamacpp", False).model_copy(update={"worker_id": w, "capacity": 4}) for w in (A, B)]
)
LONG = "a system prompt long enough to span many blocks of the prompt's hash chain " * 4


def router(affinity: bool = True) -> Router:
    # no tokenizer on this host: the prompt is hashed in character blocks, as the client would
    tokens = PrefixHasher(tokenizer_for=lambda model: None)
    return Router(MODELS, POLICY.model_copy(update={"policy": "tree"}), BACKENDS, tokens, affinity=affinity)


def chat(text: str, model: str = "all"):
    return job(model, backend="llamacpp").model_copy(update={"prompt": text})


def holding(plan: Plan, worker_id: str, in_flight: int = 0) -> Lookup:
    """What the hints would say: ``worker_id`` holds every block of the plan's prompt."""
    blocks = len(plan.hashes or [])
    return Lookup({worker_id: blocks}, {A: in_flight, B: in_flight}, {A: 0, B: 0} | {worker_id: blocks})


class Depths(dict):
    """Own queues' depths, as the caller would read them; remembers which were asked for."""

    def __init__(self, depths: dict[str, int] | None = None) -> None:
        super().__init__(depths or {})
        self.asked: list[str] = []

    def __call__(self, queue: str) -> int:
        self.asked.append(queue)
        return self.get(queue, 0)


def test_a_long_prompt_asks_for_its_hints_over_the_live_workers():
    r = router()
    long, short = r.plan_each([chat(LONG), chat("hi")], FLEET)
    assert isinstance(long, Plan) and len(long.hashes or []) >= POLICY.prefix_min_blocks
    assert sorted(long.live) == [A, B]
    assert r.asks([long, short]) == [(long.hashes, long.live), (short.hashes, short.live)]


def test_each_job_is_placed_on_its_own_lookup_also_after_a_refused_one():
    r = router()
    plans = r.plan_each([chat(LONG), chat("x", model="nope"), chat(LONG + "!")], FLEET)
    first, refused, third = plans
    assert isinstance(refused, UnknownModelError)
    depths = Depths()
    placed = r.place_each(plans, RouteReads([holding(first, A), holding(third, B)], depths), FLEET, Sent())
    assert placed[1] is refused
    assert depths.asked == [f"ib.llamacpp.{A}", f"ib.llamacpp.{B}"]  # only where a job goes
    assert (placed[0].affinity_worker, placed[0].queue) == (A, f"ib.llamacpp.{A}")
    assert (placed[2].affinity_worker, placed[2].queue) == (B, f"ib.llamacpp.{B}")


def test_a_holders_own_queue_full_by_the_depth_read_sends_the_job_to_the_shared_queue():
    r = router()
    [plan] = r.plan_each([chat(LONG)], FLEET)
    full = POLICY.prefix_max_queued_per_slot * 4  # the holder's capacity is 4
    depths = Depths({f"ib.llamacpp.{A}": full})
    [placed] = r.place_each([plan], RouteReads([holding(plan, A)], depths), FLEET, Sent())
    assert (placed.affinity_worker, placed.queue) == (None, "ib.llamacpp")
    depths = Depths({f"ib.llamacpp.{A}": full - 1})
    [placed] = r.place_each([plan], RouteReads([holding(plan, A)], depths), FLEET, Sent())
    assert placed.affinity_worker == A


def test_what_a_dispatch_sent_counts_in_its_next_decisions():
    """A new prefix goes to the worker holding the fewest blocks; the next new one, in the
    same dispatch, to the other (the first's blocks are counted as held, ``Sent``)."""
    r = router()
    plans = r.plan_each([chat(LONG), chat("another prompt, as long: " + LONG)], FLEET)
    nobody = Lookup({}, {A: 0, B: 0}, {A: 0, B: 0})
    placed = r.place_each(plans, RouteReads([nobody, nobody], Depths()), FLEET, sent := Sent())
    assert {p.affinity_worker for p in placed} == {A, B}
    assert sent.jobs == {A: 1, B: 1}


def test_without_affinity_nothing_is_hashed_or_read():
    r = router(affinity=False)
    plans = r.plan_each([chat(LONG)], FLEET)
    assert plans[0].hashes is None and r.asks(plans) == []
    [placed] = r.place_each(plans, RouteReads([], Depths()), FLEET, Sent())
    assert placed.queue == "ib.llamacpp" and placed.affinity_worker is None


def test_a_short_prompt_goes_to_the_shared_queue_without_reading_any_depth():
    r = router()
    plans = r.plan_each([chat("hi")], FLEET)
    assert len(plans[0].hashes or []) < POLICY.prefix_min_blocks
    nobody = Lookup({}, {A: 0, B: 0}, {A: 0, B: 0})
    [placed] = r.place_each(plans, RouteReads([nobody], depths := Depths()), FLEET, Sent())
    assert placed.queue == "ib.llamacpp" and depths.asked == []
