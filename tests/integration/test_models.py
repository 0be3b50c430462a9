"""Bring your own model: `ib models add` from a GGUF file, a local Hugging Face folder and
an offline `hf:` id (a hub cache laid out here, read by huggingface_hub's own code), then
two models served at once: two llama.cpp workers (SmolLM2 and Gemma 3 270M) and PyTorch
workers for the added HF models, jobs reaching the worker of their model, a batch mixing
them, `ib explain` per model; and every refusal of `ib models add` writing nothing."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import ib, start_worker, wait_for

pytestmark = pytest.mark.integration

SMOL = "smollm2-135m"
GEMMA = "gemma3-270m"
LOCAL = "smol-local"  # added from a local HF folder
HUB = "smol-hub"  # added from hf:local-org/smollm2-135m, offline
HUB_REPO = "local-org/smollm2-135m"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    """This module's own user registry file (the suite's is left alone)."""
    path = tmp_path_factory.mktemp("registry") / "models.yaml"
    before = os.environ["IB_MODELS_FILE"]
    os.environ["IB_MODELS_FILE"] = str(path)
    yield path
    os.environ["IB_MODELS_FILE"] = before


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, hf_dir):
    """A Hugging Face cache as huggingface_hub lays one out (refs/main → a commit, its
    snapshot's files), holding the prepared SmolLM2 folder; offline, so the real
    resolution code runs and nothing is downloaded. Set for this process (the client
    reads the tokenizer through it) and for the workers and CLI it starts."""
    import huggingface_hub.constants as hub

    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / f"models--{HUB_REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in hf_dir.iterdir():
        if not f.name.startswith("."):
            (snapshot / f.name).symlink_to(f)
    before = (os.environ.get("HF_HOME"), hub.HF_HUB_CACHE)
    os.environ["HF_HOME"] = str(home)
    hub.HF_HUB_CACHE = str(home / "hub")  # read at import; the worker processes read HF_HOME
    yield home
    if before[0] is None:
        os.environ.pop("HF_HOME")
    else:
        os.environ["HF_HOME"] = before[0]
    hub.HF_HUB_CACHE = before[1]


def add(redis_url: str, *args: str):
    out = ib("models", "add", *args, redis_url=redis_url)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture(scope="module")
def added(redis_url, user_models, hf_home, hf_dir, gemma_gguf):
    add(redis_url, GEMMA, "--from", str(gemma_gguf))
    add(redis_url, LOCAL, "--from", str(hf_dir))
    add(redis_url, HUB, "--from", f"hf:{HUB_REPO}")
    return yaml.safe_load(user_models.read_text())["models"]


@pytest.fixture(scope="module")
def fleet(redis_url, added):
    """Two llama.cpp workers, one model each, and a PyTorch worker per added HF model."""
    started = {
        SMOL: start_worker(redis_url, "llamacpp", model=SMOL, extra_args=["--threads=1"]),
        GEMMA: start_worker(redis_url, "llamacpp", model=GEMMA, extra_args=["--threads=1"]),
        LOCAL: start_worker(redis_url, "pytorch", model=LOCAL, extra_args=["--threads=1"]),
        HUB: start_worker(redis_url, "pytorch", model=HUB, extra_args=["--threads=1"]),
    }
    yield started
    for w in started.values():
        w.stop()


@pytest.fixture
def client(redis_url, added):
    from dispatcher.client import Client

    with Client(redis_url) as c:  # made after the registry file exists: it knows the added models
        yield c


def test_the_entries_are_read_from_the_models_own_files(added, hf_dir, gemma_gguf):
    gemma = added[GEMMA]
    assert (gemma["architecture"], gemma["context_length"], gemma["vocab_size"]) == ("gemma3", 32768, 262144)
    assert gemma["chat"] is False and gemma["dtype"] == "Q4_K_M" and gemma["license"] == "gemma"
    assert gemma["license_files"] == ["GEMMA_TERMS.html", "NOTICE.md"]
    assert gemma["artifacts"] == {"gguf": {"source": str(gemma_gguf), "quantization": "Q4_K_M"}}
    assert set(gemma["derive"]) == {"hf", "onnx", "onnx-int4"}  # transformers de-quantizes gemma3 GGUFs
    local = added[LOCAL]
    config = json.loads((hf_dir / "config.json").read_text())
    assert local["context_length"] == config["max_position_embeddings"] and local["chat"] is True
    assert local["vocab_size"] == 49152 and 134e6 < local["parameters"] < 136e6
    assert local["unsupported"] == {} and local["derive"]["gguf"] == {"from": "hf", "precision": "q8_0"}
    assert added[HUB]["revision"] == f"hf-{COMMIT}" and added[HUB]["source"] == f"hf:{HUB_REPO}"


def test_ib_models_list_and_show(redis_url, added):
    listed = ib("models", "list", redis_url=redis_url)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if GEMMA in line)
    assert "gemma3" in row and "268M" in row and "llamacpp" in row
    shown = ib("models", "show", LOCAL, redis_url=redis_url)
    assert shown.returncode == 0, shown.stderr
    assert "gguf" in shown.stdout and "derived from hf" in shown.stdout and "yes (gguf)" in shown.stdout
    gemma = ib("models", "show", GEMMA, redis_url=redis_url).stdout
    assert "GEMMA_TERMS.html" in gemma and "completions (prompt) only" in gemma


def test_jobs_for_each_model_reach_a_worker_that_serves_it(client, fleet):
    """Two llama.cpp workers on one backend: each takes only its own model's jobs (with one
    shared queue, the idle Gemma worker would take SmolLM2 jobs and answer with Gemma)."""
    smol = client.submit_many(
        {"model": SMOL, "messages": chat(f"Count to {i}."), "sampling": {"max_tokens": 8}} for i in range(6)
    )
    gemma = client.submit_many(
        {"model": GEMMA, "prompt": p, "sampling": {"max_tokens": 8}}
        for p in ["The capital of France is Paris. The capital of Italy is", "Water boils at", "One, two, three, four,"]
    )
    assert {h.selection.queue for h in smol} == {"ib.llamacpp"}
    assert {h.selection.queue for h in gemma} == {f"ib.llamacpp@{GEMMA}"}
    assert {h.result(timeout=120).worker for h in smol} == {fleet[SMOL].worker_id}
    results = [h.result(timeout=120) for h in gemma]
    assert {r.worker for r in results} == {fleet[GEMMA].worker_id} and {r.model for r in results} == {GEMMA}
    # the base model completes sensibly (llama-cpp-python in-process, greedy: " Rome. The capital of
    # Germany is Berlin", " 100 degrees Celsius.", " five, six, seven, eight,")
    assert "Rome" in results[0].text and "100" in results[1].text and "five" in results[2].text, results


def test_a_model_added_from_a_local_folder_is_greedy_equal_to_transformers_on_it(client, fleet, reference):
    """The tree sends it to llama.cpp, which has no live worker for it; the fallback lands
    on the PyTorch worker serving it; its greedy tokens equal transformers' own."""
    messages = chat("Name three colours.")
    r = client.submit(model=LOCAL, messages=messages, sampling={"max_tokens": 16}).result(timeout=120)
    assert r.worker == fleet[LOCAL].worker_id and r.backend == "pytorch"
    assert any(f"no live llamacpp worker for {LOCAL}" in step.detail for step in r.path), r.path
    assert r.token_ids == reference(messages, 16)


