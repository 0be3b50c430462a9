#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` once and cache it: the peer the benchmarks compare
# the fleet with (bench/gateway.py). It is built from the llama.cpp source that the
# llama-cpp-python sdist vendors, at the same version and with the same portable flags as
# the wheel (scripts/llamacpp_wheel.sh), so both sides run the same kernels.
#
# Linked statically (BUILD_SHARED_LIBS=OFF), so the cached binary needs nothing beside it.
# Prints the binary's path. ~6 min on 2 idle cores, once; later calls print the cached path.
#
# Usage: scripts/llama_server.sh PYTHON     (PYTHON: an interpreter with pip)
set -euo pipefail

PY="${1:?usage: $0 PYTHON}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
FLAGS="${LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_OPENMP=OFF}"
DATA_DIR="${IB_DATA_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/inference-backend}"
KEY="$(printf '%s|%s' "$VERSION" "$FLAGS" | sha256sum | cut -c1-12)"
OUT="$DATA_DIR/bin/llama-server-$VERSION-$KEY"

if [ -x "$OUT/llama-server" ]; then
    echo "$OUT/llama-server"
    exit 0
fi
mkdir -p "$DATA_DIR/bin"
exec 9>"$DATA_DIR/bin/.lock"
flock 9
if [ ! -x "$OUT/llama-server" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    echo "llama-server $VERSION: building once from the llama-cpp-python sdist (several minutes)" >&2
    start=$(date +%s)
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >&2
    tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
    src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
    # shellcheck disable=SC2086  # FLAGS is a list of cmake arguments
    cmake -S "$src" -B "$work/build" $FLAGS -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release >&2
    cmake --build "$work/build" --target llama-server -j"$(nproc)" >&2
    mkdir -p "$OUT.partial"
    cp "$work/build/bin/llama-server" "$OUT.partial/"
    printf '{"version": "%s", "cmake_args": "%s", "build_seconds": %d, "built_at": "%s"}\n' \
        "$VERSION" "$FLAGS" "$(( $(date +%s) - start ))" "$(date -u +%FT%TZ)" > "$OUT.partial/build.json"
    rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
fi
echo "$OUT/llama-server"
