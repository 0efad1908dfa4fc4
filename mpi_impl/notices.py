"""The end of a ring call between neighbours: one notice each way, "done" or why a rank left.

The failure protocol of `mpi_impl.comm.RingComm`, apart from its three verbs:

Every rank ends its ring call with one notice to each neighbour (ring tag 0):
"done" from `close`, or, from a rank that left the ring (an exception,
`sys.exit` included, ended its ring call), the reason. A rank waiting for a
transfer waits for the neighbour's notice too, so that it says "rank 1 left
the ring" instead of failing with MPI's bare error or waiting for ever; and
`close` waits for both neighbours' notices, so that a neighbour that left
after its last transfer with this rank is named too, however late its notice
comes (without that, the call would return into the next collective, which
would wait for the rank that left for ever). Only neighbours are told: with
4 ranks or more, a rank two hops from the one that left ends its call as
usual, and the job ends when a neighbour's error aborts it (``python -m
mpi4py`` does). The rank that leaves cancels its receives and completes its
sends first, so that MPI never reads its freed memory after Python exits.
A ring call that failed may leave messages on their way (a notice, a block)
that no receive will take: unless both neighbours said "done", the
communicator `on` duplicated is then kept, never freed (a freed one's
context is reused by the next duplicate, whose receives would match them:
seen with MPICH, where the next call's notice receive took the failed call's
"done" and that call then missed a neighbour that left). A process that carries on after failed ring calls keeps one
communicator for each (MPICH has about 2,000). `RingComm` made directly on
a communicator (not by `on`) leaves such messages on the caller's.
"""

import numpy as np

from .cores import wait_any

FROM_PREV, FROM_NEXT = 0, 1     # MPI tags of a neighbour's notice ("done" or why it left), by where it comes from
NOTICE_BYTES = 512              # its reason, UTF-8, cut to fit


class NeighbourLeft(Exception):
    """The neighbour a transfer waits for sent word that it left the ring."""


class Notices:
    """Word between neighbours at the end of a ring call: each rank keeps a
    receive posted for one notice from either neighbour ("done", or the reason
    it left the ring), and waits for a transfer or that notice, whichever
    comes first."""

    def __init__(self, comm, prev, next, *, quiet=False):
        self.comm, self.prev, self.next = comm, prev, next      # no reference back: no cycle to collect
        self.quiet = quiet          # wait by testing with a short sleep, not spinning (`mpi_impl.cores.wait_any`)
        self._buffers = {FROM_PREV: np.zeros(NOTICE_BYTES, np.uint8), FROM_NEXT: np.zeros(NOTICE_BYTES, np.uint8)}
        self._peers = {FROM_PREV: prev, FROM_NEXT: next}
        self._requests = {tag: comm.Irecv(self._buffers[tag], source=self._peers[tag], tag=tag)
                          for tag in (FROM_PREV, FROM_NEXT)}
        self._said = {}             # tag -> what the neighbour said: DONE, or the reason it left
        self.told = False           # this rank sent its own notices
        self._sent = []             # [(Isend request, buffer)] of those notices

    def _tag(self, peer):
        return FROM_PREV if peer == self.prev else FROM_NEXT

    def _read(self, tag):
        self._said[tag] = bytes(self._buffers[tag]).rstrip(b"\0").decode(errors="replace")

    def wait(self, request, peer):
        """Wait for `request` or the notice from `peer`; raise NeighbourLeft
        if `peer` left. A neighbour that said "done" finished every shift,
        and both ranks start the same shifts (the ring call's agreement), so
        its transfers with this rank are matched and `request` completes (its
        data may land after the notice): it is waited for."""
        tag = self._tag(peer)
        if tag not in self._said:
            if wait_any([request, self._requests[tag]], quiet=self.quiet) == 0:
                return
            self._read(tag)
        if self._said[tag] != DONE:
            raise NeighbourLeft(self._said[tag])
        wait_any([request], quiet=self.quiet)

    def reason(self, peer):
        """What `peer` said when it left, or None if it has not (tested now)."""
        tag = self._tag(peer)
        if tag not in self._said and self._requests[tag].Test():
            self._read(tag)
        return self._said.get(tag) or None

    def end(self, peer):
        """Wait for the notice from `peer` (both, when `peer` is both
        neighbours); return the reason it left, or None if it said "done"."""
        for tag in (FROM_PREV, FROM_NEXT):
            if self._peers[tag] == peer and tag not in self._said:
                wait_any([self._requests[tag]], quiet=self.quiet)
                self._read(tag)
        return next((self._said[tag] for tag in (FROM_PREV, FROM_NEXT)
                     if self._peers[tag] == peer and self._said[tag] != DONE), None)

    def tell(self, reason):
        """Tell both neighbours that this rank is done (`DONE`) or leaves, and why."""
        self.told = True
        payload = np.zeros(NOTICE_BYTES, np.uint8)
        data = reason.encode()[:NOTICE_BYTES]
        payload[:len(data)] = np.frombuffer(data, np.uint8)
        # the neighbour after this one hears it from its prev, the one before from its next
        self._sent = [(self.comm.Isend(payload, dest=dest, tag=tag), payload)
                      for dest, tag in ((self.next, FROM_PREV), (self.prev, FROM_NEXT))]

    def delivered(self):
        """Wait for this rank's "done" to reach both neighbours (each takes it
        in its own `close`, having sent its own)."""
        for request, _ in self._sent:
            request.Wait()
        self._sent = []

    def withdraw(self):
        """Read the notices that came, cancel the receives of those that have
        not (they may still come). The notices this rank sent are small: MPI
        copies them when sent, so they are complete at once; one that is not
        is kept, with its buffer, in _TOLD, which the next failed ring call
        prunes of those complete by then (a neighbour that left may never take
        one)."""
        for tag, request in self._requests.items():
            if tag in self._said:
                continue
            if _completes(request, failed=False):   # (after its test it is MPI_REQUEST_NULL: no cancel)
                self._read(tag)
            else:
                quietly(request.Cancel)
                quietly(request.Wait)
        _TOLD[:] = [(request, kept) for request, kept in _TOLD + self._sent if not _completes(request)]
        self._sent = []

    def all_done(self):
        """Both neighbours said "done": every transfer with them matched, no message of theirs still to come."""
        return all(self._said.get(tag) == DONE for tag in (FROM_PREV, FROM_NEXT))


DONE = ""       # the notice of a rank that closed its ring call (a reason to leave is never empty)
_TOLD = []      # notices MPI had not sent at once: (request, buffer)
KEPT = []      # duplicates of failed ring calls, never freed: a message of theirs may still come


def _completes(request, failed=True):
    """Whether `request` is complete now; `failed` if its test raises (a
    notice kept in _TOLD is then dropped: nothing more can be done for it)."""
    try:
        return request.Test()
    except Exception:       # noqa: BLE001 - clean-up after a failure
        return failed


def quietly(action):
    """Run `action`, ignoring its errors: for clean-up after a failure, which
    must not hide the failure."""
    try:
        action()
    except Exception:       # noqa: BLE001 - the first error is the one reported
        pass
