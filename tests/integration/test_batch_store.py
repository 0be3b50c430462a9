"""Batch bookkeeping on a real Redis, no workers: validation, one record per line, the
feeder's backpressure and crash resume, cancel, expiry, the feeder lease.

These run in a database of their own: the feeder enqueues real Celery messages, and no
worker of the other tests may pick them up.
"""

from __future__ import annotations

import gzip
import json
import time

import pytest

from conftest import own_database, wait_for
from core.records import CHAT_URL, line_job_id
from core.store import keys
from core.store.jobstore import LineRecord
from dispatcher.batch.feeder import BatchFeeder
from dispatcher.batch.objects import BatchInputError
from dispatcher.client import Client

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"


@pytest.fixture
def url(redis_url):
    with own_database(redis_url, 13) as url:
        yield url


@pytest.fixture
def client(url, monkeypatch):
    monkeypatch.setenv("IB_BATCH_MAX_QUEUED", "10")
    monkeypatch.setenv("IB_BATCH_FEED_CHUNK", "4")
    with Client(url) as c:
        yield c


def good(i: int, **body) -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": CHAT_URL,
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 4, **body},
    }


def queued(client: Client) -> list[str]:
    """Task ids of every message waiting in the ib.* queues (all priorities)."""
    ids = []
    for key in client.redis.scan_iter("ib.*"):
        if client.redis.type(key) == b"list":
            ids += [json.loads(m)["headers"]["id"] for m in client.redis.lrange(key, 0, -1)]
    return ids


def drain(feeder: BatchFeeder) -> int:
    total = 0
    while worked := feeder.tick():
        total += worked
    return total


def test_lines_are_validated_and_staged_and_bad_ones_recorded_at_once(client):
    lines = [good(1), "{oops", good(2), "", good(3, max_tokens=-1), good(4), good(1)]
    batch = client.batches.create(lines)
    assert batch.status == "in_progress" and batch.priority == "batch"
    assert batch.request_counts.total == 6  # the blank line is not a request
    assert batch.request_counts.failed == 3 and batch.request_counts.completed == 0
    assert client.redis.llen(keys.batch_lines(batch.id)) == 3
    records = list(client.batches.results(batch.id))
    assert [r["error"]["code"] for r in records] == ["invalid_json", "invalid_request", "duplicate_custom_id"]
    assert [r["custom_id"] for r in records] == [None, "req-3", "req-1"]


def test_a_hostile_gzipped_file_runs_its_good_lines_and_records_one_error_per_bad_one(client, tmp_path):
    bad = [
        b'{"custom_id": "latin1", "prompt": "caf\xe9"}\n',  # Windows-1252, not UTF-8
        b'"{""custom_id"": ""csv""}"\r\n',  # a spreadsheet's quoted cell
        b'{"custom_id": "big", "prompt": "' + b"x" * 9_000_000 + b'"}\n',  # over batch.max_line_bytes
        b"[" * 50_000 + b"\n",  # deeper than the JSON parser goes
        b'{"custom_id": "cut", "prompt": "trunc',  # the last line of an interrupted upload
    ]
    good_lines = [json.dumps(good(i)).encode() + b"\r\n" for i in range(1, 4)]
    path = tmp_path / "requests.jsonl.gz"
    content = b"\xef\xbb\xbf" + good_lines[0] + b"".join(bad[:4]) + b"".join(good_lines[1:]) + bad[4]
    path.write_bytes(gzip.compress(content))
    batch = client.batches.create(path)
    assert batch.status == "in_progress" and batch.input_file == "requests.jsonl.gz"
    assert batch.request_counts.total == 8 and batch.request_counts.failed == 5
    assert client.redis.llen(keys.batch_lines(batch.id)) == 3  # the good lines, the first one's BOM read past
    records = list(client.batches.results(batch.id))
    codes = [r["error"]["code"] for r in records]
    assert codes == ["invalid_utf8", "invalid_json", "line_too_long", "invalid_json", "invalid_json"]
    assert [r["id"].rsplit("-", 1)[1] for r in records] == ["2", "3", "4", "5", "8"]  # each at its own line


def test_a_workbook_instead_of_jsonl_fails_the_batch_naming_the_format(client, tmp_path):
    path = tmp_path / "requests.xlsx"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 200)
    batch = client.batches.create(path)
    assert batch.status == "failed" and batch.errors.data[0]["code"] == "invalid_file_format"
    assert "Excel .xlsx" in batch.errors.data[0]["message"]


