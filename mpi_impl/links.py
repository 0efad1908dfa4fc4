"""Links emulated on one machine: ranks as nodes, each transfer held until its link would have delivered it.

`EmulatedLinks(machine, rank)` puts this process, machine rank m (its world
rank), on node m // R of `machine` (a `reference.topology.Machine`), with the
two links each rank has there: one inside its node, one to the other nodes.
When the rank sends n bytes over a link, that link is busy from the later of
now and the end of its previous message, for n over its bandwidth, and the
message is delivered a latency later. The sender knows both (it posts the
message, and its link is its own), so it sends the delivery time with the
message: `RingComm` as one more float64 array of the shift, `AllToAll` in a
second, small all-to-all. The receiver, once MPI has moved the bytes (a copy
through shared memory, far faster than any link emulated here), holds the
transfer until that time, sleeping, never spinning, and testing the other
transfers in flight between naps. One clock serves every process of the
machine: ``time.monotonic()`` (Linux's CLOCK_MONOTONIC).

What is emulated is each sender's own direction: a receiver's link in is
taken to keep up (in the ring and the all-to-all every rank receives what it
sends, so the two directions carry the same bytes). The counts it makes are
the trace's ``sent_intra`` and ``sent_inter`` (`reference.trace`).

    links = EmulatedLinks(machine, MPI.COMM_WORLD.Get_rank())
    comm = placed(MPI.COMM_WORLD, placement)       # mpi_impl.groups: scheme rank g on machine rank order[g]
    out, lse = ring_attention(q, k, v, comm=comm, make_ring=functools.partial(RingComm.on, links=links),
                              scheme="usp", ulysses_degree=2)
    mpiexec -n 4 python -m mpi4py -m mpi_impl --scheme usp --ulysses-degree 2 --ranks-per-node 2 --intra 1 --inter 0.1
"""

import time

from reference.topology import LINKS

HOLD_NAP_S = 0.001      # the longest sleep while a transfer is held, between tests of the others in flight


class EmulatedLinks:
    """This process's two links on an emulated `machine`, as machine rank `rank`."""

    def __init__(self, machine, rank):
        self.machine, self.rank = machine, rank
        self.free_at = dict.fromkeys(LINKS, 0.0)     # time.monotonic() when each link's way out is free

    def on(self, comm):
        """This rank's links as `comm` numbers its ranks (collective: the ranks
        tell each other their machine ranks)."""
        return LinkView(self, tuple(comm.allgather(self.rank)), comm.Get_rank())

    def post(self, link, nbytes):
        """The time.monotonic() at which `nbytes` sent now over `link` ("intra",
        "inter") are delivered; the link is busy until the last byte left."""
        speed = self.machine.links()[link]
        start = max(time.monotonic(), self.free_at[link])
        self.free_at[link] = start + nbytes / speed.bytes_per_s
        return self.free_at[link] + speed.latency_us * 1e-6

    def describe(self, n_ranks):
        return "emulated " + self.machine.describe(n_ranks)


class LinkView:
    """The links of `links` seen from a communicator whose rank i is machine
    rank ``peers[i]`` (this rank: ``peers[me]``)."""

    def __init__(self, links, peers, me):
        self.links, self.peers, self.me = links, peers, me

    def link(self, i):
        """The link a message to the communicator's rank i crosses."""
        return self.links.machine.link(self.peers[self.me], self.peers[i])

    def post(self, i, nbytes):
        """Delivery time of `nbytes` sent now to rank i (`EmulatedLinks.post`)."""
        return self.links.post(self.link(i), nbytes)

    def on(self, comm):
        """The same links seen from another communicator (collective)."""
        return self.links.on(comm)


def hold_until(when, test=None):
    """Return once time.monotonic() has reached `when`, sleeping in naps of at
    most HOLD_NAP_S and calling `test()` between them (MPI moves the other
    transfers in flight only inside its calls)."""
    while True:
        left = when - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, HOLD_NAP_S))
        if test is not None:
            test()
