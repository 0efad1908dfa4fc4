"""Every scheme's buffer hazards, caught without MPI: the schemes of
`reference.schemes` run on threads over communication objects at their
strictest, and must still equal dense attention, forward and backward.

- the ring group's object is `StrictRing` (tests/support/strict_comm.py): a
  block `finish_shift` returns is valid only until the second shift after it
  with its tag (its buffers are then received into again, scribbled on first,
  as mpi_impl's RingComm reuses its two buffer sets), so an all-gather that
  keeps a received block without copying it reads garbage;
- the double ring's three rings are StrictRings too: a block that came on the
  outer ring lies in its buffers when the inner ring sends it on, and the
  outer ring receives into them again two outer shifts later (8 devices, four
  groups of two), so the inner ring must send a copy;
- the Ulysses group's object is mpi_impl's own `AllToAll`, on a stand-in
  communicator between threads whose ``Alltoall`` refuses a send buffer that
  shares memory with the receive buffer, as MPI does, and fills the receive
  buffer with garbage until each piece lands.

tests/mpi/test_hazards.py holds the same contract for the ring on real MPI ranks
and on `CheckingMPI`; these run in `make test` beside the oracle's tests.

    .venv/bin/python -m pytest tests/oracle/test_scheme_hazards.py -q
"""

import numpy as np
import pytest

from conftest import assert_close
from mpi_impl.groups import AllToAll
from reference import attention, attention_backward, double_ring, schemes
from reference.call import check_call
from reference.layouts import shard_at, unshard_at
from strict_comm import HazardError, StrictRing, World, run_threads, scribble

B, S, HQ, HKV, D = 1, 32, 4, 2, 8


class Group:
    """The members' part of a World: group rank i is global rank members[i],
    and their messages are apart from every other group's."""

    def __init__(self, world, members):
        self.world, self.members, self.n = world, members, len(members)
        self.failed = world.failed

    def post(self, dest, key, message):
        self.world.post(self.members[dest], (self.members, key), message)

    def take(self, dest, key, what):
        return self.world.take(self.members[dest], (self.members, key), what)


class ThreadAlltoall:
    """The Alltoall of an mpi4py communicator of `group`'s threads (equal
    byte counts per rank), strict: aliased buffers are refused, as MPI refuses
    them, and the receive buffer holds garbage until a piece lands in it."""

    def __init__(self, rank, group):
        self.rank, self.group, self.calls = rank, group, 0

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.group.n

    def Alltoall(self, send, received):
        if np.shares_memory(send, received):
            raise HazardError(f"rank {self.rank}: Alltoall with a send buffer that shares memory with the "
                              "receive buffer (MPI refuses aliased buffers)")
        scribble(received)
        size, key = self.group.n, ("all_to_all", self.calls)
        self.calls += 1
        for i, piece in enumerate(np.split(send, size)):
            self.group.post(i, key + (self.rank,), piece.copy())
        for i, place in enumerate(np.split(received, size)):
            place[...] = self.group.take(self.rank, key + (i,), f"rank {self.rank}: the piece of rank {i}")


def run_scheme(name, u, n, layout, seed=0, w=None):
    """(out, lse, dq, dk, dv) of `name` on n threads over the strict objects, natural order; and dense's."""
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((B, S, HQ, D)) for _ in range(2))
    k, v = (rng.standard_normal((B, S, HKV, D)) for _ in range(2))
    out, lse = attention(q, k, v)
    want = (out, lse, *attention_backward(q, k, v, out, lse, dout))
    call = check_call(q, k, v, n_devices=n, layout=layout, scheme=name, ulysses_degree=u, ring_inner=w, step="v1",
                      tile_size=4)
    scheme, pos = call.scheme, call.positions
    shards = [shard_at(x, pos) for x in (q, k, v, out)] + [shard_at(lse, pos, axis=2), shard_at(dout, pos)]
    opts = dict(scheme=scheme, scale=call.scale, tile_size=call.tile, step=call.step, mask=call.mask)

    def strict(world, j, members):
        return StrictRing(members.index(j), Group(world, members))

    def device(j, world):
        group = scheme.ulysses_group(j)
        if name == "double_ring":
            rings = [strict(world, j, members) for members in scheme.double_ring_groups(j)]
            ring = double_ring.DoubleRing(*rings)
        else:
            rings = [strict(world, j, scheme.ring_group(j))]
            ring = rings[0]
        a2a = AllToAll(ThreadAlltoall(group.index(j), Group(world, group))) if scheme.u > 1 else None
        comms = schemes.Comms(ring, a2a)
        group_pos = np.concatenate([pos[g] for g in group])
        qj, kj, vj, oj, lj, dj = (s[j] for s in shards)
        o, l, _ = schemes.forward(qj, kj, vj, group_pos, comms, **opts)
        dq, dk, dv, _ = schemes.backward(qj, kj, vj, oj, lj, dj, group_pos, comms, **opts)
        for r in rings:
            assert not r.unfinished(), f"device {j} left shifts unfinished: {r.unfinished()}"
            r.close()           # what it sent must be as it was sent
        return o, l, dq, dk, dv

    results = run_threads(n, device)
    got = tuple(unshard_at([r[i] for r in results], pos, S, axis=2 if i == 1 else 1) for i in range(5))
    return got, want


@pytest.mark.parametrize("name, u, n", [("ring", None, 4), ("all_gather", None, 4), ("all_gather", None, 3),
                                        ("ulysses", None, 2), ("usp", 2, 4)])
@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_each_scheme_on_strict_communication_equals_dense(name, u, n, layout):
    got, want = run_scheme(name, u, n, layout)
    for what, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert_close(g, w, np.float64, what=f"{what} of {name} on {n} devices, {layout}")


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_the_double_ring_on_strict_communication_equals_dense(layout):
    got, want = run_scheme("double_ring", None, 8, layout, w=2)
    for what, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert_close(g, w, np.float64, what=f"{what} of the double ring, {layout}")


def test_a_double_ring_whose_inner_ring_sends_the_outer_rings_buffers_is_caught(monkeypatch):
    monkeypatch.setattr(double_ring, "copied", lambda arrays: arrays)
    with pytest.raises(HazardError, match="written before the ring ended"):
        run_scheme("double_ring", None, 8, "striped", w=2)


def test_the_stand_in_refuses_aliased_buffers():
    world = World(1)
    a = np.zeros(8, np.uint8)
    with pytest.raises(HazardError, match="shares memory with the receive buffer"):
        ThreadAlltoall(0, Group(world, (0,))).Alltoall(a, a)