@pytest.mark.parametrize(
    ("lines", "code"), [([], "empty_file"), (["", "  "], "empty_file"), (["{x", {"custom_id": "a"}], "no_valid_lines")]
)
def test_a_batch_with_no_valid_line_fails_at_validation_with_the_reason(client, lines, code):
    batch = client.batches.create(lines)
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors.data[0]["code"] == code


def test_a_line_is_recorded_once_and_the_last_one_completes_the_batch(client):
    batch = client.batches.create([good(1), good(2)])
    store = client.batches.store
    assert store.record_line(batch.id, 1, {"custom_id": "req-1"}, "completed", tokens=4)
    assert not store.record_line(batch.id, 1, {"custom_id": "req-1", "again": True}, "completed", tokens=4)
    assert client.batches.retrieve(batch.id).status == "in_progress"
    # a worker's finish writes the job outcome and the line together, once
    job_id = line_job_id(batch.id, 2)
    client.store.claim([(job_id, {})])
    line = LineRecord(batch.id, 2, {"custom_id": "req-2"}, "completed", 5)
    assert client.store.finish(job_id, "completed", {"text": "x"}, line=line)
    assert not client.store.finish(job_id, "completed", {"text": "y"}, line=line)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.completed_at
    assert done.request_counts.completed == 2 and done.completion_tokens == 9
    assert [r["custom_id"] for r in client.batches.results(batch.id)] == ["req-1", "req-2"]
    assert batch.id not in client.batches.store.ids(active_only=True)


def test_the_feeder_keeps_the_queues_bounded_and_resumes_a_dead_feeders_chunk(client):
    batch = client.batches.create([good(i) for i in range(1, 31)])
    feeder = BatchFeeder(client.parts, owner="t")
    assert drain(feeder) == 10  # max_queued: 10 lines waiting, no more
    assert len(queued(client)) == 10 and client.batches.retrieve(batch.id).fed == 10
    assert client.batches.retrieve(batch.id).backends == {"llamacpp": 10}  # the tree's batch choice on CPU

    # A feeder that died after claiming the next lines but before sending them:
    next_ids = [line_job_id(batch.id, n) for n in range(11, 15)]
    client.store.claim([(j, {}) for j in next_ids])
    # Four lines finish: room for four more.
    for n in range(1, 5):
        job = line_job_id(batch.id, n)
        client.store.finish(job, "completed", {}, line=LineRecord(batch.id, n, {"custom_id": f"req-{n}"}, "completed"))
    assert drain(feeder) == 4
    ids = queued(client)
    assert len(ids) == 14 and len(set(ids)) == 14  # the claimed-but-unsent lines were sent, once
    assert set(next_ids) <= set(ids)
    assert all(client.store.get(j).get("sent") == "1" for j in next_ids)


def test_cancel_drops_pending_lines_and_ends_after_the_grace(client, url, monkeypatch):
    batch = client.batches.create([good(i) for i in range(1, 21)])
    feeder = BatchFeeder(client.parts, owner="t")
    drain(feeder)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at
    assert cancelled.request_counts.failed == 10  # the 10 never fed; the 10 queued wait for a worker
    assert client.store.cancelled({line_job_id(batch.id, 1): batch.id})  # one flag cancels every line
    assert drain(feeder) == 0  # nothing more is fed
    monkeypatch.setenv("IB_BATCH_CANCEL_GRACE_S", "0")
    with Client(url) as c2:  # config is read when a client starts
        drain(BatchFeeder(c2.parts, owner="t"))
    done = client.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.request_counts.failed == 20
    codes = {r["error"]["code"] for r in client.batches.results(batch.id)}
    assert codes == {"batch_cancelled"}


def test_a_batch_past_its_window_expires(client):
    batch = client.batches.create([good(1), good(2), good(3)], completion_window="1s")
    feeder = BatchFeeder(client.parts, owner="t")
    time.sleep(1.2)
    drain(feeder)
    done = client.batches.retrieve(batch.id)
    assert done.status == "expired" and done.expired_at
    assert [r["error"]["code"] for r in client.batches.results(batch.id)] == ["batch_expired"] * 3
    assert not client.redis.exists(keys.batch_lines(batch.id))  # its staged input went with it


