"""Prompt-lookup (n-gram) drafts: the tokens that followed the last earlier occurrence of
the sequence's final n tokens. Draft-free speculation: it pays where the answer repeats
its input (copying, extracting, quoting) and costs little where it finds nothing."""

from __future__ import annotations


def ngram_draft(seq: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to ``k`` drafted tokens for ``seq`` (prompt + generated so far): the longest
    suffix n-gram (``max_n`` down to ``min_n``) that occurred before, most recent match."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []
