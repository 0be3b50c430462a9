"""Offline batches through a real fleet: Redis, llama.cpp workers, the real model.

- a 200-line file with 10 bad lines → 190 outputs + 10 errors, in input order;
- a worker SIGKILLed and the broker restarted mid-batch → exactly one result per line;
- cancel mid-batch → cancelling, then cancelled, finished lines kept;
- a 100k-line file is validated and enqueued with bounded memory and bounded queues.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from conftest import ib, start_worker, wait_for
from core.records import CHAT_URL, COMPLETIONS_URL, line_job_id
from core.store import keys
from dispatcher.client import Client

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
TOPICS = ["the sea", "a cat", "winter", "bread", "a clock", "the moon", "a river", "chess", "rain", "a lamp"]


def request_line(i: int, max_tokens: int) -> dict:
    """Four shapes in turn: OpenAI chat, OpenAI completions, plain messages, plain prompt."""
    topic = TOPICS[i % len(TOPICS)]
    cid = f"req-{i:03d}"
    match i % 4:
        case 0:
            return {
                "custom_id": cid,
                "method": "POST",
                "url": CHAT_URL,
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"One fact about {topic}."}],
                    "max_tokens": max_tokens,
                },
            }
        case 1:
            return {
                "custom_id": cid,
                "method": "POST",
                "url": COMPLETIONS_URL,
                "body": {"model": MODEL, "prompt": f"A sentence about {topic}:", "max_tokens": max_tokens},
            }
        case 2:
            return {
                "custom_id": cid,
                "messages": [{"role": "user", "content": f"Describe {topic}."}],
                "max_tokens": max_tokens,
            }
        case _:
            return {"custom_id": cid, "prompt": f"{topic.capitalize()} is", "max_tokens": max_tokens}


BAD_LINES = {
    7: "{not json",
    23: json.dumps({"prompt": "no id", "model": MODEL}),
    41: json.dumps({"custom_id": "req-001", "prompt": "a duplicate id"}),
    60: json.dumps({"custom_id": "bad-60", "prompt": "x", "model": "gpt-9"}),
    88: json.dumps({"custom_id": "bad-88", "prompt": "x", "max_tokens": 0}),
    101: json.dumps({"custom_id": "bad-101", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "x"}}),
    130: json.dumps({"custom_id": "bad-130", "url": CHAT_URL, "body": {"model": MODEL, "prompt": "x"}}),
    150: json.dumps({"custom_id": "bad-150", "prompt": "x", "tools": []}),
    177: json.dumps({"custom_id": "bad-177", "messages": []}),
    199: json.dumps(["not", "an", "object"]),
}


def write_file(path: Path, n: int, max_tokens: int, bad: dict[int, str] | None = None) -> Path:
    with path.open("w") as fh:
        for line in range(1, n + 1):
            fh.write((bad or {}).get(line) or json.dumps(request_line(line, max_tokens)))
            fh.write("\n")
    return path


def line_of(record: dict) -> int:
    return int(record["id"].rsplit("-", 1)[1])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture
def llamacpp_worker(redis_url):
    """One per test: each test's feeder settings come from its own worker's environment."""
    worker = start_worker(redis_url, "llamacpp", extra_args=["--threads=2"])
    yield worker
    worker.stop()


def test_200_lines_with_10_bad_ones_give_190_outputs_and_10_errors_in_input_order(
    llamacpp_worker, client, redis_url, tmp_path
):
    src = write_file(tmp_path / "requests.jsonl", 200, max_tokens=6, bad=BAD_LINES)
    submitted = ib("batch", "submit", str(src), "--model", MODEL, redis_url=redis_url)
    assert submitted.returncode == 0, submitted.stderr + submitted.stdout
    batch_id = re.search(r"batch (batch_[0-9a-f]+)", submitted.stdout).group(1)
    assert "200 request(s), 10 refused at validation" in " ".join(submitted.stdout.split())

    batch = wait_for(lambda: (b := client.batches.retrieve(batch_id)).is_final and b, 600, "batch done")
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (200, 190, 10)
    assert batch.backends == {"llamacpp": 190}
    status = json.loads(ib("batch", "status", batch_id, "--json", redis_url=redis_url).stdout)
    assert status["status"] == "completed" and status["request_counts"] == {
        "total": 200,
        "completed": 190,
        "failed": 10,
    }
    # the ended batch's staged input leaves Redis (it stayed for the window + 7 days)
    wait_for(lambda: not client.redis.exists(keys.batch_lines(batch_id)), 10, "the staged input deleted")

    out, err = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    done = ib("batch", "results", batch_id, "-o", str(out), "--errors", str(err), redis_url=redis_url)
    assert done.returncode == 0, done.stderr + done.stdout
    outputs, errors = read_jsonl(out), read_jsonl(err)
    assert len(outputs) == 190 and len(errors) == 10
    # every line exactly once, each file in input order
    assert sorted(map(line_of, outputs + errors)) == list(range(1, 201))
    assert [line_of(r) for r in outputs] == sorted(line_of(r) for r in outputs)
    assert [line_of(r) for r in errors] == sorted(BAD_LINES)
    assert sorted(r["custom_id"] for r in outputs) == [f"req-{i:03d}" for i in range(1, 201) if i not in BAD_LINES]
    codes = [r["error"]["code"] for r in errors]
    assert codes == [
        "invalid_json",
        "missing_custom_id",
        "duplicate_custom_id",
        "model_not_found",
        "invalid_request",
        "invalid_url",
        "invalid_request",
        "unsupported_parameter",  # tools on /v1/completions
        "invalid_request",
        "invalid_request",
    ]
    assert all(f"line {line_of(r)}" in r["error"]["message"] for r in errors)

    for rec in outputs:
        body = rec["response"]["body"]
        assert rec["response"]["status_code"] == 200 and rec["error"] is None
        chat = line_of(rec) % 4 in (0, 2)
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        choice = body["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        assert choice["finish_reason"] in ("stop", "length") and 1 <= body["usage"]["completion_tokens"] <= 6
        if choice["finish_reason"] == "length":
            assert body["usage"]["completion_tokens"] == 6 and text
    # each line's record and its job's own result agree
    for rec in outputs[::19]:
        result = client.result(rec["response"]["request_id"], timeout=5)
        choice = rec["response"]["body"]["choices"][0]
        assert (
            result.batch_id == batch_id and result.custom_id == rec["custom_id"] and result.batch_line == line_of(rec)
        )
        assert result.text == (choice["message"]["content"] if "message" in choice else choice["text"])


def test_cancel_mid_batch_keeps_finished_lines_and_drops_the_rest(client, redis_url, tmp_path):
    # A small queue bound, so most lines are still pending (never enqueued) at the cancel.
    worker = start_worker(redis_url, "llamacpp", extra_args=["--threads=2"], env={"IB_BATCH_MAX_QUEUED": "12"})
    try:
        batch = client.batches.create(write_file(tmp_path / "r.jsonl", 150, max_tokens=32), model=MODEL)
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 10, 300, "10 lines done")
        cancelled = ib("batch", "cancel", batch.id, redis_url=redis_url)
        assert cancelled.returncode == 0 and "cancelling" in cancelled.stdout, cancelled.stdout
        final = wait_for(lambda: (b := client.batches.retrieve(batch.id)).is_final and b, 120, "cancelled")
        assert final.status == "cancelled" and final.cancelling_at <= final.cancelled_at
        records = list(client.batches.results(batch.id))
        assert sorted(map(line_of, records)) == list(range(1, 151))  # every line once
        ok = [r for r in records if r["error"] is None]
        dropped = [r for r in records if r["error"] is not None]
        assert len(ok) == final.request_counts.completed >= 10
        assert {r["error"]["code"] for r in dropped} == {"batch_cancelled"}
        assert len(dropped) >= 100  # never enqueued, or aborted
        assert final.fed < 150  # the rest were dropped before reaching a queue
        # lines in queues or running were stopped (saying how far they got); the rest never ran
        assert any("after" in r["error"]["message"] for r in dropped)
        assert any("before this request ran" in r["error"]["message"] for r in dropped)
    finally:
        worker.stop()


def test_a_killed_worker_and_a_restarted_broker_lose_nothing_and_double_nothing(tmp_path):
    from ops.local.broker import EmbeddedBroker
    from ops.subprocesses import free_port

    port, data = free_port(), tmp_path / "valkey"
    broker = EmbeddedBroker(port=port, data_dir=data).start(announce=False)
    url = broker.url
    first = start_worker(url, "llamacpp", extra_args=["--threads=2"])
    second = None
    try:
        with Client(url) as client:
            batch = client.batches.create(write_file(tmp_path / "r.jsonl", 160, max_tokens=24), model=MODEL)
            wait_for(lambda: client.batches.retrieve(batch.id).done >= 12, 300, "12 lines done")
            first.kill()  # mid-batch: jobs in flight on it
            # what it held when it died (no live worker has reaped it yet: its record stays)
            held = {k.decode() for k in client.redis.hkeys(keys.inflight(first.worker_id))}
            # More messages reserved than running (4 threads, prefetch 3 each): the ones not
            # running at the reconnect are put back by workers/redelivery/reconnect.py.
            second = start_worker(
                url,
                "llamacpp",
                extra_args=["--threads=2", "--concurrency=4"],
                env={"IB_CELERY_PREFETCH_MULTIPLIER": "3"},
            )
            wait_for(lambda: client.batches.retrieve(batch.id).done >= 60, 300, "60 lines done")
            before_restart = client.batches.retrieve(batch.id).done
            broker.server.stop()  # SIGTERM: the append-only file is flushed
            # Stay down until the worker sees the loss (mostly at once), or 20 s. A worker whose
            # prefetch is full reads nothing (kombu leaves the dead socket's event alone while
            # it cannot take more) and its running jobs wait for Redis (workers.running.outage); it
            # sees the loss when the first of them acks after the broker is back. Either way
            # the reconnect path below runs.
            lost = lambda: "Connection to broker lost" in second.log_path.read_text()  # noqa: E731
            try:
                wait_for(lost, 20, "the worker to see the outage")
            except TimeoutError:
                pass  # the full-prefetch case
            broker = EmbeddedBroker(port=port, data_dir=data).start(announce=False)
            # (without the reconnect step the dropped messages would wait for the 2 h visibility timeout)
            final = wait_for(lambda: (b := client.batches.retrieve(batch.id)).is_final and b, 600, "batch done")
            assert before_restart < 160, "the broker restart came after the batch had finished"
            assert final.status == "completed"
            assert (final.request_counts.completed, final.request_counts.failed) == (160, 0)
            records = list(client.batches.results(batch.id))
            assert [line_of(r) for r in records] == list(range(1, 161))
            assert len({r["custom_id"] for r in records}) == 160
            ids = [line_job_id(batch.id, n) for n in range(1, 161)]
            jobs = {i: client.record(i) for i in ids}
            # Engine runs, not outcomes (one outcome per job is the record's HSETNX): a job ran
            # more than once only if the killed worker held it; the broker restart and any
            # redelivery after it repeated no engine work.
            rerun = {i for i, j in jobs.items() if int(j["attempts"]) > 1}
            assert rerun and rerun <= held, (sorted(rerun - held), sorted(held))
            assert all(int(j["attempts"]) >= 1 for j in jobs.values())
            assert {j["worker"] for j in jobs.values()} >= {second.worker_id}
            # The reconnect step looked at what the worker held, and put back exactly the
            # reserved jobs that were not running (reserved jobs the thread pool started
            # during the outage finish and ack normally, so how many depends on timing).
            log = second.log_path.read_text()
            seen = re.search(r"broker reconnected: (\d+) job\(s\) reserved, (\d+) running", log)
            assert seen, "the reconnect step did not run"
            reserved, running = int(seen.group(1)), int(seen.group(2))
            back = re.search(r"broker reconnected: put (\d+) reserved job\(s\) back", log)
            assert (int(back.group(1)) if back else 0) == max(reserved - running, 0)
    finally:
        first.kill()
        if second is not None:
            second.stop()
        broker.stop()


RSS_BOUND_MB = 150


def _peak_rss_mb(args: list[str], env: dict[str, str]) -> tuple[int, float, str]:
    """Run ``ib ...`` as a grandchild and return (exit code, its peak RSS in MB, output)."""
    probe = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
        "print(p.stdout + p.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, sys.executable, "-m", "ops.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    head, _, rest = out.stdout.partition("\n")
    code, rss = head.split()
    return int(code), float(rss), rest


def test_a_100k_line_file_is_validated_and_enqueued_with_bounded_memory(redis_url, tmp_path):
    import os

    base, _, _ = redis_url.rpartition("/")
    url = f"{base}/12"  # no worker consumes here
    r = redis.Redis.from_url(url)
    r.flushdb()
    src = tmp_path / "big.jsonl"
    filler = "Summarise the following note in one line. " * 10
    with src.open("w") as fh:
        for i in range(100_000):
            fh.write(json.dumps({"custom_id": f"r{i}", "prompt": f"{filler}#{i}", "max_tokens": 16}) + "\n")
    size_mb = src.stat().st_size / 2**20
    env = {**os.environ, "REDIS_URL": url, "COLUMNS": "200", "IB_BATCH_FEEDER_IN_WORKERS": "false"}
    try:
        code, rss, output = _peak_rss_mb(["batch", "submit", str(src), "--model", MODEL], env)
        assert code == 0, output
        batch_id = re.search(r"batch (batch_[0-9a-f]+)", output).group(1)
        with Client(url) as client:
            batch = client.batches.retrieve(batch_id)
            assert batch.status == "in_progress" and batch.request_counts.total == 100_000
            assert rss < RSS_BOUND_MB, f"submit peaked at {rss:.0f} MB for a {size_mb:.0f} MB file"
            assert size_mb > 40  # the file alone would not fit under the bound with its parsed jobs

            code, feed_rss, output = _peak_rss_mb(["batch", "feed", "--once"], env)
            assert code == 0, output
            limit = client.batches.cfg.max_queued
            in_queues = sum(r.llen(k) for k in r.scan_iter("ib.*") if r.type(k) == b"list")
            assert client.batches.retrieve(batch_id).fed == limit == in_queues  # backpressure: no more
            assert feed_rss < RSS_BOUND_MB
        print(f"100k lines, {size_mb:.0f} MB: submit peak RSS {rss:.0f} MB, feeder {feed_rss:.0f} MB")
    finally:
        r.flushdb()


def test_a_line_whose_message_a_dying_worker_took_is_sent_again(redis_url, tmp_path, monkeypatch, caplog):
    """A worker killed between the broker's pop (BRPOP) and its record of the message takes
    the message with it. Here the test is that worker: it pops one fed line's message and
    drops it. The feeder sees the batch stall and sends that line again; the batch
    completes with every line answered once."""
    import logging
    import os
    import signal

    from conftest import own_database
    from core.celery_app import priority_queue_names
    from dispatcher.batch.feeder import BatchFeeder

    monkeypatch.setenv("IB_BATCH_LOST_LINE_CHECK_S", "2")
    caplog.set_level(logging.WARNING, logger="dispatcher.batch.feeder")
    with own_database(redis_url, 15) as url:
        worker = start_worker(url, "llamacpp", extra_args=["--threads=2"], env={"IB_BATCH_FEEDER_IN_WORKERS": "false"})
        feeder = None
        try:
            with Client(url) as client:
                os.kill(worker.proc.pid, signal.SIGSTOP)  # live for the fleet view a while yet, taking nothing
                batch = client.batches.create(write_file(tmp_path / "r.jsonl", 6, max_tokens=8), model=MODEL)
                feeder = BatchFeeder(client.parts, "test-feeder")
                feeder.run(once=True)
                assert int(client.batches.store.get(batch.id)["fed"]) == 6
                lists = priority_queue_names("ib.llamacpp", client.fleet.steps)
                taken = next(m for q in lists if (m := client.redis.rpop(q)) is not None)
                lost_id = json.loads(taken)["headers"]["id"]
                os.kill(worker.proc.pid, signal.SIGCONT)
                feeder.start()
                final = wait_for(lambda: (b := client.batches.retrieve(batch.id)).is_final and b, 120, "batch done")
                assert final.status == "completed"
                assert (final.request_counts.completed, final.request_counts.failed) == (6, 0)
                records = list(client.batches.results(batch.id))
                assert [line_of(r) for r in records] == list(range(1, 7))
                assert int(client.record(lost_id)["attempts"]) == 1
                assert "1 line(s) lost with a worker that died taking them: 1 sent again, 0 refused" in caplog.text
        finally:
            if feeder is not None:
                feeder.stop()
            os.kill(worker.proc.pid, signal.SIGCONT)
            worker.stop()
