"""The ONNX Runtime worker: greedy parity with transformers, dynamic batches, the CPU branch."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import start_worker, start_worker_with_artifact, without_tokenizer
from core.errors import ContextOverflowError, UnsupportedByBackendError

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about cats and dogs playing.",
]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def onnx_worker(redis_url, onnx_dir):
    worker = start_worker(redis_url, "onnx", extra_args=["--threads=1"])
    yield worker
    worker.stop()


def test_greedy_fp32_equals_transformers_alone_and_in_a_dynamic_batch(client, onnx_worker, reference):
    expected = [reference(chat(p), 24) for p in PROMPTS]
    for p, exp in zip(PROMPTS, expected):
        r = client.submit(model=MODEL, messages=chat(p), sampling={"max_tokens": 24}, backend="onnx").result(
            timeout=120
        )
        assert r.backend == "onnx" and r.worker == onnx_worker.worker_id
        assert r.token_ids == exp, p
    # mixed-length prompts arriving together share one right-padded batch
    handles = client.submit_many(
        {"model": MODEL, "messages": chat(p), "sampling": {"max_tokens": 24}, "backend": "onnx"} for p in PROMPTS
    )
    results = [h.result(timeout=120) for h in handles]
    assert len({r.timings.first_token for r in results}) < len(results)  # batched
    assert [r.token_ids for r in results] == expected


def test_the_cpu_branch_routes_by_latency_target(client, onnx_worker):
    fast = client.submit(model=MODEL, messages=chat("Hi"), sampling={"max_tokens": 4}, slo={"latency_target_ms": 50})
    assert fast.selection.tree_choice == "onnx" and fast.backend == "onnx"
    assert fast.result(timeout=60).worker == onnx_worker.worker_id
    # a looser target: the tree says llama.cpp; no llama.cpp worker is live, so the
    # fallback policy takes the next live backend in its order (onnx)
    loose = client.explain(model=MODEL, messages=chat("Hi"), slo={"latency_target_ms": 500})
    assert loose.tree_choice == "llamacpp" and loose.backend == "onnx"
    assert loose.path[-1].answer == "fallback onnx"


def test_context_overflow_is_typed_and_the_worker_keeps_serving(client, onnx_worker):
    without_tokenizer(client)  # the worker's own check, the last guard, is what is tested here
    handle = client.submit(
        model=MODEL, prompt="lorem ipsum dolor sit amet " * 500, sampling={"max_tokens": 8}, backend="onnx"
    )
    with pytest.raises(ContextOverflowError):
        handle.result(timeout=60)
    ok = client.submit(model=MODEL, messages=chat("Say hello."), sampling={"max_tokens": 4}, backend="onnx")
    assert ok.result(timeout=60).status == "completed"


def test_a_worker_with_an_incomplete_onnx_folder_refuses_to_start(tmp_path, redis_url, onnx_dir):
    broken = tmp_path / "onnx"
    broken.mkdir()
    shutil.copy(onnx_dir / "genai_config.json", broken)  # no model.onnx, no tokenizer
    out = start_worker_with_artifact(tmp_path, redis_url, "onnx", "onnx", broken)
    assert out.returncode == 2
    assert "missing model.onnx, tokenizer.json" in out.stdout


def test_onnxruntime_genais_own_guidance_holds_structured_outputs(client, onnx_worker):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["name", "size"],
        "additionalProperties": False,
    }

    def run(structured: dict, text: str, **sampling) -> str:
        job = {"model": MODEL, "messages": chat(text), "backend": "onnx"}
        job["sampling"] = {"max_tokens": 60, "structured": structured, **sampling}
        return client.submit(job).result(timeout=180).text

    value = json.loads(run({"kind": "json_schema", "json_schema": schema}, "A T-shirt as JSON."))
    assert set(value) == {"name", "size"} and value["size"] in ("S", "M", "L")
    # Fifty submitted together, all valid: each runs alone (a batch whose rows end at
    # different steps made onnxruntime-genai's guidance fail the whole batch).
    together = client.submit_many(
        {
            "model": MODEL,
            "messages": chat(f"Shirt number {i} as JSON."),
            "backend": "onnx",
            "sampling": {"max_tokens": 60, "structured": {"kind": "json_schema", "json_schema": schema}},
        }
        for i in range(50)
    )
    answers = [json.loads(h.result(timeout=300).text) for h in together]
    assert all(set(a) == {"name", "size"} and a["size"] in ("S", "M", "L") for a in answers)
    assert run({"kind": "choice", "choice": ["yes", "no"]}, "Is ice cold?") in ("yes", "no")
    digits = run({"kind": "regex", "regex": "[0-9]{4}"}, "A year?", repetition_penalty=1.2)
    assert len(digits) == 4 and digits.isdigit()
    with pytest.raises(UnsupportedByBackendError, match="onnx does not serve logit_bias"):
        client.submit(model=MODEL, messages=chat("hi"), backend="onnx", sampling={"logit_bias": {"5": 1}})
