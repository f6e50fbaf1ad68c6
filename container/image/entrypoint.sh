#!/bin/sh
# Image entrypoint: CUDA forward compatibility, then the command (SageMaker runs `docker run IMAGE serve`).
#
# The llama.cpp DLC's GPU image runs CUDA 13 and ships NVIDIA's forward-compatibility libraries
# (cuda-compat, in /usr/local/cuda/compat) but puts nothing on the loader path for them, and its own
# entrypoint (nginx + llama-server) is not ours to run. SageMaker's GPU hosts with an
# "al2*-ami-sagemaker-inference-gpu-*-1" AMI do not mount cuda-compat themselves, so, as SageMaker
# documents for such containers, we use it only when the host driver is older than the compat driver.
# On CPU images (no nvidia-smi, no compat directory) this only execs the command.
set -eu

COMPAT_DIR="${SEMIF_CUDA_COMPAT_DIR:-/usr/local/cuda/compat}"

# "535.54.03" < "580.65.06"?  Compared field by field as numbers.
version_lt() {
  [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -t. -k1,1n -k2,2n -k3,3n | head -n1)" = "$1" ]
}

if [ -d "$COMPAT_DIR" ] && command -v nvidia-smi >/dev/null 2>&1; then
  driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)"
  compat_lib="$(ls "$COMPAT_DIR"/libcuda.so.*.* 2>/dev/null | head -n1 || true)"
  compat="${compat_lib##*/libcuda.so.}"
  if [ -n "$driver" ] && [ -n "$compat" ] && version_lt "$driver" "$compat"; then
    export LD_LIBRARY_PATH="${COMPAT_DIR}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
    echo "semif-entrypoint: host driver ${driver} < compat driver ${compat}: using CUDA forward compatibility" >&2
  else
    echo "semif-entrypoint: host driver ${driver:-unknown}, compat driver ${compat:-none}: no forward compatibility needed" >&2
  fi
fi

exec "$@"