def test_a_completion_window_past_the_configured_longest_is_refused(client):
    """A 99999d window kept a batch's data in Redis for ever (window + retention)."""
    with pytest.raises(BatchInputError, match="longer than this fleet allows"):
        client.batches.create([good(1)], completion_window="99999d")
    with pytest.raises(BatchInputError, match="not a duration"):
        client.batches.create([good(1)], completion_window="9" * 5000 + "d")


def test_an_interrupted_or_abandoned_validation_fails_the_batch(client, url, monkeypatch):
    def broken():
        yield json.dumps(good(1))
        raise OSError("disk went away")

    with pytest.raises(OSError):
        client.batches.create(broken())
    failed = client.batches.list()[0]
    assert failed.status == "failed" and failed.errors.data[0]["code"] == "validation_interrupted"
    assert "disk went away" in failed.errors.data[0]["message"]

    client.batches.store.create(
        "batch_orphan", {"expires_at": time.time() + 60, "completion_window": "1m"}, int(time.time()) + 120
    )
    monkeypatch.setenv("IB_BATCH_VALIDATION_STALE_S", "0")
    with Client(url) as c2:
        BatchFeeder(c2.parts, owner="t").tick()
    orphan = client.batches.retrieve("batch_orphan")
    assert orphan.status == "failed" and orphan.errors.data[0]["code"] == "validation_abandoned"


def test_one_feeder_holds_the_lease_at_a_time(client):
    a, b = BatchFeeder(client.parts, owner="a"), BatchFeeder(client.parts, owner="b")
    assert a.holds_lease() and a.holds_lease()
    assert not b.holds_lease()
    a.run(once=True)  # nothing to do: returns and lets the lease go
    assert b.holds_lease()


def test_an_idle_feeder_steps_once_a_second_and_one_without_the_lease_asks_for_it_rarely(client):
    """Every worker runs a feeder: idle ones must not poll Redis 5 times a second. The
    holder with no active batch steps every feed_idle_interval_s (1 s), one without
    the lease asks for it every quarter lease (2.5 s), and a new batch is still fed
    within the idle interval."""
    holder, other = BatchFeeder(client.parts, owner="h"), BatchFeeder(client.parts, owner="o")
    steps = {"h": 0, "o": 0}
    for feeder in (holder, other):

        def counted(real=feeder.holds_lease, owner=feeder.owner) -> bool:
            steps[owner] += 1
            return real()

        feeder.holds_lease = counted
    holder.start()
    try:
        wait_for(lambda: client.redis.get(keys.FEEDER_LEASE) == b"h", 5, "the holder's lease")
        other.start()
        time.sleep(1.5)
        assert 1 <= steps["h"] <= 3  # 8 at the 0.2 s interval
        assert steps["o"] == 1
        client.batches.create([good(1), good(2)])
        wait_for(lambda: len(queued(client)) == 2, 3, "the new batch's lines fed")
    finally:
        holder.stop()
        other.stop()


def test_unknown_batch_and_bad_options_are_refused(client):
    from core.errors import UnknownModelError
    from dispatcher.batch.objects import BatchInputError, UnknownBatchError

    with pytest.raises(UnknownBatchError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(BatchInputError, match="no such input file"):
        client.batches.create("/nonexistent/requests.jsonl")
    with pytest.raises(BatchInputError, match="completion_window"):
        client.batches.create([good(1)], completion_window="soon")
    with pytest.raises(UnknownModelError, match="known models"):
        client.batches.create([good(1)], model="gpt-9")
    assert client.batches.list() == []  # nothing was stored for a refused batch


def test_concurrent_creates_never_exceed_a_keys_active_batch_limit(client):
    """The gateway counted a key's active batches, then created one: eight creates at once
    all saw room. Now the count and the create are one step."""
    import threading
    import uuid

    from dispatcher.batch.objects import BatchLimitError

    owner = f"tenant-{uuid.uuid4().hex[:8]}"
    made, refused = [], []

    def create() -> None:
        try:
            made.append(client.batches.create([good(1)], owner=owner, max_active=2).id)
        except BatchLimitError:
            refused.append(1)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert (len(made), len(refused)) == (2, 6)
    assert client.batches.active_owned(owner) == 2
    client.batches.cancel(made[0])  # a slot comes back when one ends
    wait_for(lambda: client.batches.active_owned(owner) < 2, 30, "a slot freed")
