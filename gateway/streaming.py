"""Server-sent events: OpenAI's stream chunks for chat and text completions.

A client that hangs up is noticed even while nothing is being sent (its job still queued
or in prefill): under uvicorn's ASGI 2.3 scope Starlette's StreamingResponse listens for
the disconnect and cancels the body, whose ``finally`` cancels the job
(tests/integration/test_gateway.py holds both cases).
"""

from __future__ import annotations

import json
import time
from typing import Any

from core.jobs import JobResult
from core.records import CHAT_URL, finish_reason, tool_calls_body, usage_body


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

    def start(self) -> str | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        return sse(self._chunk([self._choice("", None, first=True)])) if self.chat else None

    def delta(self, text: str) -> str:
        return "" if self.tools else sse(self._chunk([self._choice(text, None)]))

    def finish(self, result: JobResult) -> str:
        out = ""
        if self.tools:
            calls = [{"index": i, **call} for i, call in enumerate(tool_calls_body(result.tool_calls))]
            delta = {"tool_calls": calls} if calls else {"content": result.text}
            out += sse(self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]))
        out += sse(self._chunk([self._choice(None, finish_reason(result))]))
        if self.include_usage:
            out += sse({**self._chunk([]), "usage": usage_body(result.usage)})
        return out + DONE
