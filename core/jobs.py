"""The job contract shared by the dispatcher and the workers (pydantic v2, JSON only).

The task message is (GenerationJob, Selection): what was asked, and where the dispatcher
sent it and why. A JobResult or a typed JobError (core.errors) comes back. Everything here round-trips
through JSON, because that is the only serializer the fleet accepts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from core.errors import ContextOverflowError, JobError, JobValidationError

BACKENDS: tuple[str, ...] = ("pytorch", "vllm", "tgi", "llamacpp", "onnx")
Backend = Literal["pytorch", "vllm", "tgi", "llamacpp", "onnx"]


class Priority(str, Enum):
    interactive = "interactive"
    normal = "normal"
    batch = "batch"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]  # tool: a function's result, as the template renders it
    content: str


class ToolCalling(BaseModel):
    """How a job's answer becomes tool calls (core.tool_calls reads it back): ``named``,
    the answer is that function's arguments; ``required``, a list of ``{name,
    parameters}``; ``auto``, the model's own choice, which needs a chat template that
    renders tools. The first two are enforced by the job's structured output."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: Literal["named", "required", "auto"]
    name: str | None = None  # named: the function


class ToolCall(BaseModel):
    """One call of a function the request offered, as the answer made it."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


N_MAX = 16  # answers per request
SEED_MAX = 2**63 - 1  # what every engine's generator takes (torch, vLLM); above it is a 400, not a 500
LOGPROBS_MAX = 20  # OpenAI's top_logprobs limit


class StructuredOutput(BaseModel):
    """What the answer must match, enforced token by token by a grammar engine (xgrammar on
    the fleet's own samplers, the engine's own structured outputs on vLLM): any JSON
    object, JSON matching a schema, a regular expression, or one of a list of strings."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["json_object", "json_schema", "regex", "choice"]
    json_schema: dict[str, Any] | None = None
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_value_for_its_kind(self) -> StructuredOutput:
        given = {k for k in ("json_schema", "regex", "choice") if getattr(self, k) is not None}
        wanted = set() if self.kind == "json_object" else {self.kind}
        if given != wanted:
            raise ValueError(f"a {self.kind} structured output takes {' '.join(wanted) or 'no value'}, got {given}")
        return self


class SamplingParams(BaseModel):
    """OpenAI-style sampling, with vLLM's extensions. temperature 0 means greedy.

    Each field that changes the logits beyond temperature and top_p is a *feature* a
    backend serves or not (``features()``): the dispatcher routes on them and refuses a
    job no backend can serve, naming the field, instead of dropping it.
    """

    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(default=128, ge=1, le=32768)
    n: int = Field(
        default=1, ge=1, le=N_MAX
    )  # answers to one prompt (its prefill shared where the engine keeps prefixes)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list, max_length=8)
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=300)
    top_k: int | None = Field(default=None, ge=1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    # The chosen token's logprob and this many alternatives per generated token (None: none).
    logprobs: int | None = Field(default=None, ge=0, le=LOGPROBS_MAX)
    # The same for each prompt token after the first (an echo with logprobs: loglikelihood).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=LOGPROBS_MAX)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value: dict[int, float]) -> dict[int, float]:
        if any(t < 0 for t in value):
            raise ValueError("logit_bias keys are token ids (non-negative integers)")
        if any(not -100.0 <= b <= 100.0 for b in value.values()):
            raise ValueError("logit_bias values must lie between -100 and 100")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, value: int, info: ValidationInfo) -> int:
        most = info.data.get("max_tokens")
        if most is not None and value > most:
            raise ValueError(f"min_tokens ({value}) exceeds max_tokens ({most})")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def features(self) -> set[str]:
        """The fields of this job that a backend must serve (named as in the request);
        ``echo`` stands for the prompt's logprobs, which only an echo asks for."""
        found = {name for name, used in SAMPLING_FEATURES.items() if used(self)}
        if self.structured is not None:
            found.add(self.structured.kind)
        return found

    @property
    def shapes_logits(self) -> bool:
        """Whether the next token depends on more than the logits, temperature and top_p
        (a grammar, penalties, biases, a floor on EOS): such jobs leave fast paths that
        assume it does not (the llama.cpp batch argmax, speculation)."""
        return bool(self.features() - {"include_stop_str_in_output", "logprobs", "echo", "n"})


# Each sampling feature, named as the request names it, and when a job uses it.
SAMPLING_FEATURES: dict[str, Callable[[SamplingParams], bool]] = {
    "presence_penalty": lambda s: s.presence_penalty != 0.0,
    "frequency_penalty": lambda s: s.frequency_penalty != 0.0,
    "repetition_penalty": lambda s: s.repetition_penalty != 1.0,
    "logit_bias": lambda s: bool(s.logit_bias),
    "top_k": lambda s: s.top_k is not None,
    "min_p": lambda s: s.min_p > 0.0,
    "min_tokens": lambda s: s.min_tokens > 0,
    "ignore_eos": lambda s: s.ignore_eos,
    "include_stop_str_in_output": lambda s: s.include_stop_str_in_output,
    "logprobs": lambda s: s.logprobs is not None,
    "echo": lambda s: s.prompt_logprobs is not None,
    "n": lambda s: s.n > 1,
}
# Every feature a backend may serve: those, and each kind of structured output.
FEATURES: tuple[str, ...] = (*SAMPLING_FEATURES, *get_args(StructuredOutput.model_fields["kind"].annotation))


