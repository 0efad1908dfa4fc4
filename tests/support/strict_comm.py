"""Communication objects that hold the ring to its contract, so that a buffer
hazard fails a test on any machine instead of only at message sizes where MPI
stops copying messages at send time.

The contract (reference/ring.py, mpi_impl/comm.py):
- a buffer passed to `start_shift` may be read until the ring ends (a send
  completes as late as the communication object's `close`), so the ring never
  writes an array it sent;
- the arrays `finish_shift` returns stay valid until the second `start_shift`
  after it with the same tag (two receive buffer sets per tag, in turn);
- a tag has one shift in flight at a time, and every shift started is finished.

`StrictRing` is the virtual ring's communication object at its strictest: it
reads each send buffer at `finish_shift` and again at `close` (the latest the
contract allows, as a rendezvous transfer may), raises `HazardError` if the
buffer changed since `start_shift`, fills a receive buffer set with garbage
(NaN, or the most negative int) from the moment it is taken until the data
lands in it, and reports shifts left unfinished.

`ThreadMPI` is a stand-in for an mpi4py communicator between threads, with
the request methods RingComm uses (Test, Wait, Cancel, Waitany): like MPI's
rendezvous protocol, a message's bytes are read from the sender's buffer when
the receive completes, and only then does the send complete. `CheckingMPI`
adds the checks for `mpi_impl.RingComm`: a send buffer must be unchanged until
its send completes, a receive may not be posted into the buffer of a send not
yet complete, and every send must complete (`incomplete()`). `Pairs` is a
Ulysses group of two seen from rank 0, its partner's bytes given.

    results = run_threads(3, lambda rank, world: work(rank, StrictRing(rank, world)))   # tests/mpi/test_hazards.py
"""

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from mpi_impl.notices import FROM_NEXT, FROM_PREV

POLL_S = 0.02
NOTICE_TAGS = (FROM_PREV, FROM_NEXT)    # the MPI tags of the notices neighbours send at a ring's end
ARRIVAL_TIMEOUT_S = 30      # a message that has not come by then never will


class HazardError(AssertionError):
    """The ring or its communication object broke the buffer contract."""


class Aborted(RuntimeError):
    """Another thread failed first."""


class World:
    """Mailboxes between N threads, and a flag that ends every wait once one fails."""

    def __init__(self, n):
        self.n = n
        self.failed = threading.Event()
        self.changed = threading.Condition()
        self._boxes, self._lock = {}, threading.Lock()

    def _box(self, dest, key):
        with self._lock:
            return self._boxes.setdefault((dest, key), queue.Queue())

    def post(self, dest, key, message):
        self._box(dest, key).put(message)
        with self.changed:
            self.changed.notify_all()

    def take(self, dest, key, what):
        box = self._box(dest, key)
        for _ in range(int(ARRIVAL_TIMEOUT_S / POLL_S)):
            try:
                return box.get(timeout=POLL_S)
            except queue.Empty:
                if self.failed.is_set():
                    raise Aborted("another thread failed") from None
        raise HazardError(f"{what} never arrived")

    def take_now(self, dest, key):
        """The next message for `dest` under `key`, or None."""
        try:
            return self._box(dest, key).get_nowait()
        except queue.Empty:
            return None

    def wait_until(self, done, what):
        """Block until done() (re-checked whenever a message is posted)."""
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        with self.changed:
            while not done():
                if self.failed.is_set():
                    raise Aborted("another thread failed")
                if time.monotonic() > deadline:
                    raise HazardError(f"{what}: never happened")
                self.changed.wait(POLL_S)

    def notify(self):
        with self.changed:
            self.changed.notify_all()


