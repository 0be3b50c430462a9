"""Backend profiles: the 7B memory estimate, the book, its docs table, and the profile policy."""

from __future__ import annotations

import pytest

from core.fleet import FleetView
from dispatcher.routing.decision import decide
from dispatcher.routing.profiles import (
    LLAMA2_7B,
    Architecture,
    BackendProfile,
    ProfileBook,
    estimate_memory,
    load,
    save,
)
from ops.profiles.docs import END, START, write
from tests.unit.test_decision import BACKENDS, MODELS, POLICY, job, worker

# SmolLM2-135M's config.json: 30 layers, hidden 576, MLP 1536, 9 heads (3 KV), 49152 tokens, tied
SMOLLM2 = Architecture("SmolLM2-135M", 30, 576, 1536, 9, 3, 49152, True, 8192)


def test_parameter_counts_match_the_published_sizes():
    assert LLAMA2_7B.params == pytest.approx(6.74e9, rel=0.001)  # "7B": 6,738,415,616
    assert SMOLLM2.params == pytest.approx(134.5e6, rel=0.005)


def test_memory_estimate_per_7b():
    gpu = estimate_memory(LLAMA2_7B, "vllm", "gpu", concurrency=64)
    assert gpu.weights_gb == pytest.approx(13.48, abs=0.01)  # bf16: 2 bytes a parameter
    assert LLAMA2_7B.kv_bytes_per_token(2) == 2**19  # 0.5 MiB a token in fp16
    assert gpu.kv_cache_gb == pytest.approx(64 * 4096 * 2**19 / 1e9, abs=0.01)
    q4 = estimate_memory(LLAMA2_7B, "llamacpp", "cpu", concurrency=8)
    assert q4.weights_gb == pytest.approx(4.21, abs=0.01) and "Q4_1" in q4.render()
    assert q4.total_gb == round(q4.weights_gb + q4.kv_cache_gb, 1)


def row(backend: str, ttft: float, tok_s: float, kind: str = "cpu", when: str = "2026-12-01") -> BackendProfile:
    return BackendProfile(
        backend=backend,
        hardware_kind=kind,
        hardware="test CPU",
        model="all",
        measured_at=when,
        command="ib bench profiles",
        jobs=8,
        max_tokens=64,
        mean_completion_tokens=60,
        ttft_p50_ms=ttft,
        ttft_p95_ms=ttft * 1.5,
        single_stream_tok_s=tok_s / 3,
        saturated_tok_s=tok_s,
        saturated_jobs=32,
        memory_mb=300,
        memory_kind="rss",
        estimate_7b=estimate_memory(LLAMA2_7B, backend, kind, 8),
    )


BOOK = ProfileBook(
    rows=[row("onnx", 60, 350), row("llamacpp", 120, 300), row("pytorch", 900, 500), row("vllm", 40, 9000, "gpu")]
)


def test_the_book_merges_by_backend_and_hardware_and_round_trips(tmp_path):
    newer = BOOK.merged([row("onnx", 55, 360, when="2026-12-02")])
    assert [(r.backend, r.hardware_kind) for r in newer.rows] == [
        ("pytorch", "cpu"),
        ("llamacpp", "cpu"),
        ("onnx", "cpu"),
        ("vllm", "gpu"),
    ]
    assert newer.get("onnx", "cpu").measured_at == "2026-12-02" and newer.get("vllm", "gpu") is not None
    assert load(save(newer, tmp_path / "p.json")) == newer
    assert load(tmp_path / "missing.json") is None


def test_the_docs_section_is_replaced_in_place(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    write(BOOK, doc)
    write(BOOK.merged([row("onnx", 55, 360)]), doc)
    text = doc.read_text()
    assert text.count(START) == 1 and text.count(END) == 1 and text.endswith("intro\n")
    assert "| ONNX Runtime | test CPU | 55 / 82 ms |" in text
    assert "Not measured yet: TGI" in text


def decide_with(j, fleet, book):
    policy = POLICY.model_copy(update={"policy": "profile"})
    return decide(j, MODELS.get(j.model), fleet, policy, BACKENDS, book)


CPU_FLEET = FleetView(workers=[worker("llamacpp", False), worker("onnx", False), worker("pytorch", False)])


def test_profile_policy_picks_the_fastest_backend_that_meets_the_latency_target():
    sel = decide_with(job(slo={"latency_target_ms": 1000}), CPU_FLEET, BOOK)
    assert (sel.tree_choice, sel.backend) == ("llamacpp", "pytorch")  # 500 tok/s and 900 ms ≤ 1000 ms
    step = next(s for s in sel.path if s.check == "profile")
    assert step.detail.startswith("differs from the tree (llamacpp)") and "pytorch 900 ms / 500 tok/s" in step.detail
    sel = decide_with(job(slo={"latency_target_ms": 500}), CPU_FLEET, BOOK)
    assert sel.backend == "onnx"  # pytorch is too slow to first token; onnx out-runs llama.cpp
    sel = decide_with(job(slo={"latency_target_ms": 80}), CPU_FLEET, BOOK)
    assert sel.backend == sel.tree_choice == "onnx"
    assert next(s for s in sel.path if s.check == "profile").detail.startswith("agrees with the tree")


def test_profile_policy_keeps_the_tree_when_nothing_measured_fits():
    sel = decide_with(job(slo={"latency_target_ms": 10}), CPU_FLEET, BOOK)
    assert (
        sel.backend == sel.tree_choice == "onnx"
        and "no live backend's measured TTFT p50 meets 10 ms" in sel.path[-2].detail
    )
    sel = decide_with(job(slo={"latency_target_ms": 1000}), CPU_FLEET, None)
    assert sel.backend == "llamacpp" and any("run `ib bench profiles`" in s.detail for s in sel.path)
    # a measured backend with no live worker is not a candidate (vLLM's GPU row here)
    only_llama = FleetView(workers=[worker("llamacpp", False)])
    assert decide_with(job(slo={"latency_target_ms": 1000}), only_llama, BOOK).backend == "llamacpp"
