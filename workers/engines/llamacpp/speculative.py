"""Prompt-lookup speculation inside the continuous batch.

A decoding sequence whose job speculates (greedy, asked for or on by default) adds up to
``num_tokens`` drafted tokens to the step, after its last token: the tokens that followed
the latest earlier occurrence of its final n-gram (workers.engines.ngram). All of them are
evaluated in the same ``llama_decode`` as the rest of the batch; each draft is accepted
while it is the target's own pick at the position before it, the first miss is replaced
by that pick, and the KV cells of rejected drafts are removed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llama_cpp

from workers.engines.llamacpp.sequence import Sequence
from workers.engines.ngram import ngram_draft


class PromptLookup:
    def __init__(self, ctx: Any, memory: Any, num_tokens: int) -> None:
        self.ctx, self.memory, self.num_tokens = ctx, memory, num_tokens
        self.drafted_tokens = self.accepted_tokens = 0  # the engine's own counters

    def draft(self, s: Sequence) -> list[int]:
        """Drafts for a decoding sequence whose job speculates, never past its max_tokens:
        its KV cells stay within its reservation."""
        r = s.request
        if r.speculative is None or not self.num_tokens:
            return []
        k = min(self.num_tokens, r.sampling.max_tokens - len(r.tokens) - 1)
        return ngram_draft(r.prompt_ids + r.tokens, k, r.speculative.max_ngram, r.speculative.min_ngram)

    def verify(
        self,
        s: Sequence,
        first: int,
        n_past: int,
        draft: list[int],
        rows: list[int],
        take: Callable[[Sequence, int], bool],
        pick: Callable[[Sequence, int], int],
    ) -> None:
        """``first``: the target's pick after the sequence's last token; ``rows``: the batch
        rows of the drafts; ``take`` records a token and says whether the job ended;
        ``pick`` is the target's pick from a batch row's logits."""
        s.request.drafted_tokens = (s.request.drafted_tokens or 0) + len(draft)
        self.drafted_tokens += len(draft)
        accepted, tok = 0, first
        for d, row in zip(draft, rows, strict=True):
            if tok != d:
                break
            accepted += 1
            self.accepted_tokens += 1
            tok = pick(s, row)  # the pick after the accepted draft
            if take(s, tok):
                return
        # Cells n_past .. n_past + accepted hold the last token and the accepted drafts.
        s.n_past = n_past + 1 + accepted
        llama_cpp.llama_memory_seq_rm(self.memory, s.seq_id, s.n_past, -1)