class SLO(BaseModel):
    """What the caller needs; None means the fleet default from config/fleet.yaml."""

    model_config = ConfigDict(extra="forbid")
    latency_target_ms: float | None = Field(default=None, gt=0)
    throughput_target_tok_s: float | None = Field(default=None, ge=0)


class GenerationJob(BaseModel):
    """One text generation request, as submitted by a client."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=128)
    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_ids: list[int] | None = Field(default=None, min_length=1)  # a prompt given as token ids (OpenAI allows it)
    echo: bool = False  # completions: the answer starts with the prompt (and its logprobs, if asked)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    slo: SLO = Field(default_factory=SLO)
    hardware: Literal["gpu", "cpu"] | None = None  # a hint that overrides the live fleet
    backend: Backend | None = None  # an override that skips the tree
    priority: Priority = Priority.normal
    batch_id: str | None = None
    custom_id: str | None = None
    batch_line: int | None = Field(default=None, ge=1)  # the line of the batch file it came from
    stream: bool = False  # publish text deltas as they are generated (JobHandle.stream())
    # Speculative decoding: None = the backend's default, False = never (opt out), True = wanted.
    speculative: bool | None = None
    tool_calling: ToolCalling | None = None  # the answer is read back as tool calls
    # Prefix caches and hints share prompt state only among jobs of one salt (core.tenancy);
    # the leading ``public_messages`` messages are shared with every salt. None: unsalted.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=128)
    public_messages: int = Field(default=0, ge=0, le=1)
    submitted_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> GenerationJob:
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_ids)) != 1:
            raise ValueError("give exactly one of 'prompt' or 'messages' (or 'prompt_ids')")
        if self.echo and self.messages is not None:
            raise ValueError("echo is served for prompts (/v1/completions), not messages")
        if self.prompt_ids is not None and min(self.prompt_ids) < 0:
            raise ValueError("prompt token ids are non-negative integers")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV state the engine reused instead of evaluating (a prefix cache
    # hit); OpenAI reports the same as usage.prompt_tokens_details.cached_tokens.
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(BaseModel):
    """Wall-clock epoch seconds. Queue wait and TTFT are measured from submission."""

    submitted: float
    started: float
    first_token: float | None
    finished: float

    @property
    def queue_wait_s(self) -> float:
        return max(0.0, self.started - self.submitted)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def decode_s(self) -> float:
        return self.finished - (self.first_token or self.started)


class PathStep(BaseModel):
    """One step the dispatcher took: a question of the tree or a hard constraint."""

    check: str
    answer: str
    detail: str = ""

    def render(self) -> str:
        return f"{self.check}: {self.answer}" + (f" ({self.detail})" if self.detail else "")


class Selection(BaseModel):
    """The dispatcher's decision for one job, sent with it: backend, queue, format, the
    engine config it expects, and the path that led there."""

    backend: str
    queue: str
    model: str
    format: str
    config: dict[str, Any]
    path: list[PathStep]
    tree_choice: str
    # The prompt's block-hash chain (the worker confirms it holds them once done), and
    # the worker chosen for them, when prefix affinity won.
    prefix_hashes: list[str] = Field(default_factory=list)
    affinity_worker: str | None = None


class TopLogprob(BaseModel):
    """One candidate token at a position, as OpenAI reports it (its text and its bytes)."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A generated token's logprob, with the ``logprobs`` most likely alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "cancelled"]


class Choice(BaseModel):
    """One of a job's n answers."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None


JobStatus = Literal["queued", "running", "completed", "failed", "cancelled"]


class JobResult(BaseModel):
    id: str
    status: Literal["completed", "cancelled"]
    model: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    backend: str
    worker: str
    path: list[PathStep] = Field(default_factory=list)
    attempt: int = 1
    batch_id: str | None = None
    custom_id: str | None = None
    batch_line: int | None = None
    # method, target forward passes, tokens accepted beyond one per pass (None: not speculative)
    speculative: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the job asked
    tool_calls: list[ToolCall] | None = None  # the answer read as the job's tool calls (then text is their JSON)
    choices: list[Choice] | None = None  # n > 1: every answer, the first being the result's own fields
    echo_text: str | None = None  # an echo's prompt, which the answer starts with
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None: the first)

    @property
    def tokens_per_s(self) -> float:
        """Decode rate: tokens after the first over the time since the first."""
        n = self.usage.completion_tokens
        return (n - 1) / self.timings.decode_s if n > 1 and self.timings.decode_s > 0 else 0.0


def check_context(job: GenerationJob, prompt_tokens: int, window: int) -> None:
    """ContextOverflowError if the prompt and ``max_tokens`` do not fit in ``window``."""
    need = prompt_tokens + job.sampling.max_tokens
    if need > window:
        raise ContextOverflowError(
            f"this model's context window is {window} tokens; the job needs {need}"
            f" ({prompt_tokens} in the prompt + max_tokens {job.sampling.max_tokens}):"
            " shorten the prompt or lower max_tokens",
            {"context_length": window, "prompt_tokens": prompt_tokens, "max_tokens": job.sampling.max_tokens},
        )


def result_of(status: str, payload: dict[str, Any]) -> JobResult:
    """A job's final outcome (status, payload as the job record holds it) as its result;
    a failed job raises its typed JobError."""
    if status == "failed":
        raise JobError.from_dict(payload)
    return JobResult.model_validate(payload)


def parse_job(data: GenerationJob | dict[str, Any]) -> GenerationJob:
    """Validate a job, turning pydantic's error into the fleet's typed one."""
    if isinstance(data, GenerationJob):
        return data
    try:
        return GenerationJob.model_validate(data)
    except ValidationError as exc:
        raise JobValidationError.from_pydantic(exc) from None
