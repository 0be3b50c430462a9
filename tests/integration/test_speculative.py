"""Speculative decoding on the PyTorch eager worker (transformers' prompt lookup): greedy
output with speculation equals output without, token for token, and the result says how
many target passes it took and how many drafted tokens were accepted."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
PASSAGE = ("The committee met on Tuesday at the town hall. It agreed to repair the bridge over the river, "
           "to open the library on Sundays, and to plant forty trees along the main street before winter.")  # fmt: skip
PROMPTS = [
    ({"messages": [{"role": "user", "content": f"Repeat this text exactly: {PASSAGE}"}]}, {"max_tokens": 64}),
    ({"messages": [{"role": "user", "content": f"{PASSAGE}\n\nCopy the second sentence."}]}, {"max_tokens": 48}),
    ({"messages": [{"role": "user", "content": "Write a short story about a lighthouse."}]}, {"max_tokens": 40}),
    ({"messages": [{"role": "user", "content": "List the days of the week."}]}, {"max_tokens": 40, "stop": ["Friday"]}),
    ({"messages": [{"role": "user", "content": "What is the capital of France?"}]}, {"max_tokens": 32}),
    ({"prompt": f"{PASSAGE} In short, the committee agreed to"}, {"max_tokens": 24}),
    ({"messages": [{"role": "user", "content": f"{PASSAGE}\n\nWhat will be planted?"}]}, {"max_tokens": 24, "stop": ["."]}),
    ({"messages": [{"role": "user", "content": "Count from one to twenty in words."}]}, {"max_tokens": 12}),
]


def test_greedy_output_is_the_same_with_and_without_speculation(client, pytorch_worker):
    def run(speculative: bool):
        jobs = [{"model": MODEL, "backend": "pytorch", "speculative": speculative, **body, "sampling": sampling}
                for body, sampling in PROMPTS]  # fmt: skip
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