def test_a_model_added_from_an_offline_hub_id_is_served(client, fleet, reference):
    messages = chat("What is the capital of Italy?")
    r = client.submit(model=HUB, messages=messages, sampling={"max_tokens": 12}).result(timeout=120)
    assert r.worker == fleet[HUB].worker_id and r.model == HUB
    assert r.token_ids == reference(messages, 12)


def test_a_gguf_converted_from_the_local_folder_is_served_by_llama_cpp(client, redis_url, fleet, reference):
    """HF → GGUF (q8_0) through llama.cpp's own converter (`ib models prepare --format
    gguf`), then a llama.cpp worker of its own for the added model: the same tokens in,
    and greedy decoding that starts like transformers' own on the fp32 weights (q8_0 and
    fp32 part after a few tokens on this model: the shipped Q4_1 GGUF does the same)."""
    out = ib("models", "prepare", LOCAL, "--format", "gguf", redis_url=redis_url)
    assert out.returncode == 0, out.stdout + out.stderr
    from workers.models.facts import read_facts

    facts = read_facts(client.registry.get(LOCAL).artifact_path("gguf"))
    assert (facts.format, facts.architecture, facts.dtype, facts.vocab_size) == ("gguf", "llama", "Q8_0", 49152)
    worker = start_worker(redis_url, "llamacpp", model=LOCAL, extra_args=["--threads=1"])
    try:
        messages = chat("Name three colours.")
        r = client.submit(model=LOCAL, messages=messages, sampling={"max_tokens": 8}, backend="llamacpp").result(
            timeout=120
        )
        expected = reference(messages, 8)
        assert r.worker == worker.worker_id
        assert r.usage.prompt_tokens == len(
            reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        )
        assert r.token_ids[:4] == expected[:4], (r.text, reference.tokenizer.decode(expected))
    finally:
        worker.stop()


