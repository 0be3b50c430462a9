"""TGI engine: a thin, concurrent client of a remote text-generation server.

TGI (or any server with the OpenAI-compatible Messages API: vLLM's, llama.cpp's) does
the batching itself; the worker only carries jobs to it. Each Celery task thread makes
one streaming request with the ``openai`` client, so as many jobs are in flight against
the server as the worker's concurrency (``max_concurrent``) allows.

Failures:
- connection errors and 5xx before the first byte: retried by the client with
  exponential backoff (``max_retries``);
- the server going away mid-generation: the whole request is retried, up to
  ``request_retries`` times with backoff (a partial answer is discarded, never stitched);
  after that the job fails with EngineError naming the endpoint;
- 4xx: not retried; the job fails with the server's own message (a context overflow
  as ContextOverflowError).

Cancel (and the time limit) closes the stream; the server stops generating for a
disconnected client. The server tokenizes; prompt and completion token counts are the
server's ``usage`` (asked for with ``stream_options.include_usage``). A server that sends
no usage in its stream (llama.cpp's) gets its completion tokens counted from the stream,
one per content chunk, and prompt tokens reported as 0.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from core.backends import TgiSpec
from core.errors import ContextOverflowError, EngineError, JobTimeoutError, UnsupportedByBackendError
from core.jobs import GenerationJob, StructuredOutput
from workers.engines.base import Engine
from workers.engines.request import EngineOutput

log = logging.getLogger(__name__)


def response_format(s: StructuredOutput) -> dict[str, Any]:
    """OpenAI's response_format for a JSON structured output."""
    if s.kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": s.json_schema, "strict": True}}
    return {"type": "json_object"}


