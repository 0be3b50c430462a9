"""dispatcher.grouping: which jobs of one dispatch share a message."""

from __future__ import annotations

from core.fleet import FleetView, HardwareInfo, WorkerInfo
from core.jobs import GenerationJob, PathStep, Selection
from dispatcher.grouping import group_sends, units_id

LEVELS = {"interactive": 0, "normal": 3, "batch": 6}


def job(i: int, priority: str = "normal", job_id: str | None = None) -> GenerationJob:
    fields = {"model": "m", "prompt": f"p{i}", "priority": priority}
    return GenerationJob.model_validate({**fields, "id": job_id} if job_id else fields)


def sel(backend: str = "vllm", worker: str | None = None) -> Selection:
    queue = f"ib.{backend}" + (f".{worker}" if worker else "")
    return Selection(
        backend=backend,
        queue=queue,
        model="m",
        format="hf",
        config={},
        path=[PathStep(check="tree", answer=backend)],
        tree_choice=backend,
        affinity_worker=worker,
    )


def fleet(n: int, backend: str = "vllm") -> FleetView:
    return FleetView(
        workers=[
            WorkerInfo(
                worker_id=f"w{i}",
                backend=backend,
                hostname="h",
                pid=1,
                hardware=HardwareInfo(kind="cpu", cpu_cores=2, ram_gb=8),
                models=["m"],
                queues=[f"ib.{backend}"],
                started_at=0,
            )
            for i in range(n)
        ]
    )


def sizes(units: list) -> list[int]:
    return [len(u) for u in units]


def test_one_queue_is_cut_into_messages_of_at_most_max_jobs_in_order():
    pairs = [(job(i), sel()) for i in range(20)]
    units = group_sends(pairs, fleet(1), 8, ["vllm"], LEVELS)
    assert sizes(units) == [8, 8, 4]
    assert [j.id for u in units for j, _ in u] == [j.id for j, _ in pairs]


def test_a_shared_queue_gets_a_message_for_each_live_reader_at_least():
    pairs = [(job(i), sel()) for i in range(8)]
    assert sizes(group_sends(pairs, fleet(2), 8, ["vllm"], LEVELS)) == [4, 4]
    assert sizes(group_sends(pairs, fleet(3), 8, ["vllm"], LEVELS)) == [3, 3, 2]
    # a worker's own queue has one reader, whatever the fleet
    own = [(job(i), sel(worker="w1")) for i in range(8)]
    assert sizes(group_sends(own, fleet(3), 8, ["vllm"], LEVELS)) == [8]


def test_queues_priorities_other_backends_and_repeated_ids_do_not_mix():
    repeated = job(99, job_id="same")
    pairs = [
        (job(0), sel()),
        (job(1), sel("llamacpp")),  # not a grouping backend: alone
        (job(2, "interactive"), sel()),  # another priority level: another lane
        (job(3), sel(worker="w0")),  # another queue
        (job(4), sel()),
        (repeated, sel()),
        (job(5, "interactive"), sel()),
        (job(6), sel(worker="w0")),
        (repeated, sel()),  # its second time: alone (a group's claim is all or none)
    ]
    units = group_sends(pairs, fleet(1), 8, ["vllm"], LEVELS)
    ids = [[j.id for j, _ in u] for u in units]
    p = [j.id for j, _ in pairs]
    assert ids == [[p[0], p[4], "same"], [p[1]], [p[2], p[6]], [p[3], p[7]], ["same"]]


def test_off_and_single_jobs_go_one_message_each():
    pairs = [(job(i), sel()) for i in range(4)]
    assert sizes(group_sends(pairs, fleet(1), 1, ["vllm"], LEVELS)) == [1, 1, 1, 1]
    assert sizes(group_sends(pairs[:1], fleet(1), 8, ["vllm"], LEVELS)) == [1]


def test_a_units_message_id_is_its_jobs_or_a_fresh_group_id():
    one = [(job(0), sel())]
    two = [(job(1), sel()), (job(2), sel())]
    assert units_id(one) == one[0][0].id
    assert units_id(two).startswith("group-") and units_id(two) != units_id(two)
