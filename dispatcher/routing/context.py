"""Context overflow refused at submit: nothing is enqueued for a job that cannot fit.

The prompt is counted with the model's own tokenizer and chat template (the light path
the prefix hints use, dispatcher.routing.prefix), against the window the job will be
served with: the model's context length, or the chosen backend's smaller
``max_model_len``. The rule itself is the contract's (``core.jobs.check_context``);
the worker applies it again (workers.engines.base) as the last guard, for hosts without
the tokenizer and for engines that count differently.
"""

from __future__ import annotations

from typing import Any

from core.jobs import GenerationJob
from core.registry import ModelSpec


def serving_window(model: ModelSpec, engine_config: dict[str, Any] | None = None) -> int:
    """The context window a job of ``model`` gets on a backend with ``engine_config``."""
    configured = (engine_config or {}).get("max_model_len")
    return min(model.context_length, int(configured)) if configured else model.context_length


# What a chat template may add around the messages, at most (bytes): a preamble (a default
# system prompt) and, per message, its role and special tokens. Generous on purpose: it
# only decides which jobs are worth counting exactly.
TEMPLATE_PREAMBLE_BYTES = 1024
TEMPLATE_PER_MESSAGE_BYTES = 256


def might_overflow(job: GenerationJob, window: int) -> bool:
    """False when the job cannot overflow ``window`` whatever the tokenizer: a byte-level
    tokenizer makes at most one token per byte (plus its few special tokens), so a
    prompt's bytes bound its tokens. Counting exactly is then skipped: a batch of short
    lines is validated at the speed of JSON, not of a tokenizer."""
    if job.prompt_ids is not None:
        bound = len(job.prompt_ids)
    elif job.messages is None:
        bound = len((job.prompt or "").encode()) + 8
    else:
        content = sum(len(m.content.encode()) for m in job.messages)
        bound = content + TEMPLATE_PREAMBLE_BYTES + TEMPLATE_PER_MESSAGE_BYTES * len(job.messages)
    return bound + job.sampling.max_tokens > window
