"""The kit's own line (`reference.testing`), held where a developer would move
it: the lse budget counts the terms of a row's sum, the flushed-subnormal
budget grows as the rest does, the mask strategy draws a window as wide as the
sequence, a flaky ring's verdict names the smallest case, and world sizes run
smallest first however they are given. NumPy and hypothesis only.

    .venv/bin/python -m pytest tests/kit/test_kit_line.py -q
"""

import numpy as np
from hypothesis import find, settings

from reference.testing import Case, VirtualRingAdapter
from reference.testing.strategies import mask_options
from reference.testing.check import check_adapter, make_plan
from reference.testing.oracle import ErrorModel, magnitudes

S = 64


def test_the_lse_budget_counts_the_terms_of_its_row():
    # q = 0: every score 0, so a row's lse is log(keys it sees) and its budget
    # 1 + |lse| + n (L = 0): n terms summed, each rounded
    case = Case("striped", 1, 1, S, 1, 1, 4, None, True, None, np.float64, "gaussian", 0)
    q = np.zeros((1, S, 1, 4))
    k = v = dout = np.ones((1, S, 1, 4))
    n = np.arange(1, S + 1)
    lse = np.log(n)[None, None, :]
    out = np.ones((1, S, 1, 4))
    acc, _ = magnitudes(case, q, k, v, dout, out, lse)
    np.testing.assert_allclose(acc["lse"][0, 0], 1 + np.log(n) + n)


def test_the_flushed_budget_grows_as_the_rest_does():
    M = stored = expected = np.zeros(3)
    flushed = np.array([0.0, 1e30, 1e31])             # large enough to show beside the floor
    for growth in (1.0, 8.0):
        model = ErrorModel(growth=growth)
        opts = dict(accumulate=np.float32, output=np.float16)
        extra = model.tolerance(M, stored, expected, flushed=flushed, **opts) - model.tolerance(M, stored, expected,
                                                                                                **opts)
        np.testing.assert_allclose(extra, growth * float(np.finfo(np.float32).tiny) * flushed, rtol=1e-6)


def test_a_window_as_wide_as_the_sequence_is_drawn():
    found = find(mask_options(S, ("window",)), lambda o: o["window"] == S,
                 settings=settings(max_examples=2000, database=None))
    assert found["window"] == S


class WrongForAWhile(VirtualRingAdapter):
    """The virtual ring, wrong on cases of 8 tokens or more for its first 6
    such runs and right after: hypothesis finds a failure, shrinks it a few
    steps, then cannot make its smallest case fail again, so the verdict is flaky."""
    name = "wrong-for-a-while"

    def __init__(self):
        self.failed = []

    def run(self, case, shards):
        results = super().run(case, shards)
        if case.S >= 8 and len(self.failed) < 6:
            self.failed.append(case)
            for r in results:
                r["out"] = r["out"] + 1
        return results


def size(case):
    return (case.B * case.S * case.Hq * case.D, case.S)


def test_a_flaky_verdict_names_the_smallest_case_that_failed():
    ring = WrongForAWhile()
    plan = make_plan(ring, world_sizes=(2,), layouts=("striped",), dtypes=("float64",), masks=("causal",),
                     examples=20, shrink_seconds=60)
    verdict = check_adapter(ring, plan)
    assert verdict.flaky and len(ring.failed) > 1
    assert size(verdict.case) == min(size(c) for c in ring.failed) < size(ring.failed[0])


def test_world_sizes_run_smallest_first_however_given():
    assert make_plan(VirtualRingAdapter(), world_sizes=(4, 2, 4)).world_sizes == (2, 4)
