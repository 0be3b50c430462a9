"""Prompt encoding with a transformers tokenizer, for the engines that load an HF folder.

Chat messages go through the model's own chat template (with the generation prompt),
plain prompts through the tokenizer with its special tokens (BOS where the model uses
one): the same ids transformers' own generate would see.
"""

from __future__ import annotations

from typing import Any

from core.jobs import GenerationJob


class HFTokenizerMixin:
    tokenizer: Any  # a transformers tokenizer, set by the engine's load()

    def encode(self, job: GenerationJob) -> list[int]:
        if job.messages is not None:
            text = self.tokenizer.apply_chat_template(
                [m.model_dump() for m in job.messages], tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(job.prompt)["input_ids"]

    @property
    def vocab_size(self) -> int | None:
        return len(self.tokenizer)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
