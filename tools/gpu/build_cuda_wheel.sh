#!/usr/bin/env bash
# For a GPU host that cannot reach a package registry: prepare, on a CPU machine with nvcc, everything
# tools/gpu/run_device_bench.sh needs there (an sm_90 GPU such as an H100/H200, Python 3.12, CUDA 13
# libraries installed, the whole folder under 64 MiB so it copies quickly). A GPU host that can reach PyPI
# needs none of this: `make LLAMA_CMAKE_ARGS="-DGGML_CUDA=on" setup`, then run tools/bench_batching.py.
#
#   .gpu-carry/wheels/llama_cpp_python-<v>-py3-none-linux_x86_64.whl   CUDA build for sm_90 only, stripped
#   .gpu-carry/wheels/*.whl          the serving dependencies the device image lacks, for CPython 3.12
#   .gpu-carry/tokenizer.json.gz     the embedded model's tokenizer, for a random-weight GGUF made there
#
# Usage (from the repository root, after `make setup`):   tools/gpu/build_cuda_wheel.sh
# Then copy the checkout with .gpu-carry to the GPU host and run there, from the repository root:
#   bash tools/gpu/run_device_bench.sh
#
# The CUDA compile of llama.cpp takes long on 2 cores (ggml-cuda's template instances): JOBS=N sets the
# parallelism. It needs nvcc (13.x here) but no GPU. .gpu-carry is added to .git/info/exclude (never committed).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PY:-.venv/bin/python}
CARRY=.gpu-carry
LIMIT_MIB=${LIMIT_MIB:-60}  # of the 64 MiB copy budget; the working tree travels too
JOBS=${JOBS:-2}
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qxF "/$CARRY/" "$exclude" || echo "/$CARRY/" >>"$exclude"
rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/build"

pin() {  # the version this checkout's venv runs, so the device runs the same code
  "$PY" -m pip freeze 2>/dev/null | grep -i "^$1==" | head -1
}
# shellcheck source=tools/sdist_common.sh
. tools/sdist_common.sh   # the llama-cpp-python pin, as the CPU build and llama-server read it
LLAMA="llama-cpp-python==$version"

echo ">> 1/4 building $LLAMA with CUDA for sm_90 (H100/H200) only"
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
# the toolkit's root, also where nvcc is a wrapper script (this machine's /usr/local/bin/nvcc)
cuda_root=$("$NVCC" --dryrun -x cu -c /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
cuda_root=$(readlink -f "${cuda_root:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}")
cuda_version=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')
cmake_extra=""
if [ ! -f "$cuda_root/include/cublas_v2.h" ]; then
  # A toolkit without cuBLAS (this machine's nvcc 13.0 has none): ggml-cuda links CUDA::cublas, so take its
  # headers and libraries, for linking only, from NVIDIA's nvidia-cublas wheel of the same CUDA minor
  # version (the oldest of the major: the device's own, newer or equal, libcublas.so.N satisfies it).
  echo ">>    no cuBLAS in $cuda_root: staging nvidia-cublas==$cuda_version.* for the link"
  stage="$CARRY/cublas"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: "nvidia-cublas==$cuda_version.*" -d "$stage/dl"
  "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$stage"/dl/nvidia_cublas-*.whl "$stage/x"
  lib=$(dirname "$(find "$stage/x" -name 'libcublas.so.*' | head -1)")
  inc=$(readlink -f "$lib/../include")
  for name in cublas cublasLt; do ln -sf "$(basename "$(ls "$lib"/lib$name.so.* | head -1)")" "$lib/lib$name.so"; done
  lib=$(readlink -f "$lib")
  cmake_extra="-DCUDA_cublas_LIBRARY=$lib/libcublas.so -DCUDA_cublasLt_LIBRARY=$lib/libcublasLt.so -DCMAKE_CUDA_FLAGS=-I$inc -DCMAKE_CXX_FLAGS=-I$inc"
fi
if ! find "$cuda_root/" -name 'libcuda.so' 2>/dev/null | grep -q .; then
  # No driver library to link against (no GPU here, no stubs in this toolkit): ggml-cuda then skips the
  # driver's virtual memory pool and uses its pooled cudaMalloc allocator instead (GGML_CUDA_NO_VMM).
  echo ">>    no libcuda.so (driver stub) in $cuda_root: building with GGML_CUDA_NO_VMM=ON"
  cmake_extra="$cmake_extra -DGGML_CUDA_NO_VMM=ON"
fi
CUDACXX="$NVCC" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $cmake_extra" \
  "$PY" -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python "$LLAMA" -w "$CARRY/build"

echo ">> 2/4 stripping symbols from its shared libraries"
wheel=$(ls "$CARRY"/build/llama_cpp_python-*.whl)
"$PY" -m wheel unpack "$wheel" -d "$CARRY/build/unpacked"
find "$CARRY/build/unpacked" -name '*.so*' -type f -exec strip --strip-unneeded {} +
# A wheel cannot hold symlinks: each library is in it under all its names (x.so, x.so.0, x.so.0.25.3), in
# llama_cpp/lib/ and again in lib/ (with include/): 6 copies of the 38 MB (compressed) libggml-cuda, 267 MB.
# Keep llama_cpp/lib/ only, each library once under its soname (x.so.0, what the loader asks for), plus the
# plain name of those llama_cpp opens itself with ctypes.
u=$(ls -d "$CARRY"/build/unpacked/llama_cpp_python-*)
rm -rf "$u/lib" "$u/include" "$u/bin"
for f in "$u"/llama_cpp/lib/*.so.*.*; do [ -e "$f" ] && rm -f "$f"; done
for f in "$u"/llama_cpp/lib/*.so; do
  base=$(basename "$f" .so)
  case "$base" in libllama|libggml|libmtmd|libllava) ;; *) ls "$f".* >/dev/null 2>&1 && rm -f "$f" ;; esac
done
"$PY" -m wheel pack "$CARRY"/build/unpacked/llama_cpp_python-* -d "$CARRY/wheels"
rm -rf "$CARRY/build" "$CARRY/cublas"

echo ">> 3/4 serving dependencies for CPython 3.12 (the device image has numpy, jinja2, anyio, h11, click, httpx, pyyaml, tqdm, requests)"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CARRY/wheels" $(pin starlette) $(pin uvicorn) $(pin pydantic) $(pin pydantic_core) $(pin annotated-types) \
  $(pin typing-inspection) $(pin typing_extensions) $(pin diskcache) $(pin gguf)

echo ">> 4/4 the embedded model's tokenizer (the 98 MB model itself does not fit the carry)"
MODEL=$("$PY" -c "from semif.serving.config import embedded_model_path as e; print(e())")
"$PY" tools/gpu/random_gguf.py tokenizer --from "$MODEL" --out "$CARRY/tokenizer.json.gz"

size=$(du -sm "$CARRY" | cut -f1)
ls -la "$CARRY" "$CARRY/wheels"
echo ">> $CARRY: ${size} MiB (limit ${LIMIT_MIB})"
if [ "$size" -gt "$LIMIT_MIB" ]; then
  echo "!! over the carry budget: rebuild with fewer CUDA kernels (e.g. -DGGML_CUDA_FA=OFF, at a speed cost) or drop a wheel" >&2
  exit 1
fi
