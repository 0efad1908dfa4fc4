#!/usr/bin/env bash
# make gpu-check: the GPU tests and the GPU benchmark table, on a machine with a CUDA 13 GPU.
#
#   bash scripts/gpu_check.sh               # what `make gpu-check` runs (under 5 minutes on one H200)
#   bash scripts/gpu_check.sh --no-install  # use .venv as it is (offline machines)
#
# 1. installs the gpu extra (CuPy for CUDA 13) into .venv, unless CuPy already imports;
# 2. stops with status 2 and the reason if CuPy finds no GPU: a GPU check that
#    passes without a GPU would say nothing, so it fails clearly instead;
# 3. runs tests/test_gpu.py and fails if any GPU test was skipped;
# 4. writes the benchmark table (bench/gpu_bench.py) to bench/results/gpu_check.md
#    and prints it.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
OUT=bench/results/gpu_check.md
install=1
[[ "${1:-}" == "--no-install" ]] && install=0

step() { printf '\n== %s (%ds)\n' "$1" "$SECONDS"; }

if [[ ! -x "$PY" ]]; then
    if (( install )); then
        step "creating .venv"
        python3 -m venv .venv
        "$PY" -m pip install -q --upgrade pip
        "$PY" -m pip install -q -e '.[mpi,test,plot]'
    else
        echo "gpu-check: no .venv here (run 'make test' first, or drop --no-install)" >&2
        exit 2
    fi
fi

if (( install )) && ! "$PY" -c "import cupy" 2>/dev/null; then
    step "installing the gpu extra"
    "$PY" -m pip install -q -e '.[gpu]'
fi

step "looking for a GPU"
if ! "$PY" - <<'PYTHON'
import sys
import gpu_impl
try:
    cupy = gpu_impl.require_cupy()
except gpu_impl.GpuUnavailable as e:
    sys.exit(f"gpu-check: no usable GPU here, nothing was checked: {e}")
print("CuPy", cupy.__version__, "sees", cupy.cuda.runtime.getDeviceCount(), "GPU(s)")
PYTHON
then
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L || true

step "GPU tests"
log=$(mktemp)
if ! MPIEXEC_TIMEOUT=300 "$PY" -m pytest tests/test_gpu.py -q -rs -p no:cacheprovider 2>&1 | tee "$log"; then
    echo "gpu-check: GPU tests failed" >&2
    exit 1
fi
if grep -q "SKIPPED.*needs a GPU" "$log"; then
    echo "gpu-check: GPU tests were skipped although a GPU is present" >&2
    exit 1
fi

step "benchmark"
mkdir -p "$(dirname "$OUT")"
"$PY" -m bench.gpu_bench --out "$OUT"
step "done: $OUT"