@pytest.mark.timeout(1200)  # two weight conversions, each allowed 480 s on a loaded machine
def test_a_folder_the_onnx_builder_refuses_is_never_sent_to_onnx(redis_url, added):
    """Gemma 3's GGUF de-quantized to HF by transformers (`ib models prepare`), then added
    as a folder: onnxruntime-genai's builder lists Gemma3ForCausalLM but refuses this
    config (it is asked at add time), so the tree's ONNX choice falls back, saying why."""
    out = ib("models", "prepare", GEMMA, "--format", "hf", redis_url=redis_url, timeout=480)
    assert out.returncode == 0, out.stdout + out.stderr
    from core.registry import ModelRegistry

    hf = ModelRegistry.from_config().get(GEMMA).artifact_path("hf")
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["vocab_size"] == 262144
    add(redis_url, "gemma-hf", "--from", str(hf))
    try:
        entry = yaml.safe_load(Path(os.environ["IB_MODELS_FILE"]).read_text())["models"]["gemma-hf"]
        assert "onnxruntime-genai's model builder refuses this model" in entry["unsupported"]["onnx"], entry
        assert "onnx" not in entry["derive"] and entry["derive"]["gguf"]["from"] == "hf"
        out = ib("explain", "--model", "gemma-hf", "--latency-ms", "50", "--hardware", "cpu", redis_url=redis_url)
        assert out.returncode == 0, out.stdout
        assert "format constraint" in out.stdout and "refuses this model" in out.stdout
    finally:
        ib("models", "remove", "gemma-hf", redis_url=redis_url)
    # the GGUF-added entry learns the same at `ib models prepare`: one line, the log kept,
    # and onnx marked unsupported for it (its workers would load exactly that format)
    out = ib("models", "prepare", GEMMA, "--format", "onnx", redis_url=redis_url, timeout=480)
    assert out.returncode == 1 and "preparation failed" in out.stdout and "Traceback" not in out.stdout + out.stderr
    assert "-prepare.log" in out.stdout and "recorded" in out.stdout, out.stdout
    entry = yaml.safe_load(Path(os.environ["IB_MODELS_FILE"]).read_text())["models"][GEMMA]
    assert "rope_type" in entry["unsupported"]["onnx"] and "onnx-int4" in entry["derive"]


def test_heartbeats_and_ib_workers_say_each_workers_model(client, fleet, redis_url):
    live = client.workers()
    for model, w in fleet.items():
        assert [x.worker_id for x in live.live(model=model)] == [w.worker_id]
    out = ib("workers", redis_url=redis_url)
    assert all(model in out.stdout for model in fleet)


def test_ib_explain_shows_the_decision_per_model(redis_url, fleet):
    gemma = ib("explain", "--model", GEMMA, "--prompt", "Hello", redis_url=redis_url)
    assert gemma.returncode == 0, gemma.stderr
    assert f"ib.llamacpp@{GEMMA}" in gemma.stdout and f"llamacpp serving {GEMMA}" in gemma.stdout
    local = ib("explain", "--model", LOCAL, redis_url=redis_url)
    assert f"no live llamacpp worker for {LOCAL}" in local.stdout and f"ib.pytorch@{LOCAL}" in local.stdout
    chat_to_base = ib("explain", "--model", GEMMA, "-m", "hi", redis_url=redis_url)
    assert chat_to_base.returncode == 1 and "send a prompt" in chat_to_base.stdout
    assert "Traceback" not in chat_to_base.stdout + chat_to_base.stderr


def test_a_batch_mixing_models_completes_with_one_error_line(client, fleet, tmp_path):
    """Chat lines for the two chat models, a completion line for the base model, and a
    chat line for the base model: that one line is an error naming the fix, the rest run."""
    chat_url, completions_url = "/v1/chat/completions", "/v1/completions"
    lines = [
        ("smol", chat_url, {"model": SMOL, "messages": chat("Say hi."), "max_tokens": 6}),
        ("local", chat_url, {"model": LOCAL, "messages": chat("Say hi."), "max_tokens": 6}),
        ("gemma", completions_url, {"model": GEMMA, "prompt": "Water boils at", "max_tokens": 6}),
        ("gemma-chat", chat_url, {"model": GEMMA, "messages": chat("Say hi."), "max_tokens": 6}),
    ]
    src = tmp_path / "mixed.jsonl"
    src.write_text(
        "".join(json.dumps({"custom_id": c, "method": "POST", "url": u, "body": b}) + "\n" for c, u, b in lines)
    )
    batch = client.batches.create(src)
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).is_final and b, 300, "batch done")
    assert done.status == "completed", done
    out = {r["custom_id"]: r for r in client.batches.results(batch.id)}
    models = {k: out[k]["response"]["body"]["model"] for k in ("smol", "local", "gemma")}
    assert models == {"smol": SMOL, "local": LOCAL, "gemma": GEMMA}
    assert out["gemma"]["response"]["body"]["object"] == "text_completion"
    error = out["gemma-chat"]["error"]
    assert error["code"] == "validation_error" and "send a prompt" in error["message"], error


