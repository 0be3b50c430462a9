#!/usr/bin/env bash
# Build llama-cpp-python once into a wheel cache and install it from there.
#
# llama-cpp-python ships as an sdist that compiles llama.cpp with cmake: 3.5 minutes on
# an idle 2-core machine, up to ~17 under load. Rebuilding it on every `make install`
# or CI run would dominate both, so the wheel is cached in the project's data directory,
# keyed by version and build flags: a change to either builds a new wheel beside it.
#
# The flags make a portable build: GGML_NATIVE=OFF keeps -march=native out (a native
# build can die with an illegal instruction on another CPU), LLAVA_BUILD=OFF skips the
# multimodal helper we do not serve, GGML_OPENMP=OFF uses ggml's own thread pool, which
# held up better than OpenMP when several workers share two cores.
#
# The same sdist carries llama.cpp's HF → GGUF converter (convert_hf_to_gguf.py, its
# conversion/ package and the gguf-py it was written against): it is unpacked once beside
# the wheel cache, where `ib models prepare` finds it to derive a GGUF from HF weights.
#
# Usage: scripts/llamacpp_wheel.sh PYTHON     (PYTHON: the interpreter of the target venv)
set -euo pipefail

PY="${1:?usage: $0 PYTHON}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
FLAGS="${LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_OPENMP=OFF}"
DATA_DIR="${IB_DATA_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/inference-backend}"
KEY="$(printf '%s|%s|%s' "$VERSION" "$FLAGS" "$("$PY" -c 'import sys; print(sys.implementation.cache_tag)')" | sha256sum | cut -c1-12)"
WHEELS="$DATA_DIR/wheels/llama-cpp-python-$VERSION-$KEY"

# One build at a time per cache (two `make install`s, or CI beside a session).
mkdir -p "$DATA_DIR/wheels"
exec 9>"$DATA_DIR/wheels/.lock"
flock 9

CONVERTER="$DATA_DIR/llama.cpp-convert-$VERSION"
unpack_converter() {
    [ -f "$CONVERTER/convert_hf_to_gguf.py" ] && return 0
    local tmp
    tmp="$(mktemp -d)"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
    local root="llama_cpp_python-$VERSION/vendor/llama.cpp"
    tar -xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp" \
        "$root/convert_hf_to_gguf.py" "$root/conversion" "$root/gguf-py" "$root/LICENSE"
    rm -rf "$CONVERTER.partial" && mv "$tmp/$root" "$CONVERTER.partial"
    rm -rf "$CONVERTER" && mv "$CONVERTER.partial" "$CONVERTER"   # whole or not at all
    rm -rf "$tmp"
    echo "llama.cpp's HF → GGUF converter: $CONVERTER"
}

if "$PY" -c "import importlib.metadata as m, sys; import starlette_context; sys.exit(m.version('llama-cpp-python') != '$VERSION')" 2>/dev/null; then
    unpack_converter
    exit 0  # already installed in this environment
fi


if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "llama-cpp-python $VERSION: building a wheel once (several minutes on 2 cores)"
    echo "  flags: $FLAGS"
    echo "  cache: $WHEELS"
    mkdir -p "$WHEELS.partial"
    start=$(date +%s)
    CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$PY" -m pip wheel --quiet --no-deps "llama-cpp-python==$VERSION" -w "$WHEELS.partial"
    rm -rf "$WHEELS" && mv "$WHEELS.partial" "$WHEELS"   # appears whole or not at all
    printf '{"version": "%s", "cmake_args": "%s", "build_seconds": %d, "built_at": "%s"}\n' \
        "$VERSION" "$FLAGS" "$(( $(date +%s) - start ))" "$(date -u +%FT%TZ)" > "$WHEELS/build.json"
    echo "  built in $(( $(date +%s) - start )) s"
fi
unpack_converter
# The `server` extra: its OpenAI-compatible server is what the TGI backend's tests talk to.
"$PY" -m pip install --quiet --find-links "$WHEELS" --only-binary llama-cpp-python "llama-cpp-python[server]==$VERSION"
