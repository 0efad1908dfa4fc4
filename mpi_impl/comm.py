"""The ring's communication object on MPI: one rank's three verbs, start_shift, progress and finish_shift.

`reference.ring` runs one device's rounds against an object with ``rank``,
``size``, ``start_shift(arrays, tag) -> handle`` (send a tuple of arrays to
rank+1, receive a same-shaped tuple from rank-1), ``progress()`` (called by the
step between tiles) and ``finish_shift(handle) -> arrays``. `RingComm`
implements them with mpi4py's ``Isend`` / ``Irecv`` on the raw bytes of
C-contiguous arrays, so nothing is pickled on the hot path (paper, Algorithm 1:
"send K_k, V_k to the next device while computing"). MPI moves a large message
only inside MPI calls, so `progress` tests every request in flight, and
`finish_shift` waits only for the receives it hands back, never for the sends.

Each tag has two sets of receive buffers, used in turn, so the block a caller
holds is not received into before the second `start_shift` after it. Misuse
(a shift started twice, finished twice, or sending arrays about to receive)
raises `ShiftOrderError`; a transfer that fails raises `RingError` naming the
rank, the neighbour, the round and the transfer (`mpi_impl.ranks`). Where the
bytes live is the `memory` object's (`mpi_impl.memory`); how a call ends, one
notice each way, is `mpi_impl.notices`. The buffers, each hazard and what
handles it: docs/mpi.md, "How the blocks move". With `links` (`mpi_impl.links`),
each shift takes the time of the emulated link it crosses.

    mpiexec -n 2 python -m mpi4py -c "from mpi4py import MPI; import numpy as np; \\
        from mpi_impl.comm import RingComm; \\
        with RingComm.on(MPI.COMM_WORLD) as ring: \\
            print(ring.rank, ring.finish_shift(ring.start_shift((np.full(3, ring.rank),), 1)))"
"""

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from reference import ring, trace

from .cores import crowded, wait_any
from .links import hold_until
from .memory import BufferSet, HostMemory, Lane, byte_view, overlaps_any
from .notices import DONE, KEPT, Notices, quietly
from .ranks import RingError, naming_failure, rank_name

TAG_STRIDE = 16     # MPI tag = ring tag * TAG_STRIDE + index of the array in the tuple
# what each ring tag carries, for error messages; ring tag 0 carries the notices below
TRANSFERS = {ring.KV: "K/V block", ring.DKV: "dK/dV block"}


class ShiftOrderError(RuntimeError):
    """The communication object was used out of order: a shift finished twice
    or never started, a second shift of a tag started before the first
    finished, or a block sent after its buffers were handed back to MPI."""


@dataclass(eq=False)
class Shift:
    """One shift: its requests not yet complete, what is being sent (kept
    alive until the sends complete) and the buffer set the data arrives in."""
    owner: object = field(repr=False)
    tag: int
    round: int          # shifts with this tag this RingComm started before this one
    buffers: BufferSet
    sent: tuple
    receives: list = field(default_factory=list)   # [(array index, Irecv)] not yet complete
    sends: list = field(default_factory=list)      # [(array index, Isend)] not yet complete
    arrays: tuple = ()              # the caller's arrays, kept alive while copies of them may be queued
    posted: bool = False            # Irecv and Isend posted (once the memory object is ready)
    posted_at: float = 0.0          # time.perf_counter() when posted
    arrived_at: float = None        # when every receive was seen complete
    finished: bool = False

    @property
    def what(self):
        return TRANSFERS.get(self.tag, f"tag {self.tag} message")


class Transfer(NamedTuple):
    """The times (time.perf_counter()) of one shift, for the trace."""
    tag: int
    round: int
    posted: float       # start_shift posted the send and the receive
    arrived: float      # every receive was seen complete (by progress or finish_shift)
    handed: float       # finish_shift returned the arrays