def test_ib_up_starts_a_worker_per_model_on_each_backend_that_can_run_it(added, user_models):
    from core.errors import UnsupportedByBackendError
    from ops.local.fleet import LocalFleet

    pairs = LocalFleet(backends=["llamacpp", "pytorch"], models=[SMOL, GEMMA]).pairs()
    assert pairs == [("llamacpp", SMOL), ("pytorch", SMOL), ("llamacpp", GEMMA), ("pytorch", GEMMA)]
    models = yaml.safe_load(user_models.read_text())
    entry = models["models"][GEMMA]
    models["models"]["gemma-no-torch"] = {**entry, "unsupported": {"pytorch": "a test says so"}}
    before = user_models.read_text()
    user_models.write_text(yaml.safe_dump(models))
    try:
        fleet = LocalFleet(backends=["llamacpp", "pytorch"], models=[SMOL, "gemma-no-torch"])
        assert fleet.pairs() == [("llamacpp", SMOL), ("pytorch", SMOL), ("llamacpp", "gemma-no-torch")]
        with pytest.raises(UnsupportedByBackendError, match="none of pytorch can run gemma-no-torch"):
            LocalFleet(backends=["pytorch"], models=["gemma-no-torch"]).pairs()
    finally:
        user_models.write_text(before)


@pytest.mark.parametrize(
    "args, says",
    [
        (["x", "--from", "s3://bucket/model"], "unknown source scheme 's3'"),
        (["x", "--from", "/nonexistent/model-dir"], "not found"),
        (["x", "--from", "NOT_A_MODEL"], "not a GGUF file"),
        (["x", "--from", "PICKLED"], "pickles, which are never loaded"),
        (["x", "--from", "MYSTERY"], "no backend can run mystery"),
        (["x", "--from", f"hf:{HUB_REPO}-absent"], "not in the Hugging Face cache"),
        (["x", "--from", "GEMMA", "--draft-of", SMOL], "share its target's vocabulary"),
        ([SMOL, "--from", "GEMMA"], "already registered"),
        (["x", "--from", "GEMMA", "--context", "100000"], "trained for 32768"),
        (["my model", "--from", "GEMMA"], "use letters, digits"),
    ],
)
def test_ib_models_add_refuses_with_the_fix_and_writes_nothing(
    redis_url, added, user_models, hf_home, gemma_gguf, tmp_path, args, says
):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": 8, "vocab_size": 8})
    )
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    mystery = tmp_path / "mystery"
    mystery.mkdir()
    config = {
        "model_type": "mystery",
        "architectures": ["MysteryForCausalLM"],
        "max_position_embeddings": 8,
        "vocab_size": 8,
    }
    (mystery / "config.json").write_text(json.dumps(config))
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(4, np.float32)}, str(mystery / "model.safetensors"))
    (tmp_path / "x.safetensors").write_bytes(b"{}" * 8)
    where = {"NOT_A_MODEL": tmp_path / "x.safetensors", "PICKLED": pickled, "MYSTERY": mystery, "GEMMA": gemma_gguf}
    before = user_models.read_bytes()
    out = ib("models", "add", *[str(where.get(a, a)) for a in args], redis_url=redis_url)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and says in text, text
    assert "Traceback" not in text and len(out.stdout.strip().splitlines()) <= 2, text
    assert user_models.read_bytes() == before


def test_a_worker_for_a_model_that_is_not_prepared_says_how_and_exits(redis_url, added, gemma_gguf):
    name = f"gemma-{uuid.uuid4().hex[:6]}"  # never prepared on this host, whatever ran before
    add(redis_url, name, "--from", str(gemma_gguf))
    try:
        out = ib("worker", "--backend", "pytorch", "--model", name, redis_url=redis_url)
        assert out.returncode != 0 and f"ib models prepare {name}" in out.stdout + out.stderr, out.stdout + out.stderr
        assert "Traceback" not in out.stdout + out.stderr
    finally:
        assert ib("models", "remove", name, redis_url=redis_url).returncode == 0
    listed = ib("models", "list", redis_url=redis_url).stdout
    assert name not in listed
    bundled = ib("models", "remove", SMOL, redis_url=redis_url)
    assert bundled.returncode == 1 and "config/models.yaml" in bundled.stdout


def test_a_hub_revision_can_be_pinned(redis_url, added, hf_home):
    add(redis_url, "smol-pinned", "--from", f"hf:{HUB_REPO}@{COMMIT}")
    shown = ib("models", "show", "smol-pinned", redis_url=redis_url).stdout
    assert f"hf-{COMMIT}" in shown and f"hf:{HUB_REPO}@{COMMIT}" in shown
    assert ib("models", "remove", "smol-pinned", redis_url=redis_url).returncode == 0
