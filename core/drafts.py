"""Draft models for speculative decoding: is a draft compatible with its target?

A draft proposes tokens that the target verifies, so both must speak the same token ids
(the vocabulary itself, compared entry by entry, not the tokenizer's name) and come from
the same architecture family (the verification and the engines' draft support assume
it). The check reads the two models' HF folders: ``tokenizer.json`` (vocabulary and
added tokens) and ``config.json`` (``model_type``, ``vocab_size``). An incompatible draft
is refused with the first mismatch named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core.errors import JobError
from core.registry import ModelSpec


class IncompatibleDraftError(JobError, ValueError):
    code = "incompatible_draft"


@dataclass(frozen=True)
class DraftCheck:
    target: str
    draft: str
    vocab_size: int
    family: str
    target_layers: int
    draft_layers: int


def vocabulary(folder: Path) -> dict[str, int]:
    """Token → id, the tokenizer's model vocabulary plus its added (special) tokens."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data.get("model", {}).get("vocab") or {})
    for added in data.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    return vocab


def check_draft(target: ModelSpec, draft: ModelSpec) -> DraftCheck:
    """Raise IncompatibleDraftError naming the mismatch; both HF folders must be prepared."""
    t_dir, d_dir = target.artifact_path("hf"), draft.artifact_path("hf")
    t_cfg, d_cfg = (json.loads((p / "config.json").read_text()) for p in (t_dir, d_dir))
    what = f"draft {draft.name} for {target.name}"
    if target.family != draft.family or t_cfg.get("model_type") != d_cfg.get("model_type"):
        raise IncompatibleDraftError(
            f"{what}: architecture differs "
            f"({target.family}/{t_cfg.get('model_type')} vs {draft.family}/{d_cfg.get('model_type')})",
            {"target": target.name, "draft": draft.name, "mismatch": "architecture"},
        )
    t_vocab, d_vocab = vocabulary(t_dir), vocabulary(d_dir)
    if t_vocab != d_vocab or t_cfg.get("vocab_size") != d_cfg.get("vocab_size"):
        detail = _first_difference(t_vocab, d_vocab)
        raise IncompatibleDraftError(
            f"{what}: vocabulary differs ({len(t_vocab)} vs {len(d_vocab)} tokens, vocab_size "
            f"{t_cfg.get('vocab_size')} vs {d_cfg.get('vocab_size')}; {detail})",
            {"target": target.name, "draft": draft.name, "mismatch": "vocabulary"},
        )
    return DraftCheck(
        target.name,
        draft.name,
        len(t_vocab),
        target.family,
        int(t_cfg.get("num_hidden_layers", 0)),
        int(d_cfg.get("num_hidden_layers", 0)),
    )


def _first_difference(a: dict[str, int], b: dict[str, int]) -> str:
    for token in sorted(a.keys() | b.keys(), key=lambda t: (a.get(t, b.get(t, 0)), t)):
        if a.get(token) != b.get(token):
            return f"first difference: {token!r} is {a.get(token)} in the target and {b.get(token)} in the draft"
    return "the same tokens, a different vocab_size"
