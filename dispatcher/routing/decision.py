"""The seed's backend decision tree, as a pure function that says which way it went.

    GPU available?  no  → latency target < 100 ms?          yes → ONNX Runtime, no → llama.cpp
                    yes → throughput target > 1000 tok/s?   yes → vLLM
                          no → Hugging Face native model?   yes → TGI, no → PyTorch eager

Hard constraints wrap the tree: a backend must be able to run one of the model's formats
(artifact or derivable), and it should have a live worker for the model (policy
``queue`` | ``fallback`` | ``reject``). Every question and constraint becomes a PathStep,
so ``ib explain`` and each JobResult can show why a job went where it went.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dispatcher.celery_app import own_queue_of, queue_for
from dispatcher.fleet import FleetView, WorkerInfo
from dispatcher.jobs import (
    BACKENDS,
    GenerationJob,
    JobValidationError,
    NoLiveWorkerError,
    PathStep,
    Selection,
    UnsupportedByBackendError,
)
from dispatcher.registry import BackendSpec, ModelSpec, SpeculativeConfig
from dispatcher.routing.profiles import ProfileBook
from dispatcher.settings import DecisionPolicy


def needs(spec: BackendSpec) -> str:
    """The formats a backend runs, as a path step or an error says them."""
    return " or ".join(spec.formats)


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


def decide(
    job: GenerationJob,
    model: ModelSpec,
    fleet: FleetView,
    policy: DecisionPolicy,
    backends: dict[str, BackendSpec],
    profile: ProfileBook | None = None,
) -> Selection:
    """Pick the backend, queue and engine config for one job. Pure: no I/O."""
    if job.messages is not None and not model.chat:
        raise JobValidationError(
            f"{model.name} has no chat template (a base model): send a prompt "
            "(/v1/completions, or prompt= in the client), not messages",
            {"model": model.name},
        )
    formats = model.formats()
    runnable = model.runnable_on({b: backends[b] for b in BACKENDS})
    path = [
        PathStep(
            check="formats",
            answer=", ".join(f"{f} ({how})" for f, how in formats.items()),
            detail="runnable on " + ", ".join(runnable) if runnable else "no backend can run them",
        )
    ]
    if model.unsupported:
        path.append(
            PathStep(
                check="architecture",
                answer=model.architecture or model.family,
                detail="; ".join(f"{b}: {why}" for b, why in model.unsupported.items()),
            )
        )

    if job.backend is not None:
        if job.backend not in runnable:
            why = model.unsupported.get(job.backend) or (
                f"backend {job.backend} needs a {needs(backends[job.backend])} artifact; "
                f"{model.name} has {', '.join(formats) or 'none'}"
            )
            raise UnsupportedByBackendError(
                f"{why} (backends that can run {model.name}: {', '.join(runnable) or 'none'})",
                {"backend": job.backend, "formats": list(formats), "runnable": list(runnable)},
            )
        choice = tree_choice = job.backend
        path.append(PathStep(check="backend override", answer=choice, detail="the job named its backend; tree skipped"))
    else:
        tree_choice, steps = tree(job, model, fleet, policy)
        path += steps
        path.append(PathStep(check="tree", answer=tree_choice))
        choice = tree_choice
        if choice not in runnable:
            alternatives = [b for b in policy.fallback_order.get(choice, []) if b in runnable]
            why = model.unsupported.get(tree_choice) or (
                f"{tree_choice} needs {needs(backends[tree_choice])}, which {model.name} lacks"
            )
            if not alternatives:
                raise UnsupportedByBackendError(
                    f"{model.name} cannot run on {tree_choice} ({why}) and no fallback can run it",
                    {"backend": tree_choice, "formats": list(formats)},
                )
            choice = alternatives[0]
            path.append(PathStep(check="format constraint", answer=choice, detail=why))

    if job.backend is None and policy.policy == "profile":
        choice = _profile_choice(job, model, fleet, policy, runnable, choice, profile, path)
    choice = _apply_liveness(job, model, fleet, policy, runnable, choice, path)
    spec = backends[choice]
    speculative = _speculative(job, spec, path)
    # model_copy: both values are already valid, and this runs once per submitted job
    config = spec.model_copy(update={"max_model_len": model.context_length, "speculative": speculative}).engine_config()
    return Selection(
        backend=choice,
        queue=queue_for(choice, model.queue_model),
        model=model.name,
        format=runnable[choice],
        config=config,
        path=path,
        tree_choice=tree_choice,
    )


def _speculative(job: GenerationJob, backend: BackendSpec, path: list[PathStep]) -> SpeculativeConfig | None:
    """Whether speculative decoding applies to this job on this backend, said in the path."""
    spec = backend.speculative
    if job.speculative is False:
        if spec is not None and spec.engine_wide:
            why = f"engine-wide on {backend.display_name}: the opt-out cannot apply (greedy output is the same)"
            path.append(PathStep(check="speculative", answer=spec.method, detail=why))
            return spec
        if spec is not None:
            path.append(PathStep(check="speculative", answer="off", detail="the job opted out"))
        return None
    if spec is None:
        if job.speculative:
            why = backend.speculative_unsupported or f"not configured for {backend.display_name}"
            path.append(PathStep(check="speculative", answer="not applied", detail=why))
        return None
    if not (job.speculative or spec.by_default):
        return None  # available on request (speculative=true)
    if not job.sampling.greedy:
        path.append(PathStep(check="speculative", answer="not applied", detail="greedy jobs only (temperature 0)"))
        return None
    what = "prompt lookup (n-gram), no draft model" if spec.method == "ngram" else "the registered draft model"
    detail = f"{what}, {spec.num_tokens} tokens a pass; the job runs unbatched"
    path.append(PathStep(check="speculative", answer=spec.method, detail=detail))
    return spec


def _profile_choice(
    job: GenerationJob,
    model: ModelSpec,
    fleet: FleetView,
    policy: DecisionPolicy,
    runnable: dict[str, str],
    choice: str,
    profile: ProfileBook | None,
    path: list[PathStep],
) -> str:
    """The measured alternative to the tree: of the live backends, those whose TTFT p50
    (measured on their workers' kind of hardware) meets the latency target; of those, the
    highest saturated throughput. The path says where and why it differs from the tree."""
    if profile is None:
        path.append(
            PathStep(
                check="profile",
                answer=choice,
                detail="no measured profile (run `ib bench profiles`): the tree's choice",
            )
        )
        return choice
    target, _ = latency_target(job, policy)
    measured = []
    for backend in runnable:
        live = fleet.live(backend=backend, model=model.name)
        kind = "gpu" if any(w.hardware.kind == "gpu" for w in live) else "cpu"
        row = profile.get(backend, kind) if live else None
        if row is not None:
            measured.append(row)
    meeting = sorted((r for r in measured if r.ttft_p50_ms <= target), key=lambda r: -r.saturated_tok_s)
    seen = (
        ", ".join(f"{r.backend} {r.ttft_p50_ms:.0f} ms / {r.saturated_tok_s:.0f} tok/s" for r in measured)
        or "none measured and live"
    )
    if not meeting:
        path.append(
            PathStep(
                check="profile",
                answer=choice,
                detail=f"no live backend's measured TTFT p50 meets {target:g} ms ({seen}): the tree's choice",
            )
        )
        return choice
    best = meeting[0]
    verdict = "agrees with the tree" if best.backend == choice else f"differs from the tree ({choice})"
    path.append(
        PathStep(
            check="profile",
            answer=best.backend,
            detail=f"{verdict}: highest measured throughput with TTFT p50 ≤ {target:g} ms on "
            f"{best.hardware_kind} ({seen}; measured {best.measured_at})",
        )
    )
    return best.backend


def _apply_liveness(
    job: GenerationJob,
    model: ModelSpec,
    fleet: FleetView,
    policy: DecisionPolicy,
    runnable: dict[str, str],
    choice: str,
    path: list[PathStep],
) -> str:
    live = fleet.live(backend=choice, model=model.name)
    if live:
        path.append(PathStep(check="live workers", answer=str(len(live)), detail=f"{choice} serving {model.name}"))
        return choice
    sick = fleet.unhealthy(choice, model.name)
    if sick:  # said before the policy acts, so `ib explain` shows why the backend looks empty
        why = "; ".join(f"{w.worker_id}: {', '.join(w.health.reasons)}" for w in sick)
        path.append(
            PathStep(check="unhealthy workers", answer=str(len(sick)), detail=f"{choice} not counted live: {why}")
        )
    rule = policy.no_worker_policy
    if rule == "reject":
        serving = sorted({w.backend for w in fleet.live(model=model.name)})
        raise NoLiveWorkerError(
            f"no live {choice} worker serves {model.name} (live backends for it: {', '.join(serving) or 'none'})",
            {"backend": choice, "live_backends": serving},
        )
    if rule == "fallback" and job.backend is None:
        for alt in policy.fallback_order.get(choice, []):
            if alt in runnable and fleet.live(backend=alt, model=model.name):
                path.append(
                    PathStep(
                        check="live workers",
                        answer=f"fallback {alt}",
                        detail=f"no live {choice} worker for {model.name}",
                    )
                )
                return alt
        path.append(
            PathStep(
                check="live workers",
                answer="none",
                detail=f"no live worker can serve {model.name}; queued for {choice}",
            )
        )
        return choice
    path.append(
        PathStep(check="live workers", answer="none", detail=f"policy {rule}: queued until a {choice} worker starts")
    )
    return choice


@dataclass
class Sent:
    """What one dispatch (a submit_many, a batch feed) has sent each worker so far: jobs
    not in its load yet, and new prefixes' blocks not in its hints yet. The dispatch reads
    the fleet once; without this, 8 jobs of one burst would all see the same loads."""

    jobs: Counter[str] = field(default_factory=Counter)
    blocks: Counter[str] = field(default_factory=Counter)


def affinity_cost(matched: int, blocks: int, worker: WorkerInfo, load_weight: float) -> float:
    """What sending a job to a worker costs, in full prefills of its prompt: the share of
    the prompt it must still evaluate, plus ``load_weight`` × its load (in flight ÷
    capacity): a full worker costs a whole prefill more than an idle one.

    Dynamo's router scores the same two terms (uncached prefill blocks + active decode
    blocks); with them divided by the prompt's blocks the first is SGLang's match ratio.
    Load counts per slot, not per job: below capacity a job starts at once (continuous
    batching), so a holder running one job must not lose it to an idle worker that would
    evaluate the whole prompt again."""
    return (blocks - matched) / max(1, blocks) + load_weight * worker.load


def apply_affinity(
    sel: Selection,
    hashes: list[str],
    matched: dict[str, int],
    fleet: FleetView,
    policy: DecisionPolicy,
    cached: dict[str, int] | None = None,
) -> Selection:
    """Which worker's own queue the job goes to, for the KV state of its prompt; pure (the
    caller read the hints, loads and ``cached``: how many blocks each worker holds).

    1. Some live worker holds at least ``prefix_min_blocks`` of the prompt's leading
       blocks: the worker where it costs least (affinity_cost), holder or not.
    2. Nobody does, but the prompt is that long: a new prefix. It goes to the worker
       holding the fewest blocks among those not full (SGLang: the smallest tree), so
       distinct prefixes spread over the fleet instead of wherever the shared queue's
       first free worker was.
    3. Otherwise (a short prompt, or every worker full): the shared queue, where
       whichever worker is free takes it."""
    if not hashes or sel.backend not in policy.prefix_affinity_backends:
        return sel
    live = fleet.live(backend=sel.backend, model=sel.model)
    n, cached = len(hashes), cached or {}
    update: dict[str, Any] = {"prefix_hashes": hashes}
    holders = [w for w in live if matched.get(w.worker_id, 0) >= policy.prefix_min_blocks]

    def to(w: WorkerInfo, detail: str) -> Selection:
        step = PathStep(check="prefix affinity", answer=w.worker_id, detail=detail)
        own = {"queue": own_queue_of(sel.queue, w.worker_id), "affinity_worker": w.worker_id}
        return sel.model_copy(update={**update, **own, "path": [*sel.path, step]})

    if holders:

        def cost(w: WorkerInfo) -> tuple[float, int]:
            got = matched.get(w.worker_id, 0)
            return affinity_cost(got, n, w, policy.prefix_load_weight), -got  # a tie: the longer match

        best = min(live, key=cost)
        got = matched.get(best.worker_id, 0)
        load = f"load {best.in_flight}/{best.capacity}, cost {cost(best)[0]:.2f}"
        if best in holders:
            return to(best, f"holds {got}/{n} leading blocks, {load}")
        top = max(holders, key=lambda w: matched.get(w.worker_id, 0))
        return to(
            best,
            f"holds {got}/{n} blocks, but {top.worker_id} (holds {matched.get(top.worker_id, 0)}) "
            f"is at {top.in_flight}/{top.capacity}: {load}",
        )
    room = [w for w in live if w.in_flight < w.capacity]
    if n >= policy.prefix_min_blocks and room:
        best = min(room, key=lambda w: (cached.get(w.worker_id, 0), w.load))
        return to(
            best,
            f"a new prefix ({n} blocks, nobody holds {policy.prefix_min_blocks}): the worker holding "
            f"the fewest blocks ({cached.get(best.worker_id, 0)}), load {best.in_flight}/{best.capacity}",
        )
    if n >= policy.prefix_min_blocks:
        why = "a new prefix and every worker is full: the first free one takes it"
    else:
        why = f"{n} blocks, shorter than prefix_min_blocks ({policy.prefix_min_blocks})"
    step = PathStep(check="prefix affinity", answer="shared queue", detail=why)
    return sel.model_copy(update={**update, "path": [*sel.path, step]})


def cap_affinity(sel: Selection, queued: int, capacity: int, policy: DecisionPolicy) -> Selection:
    """A job sent to a holder's own queue goes to the shared queue instead when that
    queue already holds ``prefix_max_queued_per_slot`` jobs per slot of the holder: the
    prefix saves prefill, not the wait behind a backlog. ``queued``: jobs in the own queue."""
    if sel.affinity_worker is None or queued < policy.prefix_max_queued_per_slot * max(capacity, 1):
        return sel
    step = PathStep(
        check="prefix affinity",
        answer="shared queue",
        detail=f"{sel.affinity_worker}'s own queue holds {queued} job(s), its cap for {capacity} slot(s)",
    )
    shared = sel.queue.rsplit(".", 1)[0]
    return sel.model_copy(update={"queue": shared, "affinity_worker": None, "path": [*sel.path, step]})
