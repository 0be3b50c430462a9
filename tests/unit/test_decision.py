"""The decision tree, branch by branch, and every hard constraint (pure, no I/O)."""

from __future__ import annotations

import pytest

from core.backends import load_backends
from core.errors import JobValidationError, NoLiveWorkerError, UnsupportedByBackendError
from core.fleet import FleetView, HardwareInfo, WorkerInfo
from core.jobs import GenerationJob
from core.registry import ModelRegistry
from core.settings import fleet_config
from dispatcher.routing.decision import decide

BACKENDS = load_backends()
POLICY = fleet_config().decision  # config/fleet.yaml's, as a fleet runs with it

MODELS = ModelRegistry.from_config(
    {
        "models": {
            "all": {
                "display_name": "all formats",
                "family": "llama",
                "hf_native": True,
                "context_length": 2048,
                "artifacts": {"gguf": {"source": "/x.gguf"}, "hf": {"source": "/hf"}, "onnx": {"source": "/onnx"}},
            },
            "custom": {
                "display_name": "not HF native",
                "family": "custom",
                "hf_native": False,
                "context_length": 2048,
                "artifacts": {"gguf": {"source": "/x.gguf"}, "hf": {"source": "/hf"}, "onnx": {"source": "/onnx"}},
            },
            "gguf-only": {
                "display_name": "gguf only",
                "family": "llama",
                "hf_native": True,
                "context_length": 2048,
                "artifacts": {"gguf": {"source": "/x.gguf"}},
            },
            "hf-only": {
                "display_name": "hf only",
                "family": "llama",
                "hf_native": True,
                "context_length": 2048,
                "artifacts": {"hf": {"source": "/hf"}},
            },
            "derived": {
                "display_name": "gguf, hf derivable",
                "family": "llama",
                "hf_native": True,
                "context_length": 4096,
                "artifacts": {"gguf": {"source": "/x.gguf"}},
                "derive": {"hf": {"from": "gguf"}},
            },
        }
    }
)


def worker(backend: str, gpu: bool, model: str = "all", status: str = "ready") -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"{backend}-{'gpu' if gpu else 'cpu'}-{model}",
        backend=backend,
        hostname="h",
        pid=1,
        hardware=HardwareInfo(kind="gpu" if gpu else "cpu", cpu_cores=2, ram_gb=8),
        models=[model],
        queues=[f"ib.{backend}"],
        started_at=0,
        status=status,  # type: ignore[arg-type]
    )


EVERYONE = FleetView(
    workers=[
        worker(b, g)
        for b, g in [("vllm", True), ("tgi", True), ("pytorch", True), ("llamacpp", False), ("onnx", False)]
    ]
    + [worker(b, g, "custom") for b, g in [("pytorch", True), ("tgi", True), ("onnx", False)]]
)


def job(model: str = "all", **kw) -> GenerationJob:
    return GenerationJob(model=model, prompt="hi", **kw)


def run(j: GenerationJob, fleet: FleetView = EVERYONE, rule: str = "fallback"):
    policy = POLICY.model_copy(update={"no_worker_policy": rule, "policy": "tree"})
    return decide(j, MODELS.get(j.model), fleet, policy, BACKENDS)


@pytest.mark.parametrize(
    "fields, model, expected, answers",
    [
        # GPU from the live fleet
        ({"slo": {"throughput_target_tok_s": 5000}}, "all", "vllm", ["yes", "yes"]),
        ({"slo": {"throughput_target_tok_s": 1000}}, "all", "tgi", ["yes", "no", "yes"]),  # > 1000, not >=
        ({}, "all", "tgi", ["yes", "no", "yes"]),
        ({}, "custom", "pytorch", ["yes", "no", "no"]),
        # CPU by hint
        ({"hardware": "cpu", "slo": {"latency_target_ms": 50}}, "all", "onnx", ["no", "yes"]),
        ({"hardware": "cpu", "slo": {"latency_target_ms": 100}}, "all", "llamacpp", ["no", "no"]),  # < 100, not <=
        ({"hardware": "cpu"}, "all", "llamacpp", ["no", "no"]),  # default latency target 1000 ms
        # GPU by hint
        ({"hardware": "gpu", "slo": {"throughput_target_tok_s": 2000}}, "all", "vllm", ["yes", "yes"]),
    ],
)
def test_tree_branches(fields, model, expected, answers):
    sel = run(job(model, **fields))
    tree_steps = [s for s in sel.path if s.check.endswith("?")]
    assert [s.answer for s in tree_steps] == answers
    assert sel.tree_choice == expected
    assert sel.backend == expected
    # the registry's default model ("all", first) keeps the plain queue; another model has its own
    assert sel.queue == (f"ib.{expected}" if model == "all" else f"ib.{expected}@{model}")