class RingComm:
    """This rank's end of the ring over an mpi4py communicator."""
    progress_interval_s = 0.0005        # progress() tests the requests at most this often

    def __init__(self, mpi_comm, memory=None, *, quiet=False, links=None):
        self.comm, self.memory = mpi_comm, memory or HostMemory()
        self.links = links          # emulated links (`mpi_impl.links`) seen from mpi_comm; a ring of one uses none
        self.clock = getattr(self.memory, "clock", None)
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self._lanes = {}            # tag -> Lane
        self._active = []           # shifts with requests not yet complete
        self.buffer_sets_allocated = 0
        self.transfers = []         # a Transfer per shift finished: its times, for the trace
        self.traffic = trace.Traffic()     # the bytes each shift moved, per round of the loop (the trace's)
        self._tested_at = float("-inf")     # when progress() last tested the requests
        self.quiet = quiet          # wait testing with a short sleep, not spinning (mpi_impl.cores)
        self._notices = Notices(mpi_comm, self.prev, self.next, quiet=quiet) if self.size > 1 else None
        self._owns_comm = False     # a duplicate made by `on`, freed by `close`
        self._closed = False        # closed, or left: the ring's end has been dealt with

    @classmethod
    def on(cls, mpi_comm, memory=None, *, quiet=None, links=None):
        """A RingComm on a duplicate of `mpi_comm` (collective), so that ring
        messages never meet the caller's. Use it as a context manager
        (``with RingComm.on(comm) as ring_comm:``), or call `close()`. `quiet`
        (default: `mpi_impl.cores.crowded`) waits testing with a short sleep.
        `links`: an `mpi_impl.links.EmulatedLinks`, whose times each shift
        takes (host arrays only)."""
        if quiet is None:
            quiet = hasattr(mpi_comm, "Split_type") and crowded(mpi_comm)
        if links is not None and not isinstance(memory or HostMemory(), HostMemory):
            raise ValueError("emulated links hold host arrays: RingComm.on takes links with host memory only")
        dup = mpi_comm.Dup()
        ring_comm = cls(dup, memory, quiet=quiet, links=None if links is None else links.on(dup))
        ring_comm._owns_comm = True
        return ring_comm

    # -- the three verbs -----------------------------------------------------------

    def start_shift(self, arrays, tag):
        """Post the receive of the previous rank's arrays and the send of
        `arrays` to the next rank. `arrays` must not be written while the
        ring runs (their send may complete as late as `close`)."""
        arrays = tuple(arrays)
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or tag < 1:
            raise ValueError(f"{rank_name(self.comm)}: start_shift: tag must be an int >= 1 (ring tag 0 carries "
                             f"the neighbours' notices), got {tag!r}")
        for a in arrays:
            byte_view(a)                    # C-contiguous, or a clear error before anything is posted
        lane = self._lanes.setdefault(tag, Lane())
        if lane.in_flight is not None:
            raise ShiftOrderError(f"{rank_name(self.comm)}: start_shift called twice: the "
                                  f"{lane.in_flight.what} of round {lane.in_flight.round} is still in flight; "
                                  f"finish_shift it before starting the next shift with tag {tag}")
        link, sending = None, arrays
        if self.links is not None and self.size > 1:    # when the bytes arrive over the emulated link travels with them
            link = self.links.link(self.next)
            sending = arrays + (np.array([self.links.post(self.next, sum(a.nbytes for a in arrays))]),)
        buffers = self._take_set(lane, sending, tag)
        outgoing = self.memory.outgoing(sending, buffers)     # what MPI reads, once the memory object is ready
        shift = Shift(self, tag, lane.started, buffers, outgoing, arrays=sending)
        lane.started, lane.in_flight = lane.started + 1, shift
        self._active.append(shift)
        self.traffic.moved(tag, sent=arrays if self.size > 1 else (), link=link)
        self._post_ready()
        return shift

    def _post_ready(self):
        """Post the shifts whose memory object is ready (on the host: at once;
        on a GPU: once the copies or kernels MPI waits for are done, asked
        without waiting), in the order they were started."""
        for shift in self._active:
            if not shift.posted and self.memory.ready(shift.buffers):
                self._post(shift)

    def _post(self, shift):
        for i, (out, into) in enumerate(zip(shift.sent, shift.buffers.receive)):
            mpi_tag, out_bytes, into_bytes = shift.tag * TAG_STRIDE + i, byte_view(out), byte_view(into)
            # receive first, so a matching send never waits in an unexpected-message queue;
            # uint8 views carry their MPI type (bytes) themselves, so this module needs
            # no mpi4py import and runs on the tests' stand-in communicators too
            with self._naming_failure(shift, i, receiving=True):
                shift.receives.append((i, self.comm.Irecv(into_bytes, source=self.prev, tag=mpi_tag)))
            with self._naming_failure(shift, i, receiving=False):
                shift.sends.append((i, self.comm.Isend(out_bytes, dest=self.next, tag=mpi_tag)))
        shift.posted, shift.posted_at = True, time.perf_counter()

    def progress(self):
        """Let MPI move the transfers in flight: test each request not yet
        complete (MPI progresses only inside its calls). The step calls it
        between tiles, however small: it tests at most every
        `progress_interval_s` (a test of a shift's 8 requests cost 20-60 us
        on a loaded 2-core machine; a call in between costs under a microsecond)."""
        if not self._active:
            return
        now = time.perf_counter()
        if now - self._tested_at < self.progress_interval_s:
            return
        self._tested_at = now
        self._post_ready()
        for shift in list(self._active):
            if shift.posted:
                self._test(shift)

    def _test_active(self):
        """Test every posted shift's requests (while a transfer is held)."""
        for shift in list(self._active):
            if shift.posted:
                self._test(shift)

    def all_arrived(self):
        """True when every receive in flight has completed, as last tested
        (by `progress`): the next `finish_shift` will not wait."""
        return not any(shift.receives or not shift.posted for shift in self._active)

    def finish_shift(self, shift):
        """Wait for the shift's receives; return the arrays that arrived. They
        stay valid until the second `start_shift` after this one with the same
        tag. The shift's sends may still be in flight."""
        lane = self._check_finish(shift)
        # While a shift is not yet posted (its memory not ready), poll: post each
        # as it becomes ready, for a neighbour may be waiting for its send
        self._post_ready()
        while any(not s.posted for s in self._active):
            if shift.posted:
                self._test(shift)
                if not shift.receives:
                    break
            time.sleep(0)
            self._post_ready()
        self._test(shift)                   # arrived already? (its time is the trace's)
        # One request at a time, so that a failure is pinned on its transfer.
        while shift.receives:
            i, request = shift.receives[0]
            with self._naming_failure(shift, i, receiving=True):
                self._wait(request, self.prev)
            shift.receives.pop(0)
        self._settled(shift)
        arrived = self.memory.arrived(shift.buffers)
        if self.links is not None and self.size > 1:    # held until the emulated link delivers it (mpi_impl.links)
            *arrived, delivered = arrived
            hold_until(float(delivered[0]), self._test_active)
            arrived, shift.arrived_at = tuple(arrived), time.perf_counter()
        shift.finished, lane.in_flight = True, None
        self.transfers.append(Transfer(shift.tag, shift.round, shift.posted_at, shift.arrived_at,
                                       time.perf_counter()))
        self.traffic.moved(shift.tag, received=arrived if self.size > 1 else ())
        return arrived

    # -- the end of the ring -------------------------------------------------------

    def close(self):
        """Wait for the sends still in flight (each neighbour receives every
        block it was sent), tell both neighbours this rank is done, wait for
        both neighbours' notices, free the communicator `on` duplicated. Every shift
        started must have been finished, and a neighbour that left the ring
        meanwhile (after its last transfer with this rank) makes the call fail
        here too: the ring call is collective, and the next collective would
        wait for that rank for ever. Closing again does nothing."""
        if self._closed:
            return
        try:
            unfinished = [lane.in_flight for lane in self._lanes.values() if lane.in_flight is not None]
            if unfinished:
                raise ShiftOrderError(f"{rank_name(self.comm)}: closed with shifts never finished: "
                                      + ", ".join(f"the {s.what} of round {s.round}" for s in unfinished))
            for shift in list(self._active):
                self._wait_sends(shift, lambda array: True)
            if self._notices is not None:
                self._notices.tell(DONE)
            for peer in dict.fromkeys((self.prev, self.next)) if self._notices is not None else ():
                said = self._notices.end(peer)
                if said is not None:
                    raise RingError(f"{rank_name(self.comm)}: {rank_name(self.comm, peer)} left the ring ({said}) "
                                    "before its end here")
            if self._notices is not None:
                self._notices.delivered()
        except BaseException as error:
            self.leave(error)
            raise
        self._free()

    free = close        # the name earlier callers use

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None:
            self.close()
        else:
            self.leave(error)
        return False

    def leave(self, error):
        """This rank's ring call ended with `error`: tell both neighbours (they
        stop waiting for this rank and say why), cancel the receives in flight,
        complete the sends (their receivers wait for them) unless the receiver
        left too, and free the communicator. Once closed or left, nothing more.
        A rank whose `close` failed after it said "done" tells nothing more:
        its neighbours have its one notice (sent), and fail on their own
        if they were waiting for the same neighbour, or carry on. The
        communicator `on` duplicated is freed only if both neighbours said
        "done" (every transfer with them matched, nothing more to come);
        otherwise it is kept, never freed (module docstring)."""
        if self._closed:
            return
        if self._notices is not None and not self._notices.told:
            quietly(lambda: self._notices.tell(f"{type(error).__name__}: {error}"))
        for shift in list(self._active):
            for _, request in shift.receives:
                quietly(request.Cancel)
                quietly(request.Wait)
            shift.receives.clear()
            for _, request in shift.sends:
                quietly(lambda: self._wait(request, self.next))
            shift.sends.clear()
        self._active.clear()
        if self._notices is not None:
            self._notices.withdraw()
            if self._owns_comm and not self._notices.all_done():
                KEPT.append(self.comm)
                self._owns_comm = False
        self._free()

    def _free(self):
        self._closed = True
        self._lanes.clear()         # the buffer sets go now, whoever still holds this object
        if self._owns_comm:
            self._owns_comm = False
            self.comm.Free()

    # -- buffer sets -----------------------------------------------------------------

    def _take_set(self, lane, arrays, tag):
        """This tag's next buffer set shaped like `arrays` (allocated at first
        use), once no send reads it any more (see the module's hazards)."""
        buffers, new = lane.next_set(arrays, self.memory)
        self.buffer_sets_allocated += new
        for i, a in enumerate(arrays):
            if overlaps_any(a, buffers.handed):
                raise ShiftOrderError(
                    f"{rank_name(self.comm)}: start_shift: array {i} to send lies in the buffers the next "
                    f"{TRANSFERS.get(tag, f'tag {tag} message')} arrives in: a block finish_shift returned "
                    "is valid only until the second start_shift after it with the same tag")
        touched = buffers.receive + buffers.staged
        for shift in list(self._active):
            self._wait_sends(shift, lambda array: overlaps_any(array, touched))
        return buffers

    # -- requests ----------------------------------------------------------------------

    def _test(self, shift):
        """Test the shift's requests not yet complete; forget those that are."""
        for receiving, pending in ((True, shift.receives), (False, shift.sends)):
            for entry in list(pending):
                with self._naming_failure(shift, entry[0], receiving=receiving):
                    done = entry[1].Test()
                if done:
                    pending.remove(entry)
        self._settled(shift)

    def _wait_sends(self, shift, reads):
        """Wait for the shift's sends whose array satisfies `reads(array)`."""
        for entry in list(shift.sends):
            i, request = entry
            if reads(shift.sent[i]):
                with self._naming_failure(shift, i, receiving=False):
                    self._wait(request, self.next)
                shift.sends.remove(entry)
        self._settled(shift)

    def _settled(self, shift):
        if not shift.posted:
            return
        if not shift.receives and shift.arrived_at is None:
            shift.arrived_at = time.perf_counter()
        if not shift.receives and not shift.sends and shift in self._active:
            self._active.remove(shift)

    def _wait(self, request, peer):
        """Wait for `request`, a transfer with neighbour `peer`, or for that
        neighbour's notice that it left (then raise NeighbourLeft)."""
        if self._notices is None:
            wait_any([request], quiet=self.quiet)
        else:
            self._notices.wait(request, peer)

    def _check_finish(self, shift):
        if not isinstance(shift, Shift) or shift.owner is not self:
            raise ShiftOrderError(f"{rank_name(self.comm)}: finish_shift called before start_shift: "
                                  f"{shift!r} is not a shift this RingComm started")
        if shift.finished:
            raise ShiftOrderError(f"{rank_name(self.comm)}: finish_shift called twice: the {shift.what} "
                                  f"of round {shift.round} was finished already")
        return self._lanes[shift.tag]

    def _naming_failure(self, shift, array, *, receiving):
        """A RingError for a failed transfer of `array` of `shift` (`mpi_impl.ranks`)."""
        doing = (f"round {shift.round}: {'receiving' if receiving else 'sending'} the {shift.what} "
                 f"(array {array} of {len(shift.sent)}) {'from' if receiving else 'to'}")
        return naming_failure(self.comm, self.prev if receiving else self.next, doing,
                              said=self._notices.reason if self._notices is not None else None)
