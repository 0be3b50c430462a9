"""OpenAI request bodies → fleet jobs: the one reading of a chat or completions body.

The gateway (``POST /v1/chat/completions``, ``/v1/completions``), each line of a batch
file (``ib batch submit``, ``/v1/batches``) and the Python client (``Client.create``) all
read a body here, so a body means the same on every door: the same accepted fields, the
same defaults (OpenAI's: temperature 1 and top_p 1 unless given) and the same refusals.
A field is either served or refused naming it (UnsupportedParameterError: a 400 on the
gateway, an error record in a batch); nothing is dropped silently. Whether a *backend*
serves a field is the dispatcher's question (core.jobs.SamplingParams.features).

vLLM's extensions are read as vLLM's server reads them (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``include_stop_str_in_output``,
``structured_outputs: {json | regex | choice}``), and so are the fleet's routing knobs
(``latency_target_ms``, ``throughput_target_tok_s``, ``backend``, ``priority``,
``speculative``); with the OpenAI SDK they travel in ``extra_body``.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core import settings
from core.errors import JobValidationError, UnsupportedParameterError
from core.jobs import N_MAX, GenerationJob, Priority, StructuredOutput, ToolCalling
from core.records import CHAT_URL, COMPLETIONS_URL
from core.tool_calls import named_schema, required_schema, tools_system_text

COMPLETION_LOGPROBS_MAX = 5  # OpenAI's limit for /v1/completions' logprobs


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionName(Strict):
    name: str


class FunctionCall(FunctionName):
    arguments: str


class ToolCallIn(Strict):
    """A tool call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted; the fleet's chat templates have no speaker names
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of

    @model_validator(mode="after")
    def _content_or_calls(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (an assistant message may give tool_calls instead)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def as_fleet(self) -> dict[str, str]:
        """The message as the chat template gets it: an assistant's calls as the JSON it
        would have answered with (the shape the fleet holds the model to)."""
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        if self.tool_calls:
            calls = [{"name": c.function.name, "parameters": _arguments(c.function.arguments)} for c in self.tool_calls]
            text = (text + "\n" if text else "") + json.dumps(calls, ensure_ascii=False)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class Function(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None  # the parameters are always enforced


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(Strict):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def structured(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput(kind="json_object")
        if self.type == "json_schema" and self.json_schema is not None:
            return StructuredOutput(kind="json_schema", json_schema=self.json_schema.schema_)
        return None


class StructuredOutputs(Strict):
    """vLLM's extension: one of a JSON schema, a regular expression, a list of choices."""

    json_: dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if len(self._given()) != 1:
            raise ValueError("give exactly one of json, regex or choice")
        return self

    def _given(self) -> dict[str, Any]:
        values = (("json_schema", self.json_), ("regex", self.regex), ("choice", self.choice))
        return {k: v for k, v in values if v is not None}

    def structured(self) -> StructuredOutput:
        ((kind, value),) = self._given().items()
        return StructuredOutput(kind=kind, **{kind: value})  # type: ignore[arg-type]


class Generation(Strict):
    """What chat and text completions share: sampling, streaming, the extensions."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=N_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    # vLLM's sampling extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputs | None = None
    # the fleet's routing extensions
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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    # ------------------------------------------------------------ to a job

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        """The job's sampling: OpenAI's defaults for what the body leaves out."""
        sampling: dict[str, Any] = {
            "max_tokens": self.max_tokens or default_max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "n": self.n or 1,
        }
        given = self.model_dump(
            include={
                "stop",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "logit_bias",
                "min_p",
                "repetition_penalty",
                "min_tokens",
                "ignore_eos",
                "include_stop_str_in_output",
            },
            exclude_none=True,
        )
        if self.top_k is not None and self.top_k > 0:  # vLLM's -1 (and 0) mean "all tokens"
            given["top_k"] = self.top_k
        structured = self.structured()
        if structured is not None:
            given["structured"] = structured
        return {**sampling, **given}

    def structured(self) -> StructuredOutput | None:
        return self.structured_outputs.structured() if self.structured_outputs is not None else None

    def routing(self, default_priority: Priority) -> dict[str, Any]:
        job: dict[str, Any] = {"priority": (self.priority or default_priority).value}
        if self.latency_target_ms is not None or self.throughput_target_tok_s is not None:
            job["slo"] = {
                "latency_target_ms": self.latency_target_ms,
                "throughput_target_tok_s": self.throughput_target_tok_s,
            }
        for key in ("backend", "speculative"):
            if getattr(self, key) is not None:
                job[key] = getattr(self, key)
        return job

    def prompt_fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_job(
        self, default_max_tokens: int, default_priority: Priority = Priority.interactive, **fields: Any
    ) -> GenerationJob:
        """The body as a validated job. ``fields`` are set by the door (id, batch ids,
        stream) and fill in what the body leaves out (``slo``)."""
        job = {"model": self.model, "stream": self.stream, **self.routing(default_priority), **self.prompt_fields()}
        job["sampling"] = self.sampling(default_max_tokens)
        for key, value in fields.items():
            if key == "slo" and "slo" in job:
                continue  # the body's own targets win over the door's defaults
            job[key] = value
        try:
            return GenerationJob.model_validate(job)
        except ValidationError as exc:
            raise request_error(exc, strip=("sampling", "structured")) from None


class ChatCompletionRequest(Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: Literal[False] | None = None

    @model_validator(mode="after")
    def _one_structure(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        shaped = [
            self.response_format is not None and self.response_format.type != "text",
            bool(self.structured_outputs),
        ]
        if self.calling() is not None:
            shaped.append(True)
        if sum(shaped) > 1:
            raise ValueError("give one of response_format, structured_outputs or a tool call, not several")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in self._functions():
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        return self

    def _functions(self) -> dict[str, Function]:
        return {t.function.name: t.function for t in self.tools or []}

    def calling(self) -> ToolCalling | None:
        """How the answer becomes tool calls; None: a plain answer (no tools, or ``none``)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolCalling(mode="named", name=self.tool_choice.function.name)
        return ToolCalling(mode=self.tool_choice or "auto")

    def _tool_schema(self, calling: ToolCalling) -> dict[str, Any]:
        functions = self._functions()
        if calling.mode == "named" and calling.name is not None:
            return named_schema(functions[calling.name].parameters)
        offered = [f.model_dump(include={"name", "parameters"}) for f in functions.values()]
        return required_schema(offered, self.parallel_tool_calls is not False)

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        sampling = super().sampling(default_max_tokens)
        if self.max_completion_tokens is not None:
            sampling["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            sampling["logprobs"] = self.top_logprobs or 0
        return sampling

    def structured(self) -> StructuredOutput | None:
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.structured()
        calling = self.calling()
        if calling is not None and calling.mode != "auto":
            return StructuredOutput(kind="json_schema", json_schema=self._tool_schema(calling))
        return super().structured()

    def prompt_fields(self) -> dict[str, Any]:
        messages = [m.as_fleet() for m in self.messages]
        calling = self.calling()
        fields: dict[str, Any] = {"messages": messages}
        if calling is None:
            return fields
        fields["tool_calling"] = calling
        offered = self._functions()
        if calling.mode == "named" and calling.name is not None:
            offered = {calling.name: offered[calling.name]}
        text = tools_system_text([f.model_dump(exclude_none=True, exclude={"strict"}) for f in offered.values()])
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + text}
        else:
            messages.insert(0, {"role": "system", "content": text})
        return fields


class CompletionRequest(Generation):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(union_mode="left_to_right")
    echo: bool | None = None
    best_of: Literal[1] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=COMPLETION_LOGPROBS_MAX)
    suffix: None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1:
            raise ValueError("one prompt per request (send a batch for many)")
        if isinstance(p, list) and not p:
            raise ValueError("the prompt is empty")
        return self

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        sampling = super().sampling(default_max_tokens)
        if self.logprobs is not None:
            sampling["logprobs"] = self.logprobs
            if self.echo:  # the prompt's logprobs too: what loglikelihood evaluations read
                sampling["prompt_logprobs"] = self.logprobs
        return sampling

    def prompt_fields(self) -> dict[str, Any]:
        p = self.prompt
        one = p[0] if isinstance(p, list) and isinstance(p[0], (str, list)) else p
        fields: dict[str, Any] = {"prompt": one} if isinstance(one, str) else {"prompt_ids": one}
        if self.echo and self.stream:  # refused on every door, batch lines included
            raise UnsupportedParameterError(
                "echo is not streamed: ask without stream, or without echo",
                {"errors": [{"field": "echo", "message": "not served with stream: true"}]},
            )
        if self.echo:
            fields["echo"] = True
        return fields


Request = ChatCompletionRequest | CompletionRequest
REQUEST_TYPES: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    CHAT_URL: ChatCompletionRequest,
    COMPLETIONS_URL: CompletionRequest,
}


T = TypeVar("T", bound=BaseModel)


def validate(model: type[T], body: dict[str, Any]) -> T:
    """Any OpenAI body (a batch's create, a file's) by the same rule: the first problem
    raises a typed error naming its field, an unknown field is unsupported."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise request_error(exc) from None


def default_max_tokens() -> int:
    """What a body that names no max_tokens gets, on every door: fleet.yaml's
    ``gateway.default_max_tokens``."""
    return settings.fleet_config().gateway.default_max_tokens


def endpoint_of(body: dict[str, Any]) -> str:
    """The endpoint a body without one is for: chat if it has messages."""
    return CHAT_URL if "messages" in body else COMPLETIONS_URL


def parse_request(url: str, body: dict[str, Any]) -> Request:
    """A body for ``url`` (chat or completions), validated; the first problem raises a
    typed error naming its field."""
    if url not in REQUEST_TYPES:
        raise JobValidationError(f"url: only {CHAT_URL} and {COMPLETIONS_URL} are served (got {url})")
    return validate(REQUEST_TYPES[url], body)


def request_error(exc: ValidationError, strip: tuple[str, ...] = ()) -> JobValidationError:
    """pydantic's first error as the fleet's, its field named as the body names it."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if str(p) not in strip]
    param = ".".join(loc) or None
    problems = [{"field": param or "(request)", "message": err["msg"]}]
    if err["type"] == "extra_forbidden":
        return UnsupportedParameterError(
            f"Unsupported parameter: '{param}' is not served by this fleet (docs/gateway.md)", {"errors": problems}
        )
    return JobValidationError(f"{param or 'request'}: {err['msg']}", {"errors": problems})
