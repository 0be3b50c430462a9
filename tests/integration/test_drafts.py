"""Draft models: the derived SmolLM2 draft is compatible; a different vocabulary or
architecture is refused, naming the mismatch (the check reads the real files)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import ib
from dispatcher.drafts import IncompatibleDraftError, check_draft, check_registered
from dispatcher.registry import ModelRegistry

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def draft_dir(registry, hf_dir):
    from workers.models.prepare import prepare

    return prepare(registry.get("smollm2-135m-draft"), "hf")


def registry_with_draft_at(path) -> ModelRegistry:
    data = {
        "models": {
            "target": {
                "display_name": "t",
                "family": "llama",
                "hf_native": True,
                "context_length": 2048,
                "artifacts": {
                    "hf": {"source": str(ModelRegistry.from_config().get("smollm2-135m").artifact_path("hf"))}
                },
                "drafts": ["d"],
            },
            "d": {
                "display_name": "d",
                "family": "llama",
                "hf_native": True,
                "context_length": 2048,
                "artifacts": {"hf": {"source": str(path)}},
                "draft_of": "target",
            },
        }
    }
    return ModelRegistry.from_config(data)


def test_the_derived_draft_is_compatible_and_has_its_first_layers(registry, draft_dir):
    [check] = check_registered(registry, "smollm2-135m")
    assert (check.vocab_size, check.family, check.target_layers, check.draft_layers) == (49152, "llama", 30, 8)
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 8


def test_a_draft_with_another_vocabulary_is_refused_naming_the_token(draft_dir, tmp_path):
    bad = tmp_path / "bad-vocab"
    shutil.copytree(draft_dir, bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, different vocabulary
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    reg = registry_with_draft_at(bad)
    with pytest.raises(IncompatibleDraftError, match="vocabulary differs") as info:
        check_draft(reg.get("target"), reg.get("d"))
    assert "'hello'" in str(info.value) or "'world'" in str(info.value)
    assert info.value.details["mismatch"] == "vocabulary"


def test_a_draft_of_another_architecture_is_refused(draft_dir, tmp_path):
    bad = tmp_path / "bad-arch"
    shutil.copytree(draft_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(config))
    reg = registry_with_draft_at(bad)
    with pytest.raises(IncompatibleDraftError, match=r"architecture differs \(llama/llama vs llama/gpt2\)"):
        check_draft(reg.get("target"), reg.get("d"))


def test_ib_models_check_draft_says_compatible_or_refused(redis_url, draft_dir):
    ok = ib("models", "check-draft", "smollm2-135m", redis_url=redis_url)
    assert ok.returncode == 0 and "compatible (49152 tokens, family llama, 8 of 30 layers)" in " ".join(
        ok.stdout.split()
    )
