#!/usr/bin/env bash
# Build upstream llama-server from the llama.cpp that the pinned llama-cpp-python sdist vendors, with the
# Makefile's portable CPU flags, for the side-by-side benchmark (tools/bench_llama_server.py).
# Not part of `make test`: it compiles llama.cpp (~6-10 min on 2 cores). Nothing is fetched but the sdist
# from the package registry; the web UI is neither built nor downloaded.
#
# usage: tools/build_llama_server.sh [OUT_DIR]     (default .build/llama-server; prints the binary's path)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-.build/llama-server}")
# shellcheck source=tools/sdist_common.sh
. tools/sdist_common.sh
binary="$out/build/bin/llama-server"
if [ -x "$binary" ] && [ "$(cat "$out/VERSION" 2>/dev/null)" = "$version" ]; then echo "$binary"; exit 0; fi
mkdir -p "$out"
if [ ! -d "$out/src/vendor/llama.cpp" ]; then
  sdist=$(download_sdist "$out/sdist" "vendored llama.cpp")
  rm -rf "$out/src" && mkdir -p "$out/src"
  tar xzf "$sdist" -C "$out/src" --strip-components=1
fi
# Same CPU flags as the Makefile's LLAMA_CMAKE_ARGS (passed in by `make llama-server`).
cpu_flags=${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}
echo ">> configuring llama.cpp ($cpu_flags)" >&2
# shellcheck disable=SC2086
cmake -S "$out/src/vendor/llama.cpp" -B "$out/build" -DCMAKE_BUILD_TYPE=Release $cpu_flags \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >&2
echo ">> building llama-server" >&2
cmake --build "$out/build" --target llama-server -j "${JOBS:-$(nproc)}" >&2
echo "$version" > "$out/VERSION"
echo "$binary"
