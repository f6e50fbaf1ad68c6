#!/usr/bin/env bash
# Runs ON the GPU host, from the repository root:   bash tools/gpu/run_device_bench.sh
# after tools/gpu/build_cuda_wheel.sh filled .gpu-carry on a CPU machine and the checkout was copied over
# with it. Budget: under 8 minutes in all
# (venv ~0.5 min, random 3B GGUF ~1.5 min, two server loads and the benchmark ~3 min).
# Writes to $OUT: gpu.txt, bench.log, bench.json (copy the figures into docs/benchmarks.md).
#   PRESET=1b|3b|135m   model shape (default 3b)    N_SEQ=16   REQUESTS=64 per client count and mode
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/semif-device-out}; mkdir -p "$OUT"
PRESET=${PRESET:-3b}; N_SEQ=${N_SEQ:-16}; REQUESTS=${REQUESTS:-64}
started=$(date +%s)
step() { echo ">> [$(( $(date +%s) - started )) s] $*"; }

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

step "venv on the image's python3 (keeps its numpy, jinja2, httpx, ...) + carried wheels + semif"
python3 -m venv --system-site-packages /tmp/venv
/tmp/venv/bin/python -m pip install -q --no-index --no-deps --no-compile .gpu-carry/wheels/*.whl
/tmp/venv/bin/python -m pip install -q --no-index --no-deps --no-build-isolation ./container
PY=/tmp/venv/bin/python

# The wheel links libcudart/libcublas dynamically: take them from the image (nvidia-* packages, toolkit).
CUDA_LIBS=$(python3 - <<'PYEOF'
import glob, os, site
dirs = set()
roots = [os.path.join(p, "nvidia") for p in site.getsitepackages()] + ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
for root in roots:
    for name in ("libcublas.so.*", "libcublasLt.so.*", "libcudart.so.*"):
        dirs.update(os.path.dirname(p) for p in glob.glob(os.path.join(root, "**", name), recursive=True))
print(":".join(sorted(dirs)))
PYEOF
)
export LD_LIBRARY_PATH="${CUDA_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
$PY -c "import llama_cpp, sys; ok = llama_cpp.llama_supports_gpu_offload(); print('gpu offload', ok); sys.exit(0 if ok else 3)"

step "random-weight $PRESET llama GGUF (F16) with the embedded model's tokenizer"
timeout 240 $PY tools/gpu/random_gguf.py model --tokenizer .gpu-carry/tokenizer.json.gz --preset "$PRESET" --out /tmp/random.gguf
ls -la /tmp/random.gguf

step "bench_batching: throughput at 1, 4, 16 clients, serial vs SEMIF_BATCHING=1 SEMIF_N_SEQ=$N_SEQ; drift"
timeout 300 $PY tools/bench_batching.py --model /tmp/random.gguf --clients 1,4,16 --requests "$REQUESTS" \
  --n-seq "$N_SEQ" --threads 8 --n-ctx 8192 --drift-model /tmp/random.gguf --json "$OUT/bench.json" 2>&1 \
  | grep -v '^llama_\|^load\|^print_info\|^ggml_' | tee "$OUT/bench.log"
step "done"
