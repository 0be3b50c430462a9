"""API keys and tenancy: who is asking, as the hash of their key.

Keys come from ``IB_API_KEYS`` (comma-separated, a secret from the environment) and from a
keys file (``IB_API_KEYS_FILE``, default ``<data dir>/gateway/api_keys``) that holds only
SHA-256 digests, one ``sha256:<hex> [label]`` per line, written by `ib keys add`. A
presented key is hashed and compared with every digest in constant time. The first 16 hex
digits of the digest name the key's tenant: its files, batches and queue limit.

Without any key the gateway is open, and `ib serve` then binds loopback only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from core import settings
from gateway.errors import APIError

KEYS_ENV = "IB_API_KEYS"
KEYS_FILE_ENV = "IB_API_KEYS_FILE"
OPEN_TENANT = "local"  # everyone, when no key is configured


def keys_file() -> Path:
    return Path(os.environ.get(KEYS_FILE_ENV) or settings.data_dir() / "gateway" / "api_keys")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_of(key_digest: str) -> str:
    return key_digest[:16]


@dataclass(frozen=True)
class KeyRing:
    digests: tuple[str, ...]

    @classmethod
    def load(cls) -> KeyRing:
        found = [digest(k.strip()) for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip()]
        path = keys_file()
        if path.is_file():
            for line in path.read_text().splitlines():
                entry = line.split("#", 1)[0].split()
                if entry and entry[0].startswith("sha256:") and len(entry[0]) == 71:
                    found.append(entry[0][7:].lower())
        return cls(tuple(dict.fromkeys(found)))

    @property
    def open(self) -> bool:
        return not self.digests

    def tenant(self, presented: str | None) -> str | None:
        """The tenant of a presented key, or None. Every digest is compared, match or not."""
        if presented is None:
            return None
        wanted = digest(presented)
        match = None
        for known in self.digests:
            if hmac.compare_digest(known, wanted):
                match = known
        return tenant_of(match) if match else None


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def authenticate(request: Request) -> str:
    """The request's tenant; 401 in OpenAI's words without a valid key."""
    ring: KeyRing = request.app.state.keys
    if ring.open:
        request.state.tenant = OPEN_TENANT
        return OPEN_TENANT
    presented = bearer(request)
    if presented is None:
        raise APIError(
            401,
            "You didn't provide an API key: send it as 'Authorization: Bearer KEY' (OPENAI_API_KEY in the SDK)",
            "missing_api_key",
        )
    tenant = ring.tenant(presented)
    if tenant is None:
        raise APIError(401, "Incorrect API key provided", "invalid_api_key")
    request.state.tenant = tenant
    return tenant


def add_key(label: str = "") -> tuple[str, Path]:
    """A new random key; only its digest is written (appended to the keys file)."""
    key = "ib-" + secrets.token_urlsafe(32)
    path = keys_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(f"sha256:{digest(key)} {label}".rstrip() + "\n")
    path.chmod(0o600)
    return key, path
