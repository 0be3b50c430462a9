"""Messages a worker cannot run are kept as dead letters, their jobs fail typed, and
`ib dead-letters` lists and requeues them (a real llama.cpp worker, a real broker)."""

from __future__ import annotations

import json
import uuid

import pytest

from conftest import ib, start_worker, wait_for
from core.errors import InvalidMessageError
from core.jobs import GenerationJob
from core.store.dead_letters import DeadLetters

pytestmark = pytest.mark.integration
SECRET = "prompt-that-must-not-be-logged"


@pytest.fixture
def worker(redis_url):
    worker_id = f"llamacpp-{uuid.uuid4().hex[:8]}"
    w = start_worker(redis_url, "llamacpp", worker_id=worker_id, extra_args=["--threads=1"])
    yield w
    w.stop()


def test_undecodable_foreign_and_drifted_messages_become_dead_letters_not_lost_jobs(client, redis_url, worker):
    letters = DeadLetters(client.redis)
    letters.remove(*[d.id for d in letters.list(limit=1000)])
    own = f"ib.llamacpp.{worker.worker_id}"
    # 1. ib.generate from a newer fleet: a field this worker's schema does not know.
    drifted = GenerationJob(model="smollm2-135m", prompt=SECRET, sampling={"max_tokens": 4})
    assert client.store.claim([(drifted.id, {"model": drifted.model})]) == [True]
    job = {**drifted.model_dump(mode="json"), "reasoning_effort": "high"}
    client.app.send_task("ib.generate", args=[job, {"backend": "llamacpp"}], task_id=drifted.id, queue=own)
    # 2. a task this fleet does not have, 3. a pickled body (never deserialized here).
    client.app.send_task("ib.generate_v9", args=[SECRET], task_id=f"foreign-{uuid.uuid4().hex[:6]}", queue=own)
    with client.app.producer_or_acquire() as producer:
        headers = {"task": "ib.generate", "id": f"pickled-{uuid.uuid4().hex[:6]}", "lang": "py"}
        producer.publish(
            b"\x80\x04" + SECRET.encode(), routing_key=own, exchange="", serializer=None,
            content_type="application/x-python-serialize", content_encoding="binary", headers=headers,
        )  # fmt: skip

    found = wait_for(lambda: letters.count() >= 3 and letters.list(), 60, "three dead letters")
    by_reason = {d.reason: d for d in found}
    assert set(by_reason) == {"invalid_arguments", "unknown_task", "invalid_task"}, [d.detail for d in found]
    assert "job.reasoning_effort" in by_reason["invalid_arguments"].detail
    assert by_reason["invalid_arguments"].task_id == drifted.id and by_reason["unknown_task"].queue == own
    # The job fails typed, at once: nobody waits on a record that stays queued forever.
    with pytest.raises(InvalidMessageError, match="reasoning_effort"):
        client.result(drifted.id, timeout=30)
    # The worker keeps serving, and none of the bodies reached its log.
    ok = GenerationJob(model="smollm2-135m", prompt="Say hi.", sampling={"max_tokens": 4}, backend="llamacpp")
    sel = client.decide(ok, client.workers())
    client.enqueue([(ok, sel.model_copy(update={"queue": own}))])
    assert client.result(ok.id, timeout=120).status == "completed"
    assert SECRET not in worker.log_path.read_text(errors="replace")

    listed = ib("dead-letters", "list", redis_url=redis_url)
    assert listed.returncode == 0 and "dead letters (3)" in listed.stdout and SECRET not in listed.stdout
    # Requeue puts the message back unchanged and reopens its job: this worker still
    # refuses it, so it comes back as a new letter and the job fails again, naming it.
    old = by_reason["invalid_arguments"].id
    requeued = ib("dead-letters", "requeue", old, redis_url=redis_url)
    assert requeued.returncode == 0, requeued.stdout + requeued.stderr
    again = wait_for(
        lambda: [d for d in letters.list() if d.reason == "invalid_arguments" and d.id != old], 60, "a new letter"
    )
    assert letters.get(old) is None and letters.count() == 3
    record = wait_for(lambda: (r := client.record(drifted.id)).get("final") and r, 30, "the job failed again")
    assert json.loads(record["error"])["details"]["dead_letter"] == again[0].id
    assert ib("dead-letters", "drop", "--all", redis_url=redis_url).returncode == 0 and letters.count() == 0


def test_dead_letters_are_capped_in_bytes_the_oldest_dropped_first(redis_url):
    """A count cap alone let 10,000 letters of up to 8 MiB each fill Redis."""
    import redis

    from conftest import own_database
    from core.store.dead_letters import DeadLetter

    with own_database(redis_url, 10) as url:
        letters = DeadLetters(redis.Redis.from_url(url), cap=100, max_bytes=50_000)
        kept = []
        for i in range(10):
            letter = DeadLetter(reason="undecodable", detail="x", queue="ib.llamacpp", body="b" * 10_000, at=1000.0 + i)
            letters.add(letter)
            kept.append(letter.id)
        left = [d.id for d in letters.list(limit=100)]
        assert left == kept[::-1][: len(left)] and 3 <= len(left) <= 4  # the newest, each ~10.4 kB
        assert letters.bytes() <= 50_000
        assert letters.bytes() == sum(len(v) for v in letters.r.hvals("ib:dead-letters"))
        huge = DeadLetter(reason="undecodable", detail="x", queue="ib.llamacpp", body="h" * 80_000, at=2000.0)
        assert letters.add(huge) == len(left)  # over the cap alone: it stays, every older one goes
        assert [d.id for d in letters.list()] == [huge.id]
        letters.remove(huge.id)
        assert letters.bytes() == 0 and letters.count() == 0
