"""Shared pieces of the test suite: hypothesis profiles, and the strategy,
tolerances and input makers of the conformance kit (`reference.testing`),
re-exported here under the names the tests import.

Sizes are tiny on purpose (S <= 64, D <= 16, a few heads): every case runs the
dense oracle, which builds the whole (S, S) score matrix, and N virtual devices
as threads, on a shared 2-core machine.

Hypothesis profiles: "ci" (more examples, loaded when the CI environment
variable is set) and "dev" (few examples, the default).

    .venv/bin/python -m pytest tests -q                # dev profile
    CI=true .venv/bin/python -m pytest tests -q        # ci profile
"""

import os

from hypothesis import HealthCheck, settings

from reference.testing import (BFLOAT16, DTYPES, INPUT_KINDS, LARGE_LOGITS_FACTOR,  # noqa: F401
                               LARGE_LOGITS_GRAD_FACTOR, MAX_DEVICES, MAX_HEAD_DIM, MAX_SEQ, TOL, Case,
                               Tolerance, assert_close, assert_finite, cases, make_qkv, tile_sizes)

# CI is deterministic (derandomize), like Hypothesis's built-in "ci" profile.
settings.register_profile("ci", max_examples=150, deadline=None, print_blob=True, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI", "").lower() not in ("", "0", "false") else "dev")
