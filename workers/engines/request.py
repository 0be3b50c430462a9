"""What travels through an engine: a request (a job inside the engine, with its prompt ids
and where its output goes) and its output. Kept apart from the Engine interface so the
decoding helpers can use them without importing the engines that use the helpers."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.backends import SpeculativeConfig
from core.errors import EngineError
from core.jobs import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from workers.engines.shaping import Logprobs, Shaper

CancelSource = Callable[[list[str]], set[str]]


def never_cancelled(job_ids: list[str]) -> set[str]:
    return set()


@dataclass
class EngineOutput:
    token_ids: list[int]
    text: str
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    first_token_at: float | None
    finished_at: float
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    completion_tokens: int | None = None  # when the engine has no token ids (a remote server's usage)
    speculative: dict[str, Any] | None = None  # method, target passes, accepted tokens
    choices: list[EngineOutput] | None = None  # n > 1: every answer's output, this one first
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the job asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None: the first)
    echo_text: str | None = None  # the prompt as text, for an echo


@dataclass(eq=False)
class EngineRequest:
    """A job inside an engine: its prompt ids and where to deliver the output."""

    job_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    index: int = 0  # which of the job's n answers
    future: Future = field(default_factory=Future)
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finish_reason: str | None = None
    aborted: bool = False  # set when the caller gave up (time limit): the engine drops it
    cached_tokens: int = 0  # prompt tokens whose KV state came from a prefix cache
    on_text: Callable[[str], None] | None = None  # streaming: receives text deltas
    streamed: int = 0  # characters of text already sent to on_text
    speculative: SpeculativeConfig | None = None  # the engine's speculative config, if it applies to this job
    target_passes: int = 0  # speculative: forward passes of the target model
    drafted_tokens: int | None = None  # speculative: tokens proposed, where the engine knows it
    shaper: Shaper | None = None  # logit_bias, an EOS floor, a grammar (engines that run their own sampler)
    logprob_reader: Logprobs | None = None  # reads each position's logprobs (the job asked for them)
    logprobs: list[TokenLogprob] | None = None
    echo: bool = False  # the answer starts with the prompt
    cache_salt: str | None = None  # prefix-cache scope (core.tenancy)
    public_tokens: int = 0  # leading prompt tokens shared with every salt
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled while the prompt is evaluated (echo)

    @property
    def request_id(self) -> str:
        """Unique among the engine's requests (a job's n answers are n requests)."""
        return self.job_id if self.index == 0 else f"{self.job_id}#{self.index}"


def fail_requests(requests: list[EngineRequest], exc: BaseException) -> None:
    """Fail every unfinished request of a batch with a typed EngineError."""
    err = exc if isinstance(exc, EngineError) else EngineError(f"{type(exc).__name__}: {exc}")
    for r in requests:
        if not r.future.done():
            r.future.set_exception(err)