def test_gpu_means_a_live_gpu_worker_for_this_model():
    cpu_only = FleetView(
        workers=[worker("pytorch", False), worker("llamacpp", False), worker("vllm", True, model="other")]
    )
    sel = run(job(slo={"latency_target_ms": 20}), cpu_only, rule="queue")
    assert sel.path[1].check == "GPU available?" and sel.path[1].answer == "no"
    assert sel.tree_choice == "onnx"


def test_gpu_worker_that_is_not_ready_does_not_count():
    fleet = FleetView(workers=[worker("vllm", True, status="draining"), worker("llamacpp", False)])
    assert run(job(), fleet).backend == "llamacpp"


def test_format_constraint_moves_to_the_next_runnable_backend():
    # gguf only: the tree says TGI (GPU, HF native) but TGI cannot run GGUF.
    sel = run(
        job("gguf-only"), FleetView(workers=[worker("tgi", True, "gguf-only"), worker("llamacpp", False, "gguf-only")])
    )
    assert sel.tree_choice == "tgi"
    assert sel.backend == "llamacpp"
    step = next(s for s in sel.path if s.check == "format constraint")
    assert "tgi needs hf" in step.detail


def test_hf_only_model_on_cpu_falls_to_pytorch():
    sel = run(job("hf-only", hardware="cpu"), FleetView(workers=[worker("pytorch", False, "hf-only")]))
    assert sel.tree_choice == "llamacpp"
    assert sel.backend == "pytorch"
    assert sel.format == "hf"


def test_a_derivable_format_counts():
    sel = run(job("derived", backend="pytorch"), FleetView(workers=[worker("pytorch", False, "derived")]))
    assert sel.backend == "pytorch"
    assert "hf (derived from gguf)" in sel.path[0].answer
    assert sel.config["max_model_len"] == 4096


def test_override_skips_the_tree():
    sel = run(job(backend="onnx"))
    assert sel.backend == "onnx"
    assert not any(s.check.endswith("?") for s in sel.path)


def test_override_to_a_backend_that_cannot_run_the_model_is_refused():
    with pytest.raises(UnsupportedByBackendError, match="needs a gguf artifact"):
        run(job("hf-only", backend="llamacpp"))


@pytest.mark.parametrize("rule, expected", [("queue", "llamacpp"), ("fallback", "pytorch")])
def test_no_live_worker_policy(rule, expected):
    fleet = FleetView(workers=[worker("pytorch", False)])
    sel = run(job(), fleet, rule=rule)
    assert sel.tree_choice == "llamacpp"
    assert sel.backend == expected
    assert sel.path[-1].check == "live workers"


def test_no_live_worker_reject():
    with pytest.raises(NoLiveWorkerError, match="live backends for it: pytorch"):
        run(job(), FleetView(workers=[worker("pytorch", False)]), rule="reject")


def test_fallback_with_nothing_live_queues_on_the_tree_choice():
    sel = run(job(), FleetView(), rule="fallback")
    assert sel.backend == "llamacpp"
    assert sel.path[-1].answer == "none"


def test_selection_carries_engine_config():
    sel = run(job(slo={"throughput_target_tok_s": 5000}))
    assert sel.config["batching"] == "continuous"
    assert sel.config["prefix_caching"] is True
    assert "formats" not in sel.config


# ---------------------------------------------------------------- models added by users

ADDED = ModelRegistry.from_config(
    {
        "models": {
            "all": MODELS.models["all"].model_dump(exclude={"name"}, by_alias=True),
            "base-gemma": {
                "display_name": "a base model whose architecture vLLM lacks",
                "family": "gemma3",
                "architecture": "gemma3",
                "hf_native": True,
                "chat": False,
                "context_length": 32768,
                "artifacts": {"gguf": {"source": "/g.gguf"}},
                "derive": {"hf": {"from": "gguf"}},
                "unsupported": {"vllm": "vLLM's model registry has no Gemma3ForCausalLM"},
            },
        }
    }
)


