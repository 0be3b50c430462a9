"""The seed's backend decision tree, exactly as drawn, as a pure function that says which
way it went:

    GPU available?  no  → latency target < 100 ms?          yes → ONNX Runtime, no → llama.cpp
                    yes → throughput target > 1000 tok/s?   yes → vLLM
                          no → Hugging Face native model?   yes → TGI, no → PyTorch eager

The hard constraints around it (formats, live workers, the measured profile) are
dispatcher.routing.decision's.
"""

from __future__ import annotations

from core.fleet import FleetView
from core.jobs import GenerationJob, PathStep
from core.registry import ModelSpec
from core.settings import DecisionPolicy


def latency_target(job: GenerationJob, policy: DecisionPolicy) -> tuple[float, str]:
    """The job's latency target and where it came from (its SLO, or the fleet default)."""
    if job.slo.latency_target_ms is not None:
        return job.slo.latency_target_ms, "job SLO"
    return policy.default_latency_target_ms, "fleet default"


def tree(job: GenerationJob, model: ModelSpec, fleet: FleetView, policy: DecisionPolicy) -> tuple[str, list[PathStep]]:
    """The seed's tree exactly as drawn: returns the leaf and the questions asked."""
    path: list[PathStep] = []
    if job.hardware is not None:
        gpu = job.hardware == "gpu"
        path.append(PathStep(check="GPU available?", answer="yes" if gpu else "no", detail=f"job hint: {job.hardware}"))
    else:
        gpu_workers = fleet.live(model=model.name, gpu=True)
        gpu = bool(gpu_workers)
        detail = (
            f"{len(gpu_workers)} live GPU worker(s) serve {model.name}"
            if gpu
            else f"no live GPU worker serves {model.name}"
        )
        path.append(PathStep(check="GPU available?", answer="yes" if gpu else "no", detail=detail))

    if not gpu:
        target, source = latency_target(job, policy)
        fast = target < policy.latency_threshold_ms
        path.append(
            PathStep(
                check=f"latency target < {policy.latency_threshold_ms:g} ms?",
                answer="yes" if fast else "no",
                detail=f"{target:g} ms, {source}",
            )
        )
        return ("onnx" if fast else "llamacpp"), path

    target = job.slo.throughput_target_tok_s
    source = "job SLO" if target is not None else "fleet default"
    target = target if target is not None else policy.default_throughput_target_tok_s
    high = target > policy.throughput_threshold_tok_s
    path.append(
        PathStep(
            check=f"throughput target > {policy.throughput_threshold_tok_s:g} tok/s?",
            answer="yes" if high else "no",
            detail=f"{target:g} tok/s, {source}",
        )
    )
    if high:
        return "vllm", path
    path.append(
        PathStep(
            check="Hugging Face native model?",
            answer="yes" if model.hf_native else "no",
            detail=f"{model.name}: family {model.family}",
        )
    )
    return ("tgi" if model.hf_native else "pytorch"), path
