"""Shared pieces of the test suite: hypothesis profiles, and the strategy,
tolerances and input makers of the conformance kit (`reference.testing`),
re-exported here under the names the tests import.

Sizes are tiny on purpose (S <= 64, D <= 16, a few heads): every case runs the
dense oracle, which builds the whole (S, S) score matrix, and N virtual devices
as threads, on a shared 2-core machine.

The tests are grouped by the layer they guard (oracle/, steps/, kit/, mpi/,
gpu/, model/, notebooks/, bench/, project/), their machinery apart in
support/ (stand-in communicators, the GPU made of NumPy and its emulator, the
MPI workers). Every folder is on the import path, so that a test imports the
helpers of another by its module name wherever it runs from.

Hypothesis profiles: "ci" (more examples, loaded when the CI environment
variable is set) and "dev" (few examples, the default).

    .venv/bin/python -m pytest tests -q                # dev profile
    CI=true .venv/bin/python -m pytest tests -q        # ci profile
"""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

HERE = Path(__file__).resolve().parent
for folder in sorted(p for p in HERE.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))

from reference.testing import (BFLOAT16, DTYPES, INPUT_KINDS, LARGE_LOGITS_FACTOR,  # noqa: F401
                               LARGE_LOGITS_GRAD_FACTOR, MAX_DEVICES, MAX_HEAD_DIM, MAX_SEQ, TOL, Case,
                               Tolerance, assert_close, assert_finite, cases, make_qkv, tile_sizes)

# CI is deterministic (derandomize), like Hypothesis's built-in "ci" profile.
settings.register_profile("ci", max_examples=150, deadline=None, print_blob=True, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI", "").lower() not in ("", "0", "false") else "dev")
