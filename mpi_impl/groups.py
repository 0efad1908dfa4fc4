"""A scheme's communicators on MPI ranks (`reference.schemes`): split once per call.

The ring and the all-gather run on the caller's communicator (a `RingComm` on
its duplicate). Ulysses and USP split it in two, once per call, both splits
collective over every rank of it:

    ring group    ranks g with the same g % u, ordered by g // u  (r = N / u of them)
    Ulysses group ranks g with the same g // u, ordered by g % u  (u consecutive ranks)

so that rank g is piece g % u of ring rank g // u, as
`reference.layouts.ulysses_positions` deals the tokens. The ring group gets
the caller's ring factory (`make_ring`: mpi_impl's `RingComm`, or gpu_impl's
with its memory object); the Ulysses group an `AllToAll`, over the ring's
emulated links where it has them (`mpi_impl.links`). The double ring splits
it in three (`reference.double_ring.groups`: its inner ring, its outer ring,
and the ring dK, dV take to the rank holding their block next), a ring of
the caller's kind on each, joined as one `DoubleRing`.

A placement (`reference.topology.Placement`) runs the scheme's rank g on the
machine's rank ``order[g]``: `placed` makes the communicator whose rank g is
the caller's rank ``order[g]``, and the call runs on it.
"""

from contextlib import ExitStack, contextmanager

import numpy as np

from reference.double_ring import DoubleRing
from reference.layouts import array_module, to_host
from reference.schemes import Comms
from reference.trace import Traffic

from .links import hold_until
from .memory import byte_view
from .ranks import rank_name


class AllToAll:
    """A Ulysses group's one verb: ``all_to_all(pieces)`` sends piece i to
    group rank i and returns the piece each group rank sent here, in rank
    order, as arrays of the pieces' module. The pieces are of one shape and
    dtype (a scheme cuts an array into u equal parts). Host arrays go to MPI
    as they are; device arrays (CuPy) through `memory`, the ring's memory
    object, where it has an ``all_to_all`` (`gpu_impl.transfer`: device
    buffers where MPI is CUDA-aware, pinned host memory with asynchronous
    copies where it is not), else through host memory. The bytes it moves
    count into `traffic` (the ring's, when the ring shares it). With `links`
    (an `mpi_impl.links.LinkView` on `comm`), each piece takes the time of
    the emulated link it crosses, and the trade ends when the last has come."""

    def __init__(self, comm, memory=None, traffic=None, links=None):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.memory = memory
        self.traffic = traffic or Traffic()
        self.links = links          # a group of one trades nothing: no link

    def all_to_all(self, pieces):
        if len(pieces) != self.size:
            raise ValueError(f"{rank_name(self.comm)}: all_to_all takes one piece per group rank "
                             f"({self.size}), got {len(pieces)}")
        links = self.links if self.size > 1 else None
        xp = array_module(pieces[0])
        exchange = getattr(self.memory, "all_to_all", None)
        if xp is not np and exchange is not None:
            got = exchange(self.comm, pieces)
        else:
            send = np.stack([to_host(p) for p in pieces])             # (u, piece...): contiguous
            received = self._trade(send) if links is None else self._trade_held(send)
            got = [xp.asarray(piece) for piece in received]
        self.traffic.traded(pieces, got, self.rank, None if links is None else list(map(links.link, range(self.size))))
        return got

    def _trade(self, send):
        received = np.empty_like(send)
        self.comm.Alltoall(byte_view(send), byte_view(received))     # equal byte counts per rank
        return received

    def _trade_held(self, send):
        """`_trade` over the emulated links: each piece goes with the time it
        reaches its group rank (its link posted now, the pieces to the ranks
        after this one first, so that no rank is everyone's first), and the
        trade ends when the last piece here has come."""
        delivered = np.zeros((self.size, 1))                         # this rank's own piece: now
        for k in range(1, self.size):
            i = (self.rank + k) % self.size
            delivered[i] = self.links.post(i, send[i].nbytes)
        rows = np.concatenate([byte_view(send).reshape(self.size, -1), delivered.view(np.uint8)], axis=1)
        back = self._trade(rows)                                     # (u, piece bytes + 8)
        hold_until(float(np.ascontiguousarray(back[:, -8:]).view(np.float64).max()))
        return np.ascontiguousarray(back[:, :-8]).view(send.dtype).reshape(send.shape)


@contextmanager
def scheme_comms(comm, scheme, make_ring):
    """This rank's `reference.schemes.Comms` for `scheme` on the mpi4py
    communicator `comm`, freed on exit however the call ended."""
    if scheme.name == "double_ring":
        with double_ring_comm(comm, scheme, make_ring) as ring:
            yield Comms(ring)
        return
    if scheme.u == 1:
        with make_ring(comm) as ring:
            yield Comms(ring)
        return
    g, u = comm.Get_rank(), scheme.u
    ring_comm, ulysses_comm = comm.Split(g % u, g // u), comm.Split(g // u, g % u)
    try:
        with make_ring(ring_comm) as ring:
            links = getattr(ring, "links", None)
            a2a = AllToAll(ulysses_comm, getattr(ring, "memory", None), getattr(ring, "traffic", None),
                           None if links is None else links.on(ulysses_comm))
            yield Comms(ring, a2a)
    finally:
        ring_comm.Free()
        ulysses_comm.Free()


@contextmanager
def double_ring_comm(comm, scheme, make_ring):
    """This rank's `DoubleRing`: a ring of `make_ring`'s on each of its three
    rings' communicators (each split from `comm` by its members, in ring
    order), ended however the call ended, and the splits freed."""
    g = comm.Get_rank()
    splits = [comm.Split(min(members), members.index(g)) for members in scheme.double_ring_groups(g)]
    try:
        with ExitStack() as rings:
            yield DoubleRing(*(rings.enter_context(make_ring(split)) for split in splits))
    finally:
        for split in splits:
            split.Free()


def placed(comm, placement):
    """The communicator whose rank g is `comm`'s rank ``placement.order[g]``
    (collective): a scheme run on it puts its rank g on that machine rank."""
    placement.check(comm.Get_size())
    return comm.Split(0, placement.order.index(comm.Get_rank()))
