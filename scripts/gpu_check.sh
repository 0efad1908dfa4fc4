#!/usr/bin/env bash
# make gpu-check: the prepared GPU validation (scripts/gpu_check.py), on a machine with a CUDA 13 GPU.
#
#   bash scripts/gpu_check.sh                    # what `make gpu-check` runs: installs nothing
#   bash scripts/gpu_check.sh --wheels DIR       # first pip-install the wheels carried in DIR (no index)
#   bash scripts/gpu_check.sh --dry-run          # any machine: every step starts, nothing is measured
#   bash scripts/gpu_check.sh --python PATH ...  # another interpreter (default: .venv/bin/python, else python3)
#
# Every other option goes to scripts/gpu_check.py (--out FILE, --only STEP..., --mpiexec PATH).
# The interpreter needs NumPy, CuPy, mpi4py, pytest and hypothesis; mpiexec must be
# beside it or on PATH (the mpich wheel brings one). Exit status: 0 passed, 1 a step
# failed (or mpiexec is missing), 2 no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
[[ -x "$PY" ]] || PY=python3
wheels=""
args=()
while (( $# )); do
    case "$1" in
        --wheels) wheels="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done

if [[ -n "$wheels" ]]; then
    echo "== installing the wheels in $wheels (no package index)"
    "$PY" -m pip install -q --no-index --find-links "$wheels" "$wheels"/*.whl
fi
exec "$PY" scripts/gpu_check.py "${args[@]+"${args[@]}"}"
