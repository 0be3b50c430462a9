"""Redis stays bounded as jobs flow: prefix hints per worker, the batch indexes, and
kombu's binding tables of dead workers' own queues (a real Redis, a database of its own)."""

from __future__ import annotations

import time

import pytest
import redis

from conftest import own_database
from core.store import keys
from core.store.hints import PrefixHints
from dispatcher.client import Client
from workers.redelivery import reaper

pytestmark = pytest.mark.integration


@pytest.fixture
def url(redis_url):
    with own_database(redis_url, 11) as url:
        yield url


def test_a_busy_workers_prefix_hints_are_capped_and_the_stale_ones_trimmed(url):
    r = redis.Redis.from_url(url)
    hints = PrefixHints(r, ttl_s=2, max_worker_blocks=100)
    for job in range(50):  # 50 jobs of 8 new blocks each: 400 hashes offered
        hints.record("w1", [f"j{job}-b{i}" for i in range(8)])
    assert r.zcard(keys.worker_blocks("w1")) == 100  # the newest 100
    assert hints.lookup(["j49-b0", "j49-b1"]) == {"w1": 2}
    time.sleep(2.2)
    assert hints.lookup(["j49-b0"]) == {}  # not confirmed within the TTL: no longer a hint
    hints.record("w1", ["fresh"])
    assert r.zrange(keys.worker_blocks("w1"), 0, -1) == [b"fresh"]  # the stale ones trimmed
    assert hints.drop_worker("w1") == 1 and not r.exists(keys.worker_blocks("w1"))


def test_hints_recorded_in_a_callers_pipeline_are_the_same_writes(url):
    """The client records an affinity send's hints inside its push pipeline: the same
    script as a worker's own record, capped and given TTLs alike, run at execute."""
    r = redis.Redis.from_url(url)
    hints = PrefixHints(r, ttl_s=60, max_worker_blocks=3)
    pipe = r.pipeline(transaction=False)
    hints.record("w2", ["a", "b", "c", "d"], client=pipe)
    assert hints.lookup(["a"]) == {}  # nothing written before the caller executes
    pipe.execute()
    assert hints.lookup(["a", "b", "c", "d"]) == {"w2": 4}
    assert r.zcard(keys.worker_blocks("w2")) == 3  # capped like a worker's own record
    assert 0 < r.ttl(keys.prefix_block("a")) <= 60 and 0 < r.ttl(keys.worker_blocks("w2")) <= 60


def test_a_worker_does_not_rewrite_blocks_it_confirmed_moments_ago(url):
    """A job confirms its blocks as it starts and as it finishes: the second write is
    skipped within ``refresh_s``; a new block, a restart or a dispatch's record writes."""
    r = redis.Redis.from_url(url)
    hints = PrefixHints(r, ttl_s=60, refresh_s=30)
    hints.record("w3", ["a", "b"])
    r.delete(keys.prefix_block("a"))  # any record that writes puts it back
    hints.record("w3", ["a", "b"])  # the finish's confirmation, moments after the start's
    assert hints.lookup(["a"]) == {}
    hints.record("w3", ["a", "c"])  # a block not recorded yet: the whole record is written
    assert hints.lookup(["a", "c"]) == {"w3": 2}
    r.delete(keys.prefix_block("a"))
    hints.drop_worker("w3")  # a restarted worker remembers nothing
    hints.record("w3", ["a"])
    assert hints.lookup(["a"]) == {"w3": 1}
    pipe = r.pipeline(transaction=False)
    hints.record("w4", ["a"], client=pipe)  # a dispatch's record for another worker
    hints.record("w4", ["a"], client=pipe)
    pipe.execute()
    assert hints.lookup(["a"]) == {"w3": 1, "w4": 1}


def test_expired_batches_leave_every_index(url, monkeypatch):
    monkeypatch.setenv("IB_BATCH_RETENTION_S", "0")
    with Client(url) as client:
        old = [
            client.batches.create([{"custom_id": "a", "prompt": "hi"}], model="smollm2-135m", completion_window="1s")
            for _ in range(5)
        ]
        client.batches.store.r.zadd(keys.owner_batches("tenant"), {b.id: 1.0 for b in old})
        for b in old:  # as if the gateway had made them for this key
            client.batches.store.r.zadd(keys.BATCH_PURGES, {f"{b.id}\ntenant": b.expires_at})
        time.sleep(1.5)
        new = client.batches.create([{"custom_id": "a", "prompt": "hi"}], model="smollm2-135m")
        r = client.redis
        assert [m.decode() for m in r.zrange(keys.BATCHES, 0, -1)] == [new.id]
        assert r.zrange(keys.owner_batches("tenant"), 0, -1) == []
        assert r.zcard(keys.BATCH_PURGES) == 1


def test_a_dead_workers_binding_tables_go_with_its_queue_but_a_live_namesakes_stay(url, monkeypatch):
    r = redis.Redis.from_url(url)
    monkeypatch.setattr(reaper, "SWEEP_S", 0.0)
    for worker in ("dead-1", "back-1"):
        queue = f"ib.llamacpp.{worker}"
        r.hset(keys.WORKER_QUEUES, worker, queue)
        r.zadd(keys.ORPHANED, {worker: time.time() - 10})
        r.sadd(f"_kombu.binding.{queue}", f"{queue}\x06\x16\x06\x16{queue}")
        r.sadd(f"_kombu.binding_permanent.{queue}", f"{queue}\x06\x16\x06\x16{queue}")
    r.set(keys.worker("back-1"), "{}", px=60_000)  # restarted under the same id
    reaper.sweep_orphans(r)
    assert not r.exists("_kombu.binding.ib.llamacpp.dead-1", "_kombu.binding_permanent.ib.llamacpp.dead-1")
    assert r.exists("_kombu.binding.ib.llamacpp.back-1") and r.hget(keys.WORKER_QUEUES, "back-1")
    assert r.zcard(keys.ORPHANED) == 0
