"""Tenants share no cached prompt state unless an operator says they may.

A prefix cache answers faster for a prompt it has seen, and says so: ``cached_tokens`` in
the usage, the decision path's "N blocks cached on worker W". Shared across API keys, both
tell one tenant whether another recently sent the same prompt (vLLM added ``cache_salt``
for this). So every job from the HTTP gateway carries its tenant's salt: the prefix hints'
hash chain and the engines' prefix caches (llama.cpp's state cache, vLLM's block hashes)
treat equal prompts of different salts as different.

An operator may mark system prompts as shared (``prefix.shared_system_prompts``: the
SHA-256 of each prompt's text): a job whose first message is one of them shares that
message's cached state with every tenant, and only that: whatever follows it stays salted.
Jobs of the Python client and `ib batch` are one operator's own: no salt unless given.
"""

from __future__ import annotations

import hashlib

from core import settings
from core.jobs import GenerationJob


def salt_of(tenant: str) -> str:
    """A tenant's salt: derived, so the tenant's own id never travels in a message."""
    return hashlib.blake2b(f"ib-cache-salt/{tenant}".encode(), digest_size=12).hexdigest()


def digest(text: str) -> str:
    """What ``prefix.shared_system_prompts`` lists for a prompt: its SHA-256, in hex."""
    return hashlib.sha256(text.encode()).hexdigest()


def public_messages(job: GenerationJob) -> int:
    """Leading messages of ``job`` an operator marked shared across tenants (0 or 1)."""
    shared = settings.fleet_config().prefix.shared_system_prompts
    if not shared or not job.messages:
        return 0
    first = job.messages[0]
    text = first.content if isinstance(first.content, str) else None
    return int(first.role in ("system", "developer") and text is not None and digest(text) in shared)


def scoped(job: GenerationJob, tenant: str | None) -> GenerationJob:
    """``job`` as ``tenant``'s: salted (unless tenant isolation is off), with its shared
    system prompt marked. A job that names its own salt keeps it."""
    if tenant is None or job.cache_salt is not None or not settings.fleet_config().prefix.tenant_isolation:
        return job
    return job.model_copy(update={"cache_salt": salt_of(tenant), "public_messages": public_messages(job)})
