"""A prompt's block-hash chain: what prefix-affinity routing looks up in the hints.

A prompt is tokenized with the model's own tokenizer (its chat template for messages),
cut into fixed blocks (16 tokens by default, vLLM's block size) and chain-hashed: each
block's hash covers its parent's hash, the block's token ids, and the model's identity
(name and revision), so equal hashes mean equal prefixes of the same model, and two
prompts share exactly the leading blocks they share. Only full blocks are hashed.

Which workers hold which blocks lives in Redis (core.store.hints).

Without a tokenizer for the model (its HF folder is not prepared on this host), the chain
is built over blocks of characters of the rendered prompt instead: an approximation,
since equal text prefixes are then only roughly equal token prefixes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from core.jobs import GenerationJob
from core.registry import ModelSpec

log = logging.getLogger(__name__)

CHARS_PER_BLOCK_FALLBACK = 4  # characters per token, roughly, when no tokenizer is at hand


def model_identity(model: ModelSpec) -> str:
    """What a hash chain is rooted in: the model's name and revision (its weights)."""
    return f"{model.name}@{model.revision or ''}"


def chain(
    units: list[int] | bytes, block_size: int, root: str, max_blocks: int, salt: str | None = None, public: int = 0
) -> list[str]:
    """Chain-hash the full blocks of ``units`` (token ids, or bytes of text): hex digests.
    ``salt`` (core.tenancy) enters the chain at the first block not wholly within the
    ``public`` leading units: equal prompts of two salts share only their public blocks."""
    unit = 4 if isinstance(units, list) else 1
    data = array("I", units).tobytes() if isinstance(units, list) else units
    width = block_size * unit
    parent = hashlib.blake2b(root.encode(), digest_size=16).digest()
    out: list[str] = []
    for start in range(0, min(len(data) // width, max_blocks) * width, width):
        if salt is not None and start + width > public * unit:
            parent = hashlib.blake2b(parent + salt.encode(), digest_size=16).digest()
            salt = None  # once: every later block hangs off the salted one
        parent = hashlib.blake2b(parent + data[start : start + width], digest_size=16).digest()
        out.append(parent.hex())
    return out


def render(job: GenerationJob, tokenizer: PromptTokenizer | None) -> str:
    """The prompt text the engines see: the chat template for messages, else the prompt."""
    if job.messages is None:
        return job.prompt or ""
    messages = [m.model_dump() for m in job.messages]
    if tokenizer is not None:
        return tokenizer.render(messages)
    return "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages)


class PromptTokenizer:
    """The model's tokenizer (``tokenizer.json``, Rust ``tokenizers``) and chat template
    (jinja2, sandboxed, as transformers renders it): what the engines feed the model,
    without importing transformers or torch into a dispatcher (tens of MB, not hundreds)."""

    def __init__(self, folder: Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_truncation()  # counts are for the context check: never cut short
        self.tokenizer.no_padding()
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        self.template = None  # a base model: prompts only (the dispatcher refuses messages for it)
        if isinstance(template, str):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(template)
        self.special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def render(self, messages: list[dict]) -> str:
        if self.template is None:
            raise ValueError("the model has no chat template: send a prompt")
        return self.template.render(messages=messages, add_generation_prompt=True, **self.special)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def count_batch(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        """Token counts of many texts at once (the Rust tokenizer works them in parallel)."""
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]


def _raise(message: str) -> None:
    raise ValueError(message)


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def load_tokenizer(model: ModelSpec) -> PromptTokenizer | None:
    """The model's tokenizer from its prepared HF folder; None without one (the
    char-block fallback is used then)."""
    try:
        return PromptTokenizer(model.artifact_path("hf"))
    except (FileNotFoundError, OSError, ValueError) as exc:
        log.warning("no tokenizer for %s (%s): prefix hints fall back to character blocks", model.name, exc)
        return None


class PrefixHasher:
    """A job → its prompt's block-hash chain. Each model's tokenizer is loaded once per
    hasher (a client's life); a missing one is looked for again after
    ``retry_missing_s``, so a client started before `ib models prepare` picks it up."""

    retry_missing_s = 60.0

    def __init__(
        self,
        block_size: int = 16,
        max_blocks: int = 256,
        tokenizer_for: Callable[[ModelSpec], Any | None] = load_tokenizer,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.tokenizer_for = tokenizer_for
        self._tokenizers: dict[str, tuple[Any | None, float]] = {}  # model → (tokenizer, when looked for)

    def tokenizer(self, model: ModelSpec) -> Any | None:
        key, now = model_identity(model), time.monotonic()
        found = self._tokenizers.get(key)
        if found is None or (found[0] is None and now - found[1] > self.retry_missing_s):
            found = self._tokenizers[key] = (self.tokenizer_for(model), now)
        return found[0]

    def prompt_ids(self, job: GenerationJob, model: ModelSpec) -> list[int] | None:
        """The prompt's token ids as the engines see them (chat template included), with the
        model's own tokenizer; None without one on this host. A prompt given as ids is
        those ids."""
        if job.prompt_ids is not None:
            return list(job.prompt_ids)
        tok = self.tokenizer(model)
        if tok is None:
            return None
        add_special = job.messages is None  # a chat template already holds its special tokens
        return list(tok.encode(render(job, tok), add_special_tokens=add_special))

    def count_many(self, jobs: list[GenerationJob], model: ModelSpec) -> list[int] | None:
        """``prompt_ids``' lengths for many jobs of one model, counted in one batch; None
        without a tokenizer."""
        tok = self.tokenizer(model)
        if tok is None:
            return None
        counts = [len(job.prompt_ids or ()) for job in jobs]
        for plain in (True, False):  # a chat template already holds its special tokens
            picked = [i for i, job in enumerate(jobs) if (job.messages is None) == plain and job.prompt_ids is None]
            if picked:
                texts = [render(jobs[i], tok) for i in picked]
                for i, n in zip(picked, tok.count_batch(texts, add_special_tokens=plain)):
                    counts[i] = n
        return counts

    def hashes(
        self, job: GenerationJob, model: ModelSpec, block_size: int | None = None, ids: list[int] | None = None
    ) -> list[str]:
        """``block_size``: the backend's own KV block size, if it differs from the default;
        ``ids``: the prompt's ids if the caller has them already (``prompt_ids``)."""
        block = block_size or self.block_size
        root = f"{model_identity(model)}/{block}"
        if ids is None:
            ids = self.prompt_ids(job, model)
        salt = job.cache_salt
        shared = job.public_messages and salt is not None
        if ids is None:
            text = render(job, None).encode()
            public = _common(render(_public_part(job), None).encode(), text) if shared else 0
            return chain(text, block * CHARS_PER_BLOCK_FALLBACK, root + "#chars", self.max_blocks, salt, public)
        public = _common(self.prompt_ids(_public_part(job), model) or [], ids) if shared else 0
        return chain(ids[: block * self.max_blocks], block, root, self.max_blocks, salt, public)


def _public_part(job: GenerationJob) -> GenerationJob:
    """The job's public leading messages alone (core.tenancy)."""
    return job.model_copy(update={"messages": (job.messages or [])[: job.public_messages]})


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