def run_threads(n, fn):
    """fn(rank, world) on n threads; their results in rank order, or the first
    real error (a HazardError before the errors it caused elsewhere)."""
    world, results, errors = World(n), [None] * n, [None] * n

    def one(rank):
        try:
            results[rank] = fn(rank, world)
        except BaseException as e:          # noqa: BLE001 - re-raised below
            errors[rank] = e
            world.failed.set()
            world.notify()

    threads = [threading.Thread(target=one, args=(r,), name=f"device{r}") for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    chains = [_chain(e) for e in errors if e is not None]
    real = [chain for chain in chains if not any(isinstance(x, Aborted) for x in chain)]
    hazard = next((x for chain in real for x in chain if isinstance(x, HazardError)), None)
    if hazard is not None:          # itself, even where a RingError wraps it
        raise hazard
    if real:
        raise real[0][0]
    return results


def _chain(e):
    """e and the exceptions it was raised from."""
    chain = [e]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    return chain


def scribble(a):
    """Fill a buffer with what no computation should read: NaN, or the most negative int."""
    if np.issubdtype(a.dtype, np.floating):
        a.fill(np.nan)
    else:
        a.fill(np.iinfo(a.dtype).min)


NAMES = {1: "K/V block", 2: "dK/dV block"}       # reference.ring's tags


@dataclass(eq=False)
class StrictShift:
    tag: int
    round: int
    sent: tuple
    snapshot: tuple
    into: tuple


class StrictRing:
    """One device's end of the ring; see the module docstring."""

    def __init__(self, rank, world):
        self.rank, self.size = rank, world.n
        self._world = world
        self._sets = {}         # tag -> receive buffer sets (at most two)
        self._held = {}         # tag -> the set `finish_shift` handed out last
        self._in_flight = []
        self._sent = []         # (shift, array index) sent: checked again at close
        self._started = {}      # tag -> shifts started (the round, in the ring's loops)
        self.progress_calls = 0
        self.transfers = []     # RingComm records its transfers' times; nothing is timed here

    def start_shift(self, arrays, tag):
        arrays = tuple(arrays)
        if any(s.tag == tag for s in self._in_flight):
            raise HazardError(f"device {self.rank}: start_shift of the {NAMES.get(tag, tag)} while the "
                              "previous one is still in flight")
        shift = StrictShift(tag, self._started.get(tag, 0), arrays, tuple(a.copy() for a in arrays),
                            self._take_set(arrays, tag))
        self._started[tag] = shift.round + 1
        # A send reading a set taken again has completed (as RingComm completes it first).
        self._sent = [(s, i) for s, i in self._sent if not any(np.shares_memory(s.sent[i], b) for b in shift.into)]
        for buffer in shift.into:       # garbage until the data lands
            scribble(buffer)
        self._in_flight.append(shift)
        return shift

    def progress(self):
        self.progress_calls += 1

    def finish_shift(self, shift):
        if shift not in self._in_flight:
            raise HazardError(f"device {self.rank}: finish_shift of a shift not in flight")
        self._check_unchanged(shift, "finish_shift returned")
        self._world.post((self.rank + 1) % self.size, (shift.tag, shift.round),
                         tuple(a.copy() for a in shift.sent))
        arrived = self._world.take(self.rank, (shift.tag, shift.round),
                                   f"device {self.rank}: the {_what(shift)} by device {(self.rank - 1) % self.size}")
        for buffer, data in zip(shift.into, arrived):
            buffer[...] = data
        self._in_flight.remove(shift)
        self._sent += [(shift, i) for i in range(len(shift.sent))]
        self._held[shift.tag] = shift.into
        return shift.into

    def close(self):
        """The end of the ring: every array sent must still be as it was sent."""
        for shift, i in self._sent:
            self._check_unchanged(shift, "the ring ended", [i])
        self._sent = []

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None:
            self.close()
        return False

    def unfinished(self):
        return [(NAMES.get(s.tag, s.tag), s.round) for s in self._in_flight]

    def _check_unchanged(self, shift, until, arrays=None):
        for i in range(len(shift.sent)) if arrays is None else arrays:
            if not np.array_equal(shift.sent[i], shift.snapshot[i], equal_nan=True):
                raise HazardError(f"device {self.rank}: array {i} of the {_what(shift)} was written "
                                  f"before {until}")

    def _take_set(self, arrays, tag):
        """A receive buffer set shaped like `arrays`: not the one handed out
        last, none of its arrays in a shift in flight (nor among `arrays`)."""
        busy = [a for s in self._in_flight for a in s.sent + s.into] + list(arrays)
        sets = self._sets.setdefault(tag, [])
        for buffers in sets:
            fits = [(b.shape, b.dtype) for b in buffers] == [(a.shape, a.dtype) for a in arrays]
            if fits and buffers is not self._held.get(tag) \
                    and not any(np.shares_memory(b, x) for b in buffers for x in busy):
                return buffers
        if len(sets) >= 2:
            raise HazardError(f"device {self.rank}: no free receive buffer set for the "
                              f"{NAMES.get(tag, tag)}: a shift started before the last one finished")
        buffers = tuple(np.empty_like(a) for a in arrays)
        sets.append(buffers)
        return buffers


def _what(shift):
    return f"{NAMES.get(shift.tag, f'tag {shift.tag}')} sent in round {shift.round}"


# -- stand-ins for an mpi4py communicator, for mpi_impl.RingComm ------------------

class Request:
    """An mpi4py request as RingComm uses it, over `poll()`: complete the
    operation if it can be, without blocking; True once it is."""

    def __init__(self, world, poll, what, cancel=None):
        self._world, self._poll, self._what, self._cancel = world, poll, what, cancel
        self.done = False

    def Test(self):
        if not self.done:
            self.done = self._poll()
            if self.done:
                self._world.notify()
        return self.done

    def Wait(self):
        self._world.wait_until(self.Test, self._what)

    def Cancel(self):
        if not self.done and self._cancel is not None:
            self.done = self._cancel()

    @staticmethod
    def Waitany(requests):
        found = []

        def any_done():
            found[:] = [i for i, r in enumerate(requests) if r.Test()][:1]
            return bool(found)
        requests[0]._world.wait_until(any_done, " or ".join(r._what for r in requests))
        return found[0]


@dataclass(eq=False)
class Message:
    buffer: np.ndarray          # the sender's, read when the receive completes
    snapshot: np.ndarray        # what it held when the send was posted
    dest: int
    tag: int
    received: bool = False


class ThreadMPI:
    """Isend / Irecv between threads (module docstring): a receive copies the
    sender's buffer when it completes, and the send completes then."""

    def __init__(self, rank, world):
        self.rank, self.size, self._world = rank, world.n, world
        self.sends = []         # Messages whose send has not completed

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Isend(self, buf, dest, tag):
        buf = _plain(buf)
        message = Message(buf, buf.copy(), dest, tag)
        self.sends.append(message)
        self._world.post(dest, (self.rank, tag), message)

        def poll():
            if message.received:
                self.send_completes(message)
                self.sends.remove(message)
            return message.received
        return Request(self._world, poll, f"rank {self.rank}: the send to rank {dest} (tag {tag}) completing")

    def Irecv(self, buf, source, tag):
        buf = _plain(buf)
        self.receive_posted(buf, tag)
        cancelled = []

        def poll():
            message = self._world.take_now(self.rank, (source, tag))
            if message is None:
                return False
            self.receive_completes(message)
            buf[...] = message.buffer           # read now, as late as MPI may
            message.received = True
            return True

        def cancel():
            cancelled.append(1)
            return True
        return Request(self._world, lambda: not cancelled and poll(),
                       f"rank {self.rank}: the message from rank {source} (tag {tag})", cancel)

    def Free(self):
        pass

    # hooks for checks
    def receive_posted(self, buf, tag):
        pass

    def receive_completes(self, message):
        pass

    def send_completes(self, message):
        pass


def _plain(buf):
    """The buffer as a plain NumPy array (not a stand-in GPU's array type)."""
    buf = buf[0] if isinstance(buf, list) else buf
    return buf.view(np.ndarray)


class CheckingMPI(ThreadMPI):
    """ThreadMPI that refuses a send buffer written before its send completes,
    and a receive posted into the buffer of a send not yet complete;
    `incomplete()` lists the sends that never completed."""

    def receive_posted(self, buf, tag):
        for m in self.sends:
            if np.shares_memory(buf, m.buffer):
                raise HazardError(f"rank {self.rank}: receiving (tag {tag}) into the buffer of a send "
                                  f"(to rank {m.dest}, tag {m.tag}) not yet complete")
        buf.fill(0xFF)          # NaN in every float type

    def receive_completes(self, message):
        self._unchanged(message)

    def send_completes(self, message):
        self._unchanged(message)

    def _unchanged(self, m):
        if not np.array_equal(m.buffer, m.snapshot):
            raise HazardError(f"a send buffer (to rank {m.dest}, tag {m.tag}) was written before its "
                              "send completed")

    def incomplete(self):
        return [(m.dest, m.tag) for m in self.sends]


class ScriptedMPI:
    """Rank 0 of a 2-rank ring (or `rank` of `size`: both neighbours then tell
    their notices apart by their tags, FROM_PREV and FROM_NEXT) whose neighbours
    are the test itself, on one thread: `deliver(tag, arrays)` completes the receives posted for ring tag
    `tag`; a send completes when the test `take`s it or, with
    ``waits_complete_sends``, when it is waited for (the neighbour receives at
    once). Receive buffers are scribbled on when posted; a receive posted into
    the buffer of a send not complete, a send buffer written before its send
    completes, or a wait that cannot end raise HazardError. The neighbour's
    notice (ring tag 0) comes when it is waited for, saying `neighbour_ends`:
    "" (done) unless a test says otherwise, None for never. `log` lists what
    happened, in order."""

    def __init__(self, waits_complete_sends=True, neighbour_ends="", rank=0, size=2):
        self.rank, self.size = rank, size
        self.waits_complete_sends = waits_complete_sends
        self.neighbour_ends = neighbour_ends
        self.later = {}         # MPI tag -> an array that lands when its receive is waited for
        self.pending = []       # requests posted and not complete
        self.log = []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Isend(self, buf, dest, tag):
        request = _Scripted(self, "send", _plain(buf), tag)
        request.snapshot = request.buf.copy()
        return request

    def Irecv(self, buf, source, tag):
        buf = _plain(buf)
        for r in self.pending:
            if r.kind == "send" and np.shares_memory(buf, r.buf):
                raise HazardError(f"receiving (tag {tag}) into the buffer of a send (tag {r.tag}) not yet complete")
        buf.fill(0xFF)
        return _Scripted(self, "receive", buf, tag)

    def deliver(self, tag, arrays, stride=16):
        """The neighbour's arrays for ring tag `tag` land in the receives posted for them."""
        for i, a in enumerate(arrays):
            self._find("receive", tag * stride + i).land(a)

    def deliver_later(self, tag, arrays, stride=16):
        """The neighbour's arrays for ring tag `tag` are on their way: each lands
        when its receive is waited for (not when tested)."""
        for i, a in enumerate(arrays):
            self.later[tag * stride + i] = a

    def notify(self, mpi_tag, text):
        """The neighbour's notice that it left the ring, on `mpi_tag`."""
        request = self._find("receive", mpi_tag)
        data = np.frombuffer(text.encode(), np.uint8)
        request.buf[...] = 0
        request.buf[:len(data)] = data
        request.complete()

    def take(self):
        """The neighbour receives every send posted: their bytes, by MPI tag."""
        return {r.tag: r.complete_send() for r in [r for r in self.pending if r.kind == "send"]}

    def sends_pending(self):
        return [r.tag for r in self.pending if r.kind == "send"]

    def _find(self, kind, tag):
        request = next((r for r in self.pending if r.kind == kind and r.tag == tag), None)
        assert request is not None, f"no {kind} posted with tag {tag}: {[(r.kind, r.tag) for r in self.pending]}"
        return request


class _Scripted:
    def __init__(self, mpi, kind, buf, tag):
        self.mpi, self.kind, self.buf, self.tag = mpi, kind, buf, tag
        self.done = False
        mpi.pending.append(self)
        mpi.log.append(f"post {kind} {tag}")

    def complete(self):
        self.done = True
        self.mpi.pending.remove(self)
        self.mpi.log.append(f"complete {self.kind} {self.tag}")

    def land(self, array):
        """A receive completes with `array`'s bytes."""
        self.buf[...] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.complete()

    def complete_send(self):
        if not np.array_equal(self.buf, self.snapshot):
            raise HazardError(f"a send buffer (tag {self.tag}) was written before its send completed")
        self.complete()
        return self.snapshot

    def Test(self):
        return self.done

    def Wait(self):
        if self.done:
            return
        if self.tag in NOTICE_TAGS:         # the neighbour is at its own end of the ring
            if self.kind == "send":
                self.complete_send()
            elif self.mpi.neighbour_ends is not None:
                self.mpi.notify(self.tag, self.mpi.neighbour_ends)
        elif self.kind == "receive" and self.tag in self.mpi.later:
            self.land(self.mpi.later.pop(self.tag))
        if not self.done:
            if not (self.kind == "send" and self.mpi.waits_complete_sends):
                raise HazardError(f"waiting for a {self.kind} (tag {self.tag}) that cannot complete now: "
                                  "the neighbour is not there yet")
            self.complete_send()

    def Cancel(self):
        if not self.done and self.kind == "receive":
            self.complete()
            self.mpi.log.append(f"cancelled {self.tag}")

    @staticmethod
    def Waitany(requests):
        done = [i for i, r in enumerate(requests) if r.done]
        if done:
            return done[0]
        requests[0].Wait()
        return 0


class Pairs:
    """A 2-rank Ulysses group for rank 0 whose partner sent `theirs`."""
    def __init__(self, theirs):
        self.theirs = theirs

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Alltoall(self, send, received):
        half = len(send) // 2               # the bytes of piece i go to rank i
        received[:half], received[half:] = send[:half], self.theirs
