"""Deployment files against their published schemas, and every command they run exists.

No Docker engine or cluster runs here: the compose file is checked against the Compose
Specification's JSON schema (as vendored by check-jsonschema), built-in Kubernetes kinds
against the Kubernetes OpenAPI schemas (kubernetes-validate), and the custom resources
(KEDA ScaledObject / TriggerAuthentication, ServiceMonitor) against validators generated
from their published CRDs (npm @kubernetes-models, scripts/schemas.sh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from conftest import need_module
from ops.cli import app

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CRDS = {"ScaledObject", "TriggerAuthentication", "ServiceMonitor"}
OUR_IMAGES = ("inference-backend-cpu", "inference-backend-gpu", "inference-backend-tgi-worker")


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_compose_file_matches_the_compose_specification():
    jsonschema = need_module("jsonschema")
    schema = json.loads((resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())
    jsonschema.validate(compose(), schema)  # raises with the path of the first mismatch


def test_compose_runs_the_whole_fleet_with_health_restarts_volumes_and_no_secrets():
    spec = compose()
    services = spec["services"]
    assert {"redis", "flower", "worker-llamacpp", "worker-onnx", "worker-vllm", "tgi", "worker-tgi"} <= set(services)
    assert "--appendonly yes" in " ".join(services["redis"]["command"])
    assert set(spec["volumes"]) == {"redis-data", "models"}
    for name, svc in services.items():
        if name != "prepare-models":
            assert "healthcheck" in svc and svc.get("restart") == "unless-stopped", name
        if name.startswith("worker-"):
            assert svc["stop_grace_period"] == "10m" and "models:/data" in svc["volumes"], name
    for gpu in ("worker-vllm", "tgi"):
        assert services[gpu]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    text = "\n".join(line.split("#")[0] for line in (ROOT / "docker-compose.yml").read_text().splitlines())
    text = re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "", text)  # a required variable names no value
    assert not re.search(r"(PASSWORD|BASIC_AUTH)\s*[:=]\s*[\"']?[A-Za-z0-9]", text.replace("${", "")), (
        "secrets belong in .env"
    )


def test_compose_refuses_an_open_redis_and_never_puts_vllm_and_tgi_on_one_gpu():
    services = compose()["services"]
    # `${VAR:?message}`: compose stops with the message when REDIS_PASSWORD is unset or empty
    assert re.fullmatch(r"\$\{REDIS_PASSWORD:\?.+\}", services["redis"]["environment"]["REDIS_PASSWORD"])
    assert "--requirepass" in " ".join(services["redis"]["command"])
    # TGI and its worker only with --profile tgi, and then on another GPU than vLLM's by default
    assert services["tgi"]["profiles"] == ["tgi"] and services["worker-tgi"]["profiles"] == ["tgi"]
    assert "profiles" not in services["worker-vllm"]

    def gpu(name: str) -> str:
        device = services[name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert "count" not in device, name  # count: 1 would let both take the same first GPU
        return re.sub(r"\$\{[A-Z_]+:-(\w+)\}", r"\1", device["device_ids"][0])

    assert gpu("worker-vllm") != gpu("tgi")


def test_kubernetes_manifests_match_the_kubernetes_schemas():
    kv = need_module("kubernetes_validate")
    builtin = [d for d in manifests() if d["kind"] not in CRDS]
    assert {d["kind"] for d in builtin} >= {
        "Namespace",
        "ConfigMap",
        "StatefulSet",
        "Service",
        "Deployment",
        "Job",
        "PersistentVolumeClaim",
    }
    for doc in builtin:
        kv.validate(doc, "1.33.0", strict=True)  # strict: an unknown field is an error


def test_custom_resources_match_their_published_crds():
    node, tools = shutil.which("node"), ROOT / "tests" / "deploy"
    if not (node and (tools / "node_modules" / "@kubernetes-models" / "keda").is_dir()):
        if os.environ.get("IB_REQUIRE_SCHEMAS"):
            pytest.fail("the CRD validators are required here: run scripts/schemas.sh")
        pytest.skip("no CRD validators (scripts/schemas.sh installs them; CI requires them)")
    docs = [d for d in manifests() if d["kind"] in CRDS]
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    bad = {**scaled, "metadata": {"name": "broken"}, "spec": {"triggers": "not a list"}}  # the check can fail
    out = subprocess.run(
        [node, "validate_crds.mjs"],
        cwd=tools,
        input="\n".join(json.dumps(d) for d in [*docs, bad]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert out[-1].startswith(f"invalid {bad['kind']}/broken")
    assert out[:-1] == [f"ok {d['kind']}/{d['metadata']['name']}" for d in docs]
    assert {d["kind"] for d in docs} == CRDS


def test_every_backend_scales_on_each_of_its_priority_queues():
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in manifests() if d["kind"] == "ScaledObject"}
    deployments = {d["metadata"]["name"] for d in manifests() if d["kind"] == "Deployment"}
    assert set(scaled) == {f"worker-{b}" for b in ("llamacpp", "onnx", "vllm", "tgi")} and set(scaled) <= deployments
    from core.settings import fleet_config

    steps = fleet_config().priorities.steps()
    for name, obj in scaled.items():
        backend = name.removeprefix("worker-")
        lists = [t["metadata"]["listName"] for t in obj["spec"]["triggers"] if t["type"] == "redis"]
        assert lists == [f"ib.{backend}" if p == 0 else f"ib.{backend}:{p}" for p in steps]
        assert obj["spec"]["minReplicaCount"] >= 1  # a cold worker loads its engine for minutes
        # own queues (prefix affinity) are counted through the gauge each worker exports
        queries = [t["metadata"]["query"] for t in obj["spec"]["triggers"] if t["type"] == "prometheus"]
        affinity = backend in fleet_config().decision.prefix_affinity_backends
        assert queries == ([f'sum(ib_own_queue_jobs{{backend="{backend}"}})'] if affinity else []), name
    from prometheus_client import CollectorRegistry

    from core.fleet import Health
    from workers.lifecycle.metrics import WorkerMetrics

    registry = CollectorRegistry()
    metrics = WorkerMetrics("llamacpp", "w1", "smollm2-135m", registry=registry)
    metrics.sample(0, 8, Health(), own_queued=5)
    labels = {"backend": "llamacpp", "worker": "w1", "model": "smollm2-135m"}
    assert registry.get_sample_value("ib_own_queue_jobs", labels) == 5


def test_workers_drain_on_sigterm_and_take_secrets_from_a_secret():
    for d in manifests():
        if d["kind"] != "Deployment" or not d["metadata"]["name"].startswith("worker-"):
            continue
        pod = d["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 300 and pod["securityContext"]["runAsNonRoot"]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "ib-secrets"


def _commands() -> list[tuple[str, list[str]]]:
    """Every `ib` command line an image, the compose file or a manifest runs."""
    found = []
    for dockerfile in sorted((ROOT / "deploy").glob("Dockerfile.*")):
        text = dockerfile.read_text()
        assert 'ENTRYPOINT ["ib"]' in text, dockerfile.name
        cmd = re.findall(r"^CMD (\[.*\])$", text, re.M)
        found += [(dockerfile.name, json.loads(c)) for c in cmd]
    for name, svc in compose()["services"].items():
        if svc.get("image", "").startswith(OUR_IMAGES) or "build" in svc:
            found.append((f"compose {name}", svc["command"]))
    for d in manifests():
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            if c["image"].startswith(OUR_IMAGES):
                found.append((f"k8s {d['metadata']['name']}", c["args"]))
    return found


def test_every_command_the_images_run_exists_with_those_options():
    runner = CliRunner()
    commands = _commands()
    assert len(commands) >= 12
    for where, args in commands:
        result = runner.invoke(app, [*args, "--help"])  # unknown commands or options fail to parse
        assert result.exit_code == 0, f"{where}: ib {' '.join(args)}\n{result.output}"


def test_every_image_copies_every_package_the_project_installs():
    """An image built without a package of pyproject's list installs fine and fails at its
    first import (a new top-level package, core/, was once missing from every image)."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    assert packages == {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"} - {
        "bench"
    }
    for dockerfile in sorted((ROOT / "deploy").glob("Dockerfile.*")):
        copied = set(re.findall(r"^COPY (\w+) \./\1$", dockerfile.read_text(), re.M))
        assert packages <= copied, f"{dockerfile.name} lacks {sorted(packages - copied)}"


