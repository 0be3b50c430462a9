"""Server-sent events: OpenAI's stream chunks for chat and text completions.

The first answer's text streams as it is generated; what cannot (tool calls, which are
read from the whole answer; logprobs, which travel with the result; the other answers of
``n``) comes whole in chunks just before each answer's finish chunk. The SDKs accumulate
chunks per index, so a client reads the same answer either way.

A client that hangs up is noticed even while nothing is being sent (its job still queued
or in prefill): under uvicorn's ASGI 2.3 scope Starlette's StreamingResponse listens for
the disconnect and cancels the body, whose ``finally`` cancels the job
(tests/integration/test_gateway.py holds both cases).
"""

from __future__ import annotations

import json
import time
from typing import Any

from core.jobs import Choice, JobResult
from core.records import (
    CHAT_URL,
    answers,
    chat_logprobs,
    choice_finish,
    completion_logprobs,
    tool_calls_body,
    usage_body,
)


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")


class Chunks:
    """The chunks of one streamed answer, shaped as OpenAI's for its endpoint."""

    def __init__(self, url: str, job_id: str, model: str, include_usage: bool, tools: bool = False) -> None:
        self.chat = url == CHAT_URL
        # An answer read as tool calls sends them whole, in one delta before the last
        # chunk (the SDKs accumulate deltas either way); its JSON text is not content.
        self.tools = tools
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{job_id}"
        self.model, self.include_usage, self.created = model, include_usage, int(time.time())

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", "content": text or ""}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def _rest(self, result: JobResult, choice: Choice) -> dict[str, Any] | None:
        """One answer's part that was not streamed as it was generated (None: nothing)."""
        streamed = choice.index == 0 and not self.tools  # the first answer's text went out in deltas
        if not self.chat:
            logprobs = completion_logprobs(result, choice)
            if streamed and logprobs is None:
                return None
            return {
                "index": choice.index,
                "text": "" if streamed else choice.text,
                "logprobs": logprobs,
                "finish_reason": None,
            }
        delta: dict[str, Any] = {} if choice.index == 0 else {"role": "assistant"}
        if choice.tool_calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls_body(choice.tool_calls))]
        elif not streamed:
            delta["content"] = choice.text
        logprobs = chat_logprobs(choice.logprobs)
        if not delta and logprobs is None:
            return None
        return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def start(self) -> str | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        return sse(self._chunk([self._choice("", None, first=True)])) if self.chat else None

    def delta(self, text: str) -> str:
        return "" if self.tools else sse(self._chunk([self._choice(text, None)]))

    def finish(self, result: JobResult) -> str:
        """The end of the answer: what was not streamed token by token (tool calls, the
        logprobs, the other n - 1 answers, each whole under its index), each answer's
        finish chunk, the usage if asked."""
        out = ""
        for choice in answers(result):
            rest = self._rest(result, choice)
            if rest is not None:
                out += sse(self._chunk([rest]))
            finish = self._choice(None, choice_finish(choice))
            out += sse(self._chunk([{**finish, "index": choice.index}]))
        if self.include_usage:
            out += sse({**self._chunk([]), "usage": usage_body(result.usage)})
        return out + DONE
