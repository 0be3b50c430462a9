"""OpenAI request bodies → fleet jobs (the direction the name says).

Each body is a pydantic model that refuses what it does not know: a field the fleet does
not serve (``tools``, ``logit_bias`` with entries, ``n`` above 1, ...) is a 400 naming the
field, never silently dropped. The routing knobs are extension fields in the same body
(``latency_target_ms``, ``throughput_target_tok_s``, ``backend``, ``priority``,
``speculative``); with the OpenAI SDK they travel in ``extra_body``.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.jobs import Priority
from gateway.errors import APIError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted; the fleet's chat templates have no speaker names

    def as_fleet(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(Strict):
    type: Literal["text"]


class Generation(Strict):
    """What chat and text completions share: sampling, streaming, the routing extensions."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: Literal[1] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields accepted only at the value that changes nothing
    presence_penalty: Literal[0] | None = None
    frequency_penalty: Literal[0] | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)
    # the fleet's extensions
    latency_target_ms: float | None = Field(default=None, gt=0)
    throughput_target_tok_s: float | None = Field(default=None, ge=0)
    backend: str | None = None
    priority: Priority | None = None
    speculative: bool | None = None

    @model_validator(mode="after")
    def _options_need_stream(self) -> Generation:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def job(self, default_max_tokens: int, max_tokens: int | None = None) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_tokens": max_tokens or self.max_tokens or default_max_tokens,
            # OpenAI's defaults, not the fleet's greedy one: a script that names no
            # temperature gets what it gets from OpenAI.
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
        }
        if self.stop is not None:
            sampling["stop"] = self.stop
        if self.seed is not None:
            sampling["seed"] = self.seed
        job: dict[str, Any] = {
            "model": self.model,
            "sampling": sampling,
            "slo": {
                "latency_target_ms": self.latency_target_ms,
                "throughput_target_tok_s": self.throughput_target_tok_s,
            },
            "stream": self.stream,
        }
        for key in ("backend", "speculative"):
            if getattr(self, key) is not None:
                job[key] = getattr(self, key)
        job["priority"] = (self.priority or Priority.interactive).value
        return job

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Literal[False] | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None  # meaningless without tools, which are refused
    store: Literal[False] | None = None

    def to_job(self, default_max_tokens: int) -> dict[str, Any]:
        job = self.job(default_max_tokens, self.max_completion_tokens)
        job["messages"] = [m.as_fleet() for m in self.messages]
        return job


class CompletionRequest(Generation):
    prompt: str | list[str]
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    logprobs: Literal[0] | None = None
    suffix: None = None

    def to_job(self, default_max_tokens: int) -> dict[str, Any]:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(
                    400, "prompt: one prompt per request (send a batch for many)", "invalid_request", "prompt"
                )
            prompt = prompt[0]
        job = self.job(default_max_tokens)
        job["prompt"] = prompt
        return job


T = TypeVar("T", bound=BaseModel)


def parse(model: type[T], body: dict[str, Any]) -> T:
    """Validate a body; the first problem becomes a 400 naming its field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            message = f"Unsupported parameter: '{param}' is not served by this gateway (docs/gateway.md)"
            raise APIError(400, message, "unsupported_parameter", param) from None
        raise APIError(400, f"{param}: {err['msg']}", "invalid_request", param) from None
