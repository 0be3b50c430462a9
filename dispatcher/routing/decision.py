"""A job's backend, queue and engine config: the seed's tree (dispatcher.routing.tree)
wrapped in hard constraints, as a pure function that says which way it went.

Hard constraints wrap the tree: a backend must be able to run one of the model's formats
(artifact or derivable), and it should have a live worker for the model (policy
``queue`` | ``fallback`` | ``reject``). Every question and constraint becomes a PathStep,
so ``ib explain`` and each JobResult can show why a job went where it went.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.backends import BackendSpec, SpeculativeConfig
from core.celery_app import queue_for
from core.errors import JobValidationError, NoLiveWorkerError, UnsupportedByBackendError
from core.fleet import FleetView
from core.jobs import BACKENDS, GenerationJob, PathStep, Selection
from core.registry import ModelSpec
from core.settings import DecisionPolicy
from dispatcher.routing.profiles import ProfileBook
from dispatcher.routing.tree import latency_target, tree


def needs(spec: BackendSpec) -> str:
    """The formats a backend runs, as a path step or an error says them."""
    return " or ".join(spec.formats)


@dataclass
class Choosing:
    """One job's decision in the making: what each step of ``decide`` reads, and the path
    they write (one object instead of the same seven arguments handed down twice)."""

    job: GenerationJob
    model: ModelSpec
    fleet: FleetView
    policy: DecisionPolicy
    backends: dict[str, BackendSpec]
    runnable: dict[str, str] = field(default_factory=dict)  # backend -> the format it would run
    path: list[PathStep] = field(default_factory=list)

    def step(self, check: str, answer: str, detail: str = "") -> None:
        self.path.append(PathStep(check=check, answer=answer, detail=detail))


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
    if job.tool_calling is not None and job.tool_calling.mode == "auto":
        raise JobValidationError(
            "tool_choice: 'auto' (the default when tools are given) lets the model decide whether to call, which"
            f" needs a chat template that renders tools and a parser for the calls it writes; {model.name}'s template"
            " has none. Send tool_choice 'required' or a named function: the fleet holds the model to those",
            {"model": model.name, "errors": [{"field": "tool_choice", "message": "auto needs a tool template"}]},
        )
    c = Choosing(job, model, fleet, policy, backends, model.runnable_on({b: backends[b] for b in BACKENDS}))
    _formats_steps(c)
    tree_choice, choice = _overridden(c) if job.backend is not None else _tree_choice(c)
    choice = _features_choice(c, choice)
    if job.backend is None and policy.policy == "profile":
        choice = _profile_choice(c, choice, profile)
    choice = _apply_liveness(c, choice)
    spec = backends[choice]
    speculative = _speculative(job, spec, c.path)
    # model_copy: both values are already valid, and this runs once per submitted job
    config = spec.model_copy(update={"max_model_len": model.context_length, "speculative": speculative}).engine_config()
    return Selection(
        backend=choice,
        queue=queue_for(choice, model.queue_model),
        model=model.name,
        format=c.runnable[choice],
        config=config,
        path=c.path,
        tree_choice=tree_choice,
    )


def _formats_steps(c: Choosing) -> None:
    """The model's formats and which backends can run them; an architecture a backend
    cannot serve, and why."""
    formats = c.model.formats()
    c.step(
        "formats",
        ", ".join(f"{f} ({how})" for f, how in formats.items()),
        "runnable on " + ", ".join(c.runnable) if c.runnable else "no backend can run them",
    )
    if c.model.unsupported:
        c.step(
            "architecture",
            c.model.architecture or c.model.family,
            "; ".join(f"{b}: {why}" for b, why in c.model.unsupported.items()),
        )


def _overridden(c: Choosing) -> tuple[str, str]:
    """The backend the job named, if it can run the model: (tree choice, choice)."""
    backend, model = c.job.backend or "", c.model
    if backend not in c.runnable:
        formats = model.formats()
        why = model.unsupported.get(backend) or (
            f"backend {backend} needs a {needs(c.backends[backend])} artifact; "
            f"{model.name} has {', '.join(formats) or 'none'}"
        )
        raise UnsupportedByBackendError(
            f"{why} (backends that can run {model.name}: {', '.join(c.runnable) or 'none'})",
            {"backend": backend, "formats": list(formats), "runnable": list(c.runnable)},
        )
    c.step("backend override", backend, "the job named its backend; tree skipped")
    return backend, backend


def _tree_choice(c: Choosing) -> tuple[str, str]:
    """The tree's leaf, then the first fallback that can run the model's formats if the
    leaf cannot: (tree choice, choice)."""
    tree_choice, steps = tree(c.job, c.model, c.fleet, c.policy)
    c.path += steps
    c.step("tree", tree_choice)
    if tree_choice in c.runnable:
        return tree_choice, tree_choice
    alternatives = [b for b in c.policy.fallback_order.get(tree_choice, []) if b in c.runnable]
    why = c.model.unsupported.get(tree_choice) or (
        f"{tree_choice} needs {needs(c.backends[tree_choice])}, which {c.model.name} lacks"
    )
    if not alternatives:
        raise UnsupportedByBackendError(
            f"{c.model.name} cannot run on {tree_choice} ({why}) and no fallback can run it",
            {"backend": tree_choice, "formats": list(c.model.formats())},
        )
    c.step("format constraint", alternatives[0], why)
    return tree_choice, alternatives[0]


def serving(backends: dict[str, BackendSpec], features: set[str]) -> list[str]:
    """The backends that serve all of ``features``."""
    return [b for b in BACKENDS if not backends[b].lacks(features)]


def _features_choice(c: Choosing, choice: str) -> str:
    """The choice if it serves every feature the job needs (json_schema, logprobs, ...);
    else the first fallback that does and can run the model. The backends left to the
    later steps (profile, liveness) are those that serve them."""
    needed = c.job.sampling.features()
    if not needed:
        return choice
    able = serving(c.backends, needed)
    c.runnable = {b: f for b, f in c.runnable.items() if b in able}
    missing = c.backends[choice].lacks(needed)
    wanted = ", ".join(sorted(needed))
    if not missing:
        c.step("features", choice, f"needs {wanted}: served")
        return choice
    why = f"{choice} does not serve {', '.join(missing)}; backends that serve {wanted}: {', '.join(able) or 'none'}"
    alternatives = [] if c.job.backend is not None else list(c.runnable)
    fallbacks = c.policy.fallback_order.get(choice, [])
    alternatives.sort(key=lambda b: fallbacks.index(b) if b in fallbacks else len(fallbacks))
    if not alternatives:
        runs = f"; of them, none can run {c.model.name}" if able and c.job.backend is None else ""
        raise UnsupportedByBackendError(
            f"{why}{runs}",
            {
                "backend": choice,
                "unsupported": missing,
                "serving": able,
                "errors": [{"field": missing[0], "message": why}],
            },
        )
    c.step("features", alternatives[0], f"needs {wanted} → {why}")
    return alternatives[0]


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


def _profile_choice(c: Choosing, choice: str, profile: ProfileBook | None) -> str:
    """The measured alternative to the tree: of the live backends, those whose TTFT p50
    (measured on their workers' kind of hardware) meets the latency target; of those, the
    highest saturated throughput. The path says where and why it differs from the tree."""
    if profile is None:
        c.step("profile", choice, "no measured profile (run `ib bench profiles`): the tree's choice")
        return choice
    target, _ = latency_target(c.job, c.policy)
    measured = []
    for backend in c.runnable:
        live = c.fleet.live(backend=backend, model=c.model.name)
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
        c.step(
            "profile", choice, f"no live backend's measured TTFT p50 meets {target:g} ms ({seen}): the tree's choice"
        )
        return choice
    best = meeting[0]
    verdict = "agrees with the tree" if best.backend == choice else f"differs from the tree ({choice})"
    c.step(
        "profile",
        best.backend,
        f"{verdict}: highest measured throughput with TTFT p50 ≤ {target:g} ms on "
        f"{best.hardware_kind} ({seen}; measured {best.measured_at})",
    )
    return best.backend


def _apply_liveness(c: Choosing, choice: str) -> str:
    """The choice if it has a live worker for the model; otherwise the policy's answer:
    refuse, fall back to a live alternative, or queue for a worker yet to start."""
    name, fleet = c.model.name, c.fleet
    live = fleet.live(backend=choice, model=name)
    if live:
        c.step("live workers", str(len(live)), f"{choice} serving {name}")
        return choice
    sick = fleet.unhealthy(choice, name)
    if sick:  # said before the policy acts, so `ib explain` shows why the backend looks empty
        why = "; ".join(f"{w.worker_id}: {', '.join(w.health.reasons)}" for w in sick)
        c.step("unhealthy workers", str(len(sick)), f"{choice} not counted live: {why}")
    rule = c.policy.no_worker_policy
    if rule == "reject":
        serving = sorted({w.backend for w in fleet.live(model=name)})
        raise NoLiveWorkerError(
            f"no live {choice} worker serves {name} (live backends for it: {', '.join(serving) or 'none'})",
            {"backend": choice, "live_backends": serving},
        )
    if rule == "fallback" and c.job.backend is None:
        for alt in c.policy.fallback_order.get(choice, []):
            if alt in c.runnable and fleet.live(backend=alt, model=name):
                c.step("live workers", f"fallback {alt}", f"no live {choice} worker for {name}")
                return alt
        c.step("live workers", "none", f"no live worker can serve {name}; queued for {choice}")
        return choice
    c.step("live workers", "none", f"policy {rule}: queued until a {choice} worker starts")
    return choice
