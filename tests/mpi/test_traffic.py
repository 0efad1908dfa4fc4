"""mpi_impl's communication objects count the bytes they move, as the cost model predicts them.

`RingComm` counts what each shift sends and receives in the round the ring's
loop is in, and `AllToAll` the pieces it trades with the other ranks of its
group; the RoundLog reads the counts (`reference.trace.Traffic`). Here the
ring runs on threads over `CheckingMPI` (tests/support/strict_comm.py), so the
counts of a real RingComm are held to `reference.scheme_cost.predict_scheme`,
byte for byte, for one rank (a ring of one moves nothing) and more.

    .venv/bin/python -m pytest tests/mpi/test_traffic.py -q
"""

import numpy as np
import pytest

from mpi_impl.comm import RingComm
from mpi_impl.groups import AllToAll
from reference import positions, ring, shard, steps
from reference.masks import CAUSAL
from reference.scheme_cost import predict_scheme
from reference.schemes import Scheme
from strict_comm import CheckingMPI, run_threads

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


class Pairs:
    """Rank 0 of a group of two, whose partner sends `theirs` (bytes)."""
    def __init__(self, theirs):
        self.theirs = theirs

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Alltoall(self, send, received):
        half = len(send) // 2
        received[:half], received[half:] = send[:half], self.theirs


def test_the_all_to_all_counts_the_pieces_it_trades_not_its_own():
    a2a = AllToAll(Pairs(np.zeros(16, np.uint8)))
    a2a.traffic.round = 3
    a2a.all_to_all([np.zeros(2, np.float64), np.zeros(2, np.float64)])      # 16 bytes a piece
    assert a2a.traffic.take() == [(3, "all_to_all", 16, 16)]
    assert a2a.traffic.take() == []                                        # each move read once
