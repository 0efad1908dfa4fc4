"""The command line's mask options reach the ring: one rank in this process
(no MPI launch) runs `mpi_impl.cli.time_passes` on its plan as `main` does, and its out is
the dense formula's on the same inputs with those options, and differs from
it with any one of them changed. The seed in particular picks both the inputs
and the dropped pairs: a ring that kept the inputs' seed but dropped with
seed 0 would pass --check (the check builds its reference from the same
options), so the reference here is built apart.

    .venv/bin/python -m pytest tests/mpi/test_cli_options.py -q
"""

import numpy as np
import pytest

from conftest import assert_close
from mpi_impl import cli
from reference import attention
from test_gpu import OneRank


class OneRankWorld(OneRank):
    """What the command line asks of its communicator, for one rank."""
    def Barrier(self): pass
    def allreduce(self, x, op=None): return x


def ring_out(argv, monkeypatch):
    monkeypatch.setattr(cli, "_max", lambda: None)        # MPI.MAX: never import (start) MPI here
    args = cli.build_parser().parse_args(argv)
    assert cli.check_args(args, 1) is None
    plan, = cli.make_plans(args, cli.NUMPY, 1)
    timed = cli.time_passes(args, plan, cli.NUMPY, OneRankWorld())
    q, k, v, _ = cli.inputs(args, np.arange(args.seq_len))
    return timed.out, (q, k, v)


BASE = ["--seq-len", "24", "--heads", "2", "--head-dim", "4", "--tile-size", "4", "--dtype", "float64", "--no-warmup",
        "--layout", "striped"]


@pytest.mark.parametrize("argv, options, changed", [
    (["--dropout", "0.5", "--seed", "7"], dict(dropout=0.5, seed=7), dict(seed=0)),
    (["--dropout", "0.5", "--seed", "7"], dict(dropout=0.5, seed=7), dict(dropout=0.25)),
    (["--window", "5"], dict(window=5), dict(window=6)),
    (["--doc-lengths", "10,14"], dict(cu_seqlens=[0, 10, 24]), dict(cu_seqlens=[0, 11, 24])),
    (["--no-causal"], dict(causal=False), dict(causal=True)),
])
def test_mask_options_reach_the_ring(argv, options, changed, monkeypatch):
    out, (q, k, v) = ring_out(BASE + argv, monkeypatch)
    assert_close(out, attention(q, k, v, **options)[0], np.float64, f"{argv}")
    other = attention(q, k, v, **dict(options, **changed))[0]
    assert np.abs(out - other).max() > 1e-3, f"{argv}: {changed} gives the same out"


def test_seed_picks_the_inputs_and_the_dropped_pairs(monkeypatch):
    out7, inputs7 = ring_out(BASE + ["--dropout", "0.5", "--seed", "7"], monkeypatch)
    out8, inputs8 = ring_out(BASE + ["--dropout", "0.5", "--seed", "8"], monkeypatch)
    assert not np.array_equal(inputs7[0], inputs8[0])
    assert_close(out8, attention(*inputs8, dropout=0.5, seed=8)[0], np.float64, "seed 8")


def test_the_backward_runs_at_its_own_tile(monkeypatch):
    """--backward-tile-size reaches the backward alone (a fused forward's small
    tile, a large one behind it); without it the backward takes --tile-size.
    Each pass's call carries its tile resolved, (tq, tk)."""
    monkeypatch.setattr(cli, "_max", lambda: None)
    tiles = []

    def forward(q, k, v, *, call, **options):
        tiles.append(("forward", call.tile))
        return q, None, None

    def backward(q, k, v, out, lse, dout, *, call, **options):
        tiles.append(("backward", call.tile))
        return q, k, v, None

    backend = cli.Backend("recording", forward, backward)
    for argv, want in (([], (4, 4)), (["--backward-tile-size", "12x6"], (12, 6))):
        tiles.clear()
        args = cli.build_parser().parse_args(BASE + ["--backward"] + argv)
        assert cli.check_args(args, 1) is None
        plan, = cli.make_plans(args, backend, 1)
        cli.time_passes(args, plan, backend, OneRankWorld())
        assert tiles == [("forward", (4, 4)), ("backward", want)]


def test_the_choice_line_prices_both_passes_at_the_link_given():
    """The cost model's choice under the table: each scheme's time is its forward
    and backward at --link-gbs and the rate measured, and that rate counts the
    flops of both passes over the critical path's seconds."""
    from mpi_impl import scheme_args
    from reference.scheme_cost import predict_scheme
    from reference.schemes import Scheme
    args = cli.build_parser().parse_args(["--seq-len", "256", "--heads", "4", "--head-dim", "16", "--tile-size", "32",
                                          "--backward", "--link-gbs", "0.5"])
    mask = cli.mask_options(args)
    ring = Scheme.checked("ring", None, n_devices=4, Hq=4, Hkv=4)
    fwd, bwd = (predict_scheme(ring, 256, "striped", backward=b, **scheme_args._shape(args, mask)) for b in (False, True))
    flops = fwd.totals()["critical_flops"] + bwd.totals()["critical_flops"]
    assert scheme_args.measured_rate(args, ring, "striped", mask, 0.5) == pytest.approx(flops / 0.5)
    line = scheme_args.choice_line(args, 4, "striped", mask, 1e9)
    ms = (fwd.seconds(0.5e9, 1e9) + bwd.seconds(0.5e9, 1e9)) * 1e3
    assert f"[ring {ms:.0f} ms," in line and "shared memory between processes at 0.5 GB/s" in line, line
