"""PrefixStateCache: longest-common-prefix lookup, LRU eviction under a byte budget."""

from __future__ import annotations

import numpy as np

from workers.engines.prefix_cache import PrefixStateCache, common_prefix_len

SYSTEM = list(range(100, 150))  # a 50-token "system prompt"


def test_common_prefix_len():
    a = np.array([1, 2, 3, 4])
    assert common_prefix_len(a, np.array([1, 2, 9])) == 2
    assert common_prefix_len(a, np.array([1, 2])) == 2
    assert common_prefix_len(a, np.array([7])) == 0
    assert common_prefix_len(a, a) == 4


def test_lookup_finds_the_longest_shared_prefix_across_entries():
    c = PrefixStateCache(budget_bytes=1000, min_tokens=8)
    c.put(SYSTEM + [1, 2, 3], b"A" * 10)
    c.put(SYSTEM[:20] + [9] * 40, b"B" * 10)
    hit = c.lookup(SYSTEM + [7, 7])
    assert hit is not None and hit.tokens == 50 and hit.state == b"A" * 10
    hit = c.lookup(SYSTEM[:20] + [9] * 5)
    assert hit is not None and hit.tokens == 25 and hit.state == b"B" * 10
    assert c.stats.hits == 2 and c.stats.reused_tokens == 75


def test_a_short_shared_prefix_is_a_miss():
    c = PrefixStateCache(budget_bytes=1000, min_tokens=32)
    c.put(SYSTEM, b"A")
    assert c.lookup(SYSTEM[:31] + [0] * 40) is None
    assert c.lookup([0] * 60) is None
    assert c.stats.misses == 2 and c.stats.hits == 0


def test_lru_eviction_keeps_bytes_under_budget():
    c = PrefixStateCache(budget_bytes=250, min_tokens=1)
    prompts = [[i] * 10 for i in range(1, 5)]
    for p in prompts[:2]:
        c.put(p, b"x" * 100)
    assert c.lookup(prompts[0]) is not None  # 0 is now more recent than 1
    c.put(prompts[2], b"x" * 100)  # 300 > 250: the least recently used (1) goes
    assert c.bytes_used == 200 and c.stats.evicted == 1
    assert c.lookup(prompts[1]) is None
    assert c.lookup(prompts[0]) is not None and c.lookup(prompts[2]) is not None


def test_an_entry_larger_than_the_budget_is_not_kept():
    c = PrefixStateCache(budget_bytes=50, min_tokens=1)
    c.put([1, 2, 3], b"x" * 51)
    assert len(c) == 0 and c.bytes_used == 0


def test_a_longer_prompt_replaces_the_entries_it_extends():
    c = PrefixStateCache(budget_bytes=1000, min_tokens=4)
    c.put(SYSTEM, b"s" * 10)
    c.put(SYSTEM + [1, 2], b"l" * 20)
    assert len(c) == 1 and c.bytes_used == 20
    hit = c.lookup(SYSTEM + [5])
    assert hit is not None and hit.tokens == 50 and hit.state == b"l" * 20


def test_wants_skips_short_prompts_and_exact_repeats():
    c = PrefixStateCache(budget_bytes=1000, min_tokens=8)
    assert not c.wants([1, 2, 3])
    assert c.wants(SYSTEM)
    c.put(SYSTEM, b"s")
    assert not c.wants(SYSTEM)
    assert not PrefixStateCache(budget_bytes=0).wants(SYSTEM)


def test_a_salt_reuses_only_its_own_states_and_the_public_prefix_of_others():
    """core.tenancy: cached_tokens must not tell one tenant what another sent."""
    from workers.engines.prefix_cache import Scope

    cache = PrefixStateCache(budget_bytes=1 << 20, min_tokens=8)
    prompt = list(range(100))
    cache.put(prompt, b"state-a", Scope("tenant-a", public=40))
    assert cache.lookup(prompt, Scope("tenant-a")).tokens == 100
    assert cache.lookup(prompt, Scope("tenant-b")) is None  # another tenant: nothing
    assert cache.lookup(prompt, Scope(None)) is None  # nor an unsalted job
    shared = cache.lookup(prompt, Scope("tenant-b", public=40))
    assert shared is not None and shared.tokens == 40  # the shared system prompt, and no further
    assert cache.lookup(prompt, Scope("tenant-b", public=4)) is None  # under min_tokens
    assert cache.wants(prompt, Scope("tenant-b")) and not cache.wants(prompt, Scope("tenant-a"))
    cache.put(prompt, b"state-b", Scope("tenant-b"))
    assert len(cache) == 2  # one per salt: b's put does not replace a's entry
    assert cache.lookup(prompt, Scope("tenant-a")).state == b"state-a"
