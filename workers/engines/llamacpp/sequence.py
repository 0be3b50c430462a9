"""One running job in the llama.cpp context: its sequence id, sampler and prompt progress."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llama_cpp

from core.jobs import SamplingParams
from workers.engines.request import EngineRequest
from workers.engines.shaping import penalized


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: EngineRequest
    sampler: Any  # llama_sampler_p; None for a greedy job (the scheduler's argmax picks its tokens)
    pending: list[int]  # prompt tokens still to evaluate
    n_past: int  # tokens of this sequence in the KV cache
    save_prefix: bool  # store the prompt's state once it is evaluated

    @property
    def prefilling(self) -> bool:
        return bool(self.pending)


def make_sampler(s: SamplingParams, n_vocab: int) -> Any:
    """A llama.cpp sampler chain: penalties (over the generated tokens, as vLLM's presence
    and frequency penalties count them) -> temperature -> top-k -> top-p -> min-p -> draw
    (vLLM's order), seeded when the job gives a seed; a greedy job with penalties ends in
    llama.cpp's greedy pick instead. None for a greedy job without penalties: the
    scheduler takes its picks from one argmax over the step (Scheduler._pick)."""
    if s.greedy and not penalized(s):
        return None
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())

    def add(sampler: Any) -> None:
        llama_cpp.llama_sampler_chain_add(chain, sampler)

    if penalized(s):  # the window: every token the job may generate
        add(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab, s.max_tokens, s.repetition_penalty, s.frequency_penalty, s.presence_penalty
            )
        )
    if s.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
        return chain
    add(llama_cpp.llama_sampler_init_temp(s.temperature))
    if s.top_k is not None:
        add(llama_cpp.llama_sampler_init_top_k(s.top_k))
    if s.top_p < 1.0:
        add(llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
    if s.min_p > 0.0:
        add(llama_cpp.llama_sampler_init_min_p(s.min_p, 1))
    seed = s.seed % 2**32 if s.seed is not None else llama_cpp.LLAMA_DEFAULT_SEED  # llama.cpp's seed is 32-bit
    add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


def reservation(r: EngineRequest) -> int:
    """KV cells a job can use at most."""
    return len(r.prompt_ids) + r.sampling.max_tokens
