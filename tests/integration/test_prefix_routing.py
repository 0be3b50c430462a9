"""Prefix-affinity routing with two real llama.cpp workers on real Redis.

Jobs sharing a long system prompt go to the worker that holds its KV state (and that
worker's own prefix cache counts the reuse); a prompt nobody holds goes to the shared
queue; a killed worker's hints vanish and its jobs go to the other one.
"""

from __future__ import annotations

import time

import pytest

from conftest import start_worker
from core.store import keys
from core.store.hints import PrefixHints

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
SYSTEM = (
    "You are the support assistant of a bicycle shop. You know its opening hours, its repair prices, "
    "its rental terms and its return policy, and you answer in one short sentence. "
) * 5


def job(question: str, system: str = SYSTEM) -> dict:
    return {
        "model": MODEL,
        "backend": "llamacpp",
        "sampling": {"max_tokens": 8},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }


def affinity(handle) -> str:
    step = [s for s in handle.path if s.check == "prefix affinity"]
    assert step, handle.path
    return step[-1].answer


def engine_stats(client, worker_id: str) -> dict:
    return next(w.engine_stats for w in client.workers(max_age_s=0).workers if w.worker_id == worker_id)


def test_jobs_follow_their_prefix_and_a_dead_workers_hints_vanish(client, redis_url):
    a = start_worker(redis_url, "llamacpp", extra_args=["--threads=1"])
    b = start_worker(redis_url, "llamacpp", extra_args=["--threads=1"])
    try:
        first = client.submit(job("When do you open?"))
        # nobody holds it yet: a new prefix, sent to a worker holding no blocks at all
        holder = affinity(first)
        assert holder in (a.worker_id, b.worker_id) and first.selection.queue == f"ib.llamacpp.{holder}"
        assert first.result(timeout=300).worker == holder
        other = b.worker_id if holder == a.worker_id else a.worker_id
        blocks = len(first.selection.prefix_hashes)
        assert blocks >= 10 and PrefixHints(client.redis).lookup(first.selection.prefix_hashes) == {holder: blocks}

        hits_before = engine_stats(client, holder)["prefix_hits"]
        for q in (
            "How much is a tune-up?",
            "Can I rent a tandem?",
            "Do you fix e-bikes?",
            "What is your return policy?",
        ):
            h = client.submit(job(q))
            assert affinity(h) == holder and h.selection.queue == f"ib.llamacpp.{holder}"
            r = h.result(timeout=300)
            assert r.worker == holder and r.usage.cached_tokens >= 64  # the prefix was not evaluated again
        time.sleep(1.5)  # a heartbeat carries the engine's counters
        assert engine_stats(client, holder)["prefix_hits"] >= hits_before + 4

        # another new prefix goes to the worker that holds fewer blocks: the other one
        fresh = client.submit(job("Hello?", system="You are a poet who only writes about the weather. " * 8))
        assert affinity(fresh) == other and fresh.result(timeout=300).worker == other
        short = client.submit(model=MODEL, messages=[{"role": "user", "content": "Hi"}], sampling={"max_tokens": 2})
        assert affinity(short) == "shared queue"  # too short to be worth routing
        short.result(timeout=300)

        (a if holder == a.worker_id else b).kill()
        # A job sent to the dead worker's own queue (a dispatcher with a stale fleet view)
        # is swept to the shared queue by the survivor's reaper, and runs there.
        stray = client._parse(job("Is there parking?"), {})
        sel = client.decide(stray, client.workers(max_age_s=0))
        client.enqueue([(stray, sel.model_copy(update={"queue": f"ib.llamacpp.{holder}", "affinity_worker": holder}))])
        deadline = time.monotonic() + 30
        while client.redis.exists(keys.worker_blocks(holder)) and time.monotonic() < deadline:
            time.sleep(0.2)  # the other worker's reaper drops the dead one's hints
        assert not client.redis.exists(keys.worker_blocks(holder))
        assert holder not in PrefixHints(client.redis).lookup(first.selection.prefix_hashes)
        assert client.result(stray.id, timeout=300).worker == other
        after = client.submit(job("Are you open on Sunday?"))
        assert after.result(timeout=300).worker == other
        # the survivor now holds the prefix: the next job goes to it directly
        again = client.submit(job("Do you sell helmets?"))
        assert affinity(again) == other and again.result(timeout=300).worker == other
    finally:
        a.kill()
        b.kill()


def test_the_model_tokenizer_chains_shared_system_prompts_block_by_block(registry, hf_dir, reference):
    from core.jobs import GenerationJob
    from dispatcher.routing.prefix import PrefixHasher, load_tokenizer

    spec = registry.get(MODEL)
    tok = load_tokenizer(spec)
    assert tok is not None
    hf = reference.tokenizer  # transformers' own tokenizer and chat template: what the engines use

    def hf_ids(j: GenerationJob) -> list[int]:
        text = hf.apply_chat_template([m.model_dump() for m in j.messages], tokenize=False, add_generation_prompt=True)
        return hf(text, add_special_tokens=False)["input_ids"]

    one = GenerationJob.model_validate(job("When do you open?"))
    two = GenerationJob.model_validate(job("Can I rent a tandem?"))
    for j in (one, two):  # the light tokenizer (tokenizers + jinja2) sees exactly what transformers sees
        assert tok.encode(tok.render([m.model_dump() for m in j.messages]), add_special_tokens=False) == hf_ids(j)
    plain = GenerationJob(model=MODEL, prompt="Once upon a time")
    assert tok.encode(plain.prompt, add_special_tokens=True) == hf(plain.prompt)["input_ids"]

    hasher = PrefixHasher(block_size=16)
    h1, h2 = hasher.hashes(one, spec), hasher.hashes(two, spec)
    ids1, ids2 = hf_ids(one), hf_ids(two)
    shared_tokens = next(i for i, (x, y) in enumerate(zip(ids1, ids2)) if x != y)
    assert len(h1) == len(ids1) // 16
    assert sum(a == b for a, b in zip(h1, h2)) == shared_tokens // 16  # exactly the full blocks of the shared tokens
    # no tokenizer: character blocks, still shared for a shared text prefix
    chars = PrefixHasher(block_size=16, tokenizer_for=lambda _: None)
    c1, c2 = chars.hashes(one, spec), chars.hashes(two, spec)
    assert c1[:10] == c2[:10] and c1 != h1