def test_a_backend_that_cannot_run_the_architecture_is_never_picked_and_the_path_says_why():
    fleet = FleetView(workers=[worker("vllm", True, "base-gemma"), worker("tgi", True, "base-gemma")])
    sel = decide(
        GenerationJob(model="base-gemma", prompt="The capital of France is", slo={"throughput_target_tok_s": 5000}),
        ADDED.get("base-gemma"),
        fleet,
        POLICY.model_copy(update={"no_worker_policy": "fallback", "policy": "tree"}),
        BACKENDS,
    )
    assert sel.tree_choice == "vllm" and sel.backend == "tgi"  # the tree's vLLM cannot run gemma3 here
    constraint = next(s for s in sel.path if s.check == "format constraint")
    assert "no Gemma3ForCausalLM" in constraint.detail
    assert sel.queue == "ib.tgi@base-gemma"  # not the default model: its own queue
    with pytest.raises(UnsupportedByBackendError, match="no Gemma3ForCausalLM"):
        decide(
            GenerationJob(model="base-gemma", prompt="x", backend="vllm"),
            ADDED.get("base-gemma"),
            fleet,
            POLICY,
            BACKENDS,
        )


def test_messages_for_a_model_without_a_chat_template_are_refused_at_submit():
    from core.errors import JobValidationError

    with pytest.raises(JobValidationError, match="send a prompt"):
        decide(
            GenerationJob(model="base-gemma", messages=[{"role": "user", "content": "hi"}]),
            ADDED.get("base-gemma"),
            EVERYONE,
            POLICY,
            BACKENDS,
        )


def test_a_feature_the_trees_choice_lacks_moves_the_job_to_a_backend_that_serves_it():
    # The tree sends a CPU job with a tight latency target to ONNX, which has no logit_bias.
    fields = {"hardware": "cpu", "slo": {"latency_target_ms": 50}}
    plain = run(job(**fields))
    assert plain.backend == "onnx" and not [s for s in plain.path if s.check == "features"]
    sel = run(job(**fields, sampling={"logit_bias": {"5": 2.0}}))
    assert sel.tree_choice == "onnx" and sel.backend in {"llamacpp", "vllm", "pytorch"}
    (step,) = [s for s in sel.path if s.check == "features"]
    assert "needs logit_bias" in step.detail and "onnx does not serve logit_bias" in step.detail
    assert "llamacpp" in step.detail and "vllm" in step.detail and "tgi" in step.detail


def test_a_feature_the_choice_serves_is_said_and_keeps_the_choice():
    sel = run(job(hardware="cpu", sampling={"logprobs": 2, "min_p": 0.1}))
    assert sel.backend == "llamacpp"
    (step,) = [s for s in sel.path if s.check == "features"]
    assert step.answer == "llamacpp" and "logprobs, min_p: served" in step.detail


def test_a_named_backend_that_lacks_a_feature_is_refused_naming_it_and_who_serves_it():
    with pytest.raises(UnsupportedByBackendError) as exc:
        run(job(backend="onnx", sampling={"min_p": 0.3}))
    assert "onnx does not serve min_p" in exc.value.message
    assert "serve min_p: pytorch, vllm, llamacpp" in exc.value.message
    assert exc.value.details["errors"][0]["field"] == "min_p"


def test_a_feature_only_a_backend_without_a_live_worker_serves_queues_for_it_or_is_refused():
    # hf-only: pytorch, vllm and tgi run it; only vllm serves the prompt's logprobs (echo).
    cpu_only = FleetView(workers=[worker("pytorch", False, "hf-only")])
    echo = {"prompt_logprobs": 1, "max_tokens": 1}
    sel = run(job("hf-only", hardware="cpu", sampling=echo), cpu_only)
    assert sel.backend == "vllm"  # queued for the one that serves it (policy fallback, none live)
    with pytest.raises(UnsupportedByBackendError, match="pytorch does not serve echo"):
        run(job("hf-only", backend="pytorch", sampling=echo), cpu_only)


def test_n_answers_are_served_by_the_fleets_engines_not_a_remote_server():
    with pytest.raises(UnsupportedByBackendError, match="tgi does not serve n"):
        run(job(backend="tgi", sampling={"n": 3}))
    assert run(job(sampling={"n": 3})).backend == "vllm"  # the tree's GPU choice, past tgi


def test_tool_choice_auto_is_refused_at_submit_naming_the_models_template():
    with pytest.raises(JobValidationError) as exc:
        run(GenerationJob(model="all", messages=[{"role": "user", "content": "hi"}], tool_calling={"mode": "auto"}))
    assert "tool_choice" in exc.value.message and "all's template" in exc.value.message
    assert exc.value.details["errors"][0]["field"] == "tool_choice"
