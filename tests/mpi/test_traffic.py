"""mpi_impl's communication objects count the bytes they move, as the cost model predicts them.

`RingComm` counts what each shift sends and receives in the round the ring's
loop is in, and `AllToAll` the pieces it trades with the other ranks of its
group; the RoundLog reads the counts (`reference.trace.Traffic`). Here the
ring runs on threads over `CheckingMPI` (tests/support/strict_comm.py), so the
counts of a real RingComm are held to `reference.scheme_cost.predict_scheme`,
byte for byte, for one rank (a ring of one moves nothing) and more; and the
double ring's, on three RingComms a rank (`reference.double_ring`).

    .venv/bin/python -m pytest tests/mpi/test_traffic.py -q
"""

import threading

import numpy as np
import pytest

from mpi_impl.comm import RingComm
from mpi_impl.groups import AllToAll
from reference import positions, ring, shard, steps
from reference.double_ring import DoubleRing
from reference.masks import CAUSAL
from reference.scheme_cost import predict_scheme
from reference.schemes import Scheme
from strict_comm import CheckingMPI, Pairs, World, run_threads

MOVED = ("bytes_sent", "bytes_received", "kv_bytes")


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ring_comm_counts_what_the_cost_model_predicts(n, dtype):
    S, Hq, Hkv, D = 6 * n, 4, 2, 8
    rng = np.random.default_rng(n)
    q, dout = (rng.standard_normal((1, S, Hq, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, S, Hkv, D)).astype(dtype) for _ in range(2))
    pos = positions(S, n, "striped")
    qs, ks, vs, douts = (shard(x, n, "striped") for x in (q, k, v, dout))
    opts = dict(mask=CAUSAL, scale=D ** -0.5, tile_size=2, step=steps.get("v1"))

    def device(j, world):
        comm = RingComm(CheckingMPI(j, world))
        out, lse, forward = ring.ring_forward(qs[j], ks[j], vs[j], pos[j], pos[j], comm, **opts)
        *_, backward = ring.ring_backward(qs[j], ks[j], vs[j], out, lse, douts[j], pos[j], pos[j], comm, **opts)
        comm.close()
        return forward, backward

    logs = run_threads(n, device)
    for j, pair in enumerate(logs):
        for backward, log in enumerate(pair):
            want = predict_scheme(Scheme("ring", n, 1), S, "striped", B=1, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype,
                                  tile_size=2, backward=bool(backward))
            for name in MOVED:
                np.testing.assert_array_equal(getattr(log, name), getattr(want, name)[:, j],
                                              err_msg=f"{name}, rank {j}, {'backward' if backward else 'forward'}")


def test_the_all_to_all_counts_the_pieces_it_trades_not_its_own():
    a2a = AllToAll(Pairs(np.zeros(16, np.uint8)))
    a2a.traffic.round = 3
    a2a.all_to_all([np.zeros(2, np.float64), np.zeros(2, np.float64)])      # 16 bytes a piece
    assert a2a.traffic.take() == [(3, "all_to_all", 16, 16)]
    assert a2a.traffic.take() == []                                        # each move read once


class Ranks:
    """The worlds of a scheme's groups: one `World` per group of members, so
    that each rank's end of a group is a communicator of its own."""

    def __init__(self):
        self.worlds, self.lock = {}, threading.Lock()

    def comm(self, members, g):
        with self.lock:
            world = self.worlds.setdefault(members, World(len(members)))
        return CheckingMPI(members.index(g), world)


@pytest.mark.parametrize("n, w", [(4, 2), (6, 3), (8, 2)])
def test_the_double_rings_ring_comms_count_what_the_cost_model_predicts(n, w):
    """The double ring on three RingComms a rank, over CheckingMPI: a rank's
    three communicators share their list of sends not yet complete, so that
    a ring receiving into a buffer another ring still sends fails too."""
    S, Hq, Hkv, D, dtype = 2 * n, 2, 1, 4, np.float16
    rng = np.random.default_rng(n)
    q, dout = (rng.standard_normal((1, S, Hq, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, S, Hkv, D)).astype(dtype) for _ in range(2))
    pos = positions(S, n, "zigzag")
    qs, ks, vs, douts = (shard(x, n, "zigzag") for x in (q, k, v, dout))
    opts = dict(mask=CAUSAL, scale=D ** -0.5, tile_size=2, step=steps.get("v1"))
    scheme, ranks = Scheme("double_ring", n, 1, w), Ranks()

    def device(j, _world):
        mpis = [ranks.comm(members, j) for members in scheme.double_ring_groups(j)]
        for other in mpis[1:]:
            other.sends = mpis[0].sends
        rings = [RingComm(mpi) for mpi in mpis]
        comm = DoubleRing(*rings)
        out, lse, forward = ring.ring_forward(qs[j], ks[j], vs[j], pos[j], pos[j], comm, **opts)
        *_, backward = ring.ring_backward(qs[j], ks[j], vs[j], out, lse, douts[j], pos[j], pos[j], comm, **opts)
        for r in rings:
            r.close()
        assert not mpis[0].incomplete()
        return forward, backward

    logs = run_threads(n, device)
    for backward in (False, True):
        want = predict_scheme(scheme, S, "zigzag", B=1, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, tile_size=2,
                              backward=backward)
        for j, pair in enumerate(logs):
            for name in MOVED + ("source",):
                got = getattr(pair[backward], name)
                expected = getattr(want if name in MOVED else want.work, name)[:, j]
                np.testing.assert_array_equal(got, expected, err_msg=f"{name}, rank {j}, backward={backward}")