def test_multi_stage_images_run_as_a_non_root_user():
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (ROOT / "deploy" / dockerfile).read_text()
        assert text.count("FROM ") == 2 and " AS builder" in text and "COPY --from=builder" in text, dockerfile
        assert "USER ib" in text and "useradd" in text, dockerfile
    assert "llama-cpp-python" in (ROOT / "deploy" / "Dockerfile.cpu").read_text().split("FROM python:3.11-slim\n")[0]


def test_the_gateway_is_deployed_stateless_behind_a_service_with_keys_from_a_secret():
    svc = compose()["services"]["gateway"]
    assert svc["command"][0] == "serve" and all(p.startswith("127.0.0.1:") for p in svc["ports"])  # loopback
    docs = manifests()
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway")
    assert deployment["spec"]["replicas"] >= 2  # no state in the process: replicas must just work
    pod = deployment["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["IB_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "ib-secrets"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] in claims)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every replica reads every upload
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "gateway")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_rabbitmq_keeps_a_running_jobs_delivery_longer_than_the_job_time_limit():
    """Acks late: RabbitMQ must not close the channel of a job still running (its
    consumer_timeout requeues the message, and the job would be delivered again)."""
    from core.settings import fleet_config

    conf = (ROOT / "deploy" / "rabbitmq" / "rabbitmq.conf").read_text()
    timeout_ms = int(re.search(r"^consumer_timeout\s*=\s*(\d+)", conf, re.M).group(1))
    assert timeout_ms > fleet_config().celery.job_time_limit_s * 1000
    rabbit = compose()["services"]["rabbitmq"]
    assert rabbit["profiles"] == ["rabbitmq"]
    assert any("rabbitmq.conf:/etc/rabbitmq/conf.d/" in v for v in rabbit["volumes"])
    assert rabbit["ports"] == ["127.0.0.1:5672:5672"]