class TgiEngine(Engine[TgiSpec]):
    backend = "tgi"

    @property
    def endpoint(self) -> str:
        url = self.config.endpoint or os.environ.get("IB_TGI_ENDPOINT")
        if not url:
            raise FileNotFoundError("the TGI backend needs its server: `ib worker --backend tgi --endpoint URL`")
        return str(url).rstrip("/")

    @property
    def capacity(self) -> int:
        return self.config.max_concurrent

    def load(self) -> None:
        base_url = self.endpoint if self.endpoint.endswith("/v1") else f"{self.endpoint}/v1"
        self.client = openai.OpenAI(
            base_url=base_url,
            api_key=os.environ.get("IB_TGI_API_KEY", "not-needed"),
            max_retries=self.config.max_retries,
            timeout=openai.Timeout(self.config.request_timeout_s, connect=10.0),
        )
        self.served_model = self.config.served_model or self._served_model()
        log.info(
            "tgi engine: %s at %s (served as %s), %d in flight",
            self.model.name,
            base_url,
            self.served_model,
            self.capacity,
        )

    def _served_model(self) -> str:
        try:
            models = self.client.models.list().data
        except openai.APIError as exc:
            raise EngineError(f"TGI server at {self.endpoint} did not answer: {exc}") from None
        return models[0].id if models else "tgi"

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "batching": "server",
            "endpoint": self.config.endpoint,
            "max_concurrent": self.capacity,
        }

    # The server tokenizes: there is no local tokenizer to count with.
    def encode(self, job: GenerationJob) -> list[int]:
        return []

    def decode(self, token_ids: list[int]) -> str:
        return ""

    def submit(self, request: Any) -> None:  # generate() is overridden: nothing is queued here
        raise NotImplementedError

    def generate(
        self, job: GenerationJob, timeout: float | None = None, on_text: Callable[[str], None] | None = None
    ) -> EngineOutput:
        if job.echo and job.prompt is None:  # the prompt's text is the server's to know
            raise UnsupportedByBackendError(
                "tgi does not serve echo of a prompt given as token ids (send the text, or use another backend)",
                {"backend": "tgi", "unsupported": ["echo"]},
            )
        with self.counted_in_flight():
            attempts = self.config.request_retries + 1
            for attempt in range(1, attempts + 1):
                try:
                    return self._stream(job, timeout, on_text if attempt == 1 else None)
                except (openai.APIConnectionError, openai.InternalServerError, httpx.TransportError) as exc:
                    if attempt == attempts:
                        raise EngineError(
                            f"TGI server at {self.endpoint} failed {attempts} times: {type(exc).__name__}: {exc}",
                            {"endpoint": self.endpoint, "attempts": attempts},
                        ) from None
                    backoff = self.config.retry_backoff_s * 2 ** (attempt - 1)
                    log.warning(
                        "job %s: %s; retrying in %.1f s (%d/%d)", job.id, type(exc).__name__, backoff, attempt, attempts
                    )
                    time.sleep(backoff)
            raise AssertionError("unreachable")

    def _request(self, job: GenerationJob) -> dict[str, Any]:
        s = job.sampling
        args: dict[str, Any] = {
            "model": self.served_model,
            "max_tokens": s.max_tokens,
            "temperature": 0.0 if s.greedy else s.temperature,
            "top_p": 1.0 if s.greedy else s.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if s.seed is not None:
            args["seed"] = s.seed
        if s.stop:
            args["stop"] = list(s.stop)
        extra = {
            k: v for k, v in (("presence_penalty", s.presence_penalty), ("frequency_penalty", s.frequency_penalty)) if v
        }
        if s.logit_bias:
            extra["logit_bias"] = {str(t): b for t, b in s.logit_bias.items()}
        if s.structured is not None:  # OpenAI's own field (TgiSpec.SERVES: JSON only)
            extra["response_format"] = response_format(s.structured)
        if extra:
            args["extra_body"] = extra  # as sent on both endpoints (completions has no typed fields for them)
        return args

    def _open(self, job: GenerationJob) -> Any:
        """The server's stream for this job; a refusal (4xx) as the typed error it means."""
        try:
            if job.messages is not None:
                return self.client.chat.completions.create(
                    messages=[m.model_dump() for m in job.messages], **self._request(job)
                )
            prompt = job.prompt if job.prompt_ids is None else job.prompt_ids
            return self.client.completions.create(prompt=prompt, **self._request(job))
        except openai.APIStatusError as exc:
            if exc.status_code >= 500:
                raise
            message = f"TGI server refused the job (HTTP {exc.status_code}): {exc.message}"
            if "context" in exc.message.lower() or "too long" in exc.message.lower():
                raise ContextOverflowError(message, {"status_code": exc.status_code}) from None
            raise EngineError(message, {"status_code": exc.status_code}) from None

    def _stream(self, job: GenerationJob, timeout: float | None, on_text: Callable[[str], None] | None) -> EngineOutput:
        started = time.monotonic()
        stream = self._open(job)
        parts: list[str] = []
        pieces = 0  # content chunks: one token each in TGI's and llama.cpp's streams
        first_token_at, finish, usage = None, None, None
        with stream:
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    piece = choice.delta.content if hasattr(choice, "delta") else choice.text
                    if piece:
                        parts.append(piece)
                        pieces += 1
                        if on_text is not None:
                            on_text(piece)
                        first_token_at = first_token_at or time.time()
                    finish = choice.finish_reason or finish
                if self.cancelled([job.id]):
                    finish = "cancelled"
                    break
                if timeout is not None and time.monotonic() - started > timeout:
                    raise JobTimeoutError(
                        f"job {job.id} exceeded the {timeout:g} s time limit", {"time_limit_s": timeout}
                    )
        if finish is None:  # a clean end without an answer: the server gave up on this job
            raise EngineError(
                f"TGI server at {self.endpoint} ended the stream without finishing the job"
                f" ({len(parts)} chunks received); its log says why (an over-long prompt, for one)",
                {"endpoint": self.endpoint},
            )
        return EngineOutput(
            token_ids=[],
            text="".join(parts),
            finish_reason=finish if finish in ("stop", "length", "cancelled") else "stop",
            prompt_tokens=usage.prompt_tokens if usage else 0,
            first_token_at=first_token_at,
            finished_at=time.time(),
            completion_tokens=usage.completion_tokens if usage else pieces,
            echo_text=job.prompt if job.echo else None,
        )
