"""The communicators a scheme splits (`mpi_impl.groups`), with a stand-in
communicator that records each Split: the ring group of rank g holds the ranks
of its g % u in the order of g // u, the Ulysses group the ranks of its g // u
in the order of g % u; both are freed however the call ends; the double
ring's three splits hold the rings `reference.double_ring.groups` names in
their order; a placed communicator's rank g is machine rank order[g]; the
all-to-all takes one piece per group rank, no more, no fewer.

    .venv/bin/python -m pytest tests/mpi/test_groups.py -q
"""

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from mpi_impl.groups import AllToAll, placed, scheme_comms
from reference.schemes import Scheme
from reference.topology import Placement
from strict_comm import Pairs


class Sub:
    """A communicator made by Split: its color, its key, whether it was freed."""
    def __init__(self, color, key):
        self.color, self.key, self.freed = color, key, False

    def Free(self):
        self.freed = True

    def Get_rank(self):
        return self.key

    def Get_size(self):
        return None             # not asked here


class World:
    """Rank g of n: what scheme_comms asks of the caller's communicator."""
    def __init__(self, g, n):
        self.g, self.n, self.splits = g, n, []

    def Get_rank(self):
        return self.g

    def Get_size(self):
        return self.n

    def Split(self, color, key):
        self.splits.append(Sub(color, key))
        return self.splits[-1]


@contextmanager
def ring_on(comm):
    yield ("ring on", comm)


def groups(scheme):
    """{world rank: (ring group's (color, key), Ulysses group's (color, key))}, every rank split as it would be."""
    found = {}
    for g in range(scheme.n):
        world = World(g, scheme.n)
        with scheme_comms(world, scheme, ring_on) as comms:
            ring = comms.ring[1]
            assert comms.ulysses.comm is world.splits[1] and ring is world.splits[0]
        found[g] = [(s.color, s.key) for s in world.splits]
    return found


@pytest.mark.parametrize("n, u", [(6, 2), (6, 3), (8, 2), (8, 4)])
def test_each_rank_is_in_the_ring_and_ulysses_groups_the_scheme_names_in_their_order(n, u):
    """The ring group's order is the ring's direction (rank i sends to i + 1):
    ordered by g // u it runs as the scheme deals the tokens (ring rank g // u);
    a group in another order would send each block to the wrong neighbour."""
    scheme = Scheme.checked("usp", u, n_devices=n, Hq=24, Hkv=24)
    found = groups(scheme)
    for g, ((ring_color, ring_key), (ulysses_color, ulysses_key)) in found.items():
        ring = sorted((k, h) for h, ((c, k), _) in found.items() if c == ring_color)
        assert tuple(h for _, h in ring) == scheme.ring_group(g) and ring_key == g // u
        ulysses = sorted((k, h) for h, (_, (c, k)) in found.items() if c == ulysses_color)
        assert tuple(h for _, h in ulysses) == scheme.ulysses_group(g) and ulysses_key == g % u


@contextmanager
def one_rank(comm):
    yield SimpleNamespace(rank=0, size=1)      # what DoubleRing reads of a ring


@pytest.mark.parametrize("n, w", [(6, 3), (8, 4)])
def test_each_rank_is_in_the_double_rings_three_rings_in_their_order(n, w):
    """Each of the three splits (inner, outer, home) puts the rank in the ring
    `reference.double_ring.groups` names, at its place in the ring's order:
    the ring dK, dV take home runs (0, 4, 2, 3, 1, 5) on 6 ranks of groups of 3,
    not in the order of the world's ranks."""
    scheme = Scheme.checked("double_ring", n_devices=n, Hq=2, Hkv=2, ring_inner=w)
    found = {}
    for g in range(n):
        world = World(g, n)
        with scheme_comms(world, scheme, one_rank):
            pass
        found[g] = [(s.color, s.key) for s in world.splits]
        assert len(found[g]) == 3 and all(s.freed for s in world.splits)
    for g in range(n):
        for k, members in enumerate(scheme.double_ring_groups(g)):
            color = found[g][k][0]
            ring = sorted((found[h][k][1], h) for h in range(n) if found[h][k][0] == color)
            assert tuple(h for _, h in ring) == members, (g, k)


def test_a_placed_communicators_rank_g_is_the_machine_rank_its_order_names():
    """USP u = 2 ring-in-nodes on 8 ranks: scheme rank g on machine rank
    order[g], an order that is not its own inverse (on 4 ranks it is)."""
    order = (0, 4, 1, 5, 2, 6, 3, 7)
    keys = {}
    for m in range(8):
        sub = placed(World(m, 8), Placement("ring-in-nodes", order))
        assert sub.color == 0
        keys[m] = sub.key
    assert tuple(sorted(range(8), key=keys.get)) == order


@pytest.mark.parametrize("fails", [False, True])
def test_both_groups_are_freed_however_the_call_ends(fails):
    world = World(1, 4)
    with pytest.raises(RuntimeError) if fails else contextmanager(lambda: (yield))():
        with scheme_comms(world, Scheme.checked("usp", 2, n_devices=4, Hq=4, Hkv=4), ring_on):
            if fails:
                raise RuntimeError("the ring failed")
    assert [s.freed for s in world.splits] == [True, True]


def test_the_ring_alone_splits_nothing():
    world = World(0, 4)
    with scheme_comms(world, Scheme.checked("ring", None, n_devices=4, Hq=4, Hkv=4), ring_on) as comms:
        assert comms.ring == ("ring on", world) and comms.ulysses is None
    assert world.splits == []


@pytest.mark.parametrize("count", [1, 3])
def test_the_all_to_all_takes_one_piece_per_group_rank(count):
    with pytest.raises(ValueError, match=r"one piece per group rank \(2\), got " + str(count)):
        AllToAll(Pairs(b"")).all_to_all([np.zeros(4)] * count)


def test_the_all_to_all_returns_the_piece_each_rank_sent_here_in_rank_order():
    theirs = np.arange(4, 8, dtype=np.float32).view(np.uint8)
    got = AllToAll(Pairs(theirs)).all_to_all([np.arange(4, dtype=np.float32), np.full(4, -1, np.float32)])
    assert [g.tolist() for g in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
