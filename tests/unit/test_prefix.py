"""Prefix hash chains (stable, per model, block by block) and the affinity choice (pure)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.fleet import FleetView, HardwareInfo, WorkerInfo
from core.jobs import PathStep, Selection
from core.settings import fleet_config
from dispatcher.routing.affinity import apply_affinity, cap_affinity
from dispatcher.routing.prefix import chain

POLICY = fleet_config().decision


def test_a_chain_is_stable_across_processes():
    ids = list(range(1000, 1100))
    here = chain(ids, 16, "smollm2-135m@r1", 256)
    code = (
        "from dispatcher.routing.prefix import chain; "
        "print(','.join(chain(list(range(1000, 1100)), 16, 'smollm2-135m@r1', 256)))"
    )
    there = (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .split(",")
    )
    assert here == there and len(here) == 6  # 100 tokens: six full blocks, the rest is not hashed


def test_shared_prefixes_match_block_by_block_and_then_never_again():
    a = list(range(64)) + [1, 2, 3] * 20
    b = list(range(64)) + [9, 9, 9] * 20
    ca, cb = chain(a, 16, "m@1", 256), chain(b, 16, "m@1", 256)
    assert ca[:4] == cb[:4]
    assert all(x != y for x, y in zip(ca[4:], cb[4:]))  # a chain: once apart, apart for good


def test_salted_chains_share_only_their_public_blocks():
    """core.tenancy: two tenants' equal prompts get different hashes (no hint, no
    "N blocks cached" in the decision path, tells one of the other), except the blocks
    wholly within a public prefix (a shared system prompt)."""
    ids = list(range(160))  # 10 blocks of 16
    plain = chain(ids, 16, "m@r/16", 256)
    a, b = chain(ids, 16, "m@r/16", 256, salt="a"), chain(ids, 16, "m@r/16", 256, salt="b")
    assert not set(a) & set(b) and not set(a) & set(plain)
    a_pub, b_pub = (chain(ids, 16, "m@r/16", 256, salt=s, public=40) for s in ("a", "b"))
    assert a_pub[:2] == b_pub[:2] == plain[:2]  # blocks 0-31 lie within the 40 public tokens
    assert not set(a_pub[2:]) & set(b_pub[2:])  # the block crossing token 40, and all after, are salted
    assert chain(ids, 16, "m@r/16", 256, salt="a") == a  # stable


def test_chains_differ_per_model_and_revision():
    ids = list(range(64))
    assert chain(ids, 16, "m@1", 256) != chain(ids, 16, "m@2", 256) != chain(ids, 16, "n@1", 256)
    assert set(chain(ids, 16, "m@1", 256)).isdisjoint(chain(ids, 16, "m@2", 256))


def test_max_blocks_caps_the_chain_and_text_chains_work_too():
    assert len(chain(list(range(10_000)), 16, "m@1", 8)) == 8
    assert len(chain(b"x" * 130, 64, "m@1#chars", 256)) == 2


def worker(wid: str, in_flight: int = 0, capacity: int = 8) -> WorkerInfo:
    hw = HardwareInfo(kind="cpu", cpu_cores=2, ram_gb=8)
    return WorkerInfo(
        worker_id=wid,
        backend="llamacpp",
        hostname="h",
        pid=1,
        hardware=hw,
        models=["m"],
        queues=[],
        in_flight=in_flight,
        capacity=capacity,
        started_at=0,
    )


SEL = Selection(
    backend="llamacpp",
    queue="ib.llamacpp",
    model="m",
    format="gguf",
    config={},
    path=[PathStep(check="tree", answer="llamacpp")],
    tree_choice="llamacpp",
)
HASHES = [f"h{i}" for i in range(32)]


def test_the_worker_holding_the_longest_prefix_gets_the_job():
    fleet = FleetView(workers=[worker("a"), worker("b")])
    sel = apply_affinity(SEL, HASHES, {"a": 30, "b": 3}, fleet, POLICY)
    assert sel.queue == "ib.llamacpp.a" and sel.affinity_worker == "a" and sel.prefix_hashes == HASHES
    assert sel.path[-1].check == "prefix affinity" and "30/32" in sel.path[-1].detail


@pytest.mark.parametrize(
    ("hashes", "matched", "loads", "why"),
    [
        (HASHES[:3], {}, (0, 0), "a prompt shorter than prefix_min_blocks"),
        (HASHES, {"a": 3}, (8, 8), "a new prefix while every worker is full"),
        (HASHES, {"gone": 32}, (8, 8), "its holder is not live, and every live worker is full"),
    ],
)
def test_the_shared_queue_when_no_worker_is_worth_choosing(hashes, matched, loads, why):
    fleet = FleetView(workers=[worker("a", loads[0]), worker("b", loads[1])])
    sel = apply_affinity(SEL, hashes, matched, fleet, POLICY)
    assert sel.queue == "ib.llamacpp" and sel.affinity_worker is None, why
    assert sel.path[-1].answer == "shared queue" and sel.prefix_hashes == hashes


def test_a_new_prefix_goes_to_the_worker_holding_the_fewest_blocks():
    fleet = FleetView(workers=[worker("a"), worker("b", in_flight=2)])
    # nobody holds 4 of its blocks: b holds fewer blocks in all, though it is busier
    sel = apply_affinity(SEL, HASHES, {"a": 3}, fleet, POLICY, cached={"a": 900, "b": 40})
    assert sel.queue == "ib.llamacpp.b" and sel.affinity_worker == "b"
    assert "a new prefix" in sel.path[-1].detail and "(40)" in sel.path[-1].detail
    # a full worker is no candidate, however little it holds
    full = FleetView(workers=[worker("a"), worker("b", in_flight=8)])
    assert apply_affinity(SEL, HASHES, {}, full, POLICY, cached={"a": 900, "b": 0}).affinity_worker == "a"


def test_load_trades_against_uncached_prefill():
    # cost = share of the prompt left to evaluate + 1.0 x load (in flight / capacity 8)
    fleet = FleetView(workers=[worker("a", in_flight=6), worker("b", in_flight=0)])
    # a holds 30/32 at 6/8 (cost 0.81); b holds 10 idle (0.69): b evaluates less than
    # a's load is worth
    assert apply_affinity(SEL, HASHES, {"a": 30, "b": 10}, fleet, POLICY).affinity_worker == "b"
    # with a lighter weight on load, the longer match wins
    lighter = POLICY.model_copy(update={"prefix_load_weight": 0.2})
    assert apply_affinity(SEL, HASHES, {"a": 30, "b": 10}, fleet, lighter).affinity_worker == "a"


def test_a_holder_keeps_its_jobs_until_it_is_fuller_than_a_whole_prefill_is_worth():
    # one job running (a job that just finished, still counted): the holder keeps it
    one = FleetView(workers=[worker("a", in_flight=1), worker("b")])
    assert apply_affinity(SEL, HASHES, {"a": 32}, one, POLICY).affinity_worker == "a"
    # past its capacity (a job would wait for a slot): an idle worker's own queue takes it
    over = FleetView(workers=[worker("a", in_flight=9), worker("b")])
    sel = apply_affinity(SEL, HASHES, {"a": 32}, over, POLICY)
    assert sel.queue == "ib.llamacpp.b" and sel.affinity_worker == "b"
    assert "a (holds 32) is at 9/8" in sel.path[-1].detail


def test_one_dispatch_counts_what_it_sends_into_the_next_decisions():
    """A burst of 8 new prefixes, then a burst of 16 jobs on the 4 prefixes worker a
    holds: counting each send in (as Client.decide does with Sent) spreads the new
    prefixes 4 / 4, and moves held ones only once a is past full."""
    fleet = FleetView(workers=[worker("a"), worker("b")])
    cached = {"a": 0, "b": 0}
    placed = []
    for _ in range(8):
        sel = apply_affinity(SEL, HASHES, {}, fleet, POLICY, cached)
        placed.append(sel.affinity_worker)
        cached[sel.affinity_worker] += len(HASHES)
    assert placed.count("a") == 4 and placed.count("b") == 4, placed
    once = [apply_affinity(SEL, HASHES, {}, fleet, POLICY, {"a": 0, "b": 0}).affinity_worker for _ in range(8)]
    assert set(once) == {"a"}  # without counting, every new prefix lands on one worker

    loads = {"a": 0, "b": 0}
    for _ in range(16):
        view = fleet.with_in_flight(loads)
        w = apply_affinity(SEL, HASHES, {"a": 32}, view, POLICY).affinity_worker
        loads[w] += 1
    # a keeps them until full; past that each job costs a whole prefill on b (b holds
    # none of it until this dispatch's hints are written) against an eighth on a
    assert loads == {"a": 12, "b": 4}, loads


def test_backends_without_prefix_state_are_left_alone():
    onnx = SEL.model_copy(update={"backend": "onnx", "queue": "ib.onnx"})
    assert apply_affinity(onnx, HASHES, {"a": 32}, FleetView(workers=[worker("a")]), POLICY) == onnx


def test_ngram_drafts_continue_the_latest_earlier_repeat():
    from workers.engines.ngram import ngram_draft

    seq = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert ngram_draft(seq, 2) == [4, 5]  # "1 2 3" was followed by 4 5
    assert ngram_draft([7, 8, 7, 9, 7], 3) == [9, 7]  # the most recent earlier "7"
    assert ngram_draft([1, 2, 3], 4) == []  # nothing repeats
    assert ngram_draft(seq, 0) == []


def test_a_missing_tokenizer_is_looked_for_again_later_and_a_found_one_is_kept():
    """A client started before the model's HF folder was prepared must not hash with
    character blocks for the rest of its life (the feeder inside a worker lives for days)."""
    from core.registry import ModelSpec
    from dispatcher.routing.prefix import PrefixHasher

    model = ModelSpec(name="m", display_name="m", family="llama", hf_native=True, context_length=64)
    found: list[object | None] = [None]
    calls: list[str] = []

    def tokenizer_for(spec: ModelSpec) -> object | None:
        calls.append(spec.name)
        return found[0]

    hasher = PrefixHasher(tokenizer_for=tokenizer_for)
    assert hasher.tokenizer(model) is None and hasher.tokenizer(model) is None
    assert len(calls) == 1  # a miss is remembered for a while: no lookup (and warning) per job
    hasher.retry_missing_s = 0.0
    found[0] = tok = object()  # the folder has been prepared meanwhile
    assert hasher.tokenizer(model) is tok and hasher.tokenizer(model) is tok
    assert len(calls) == 2  # found: kept, never looked for again


def test_a_full_own_queue_sends_the_job_to_the_shared_queue_instead():
    fleet = FleetView(workers=[worker("a", in_flight=4), worker("b")])
    sel = apply_affinity(SEL, HASHES, {"a": 30}, fleet, POLICY)
    capacity = fleet.workers[0].capacity
    cap = int(POLICY.prefix_max_queued_per_slot * capacity)
    assert cap_affinity(sel, cap - 1, capacity, POLICY) == sel  # room left: stays with the holder
    full = cap_affinity(sel, cap, capacity, POLICY)
    assert full.queue == "ib.llamacpp" and full.affinity_worker is None and full.prefix_hashes == HASHES
    assert full.path[-1].answer == "shared queue" and f"holds {cap} job(s)" in full.path[-1].detail
    assert cap_affinity(SEL, 10_000, capacity, POLICY) == SEL  # not an affinity send: untouched
