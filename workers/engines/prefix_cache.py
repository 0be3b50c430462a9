"""A byte-bounded LRU store of prompt KV states, looked up by longest common prefix.

Why: a job that repeats a long system prompt (or few-shot examples, or a document) would
otherwise pay its whole prefill again. The llama.cpp engine saves a sequence's KV state
right after its prompt is evaluated; a later prompt that shares a leading run of tokens
with a stored one loads that state, drops the KV past the shared run, and evaluates
only the rest. One stored prompt therefore serves every later prompt that shares any
long enough prefix with it, not only exact repeats.

The store holds opaque bytes (whatever the engine's state API returns) and is bounded by
``budget_bytes``: the least recently used entries are evicted first; an entry larger
than the whole budget is not kept.

Entries belong to a salt (core.tenancy: one per API key): a prompt reuses its own salt's
states whole, and another salt's only up to the prefix both mark public (a system prompt
an operator shared), so ``cached_tokens`` never says what another tenant sent.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefixHit:
    tokens: int  # leading prompt tokens the state covers
    state: bytes  # the stored state (it may cover more tokens: the engine trims it)


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    reused_tokens: int = 0


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


Key = tuple[str | None, tuple[int, ...]]  # (salt, prompt ids)


@dataclass(frozen=True)
class Scope:
    """Whose a prompt is: its salt (None: unsalted) and how many of its leading tokens
    are public (shared with every salt)."""

    salt: str | None = None
    public: int = 0

    def reusable(self, other: Scope, common: int) -> int:
        """Of ``common`` shared leading tokens with an entry of ``other``, how many may be reused."""
        return common if other.salt == self.salt else min(common, self.public, other.public)


class PrefixStateCache:
    def __init__(self, budget_bytes: int, min_tokens: int = 32) -> None:
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[Key, bytes] = OrderedDict()
        self._arrays: dict[Key, tuple[np.ndarray, Scope]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int], scope: Scope = Scope()) -> PrefixHit | None:
        """The stored state sharing the longest reusable prefix with ``prompt`` (at least
        ``min_tokens``), marked as recently used; None on a miss."""
        p = np.asarray(prompt, dtype=np.int64)
        best_key, best_len = None, 0
        with self._lock:
            for key, (arr, owner) in self._arrays.items():
                n = scope.reusable(owner, common_prefix_len(p, arr))
                if n > best_len:
                    best_key, best_len = key, n
            if best_key is None or best_len < self.min_tokens:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(best_key)
            self.stats.hits += 1
            self.stats.reused_tokens += best_len
            return PrefixHit(tokens=best_len, state=self._entries[best_key])

    def wants(self, prompt: list[int], scope: Scope = Scope()) -> bool:
        """Whether a state for this prompt would be worth storing (long enough, and not
        already covered whole by an entry of its salt)."""
        if len(prompt) < self.min_tokens or self.budget_bytes <= 0:
            return False
        key = (scope.salt, tuple(prompt))
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return False
        return True

    def put(self, prompt: list[int], state: bytes, scope: Scope = Scope()) -> None:
        """Store the state of ``prompt``; entries of its salt it extends are replaced (it
        covers them)."""
        if len(state) > self.budget_bytes:
            return
        key = (scope.salt, tuple(prompt))
        arr = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            covered = [
                k
                for k, (a, owner) in self._arrays.items()
                if owner.salt == scope.salt and len(a) <= len(arr) and common_prefix_len(arr, a) == len(a)
            ]
            for k in covered:
                self._drop(k)
            self._entries[key] = state
            self._arrays[key] = (arr, scope)
            self._bytes += len(state)
            self.stats.stored += 1
            while self._bytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.evicted += 1

    def _drop(self, key: Key) -> None:
        self._bytes -= len(self._entries.pop(key))
        del self._arrays[key]
