"""The double ring (LoongTrain, Gu et al. 2024, arXiv 2406.18485): the ring as inner rings and an outer ring.

N = w m ranks; rank g = o w + i is place i of group o (w consecutive ranks,
a node's). In outer step j (0 .. m - 1) group o holds the blocks of group
(o - j) mod m, one a rank, and runs w of the ring's rounds over them on its
inner ring; meanwhile the block each rank began the step with travels the
outer ring to (o + 1, i), for the next step, so that the slow link's transfer
overlaps w rounds. In round t = j w + s rank g holds the block of `source(g, t, w, m)`:

    N=4, w=2: g (o, i)   t = 0  1  2  3
              0 (0, 0)       0  1  2  3
              1 (0, 1)       1  0  3  2
              2 (1, 0)       2  3  0  1
              3 (1, 1)       3  2  1  0

The ring's loop (`reference.ring`, Algorithm 1) runs it unchanged on a
`DoubleRing`, a communication object that sends each shift on its ring:
K, V to (o, i + 1) while s < w - 1 (the inner ring), and at s = w - 1 the
outer ring's block arrives (sent at s = 0); dK, dV follow their block, to
(o, i + 1), or at a step's end to (o + 1, i + 1), the rank holding it next
(its owner after the last round): a third ring, MindSpeed's "dkv outer"
ranks. w = 1 is the ring on the outer ring, w = N on the inner one; the
layouts deal tokens as for the ring, and the results are the ring's.

Legend: ``N`` ranks, ``w`` ranks per inner ring (``ring_inner``), ``m = N / w``
groups, ``o, i`` a rank's group and place, ``j, s`` a round's outer step and inner round.
"""

from contextlib import nullcontext
from typing import NamedTuple

from .layouts import array_module
from .ring import DKV, KV


def place(g, w):
    """Rank g's (group o, place i): g = o w + i."""
    return divmod(g, w)


def source(g, t, w, m):
    """The rank whose block rank g holds in round t: ((o - j) mod m) w + (i - s) mod w, t = j w + s."""
    (o, i), (j, s) = place(g, w), divmod(t, w)
    return (o - j) % m * w + (i - s) % w


def groups(g, w, m):
    """Rank g's three rings, each its members in ring order (a member's next is
    the one after it): (inner, outer, home)."""
    o, i = place(g, w)
    inner = tuple(o * w + x for x in range(w))                       # its group, (o, 0) .. (o, w - 1)
    outer = tuple(y * w + i for y in range(m))                       # its place in every group
    home, h = [g], (o + 1) % m * w + (i + 1) % w                     # (o, i) -> (o + 1, i + 1) -> ... -> (o, i)
    while h != g:
        home.append(h)
        h = (h // w + 1) % m * w + (h % w + 1) % w
    first = home.index(min(home))                                    # every member lists it from the same rank
    return inner, outer, tuple(home[first:] + home[:first])


class Shift(NamedTuple):
    """A shift in flight on one of the rings: the ring, its handle, and the
    round whose block it brings (for the trace's arrival times)."""
    ring: object
    handle: object
    round: int


class DoubleRing:
    """One rank's end of the double ring: the ring's verbs (`reference.ring`)
    over three rings of one kind (groups of `reference.virtual.VirtualRing`,
    or `mpi_impl.comm.RingComm`s): `inner` (its group's w ranks), `outer` (its
    place in each of the m groups) and `home` (dK, dV to (o + 1, i + 1)). They
    count into one Traffic; `transfers` (MPI's arrival times) in the rounds of
    the loop."""

    def __init__(self, inner, outer, home):
        self.inner, self.outer, self.home = inner, outer, home
        self.w, self.m = inner.size, outer.size
        self.rank, self.size = outer.rank * self.w + inner.rank, self.w * self.m
        self.traffic = getattr(inner, "traffic", None)     # what counts the bytes (None: nothing does)
        if self.traffic is not None:
            outer.traffic = home.traffic = self.traffic    # the log reads one Traffic
        self.clock = getattr(inner, "clock", None)         # a GPU's: the inner ring's memory object's
        self.transfers = []
        self._started = {KV: 0, DKV: 0}                    # shifts of each tag: the round of the next
        self._outer = None                                 # the outer ring's shift in flight

    def start_shift(self, arrays, tag):
        if tag not in self._started:
            raise ValueError(f"a double ring moves K/V blocks (tag {KV}) and dK/dV (tag {DKV}), got tag {tag!r}")
        # the k-th shift of a tag in a pass is in round k, and a pass shifts K, V
        # N - 1 times and dK, dV N times (`reference.ring`): a forward's object may serve a backward next
        t = self._started[tag] % (self.size if tag == DKV else max(self.size - 1, 1))
        self._started[tag] += 1
        j, s = divmod(t, self.w)
        if tag == DKV:                                     # to whoever holds the block next
            ring = self.inner if s < self.w - 1 else self.home
            return Shift(ring, ring.start_shift(arrays, tag), t)
        last_step = j == self.m - 1
        if s == 0 and not last_step:                       # the outer step's block, on to (o + 1, i)
            self._outer = Shift(self.outer, self.outer.start_shift(arrays, tag), t + self.w - 1)
        self._hold(arrays, t)
        if s == self.w - 1:                                # the inner ring's last round: next, the outer block
            shift, self._outer = self._outer, None
            return shift
        if s == 0 and j > 0:
            # Hazard: this block lies in the outer ring's receive buffers, which
            # that ring fills again two outer shifts later, waiting only for its
            # own sends: the inner ring sends a copy
            arrays = copied(arrays)
        return Shift(self.inner, self.inner.start_shift(arrays, tag), t)

    def finish_shift(self, shift):
        if not isinstance(shift, Shift):
            raise ValueError(f"finish_shift takes what start_shift returned, got {type(shift).__name__}")
        arrived = shift.ring.finish_shift(shift.handle)
        done = getattr(shift.ring, "transfers", None)
        if done:
            self.transfers.append(done[-1]._replace(round=shift.round))
        return arrived

    def progress(self):
        for ring in (self.inner, self.outer, self.home):
            ring.progress()

    def turn(self):
        return self.inner.turn() if hasattr(self.inner, "turn") else nullcontext()

    def _hold(self, block, t):
        """Count what round t holds beside the block attended to and the one
        arriving (the log counts those two: a round that shifts K, V has one
        arriving, on one ring or the other): the rest of `held_blocks`."""
        for _ in range(held_blocks(t, self.w, self.m) - 2 if self.traffic is not None else 0):
            self.traffic.held(block)


def copied(arrays):
    """New arrays equal to `arrays`, wherever they live."""
    return tuple(array_module(a).array(a, copy=True) for a in arrays)


def held_blocks(t, w, m):
    """K/V blocks a rank holds in round t (what `DoubleRing` counts, with the
    block attended to and those arriving): 1, the inner ring's arriving block
    while s < w - 1, the outer ring's two (arriving and leaving) in a step
    that sends on (one of them the block attended to at s = 0), and the copy."""
    j, s = divmod(t, w)
    return 1 + (s < w - 1) + (j < m - 1) * (1 + (s >= 1)) + (s == 0 and j > 0 and w > 1)
