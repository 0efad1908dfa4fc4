#!/usr/bin/env bash
# The package as a cluster user installs it: build the wheel, install it (not
# editable) in a fresh venv outside the checkout, and run from there what needs
# its package data: the paper's TMS table (reference/data/paper_tms.csv), a
# virtual ring against dense attention, the fused kernels' CUDA sources, and
# the kit's command line and harnesses (subpackages the wheel must list).
#
#     bash scripts/wheel_check.sh          # make wheel-check
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$python" -m pip wheel --no-deps -q -w "$tmp/dist" "$root"
"$python" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q "$tmp"/dist/*.whl
cd "$tmp"                                   # nothing of the checkout on the path
"$tmp/venv/bin/python" -m reference.tms > tms.txt
grep -q "largest |ours - paper|" tms.txt || { cat tms.txt; echo "wheel check: reference.tms printed no table" >&2; exit 1; }
"$tmp/venv/bin/python" -m reference.testing check --help > check.txt
grep -q "MODULE:ADAPTER" check.txt || { cat check.txt; echo "wheel check: the kit's command line has no check" >&2; exit 1; }
"$tmp/venv/bin/python" - <<'PY'
import numpy as np
import reference
from gpu_impl.steps import fused, fused_v2

assert "site-packages" in reference.__file__, reference.__file__
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 64, 2, 8)) for _ in range(3))
for step in ("v1", "v3"):
    out, lse = reference.ring_attention(q, k, v, n_devices=4, layout="striped", tile_size=8, step=step)
    want, _ = reference.attention(q, k, v)
    assert np.abs(out - want).max() < 1e-12, step
assert "attend_block_v1" in fused.kernel_source()
v2 = fused_v2.kernel_source()        # the three kernels and their shared header, from the package data
assert all(f"{name}(" in v2 for name in fused_v2.KERNELS) and "ATTEND_BLOCK_V2_CUH" in v2, v2[:200]
import reference.testing.harness.jax     # the harnesses are in the wheel (jax itself is imported when used)
print("wheel check: reference.tms, the virtual ring, the CUDA source and the kit's command line work from the installed wheel")
PY
