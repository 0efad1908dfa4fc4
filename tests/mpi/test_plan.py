"""The command line resolves each layout once (`mpi_impl.plan`): its plan holds
the scheme, every rank's positions, the mask, the steps and their tiles, and
the timed runs hand its calls to the ring as they are, resolving nothing again.
One rank in this process, no MPI launch.

    .venv/bin/python -m pytest tests/mpi/test_plan.py -q
"""

import functools
import threading
from contextlib import contextmanager

import numpy as np
import pytest

import mpi_impl
import reference.call
from mpi_impl import cli, plan
from reference.masks import layout_mask
from reference.schemes import Scheme
from reference.virtual import VirtualRing
from test_cli_options import OneRankWorld

ARGV = ["--seq-len", "21", "--heads", "2", "--head-dim", "4", "--tile-size", "4x2", "--dtype", "float64",
        "--window", "7", "--backward", "--check", "--no-warmup", "--repeat", "2"]


def plans_of(argv, n_ranks=1):
    args = cli.build_parser().parse_args(argv)
    assert cli.check_args(args, n_ranks) is None
    return args, cli.make_plans(args, cli.NUMPY, n_ranks)


def test_a_plan_per_layout_holds_what_its_runs_need():
    args, plans = plans_of(ARGV, n_ranks=3)
    assert [p.layout for p in plans] == ["contiguous", "striped", "zigzag"]
    for p in plans:
        np.testing.assert_array_equal(p.positions, Scheme("ring", 3, 1).positions(21, p.layout))
        assert p.forward.mask.describe() == layout_mask(21, 3, p.layout, causal=True, window=7).describe()
        assert p.backward.mask is p.forward.mask                 # built once per layout
        assert p.forward.tile == (4, 2) and p.backward.tile == (4, 2)
        assert p.backward.backward and not p.forward.backward
    assert len({id(p.forward.step) for p in plans}) == 1         # one step for every layout: they compare


@contextmanager
def one_device(comm):
    """The ring of one rank as a virtual device (a stand-in communicator has no transfers)."""
    ring = VirtualRing(0, 1, {}, threading.Event())
    ring.transfers = []                 # the arrival times RingComm records; none here
    yield ring


ONE_DEVICE = cli.Backend("one device", functools.partial(mpi_impl.ring_attention, make_ring=one_device),
                         functools.partial(mpi_impl.ring_attention_backward, make_ring=one_device))


def test_the_timed_runs_resolve_nothing_again(monkeypatch):
    """Every layout, both passes, two repeats and the check: once the plans are
    made, no mask is built, no step chosen and no call checked."""
    monkeypatch.setattr(cli, "_max", lambda: None)
    args, plans = plans_of(ARGV)
    args.threads, args.blas_threads = 1, 1

    def resolved_again(*args, **kwargs):
        raise AssertionError("resolved again after the plan")
    for module, name in ((plan, "make_steps"), (plan, "layout_mask"), (reference.call, "layout_mask"),
                         (reference.call, "resolve_call"), (mpi_impl.attention, "check_call")):
        monkeypatch.setattr(module, name, resolved_again)
    monkeypatch.setattr(Scheme, "checked", resolved_again)
    world = OneRankWorld()
    world.gather = lambda x: [x]
    rows, _ = cli.run(args, plans, ONE_DEVICE, world)
    assert [r.layout for r in rows] == ["contiguous", "striped", "zigzag"]
    assert all(r.error < 1e-12 for r in rows), [r.error for r in rows]


def test_a_planned_call_refuses_arrays_it_was_not_resolved_for():
    _, plans = plans_of(ARGV + ["--layout", "striped"])
    q = np.zeros((1, 21, 2, 4))
    with pytest.raises(ValueError, match=r"q does not fit the call: it was resolved for .*\(1, 21, 2, 4\), 'float64'"
                                         r"\), got \(\(1, 21, 2, 4\), 'float32'\)"):
        mpi_impl.ring_attention(q.astype(np.float32), q, q, comm=OneRankWorld(), call=plans[0].forward)
    with pytest.raises(ValueError, match="resolved for 1 ranks, not the communicator's 2"):
        mpi_impl.ring_attention(q, q, q, comm=TwoRanks(), call=plans[0].forward)


class TwoRanks(OneRankWorld):
    def Get_size(self):
        return 2

    def allgather(self, x):
        return [x, x]
