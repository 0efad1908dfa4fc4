"""Communication objects that hold the ring to its contract, so that a buffer
hazard fails a test on any machine instead of only at message sizes where MPI
stops copying messages at send time.

The contract (reference/ring.py, mpi_impl/comm.py):
- a buffer passed to `start_shift` may be read until `finish_shift` returns, so
  it must not be written before then;
- the arrays `finish_shift` returns stay valid until the second `start_shift`
  after it with the same tag (two receive buffer sets per tag, in turn);
- every shift started is finished.

`StrictRing` is the virtual ring's communication object at its strictest: it
reads each send buffer at `finish_shift` (the latest the contract allows, as a
rendezvous transfer may), raises `HazardError` if the buffer changed since
`start_shift`, fills a receive buffer set with garbage (NaN, or the most
negative int) from the moment it is taken until the data lands in it, and
reports shifts left unfinished. `CheckingMPI` is a stand-in for an mpi4py
communicator under `mpi_impl.RingComm`: a send buffer must be unchanged when
its request is waited for, a receive may not land in the buffer of a send not
yet waited for, and every send must be waited for.

    results = run_threads(3, lambda rank, world: work(rank, StrictRing(rank, world)))

Run the ring with them in tests/test_hazards.py.
"""

import queue
import threading
from dataclasses import dataclass

import numpy as np

POLL_S = 0.02
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
        self._boxes, self._lock = {}, threading.Lock()

    def _box(self, dest, key):
        with self._lock:
            return self._boxes.setdefault((dest, key), queue.Queue())

    def post(self, dest, key, message):
        self._box(dest, key).put(message)

    def take(self, dest, key, what):
        box = self._box(dest, key)
        for _ in range(int(ARRIVAL_TIMEOUT_S / POLL_S)):
            try:
                return box.get(timeout=POLL_S)
            except queue.Empty:
                if self.failed.is_set():
                    raise Aborted("another thread failed") from None
        raise HazardError(f"{what} never arrived")


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
        self._started = {}      # tag -> shifts started (the round, in the ring's loops)

    def start_shift(self, arrays, tag):
        arrays = tuple(arrays)
        shift = StrictShift(tag, self._started.get(tag, 0), arrays, tuple(a.copy() for a in arrays),
                            self._take_set(arrays, tag))
        self._started[tag] = shift.round + 1
        for buffer in shift.into:       # garbage until the data lands
            scribble(buffer)
        self._in_flight.append(shift)
        return shift

    def finish_shift(self, shift):
        if shift not in self._in_flight:
            raise HazardError(f"device {self.rank}: finish_shift of a shift not in flight")
        what = f"{NAMES.get(shift.tag, f'tag {shift.tag}')} sent in round {shift.round}"
        # the send reads its buffers now, the latest the contract allows
        for i, (a, before) in enumerate(zip(shift.sent, shift.snapshot)):
            if not np.array_equal(a, before, equal_nan=True):
                raise HazardError(f"device {self.rank}: array {i} of the {what} was written "
                                  "before finish_shift returned")
        self._world.post((self.rank + 1) % self.size, (shift.tag, shift.round),
                         tuple(a.copy() for a in shift.sent))
        arrived = self._world.take(self.rank, (shift.tag, shift.round),
                                   f"device {self.rank}: the {what} by device {(self.rank - 1) % self.size}")
        for buffer, data in zip(shift.into, arrived):
            buffer[...] = data
        self._in_flight.remove(shift)
        self._held[shift.tag] = shift.into
        return shift.into

    def unfinished(self):
        return [(NAMES.get(s.tag, s.tag), s.round) for s in self._in_flight]

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


# -- a stand-in for an mpi4py communicator, for mpi_impl.RingComm ----------------

class _Request:
    def __init__(self, wait):
        self.Wait = wait


class CheckingMPI:
    """Isend / Irecv between threads for `mpi_impl.RingComm` (which passes raw
    bytes). A receive buffer is scribbled on when posted and must not be the
    buffer of a send of this rank not yet waited for; a send buffer must be
    unchanged when its request is waited for; `unwaited()` lists the sends
    never waited for."""

    def __init__(self, rank, world):
        self.rank, self.size, self._world = rank, world.n, world
        self._sends = []        # [buffer, snapshot, (dest, tag)] posted and not waited for

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Isend(self, buf, dest, tag):
        entry = [buf, buf.copy(), (dest, tag)]
        self._sends.append(entry)
        self._world.post(dest, (self.rank, tag), entry[1])

        def wait():
            if not np.array_equal(buf, entry[1]):
                raise HazardError(f"rank {self.rank}: a send buffer (to rank {dest}, tag {tag}) was "
                                  "written before its send was waited for")
            if entry in self._sends:
                self._sends.remove(entry)
        return _Request(wait)

    def Irecv(self, buf, source, tag):
        for sent, _, (dest, sent_tag) in self._sends:
            if np.shares_memory(buf, sent):
                raise HazardError(f"rank {self.rank}: receiving (tag {tag}) into the buffer of a send "
                                  f"(to rank {dest}, tag {sent_tag}) not yet waited for")
        buf.fill(0xFF)          # NaN in every float type

        def wait():
            buf[...] = self._world.take(self.rank, (source, tag),
                                        f"rank {self.rank}: the message from rank {source} (tag {tag})")
        return _Request(wait)

    def unwaited(self):
        return [key for _, _, key in self._sends]
