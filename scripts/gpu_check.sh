#!/usr/bin/env bash
# make gpu-check: the prepared GPU validation (scripts/gpu_check.py), on a machine with a CUDA 13 GPU.
#
#   bash scripts/gpu_check.sh                    # what `make gpu-check` runs: installs nothing
#   bash scripts/gpu_check.sh --wheels DIR       # first install the wheels `make gpu-wheels` put in DIR (no index)
#   bash scripts/gpu_check.sh --dry-run          # any machine: every step starts, nothing is measured
#   bash scripts/gpu_check.sh --python PATH ...  # another interpreter (default: .venv/bin/python, else the
#                                                # first of python3, python that imports cupy, else python3)
#   bash scripts/gpu_check.sh --venv DIR ...     # where --wheels installs (default: .gpu-venv)
#   bash scripts/gpu_check.sh --help             # these options, then scripts/gpu_check.py's
#
# Every other option goes to scripts/gpu_check.py (--out FILE, --only STEP..., --mpiexec PATH,
# --fake-gpu). The interpreter needs NumPy, CuPy, mpi4py, pytest and hypothesis; mpiexec must
# be beside it or on PATH.
#
# --wheels DIR makes a fresh venv (--venv) that sees every package the interpreter sees (its
# CuPy, torch, NumPy, and the CUDA libraries CuPy looks for in site.getsitepackages():
# scripts/machine_pth.py writes the .pth, so this works from a system Python, a venv or conda
# alike), installs into it with the pip carried in DIR: mpich and
# mpi4py always, the rest of DIR/requirements.txt only where missing; and runs the check with
# that venv's Python. So mpiexec lies beside that Python, and mpi4py finds the mpich wheel's
# libmpi.so.12 in the venv's lib/ (where `pip install --target` would drop it). The 9
# minutes of the check count from here, the install included (45 s are kept for it).
# Exit status: 0 passed, 1 a step failed (or mpiexec is missing), 2 no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

PY=""
wheels=""
venv=.gpu-venv
help=""
args=()
while (( $# )); do
    case "$1" in
        --wheels) wheels="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --venv) venv="$2"; shift 2 ;;
        -h|--help) help=1; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
if [[ -z "$PY" ]]; then     # .venv's, else the first of python3, python that has CuPy, else python3
    PY=.venv/bin/python
    if [[ ! -x "$PY" ]]; then
        PY=python3
        for candidate in python3 python; do
            if command -v "$candidate" >/dev/null && "$candidate" -c "import cupy" 2>/dev/null; then
                PY=$candidate; break
            fi
        done
    fi
fi

if [[ -n "$help" ]]; then        # this script's own options (its header), then the Python's
    sed -n '2,/^set -euo/p' "$0" | grep -v '^set -euo' | sed 's/^# \{0,1\}//'
    echo
    exec "$PY" scripts/gpu_check.py --help
fi

if [[ -n "$wheels" ]]; then
    echo "== installing the wheels in $wheels into the venv $venv (no package index)"
    for f in forced.txt requirements.txt; do
        [[ -f "$wheels/$f" ]] || { echo "gpu-check: $wheels has no $f: prepare it with make gpu-wheels" >&2; exit 1; }
    done
    pip_wheel=$(ls "$wheels"/pip-*.whl | head -1)
    rm -rf "$venv"
    "$PY" -m venv --without-pip "$venv"
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    "$PY" scripts/machine_pth.py "$site"        # the interpreter's own packages, after the venv's
    pip=("$venv/bin/python" "$pip_wheel/pip" install -q --disable-pip-version-check --no-index --find-links "$wheels")
    "${pip[@]}" --ignore-installed --no-deps -r "$wheels/forced.txt"     # the machine's mpi4py has no MPI library
    "${pip[@]}" -r "$wheels/requirements.txt"
    PY="$venv/bin/python"
    echo "   installed in $(( $(date +%s) - started )) s: $(ls "$site" | grep -c dist-info) packages in $site"
fi
exec "$PY" scripts/gpu_check.py --started "$started" "${args[@]+"${args[@]}"}"
