"""The embedded Valkey broker (append-only persistence) and the `ib` command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import redis

from conftest import ib
from ops.local.broker import EmbeddedBroker

pytestmark = pytest.mark.integration


def test_embedded_broker_keeps_queued_work_across_a_restart(tmp_path):
    with EmbeddedBroker(port=None, data_dir=tmp_path).start(announce=False) as broker:
        r = redis.Redis.from_url(broker.url)
        r.lpush("ib.pytorch", "job-1")
        r.execute_command("BGREWRITEAOF")
        port = broker.server.port
    assert any(p.name.startswith("appendonly") for p in tmp_path.iterdir())
    with EmbeddedBroker(port=port, data_dir=tmp_path).start(announce=False) as broker:
        assert redis.Redis.from_url(broker.url).lrange("ib.pytorch", 0, -1) == [b"job-1"]


def test_embedded_broker_requires_the_password_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    data = tmp_path / "broker"
    with EmbeddedBroker(port=None, data_dir=data).start(announce=False) as broker:
        assert redis.Redis.from_url(broker.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=broker.server.port).ping()
        # From its first moment, not set afterwards: the config it started with requires it,
        # so a restart by anyone else (a supervisor, valkey-server on the same file) does too.
        assert "requirepass s3cret" in (data / "valkey.conf").read_text()
        assert data.stat().st_mode & 0o077 == 0  # and only this user can read that file


def test_ib_explain_prints_the_path(redis_url):
    out = ib("explain", "--latency-ms", "50", "--hardware", "cpu", redis_url=redis_url)
    assert out.returncode == 0, out.stderr
    assert "GPU available?" in out.stdout and "job hint: cpu" in out.stdout
    assert "latency target < 100 ms?" in out.stdout and "onnx" in out.stdout


def test_ib_explain_reads_an_openai_body_and_shows_the_feature_constraint(redis_url, tmp_path):
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "hi"}],
        "logit_bias": {"5": 2},
        "latency_target_ms": 50,
        "hardware": "cpu",
    }
    (tmp_path / "body.json").write_text(json.dumps(body).replace('"hardware": "cpu"', '"backend": null'))
    out = ib("explain", "--body", json.dumps({k: v for k, v in body.items() if k != "hardware"}), redis_url=redis_url)
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())
    assert "features" in flat and "needs logit_bias" in flat and "serves:" in flat
    from_file = ib("explain", "--body", f"@{tmp_path / 'body.json'}", redis_url=redis_url)
    assert from_file.returncode == 0 and "needs logit_bias" in " ".join(from_file.stdout.split())
    bad = ib("explain", "--body", '{"model": "smollm2-135m", "messages": [], "n": 99}', redis_url=redis_url)
    assert bad.returncode != 0 and "Traceback" not in bad.stdout + bad.stderr


def test_ib_explain_refuses_an_unknown_model(redis_url):
    out = ib("explain", "--model", "nope", redis_url=redis_url)
    assert out.returncode == 1
    assert "UnknownModelError" in out.stdout and "smollm2-135m" in out.stdout


@pytest.mark.parametrize(
    ("args", "env", "code", "says"),
    [
        (("status", "x"), {"REDIS_URL": "redis://127.0.0.1:1/0"}, 2, "cannot reach the broker"),
        (("batch", "list"), {"IB_BATCH_MAX_QUEUED": "many"}, 1, "batch.max_queued"),
        (("batch", "submit", "/no/such/requests.jsonl"), {}, 1, "no such input file"),
        (("batch", "submit", "{xlsx}"), {}, 1, "invalid_file_format"),
        (("batch", "submit", "{jsonl}", "--metadata", "run"), {}, 2, "key=value"),
        (("batch", "status", "batch_nope"), {}, 1, "unknown batch"),
        (("batch", "results", "batch_nope", "-o", "{tmp}/out.jsonl"), {}, 1, "unknown batch"),
        (("submit", "--model", "nope", "--prompt", "hi"), {}, 1, "unknown model"),
        (("submit", "--prompt", "hi", "--max-tokens", "-5"), {}, 1, "max_tokens"),
    ],
)
def test_a_users_mistake_is_one_line_naming_the_fix_and_a_non_zero_exit(redis_url, tmp_path, args, env, code, says):
    xlsx = tmp_path / "requests.xlsx"
    xlsx.write_bytes(b"PK\x03\x04" + bytes(100))
    jsonl = tmp_path / "requests.jsonl"
    jsonl.write_text('{"custom_id": "a", "prompt": "hi"}\n')
    args = tuple(a.format(xlsx=xlsx, jsonl=jsonl, tmp=tmp_path) for a in args)
    out = ib(*args, redis_url=env.get("REDIS_URL", redis_url), env=env)
    text = out.stdout + out.stderr
    assert out.returncode == code, text
    assert "Traceback" not in text and says in text, text
    assert len([line for line in text.splitlines() if line.strip()]) <= 5, text  # a line (typer's usage box: 5)


def test_ib_models_list(redis_url):
    out = ib("models", "list", redis_url=redis_url)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "smollm2-135m (default)" in line)
    assert "gguf (present)" in row and "pytorch, vllm, tgi, llamacpp, onnx" in row


def test_ib_submit_and_workers_against_a_live_worker(redis_url, pytorch_worker):
    # In a pipe at 80 columns (`ib workers | grep pytorch`): one whole line per worker, not
    # a table squeezed until the ids are cut.
    out = ib("workers", redis_url=redis_url, env={"COLUMNS": "80"})
    row = next(line for line in out.stdout.splitlines() if line.startswith(pytorch_worker.worker_id + "\t"))
    assert row.split("\t")[1] == "pytorch", out.stdout
    listed = json.loads(ib("workers", "--json", redis_url=redis_url).stdout)
    mine = next(w for w in listed if w["worker_id"] == pytorch_worker.worker_id)
    assert mine["backend"] == "pytorch" and mine["capacity"] >= 1
    out = ib(
        "submit",
        "-m",
        "What is the capital of France?",
        "--max-tokens",
        "12",
        "--backend",
        "pytorch",
        redis_url=redis_url,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "pytorch" in out.stdout and "TTFT" in out.stdout


def test_a_live_worker_answers_the_remote_control_reads_flower_shows(client, pytorch_worker):
    """Flower's worker and broker views are `celery inspect` replies, sent as JSON: a worker
    whose connection carried something JSON cannot encode (a QoS class in its transport
    options, once) answers none of stats, and Flower shows no queue of its."""
    inspect = client.app.control.inspect(timeout=5)
    for method in ("stats", "active_queues", "conf"):
        replies = getattr(inspect, method)() or {}
        mine = [reply for node, reply in replies.items() if node.startswith(f"{pytorch_worker.worker_id}@")]
        assert mine and mine[0], f"{method}: no reply from {pytorch_worker.worker_id} ({sorted(replies)})"
    queues = {q["name"] for node, qs in inspect.active_queues().items() for q in qs if pytorch_worker.worker_id in node}
    assert any(q.endswith(f".{pytorch_worker.worker_id}") for q in queues)  # its own queue, for the broker view


def test_ib_broker_stops_its_server_on_sigterm(tmp_path):
    import signal
    import socket
    import time

    from core.connection import pings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "IB_DATA_DIR": str(tmp_path)}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "broker", "--port", str(port)], env=env)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 30
    while not pings(url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pings(url)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not pings(url)  # the Valkey server went with it
