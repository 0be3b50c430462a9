"""One running job in the llama.cpp context: its sequence id, sampler and prompt progress."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llama_cpp

from core.jobs import SamplingParams
from workers.engines.request import EngineRequest


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


def make_sampler(s: SamplingParams) -> Any:
    """A llama.cpp sampler chain for a sampling job: temperature -> top-p -> draw (the
    order transformers applies them), seeded when the job gives a seed. None for a greedy
    job: the scheduler takes its picks from one argmax over the step (Scheduler._pick)."""
    if s.greedy:
        return None
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(s.temperature))
    if s.top_p < 1.0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(s.top_p, 1))
    seed = s.seed if s.seed is not None else llama_cpp.LLAMA_DEFAULT_SEED
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed))
    return chain


def reservation(r: EngineRequest) -> int:
    """KV cells a job can use at most."""
    return len(r.prompt_ids) + r.sampling.max_tokens
