"""Shared fixtures: a real Redis/Valkey, the prepared model, real worker processes.

Broker: ``IB_TEST_REDIS_URL`` if set; else Redis at 127.0.0.1:6379 (database 15, flushed
at start) when it answers; else an embedded Valkey server started for the session.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

# Fast failure detection for the tests: a SIGKILLed worker is declared dead after 4 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("IB_HEARTBEAT_INTERVAL_S", "1")
os.environ.setdefault("IB_HEARTBEAT_TTL_S", "4")
# The suite's own user registry (`ib models add` writes there): never the developer's.
os.environ["IB_MODELS_FILE"] = str(Path(__file__).resolve().parent.parent / "test-artifacts" / "models.yaml")

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
# .ci/run sets it: there a test may not skip for want of a tool; the tool is required.
IN_CI = os.environ.get("IB_CI") == "1"


def unavailable(reason: str, module: bool = False) -> None:
    """Skip a test whose tool this machine lacks; under CI (IB_CI=1) fail it instead, so
    CI cannot pass by skipping what it was meant to test."""
    if IN_CI:
        pytest.fail(f"required under CI: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def need_module(name: str) -> object:
    """``pytest.importorskip``, but a requirement under CI."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        unavailable(f"python module {name} is not installed")
        raise


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    from core.connection import pings
    from ops.local.broker import EmbeddedBroker

    url = os.environ.get("IB_TEST_REDIS_URL")
    if not url and pings("redis://127.0.0.1:6379/15"):
        url = "redis://127.0.0.1:6379/15"
    broker = None
    if not url:
        broker = EmbeddedBroker(port=None, data_dir=tmp_path_factory.mktemp("valkey")).start(announce=False)
        url = broker.url
    import redis

    redis.Redis.from_url(url).flushdb()
    os.environ["REDIS_URL"] = url
    yield url
    if broker:
        broker.stop()


@pytest.fixture(scope="session")
def registry():
    from core.registry import ModelRegistry

    return ModelRegistry.from_config()


@pytest.fixture(scope="session")
def hf_dir(registry) -> Path:
    from workers.models.prepare import prepare

    return prepare(registry.get("smollm2-135m"), "hf")


@pytest.fixture(scope="session", autouse=True)
def empty_user_registry():
    """Each session starts with no user-added models (tests that add some use their own file)."""
    Path(os.environ["IB_MODELS_FILE"]).unlink(missing_ok=True)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The second real model: Gemma 3 270M (base, Q4_K_M) from its PyPI chunk packages."""
    from ops.sample_models import gemma_gguf

    return gemma_gguf()


@pytest.fixture(scope="session")
def onnx_dir(registry, hf_dir) -> Path:
    from workers.models.prepare import prepare

    return prepare(registry.get("smollm2-135m"), "onnx")


@pytest.fixture(scope="session")
def reference(hf_dir):
    """transformers called directly, in this process: the ground truth for greedy output."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def greedy(messages: list[dict], max_tokens: int) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens)
        return out[0, ids.shape[1] :].tolist()

    greedy.tokenizer = tok  # type: ignore[attr-defined]
    return greedy


@pytest.fixture
def client(redis_url):
    from dispatcher.client import Client

    with Client(redis_url) as c:
        yield c


def wait_for(predicate, timeout: float, what: str):
    """Poll ``predicate`` until it returns something truthy (returned); a broker that is
    restarting counts as not yet."""
    import time

    import redis

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except redis.ConnectionError:
            value = None  # the broker is restarting
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(f"not within {timeout} s: {what}")


def start_worker(redis_url: str, backend: str = "pytorch", **kw):
    from ops.local.processes import WorkerProcess

    worker = WorkerProcess(backend, redis_url, log_dir=ARTIFACTS / "logs", **kw).start()
    try:
        worker.wait_ready(timeout=300)
    except Exception:
        worker.kill()
        raise
    return worker


@pytest.fixture(scope="module")
def pytorch_worker(redis_url, hf_dir):
    worker = start_worker(redis_url, "pytorch", extra_args=["--threads=1"])
    yield worker
    worker.stop()


def start_worker_with_artifact(tmp_path: Path, redis_url: str, backend: str, fmt: str, source: Path):
    """Run `ib worker` with the model's ``fmt`` artifact pointed at ``source`` (a copy of
    config/ in tmp_path); returns the finished process (a bad artifact: it refuses to start)."""
    import shutil
    import subprocess
    import sys

    import yaml

    from core.settings import config_dir

    cfg = tmp_path / "config"
    shutil.copytree(config_dir(), cfg)
    models = yaml.safe_load((cfg / "models.yaml").read_text())
    models["models"]["smollm2-135m"]["artifacts"][fmt] = {"source": str(source)}
    (cfg / "models.yaml").write_text(yaml.safe_dump(models))
    env = {**os.environ, "IB_CONFIG_DIR": str(cfg), "REDIS_URL": redis_url, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", "worker", "--backend", backend],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def queue_lists(client, prefix: str = "ib.llamacpp") -> list[bytes]:
    """Every Redis list of a backend's queues: shared and workers' own, every priority level."""
    return [k for k in client.redis.scan_iter(f"{prefix}*") if client.redis.type(k) == b"list"]


def drop_a_message(client, prefix: str = "ib.llamacpp") -> list[str]:
    """Pop one message off a backend's queues and drop it, as a worker killed between the
    broker's BRPOP and its unacked write takes one; returns the ids of the jobs it carried."""
    import json

    from core.celery_app import group_members

    headers = json.loads(next(m for q in queue_lists(client, prefix) if (m := client.redis.rpop(q)) is not None))
    headers = headers["headers"]
    return group_members(headers) or [headers["id"]]


@contextlib.contextmanager
def own_database(redis_url: str, index: int):
    """A Redis database of its own beside the suite's (emptied before and after), for
    tests whose messages no worker of the other tests may take, or that count keys."""
    import redis

    base, _, _ = redis_url.rpartition("/")
    url = f"{base}/{index}"
    redis.Redis.from_url(url).flushdb()
    try:
        yield url
    finally:
        redis.Redis.from_url(url).flushdb()


def without_tokenizer(client) -> None:
    """The client as on a host where the model's tokenizer is not prepared: it counts no
    prompt at submit, so the worker's own context check is what refuses an overflow."""
    from dispatcher.routing.prefix import PrefixHasher

    client.router.tokens = client.batches.tokens = PrefixHasher(tokenizer_for=lambda model: None)


def ib(*args: str, redis_url: str, env: dict[str, str] | None = None, timeout: float = 120):
    """Run the `ib` CLI against ``redis_url`` (and ``env`` on top); returns the finished process.
    ``timeout`` is raised for the commands that convert weights: de-quantizing Gemma 3's
    262k-row embedding took over 120 s once on a loaded two-core CI machine."""
    import subprocess
    import sys

    env = {**os.environ, "REDIS_URL": redis_url, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
