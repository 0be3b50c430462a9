"""What models exist (ModelRegistry, config/models.yaml and the user's own file), typed;
the backends are core.backends.

Formats: ``gguf`` (llama.cpp), ``onnx`` (ONNX Runtime), ``hf`` safetensors (vLLM, TGI,
PyTorch eager). A format the project can derive from one the model has counts as
available to the decision tree; the worker prepares it (``ib models prepare``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core import settings
from core.errors import UnknownModelError
from core.models import sources, user_file

if TYPE_CHECKING:
    from core.backends import BackendSpec

# A model's name is part of queue names (ib.<backend>@<model>) and Redis keys.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DERIVED_GGUF = "model.gguf"  # a derived GGUF's file in its prepared folder (llama.cpp loads a file)


class Artifact(BaseModel):
    source: str
    quantization: str | None = None


class Derivation(BaseModel):
    from_: str = Field(alias="from")
    model: str | None = None  # take the source format from this registered model (a derived draft)
    layers: int | None = Field(default=None, ge=1)  # keep the first N decoder layers (+ final norm and head)
    dtype: str = "float32"
    precision: str | None = None  # ONNX builder precision: fp32 | fp16 | int4


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key in a registry file is refused by name
    name: str
    display_name: str
    family: str
    hf_native: bool
    context_length: int
    revision: str | None = None  # the weights' version: prefix hashes of two revisions never match
    chat: bool = True
    license: str | None = None
    license_files: list[str] = Field(default_factory=list)  # beside the weights (terms of use)
    artifacts: dict[str, Artifact] = Field(default_factory=dict)
    derive: dict[str, Derivation] = Field(default_factory=dict)
    # Speculative decoding: the registered draft models of this one (same vocabulary and
    # architecture family, checked by core.drafts), and, on a draft, its target.
    drafts: list[str] = Field(default_factory=list)
    draft_of: str | None = None
    # Read from the model's own files by `ib models add` (workers.models.facts); unset on
    # hand-written entries.
    architecture: str | None = None
    model_context_length: int | None = None  # what the weights were trained for (context_length may be less)
    vocab_size: int | None = None
    parameters: int | None = None
    dtype: str | None = None  # HF weights' dtype, or the GGUF's quantization
    source: str | None = None  # what it was added from (`ib models add --from`)
    # backend -> why it cannot run this model (asked of the engines' packages at add time);
    # the decision tree never picks one of these.
    unsupported: dict[str, str] = Field(default_factory=dict)
    origin: Literal["config", "user"] = Field(default="config", exclude=True)  # which file defines it
    is_default: bool = Field(default=False, exclude=True)  # the registry's default: plain queue names

    @property
    def queue_model(self) -> str | None:
        """The model part of its queue names (core.celery_app.queue_for); None for the default."""
        return None if self.is_default else self.name

    def formats(self) -> dict[str, str]:
        """Each available format with how it is had: 'artifact' or 'derived from X'."""
        found = {fmt: "artifact" for fmt in self.artifacts}
        for fmt, how in self.derive.items():
            if how.model is not None:  # from another model's format
                found[fmt] = f"derived from {how.model} {how.from_}"
        changed = True
        while changed:  # derivations may chain (gguf -> hf -> onnx)
            changed = False
            for fmt, how in self.derive.items():
                if fmt not in found and how.from_ in found:
                    found[fmt] = f"derived from {how.from_}"
                    changed = True
        return found

    def runnable_on(self, backends: dict[str, BackendSpec]) -> dict[str, str]:
        """Backend → the format it would run (its preferred one the model has or can
        derive), for the backends whose engines can run this architecture."""
        formats = self.formats()
        return {
            name: next(f for f in spec.formats if f in formats)
            for name, spec in backends.items()
            if name not in self.unsupported and any(f in formats for f in spec.formats)
        }

    def prepared_dir(self, fmt: str) -> Path:
        """Where a derived format is cached under the data directory."""
        return settings.data_dir() / "models" / self.name / fmt

    def artifact_path(self, fmt: str) -> Path:
        """The file or folder of a format; raises FileNotFoundError with the fix."""
        if fmt in self.artifacts:
            return resolve_source(self.artifacts[fmt].source)
        if fmt in self.derive:
            path = self.prepared_dir(fmt)
            if (path / ".complete").exists():
                return path / DERIVED_GGUF if fmt == "gguf" else path
            raise FileNotFoundError(
                f"{self.name}: format {fmt} is not prepared yet: run `ib models prepare {self.name} --format {fmt}`"
            )
        raise FileNotFoundError(f"{self.name} has no {fmt} artifact (formats: {', '.join(self.formats())})")


def resolve_source(source: str) -> Path:
    """An artifact's file or folder on this host (core.models.sources); never downloads."""
    return sources.resolve(sources.parse(source))


class ModelRegistry:
    def __init__(self, models: dict[str, ModelSpec]) -> None:
        self.models = models

    @classmethod
    def from_config(cls, data: dict[str, Any] | None = None) -> ModelRegistry:
        """config/models.yaml with the user's registry file over it (an entry there replaces
        the bundled one of its name); ``data``: one file's contents, alone."""
        config = data if data is not None else settings.load_yaml("models.yaml")
        entries = {name: (spec, "config") for name, spec in (config.get("models") or {}).items()}
        if data is None:
            entries |= {name: (spec, "user") for name, spec in user_file.read().items()}
        models = {}
        for name, (spec, origin) in entries.items():
            if not MODEL_NAME.match(str(name)):
                raise ValueError(f"model name {name!r}: use letters, digits, '.', '_' and '-' (64 at most)")
            models[name] = ModelSpec(name=name, origin=origin, **spec)
        default = config.get("default_model") or next(iter(models), None)
        if default is not None:
            if default not in models:
                raise ValueError(f"models.yaml: default_model {default!r} is not registered")
            models[default].is_default = True
        _link_drafts(models)
        return cls(models)

    def names(self) -> list[str]:
        return sorted(self.models)

    def get(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(self.names()) or "(none)"
            raise UnknownModelError(f"unknown model {name!r}; known models: {known}", {"known": self.names()}) from None

    def drafts_for(self, name: str) -> list[ModelSpec]:
        """The draft models registered for ``name`` (compatibility: core.drafts)."""
        return [self.models[d] for d in self.get(name).drafts]


def _link_drafts(models: dict[str, ModelSpec]) -> None:
    """A draft names its target; the target lists it. A reference between entries to a
    model not registered is a config error, said at load."""
    for spec in models.values():
        target = models.get(spec.draft_of) if spec.draft_of else None
        if target is not None and spec.name not in target.drafts:
            target.drafts.append(spec.name)
    for spec in models.values():
        for ref in [
            *spec.drafts,
            *([spec.draft_of] if spec.draft_of else []),
            *(how.model for how in spec.derive.values() if how.model),
        ]:
            if ref not in models:
                raise ValueError(f"models.yaml: {spec.name} refers to {ref!r}, which is not registered")


class LiveRegistry(ModelRegistry):
    """The registry as the files say now: re-read when the user's registry file changes,
    so a long-running client or gateway serves a model `ib models add` registered after
    it started (one stat per look-up; bundled config changes still need a restart)."""

    def __init__(self) -> None:
        self._stamp = user_file.stamp()  # before reading: a change while reading is seen next time
        self._models = ModelRegistry.from_config().models

    @property  # type: ignore[override]
    def models(self) -> dict[str, ModelSpec]:
        now = user_file.stamp()
        if now != self._stamp:
            self._models, self._stamp = ModelRegistry.from_config().models, now
        return self._models
