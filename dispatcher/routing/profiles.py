"""Measured backend profiles (the seed's EXP-TBD table) and a memory estimate per 7B.

`ib bench profiles` (ops.profiles.bench) measures each live backend on the same
reference workload and stores one row per (backend, hardware kind) in a ProfileBook
(``config/profiles.json``); rows measured elsewhere (a GPU host) are kept when this
machine re-measures its own. The dispatcher's ``profile`` policy reads the book.

"Memory per 7B" is computed, not measured: weights from the architecture and the
backend's precision, plus the KV cache of the backend's configured concurrency at the
full context. It stands beside the measured memory of the small reference model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from core import settings
from core.backends import load_backends


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer's shape (Llama-style: gated MLP, GQA)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool
    context: int

    @property
    def params(self) -> int:
        head_dim = self.hidden // self.heads
        attn = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o and k, v projections
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (attn + mlp + 2 * self.hidden) + embeddings + self.hidden

    def kv_bytes_per_token(self, kv_bytes: float) -> float:
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * kv_bytes


# Llama-2-7B's published configuration: the "7B" of the seed's table. (Models with grouped
# KV heads, e.g. Mistral-7B with 8, need a quarter of its KV cache per token.)
LLAMA2_7B = Architecture(
    "Llama-2-7B",
    layers=32,
    hidden=4096,
    intermediate=11008,
    heads=32,
    kv_heads=32,
    vocab=32000,
    tied_embeddings=False,
    context=4096,
)

# (weight bits per parameter, KV-cache bytes per value) as each engine runs here.
# Q4_1: 32 weights share an fp16 scale and minimum (5 bits each); ONNX int4 (MatMulNBits,
# block 32, with scales and zero points): about 5 bits too; the CPU engines keep fp32
# activations and KV except llama.cpp (f16 KV).
PRECISION: dict[tuple[str, str], tuple[float, float, str]] = {
    ("pytorch", "cpu"): (32, 4, "fp32"),
    ("pytorch", "gpu"): (16, 2, "bf16"),
    ("vllm", "cpu"): (32, 4, "fp32"),
    ("vllm", "gpu"): (16, 2, "bf16"),
    ("tgi", "gpu"): (16, 2, "bf16"),
    ("tgi", "cpu"): (32, 4, "fp32"),
    ("llamacpp", "cpu"): (5, 2, "Q4_1, f16 KV"),
    ("llamacpp", "gpu"): (5, 2, "Q4_1, f16 KV"),
    ("onnx", "cpu"): (5, 4, "int4 weights, fp32 KV"),
    ("onnx", "gpu"): (5, 2, "int4 weights, fp16 KV"),
}


class MemoryEstimate(BaseModel):
    model: str
    precision: str
    weights_gb: float
    kv_mb_per_token: float = 0.0  # (books written before it was recorded: `--rewrite` fills it)
    kv_cache_gb: float
    context_tokens: int
    concurrency: int

    @property
    def total_gb(self) -> float:
        return round(self.weights_gb + self.kv_cache_gb, 1)

    def render(self) -> str:
        return (
            f"~{self.total_gb:g} GB: {self.weights_gb:g} GB weights + {self.kv_cache_gb:g} GB KV "
            f"({self.kv_mb_per_token:g} MB a token × {self.concurrency} sequences × {self.context_tokens} tokens), "
            f"{self.precision}"
        )


def estimate_memory(
    arch: Architecture, backend: str, kind: str, concurrency: int, context: int | None = None
) -> MemoryEstimate:
    bits, kv_bytes, precision = PRECISION[(backend, kind)]
    context = context or arch.context
    weights = arch.params * bits / 8
    kv = arch.kv_bytes_per_token(kv_bytes) * context * concurrency
    return MemoryEstimate(
        model=arch.name,
        precision=precision,
        weights_gb=round(weights / 1e9, 2),
        kv_mb_per_token=round(arch.kv_bytes_per_token(kv_bytes) / 1e6, 3),
        kv_cache_gb=round(kv / 1e9, 2),
        context_tokens=context,
        concurrency=concurrency,
    )


def configured_concurrency(backend: str) -> int:
    """Sequences the backend's engine holds at once, as config/backends.yaml sets it."""
    return load_backends()[backend].sequences


def with_current_estimate(row: BackendProfile) -> BackendProfile:
    """The row with its 7B estimate recomputed (formula or config changed, numbers kept)."""
    est = estimate_memory(LLAMA2_7B, row.backend, row.hardware_kind, configured_concurrency(row.backend))
    return row.model_copy(update={"estimate_7b": est})


class BackendProfile(BaseModel):
    backend: str
    hardware_kind: Literal["cpu", "gpu"]
    hardware: str
    model: str
    measured_at: str
    command: str
    jobs: int
    max_tokens: int
    mean_completion_tokens: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    single_stream_tok_s: float
    saturated_tok_s: float
    saturated_jobs: int
    memory_mb: float
    memory_kind: Literal["rss", "gpu"]
    estimate_7b: MemoryEstimate


class ProfileBook(BaseModel):
    rows: list[BackendProfile] = Field(default_factory=list)

    def get(self, backend: str, kind: str) -> BackendProfile | None:
        return next((r for r in self.rows if r.backend == backend and r.hardware_kind == kind), None)

    def merged(self, new: list[BackendProfile]) -> ProfileBook:
        """New rows replace old ones of the same backend and hardware kind; others stay."""
        keys = {(r.backend, r.hardware_kind) for r in new}
        kept = [r for r in self.rows if (r.backend, r.hardware_kind) not in keys]
        order = {b: i for i, b in enumerate(("pytorch", "vllm", "tgi", "llamacpp", "onnx"))}
        return ProfileBook(rows=sorted(kept + new, key=lambda r: (r.hardware_kind, order.get(r.backend, 9))))


def default_path() -> Path:
    return settings.config_dir() / "profiles.json"


def load(path: Path | None = None) -> ProfileBook | None:
    path = path or default_path()
    if not path.exists():
        return None
    return ProfileBook.model_validate_json(path.read_text())


def save(book: ProfileBook, path: Path | None = None) -> Path:
    path = path or default_path()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(book.model_dump(mode="json"), indent=2) + "\n")
    tmp.replace(path)
    return path
