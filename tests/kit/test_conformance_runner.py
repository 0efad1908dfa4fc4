"""The conformance runner (conformance/run.py) on a NumPy ring: what it records of a run.

Needs torch (importing conformance.run builds the peers): skipped under `make test`.

    conformance/.venv/bin/python -m pytest -q tests/kit/test_conformance_runner.py
"""

import numpy as np
import pytest

pytest.importorskip("torch")

from conformance import run as conformance  # noqa: E402
from reference.testing.adapter import VirtualRingAdapter  # noqa: E402


class Virtual(VirtualRingAdapter):
    """This project's virtual ring as a peer (what the runner stores of a peer)."""
    key, name, library, layouts = "virtual/ring", "virtual ring", "striped-attention", ("contiguous",)


class FlakyOnce(Virtual):
    """The virtual ring, except that its third call returns a wrong out: a result
    that depends on what ran before."""

    def __init__(self):
        self.calls = 0

    def run(self, case, shards):
        results = super().run(case, shards)
        self.calls += 1
        if self.calls == 3:
            results[0]["out"] = results[0]["out"] + 1
        return results


def test_a_run_that_agrees_counts_its_examples_per_world_size_and_reports_progress():
    seen = []
    run = conformance.run_one(Virtual(), np.float64, "causal / full", "forward", 5,
                              progress=lambda n, checked: seen.append((n, checked)))
    assert run.failure is None and dict(run.world_sizes) == {2: 5, 3: 5, 4: 5}
    assert seen == [(2, 5), (3, 5), (4, 5)] and run.usage["out"] < 1


def test_a_failure_that_agrees_on_replay_says_so_instead_of_a_shrunk_case():
    run = conformance.run_one(FlakyOnce(), np.float64, "causal / full", "forward", 10)
    case, message = run.failure
    assert case is not None and "out:" in message
    assert message.endswith(conformance.FLAKY)


class BackwardRaises(Virtual):
    """A peer whose backward raises: its forward must still be judged on its own."""
    key = "virtual/backward-raises"

    def run(self, case, shards):
        if self.backward:
            raise RuntimeError("its backward raises")
        return super().run(case, shards)


def test_the_forward_run_leaves_the_peers_backward_off():
    forward = conformance.run_one(BackwardRaises(), np.float64, "causal / full", "forward", 3)
    assert forward.failure is None, forward.failure
    backward = conformance.run_one(BackwardRaises(), np.float64, "causal / full", "backward", 3)
    assert backward.failure is not None and "its backward raises" in backward.failure[1]
