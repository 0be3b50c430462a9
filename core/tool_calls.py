"""Tool calls: the request's tools as what the model is told and held to, and its answer
read back as calls.

A chat template that renders tools (and a parser for what the model then writes) is a
per-model matter; SmolLM2's template has none. So the fleet serves the two choices it can
enforce on any model: a named function (``tool_choice: {"type": "function", ...}``; the
answer is that function's arguments, held to its parameter schema by the grammar) and
``required`` (a JSON list of ``{name, parameters}``, one of the offered functions each,
vLLM's shape). The functions are described to the model in a system message. ``auto``
needs the model's template (refused at submit where it has none, naming the model), and
``none`` leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
from typing import Any

from core.jobs import ToolCall, ToolCalling

TOOLS_INTRO = (
    "You can call these functions. To call one, answer with its call as JSON and nothing else.\nFunctions (JSON): "
)


def tools_system_text(functions: list[dict[str, Any]]) -> str:
    """What the model is told of the functions it may call."""
    return TOOLS_INTRO + json.dumps(functions, ensure_ascii=False)


def named_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """A named call: the answer is the function's arguments."""
    return parameters or {"type": "object", "properties": {}}


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A required call: a list of calls of the offered functions (one, unless parallel)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": named_schema(f["parameters"]),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call_id(job_id: str, index: int) -> str:
    return f"call_{job_id[-24:]}_{index}"


def read_calls(text: str, calling: ToolCalling, job_id: str) -> list[ToolCall] | None:
    """The answer as tool calls; None where it is not whole JSON (cut by max_tokens): the
    text is then answered as it is, with its finish reason."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if calling.mode == "named" and calling.name is not None:
        return [ToolCall(id=call_id(job_id, 0), name=calling.name, arguments=json.dumps(value, ensure_ascii=False))]
    if calling.mode == "required" and isinstance(value, list):
        return [
            ToolCall(
                id=call_id(job_id, i),
                name=str(call.get("name")),
                arguments=json.dumps(call.get("parameters", {}), ensure_ascii=False),
            )
            for i, call in enumerate(value)
            if isinstance(call, dict)
        ]
    return None
