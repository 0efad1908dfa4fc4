"""The trace: what every device did in every round, as arrays indexed [t, j].

Fields (all shape (N rounds, N devices)):
  source          the device the K/V block held in round t started on
  tiles_computed  tiles attended to (full or masked)
  tiles_skipped   tiles skipped because no query in them can see any key
  pairs           visible (query, key) pairs, per batch element and head
  bytes_sent      bytes this device sent in round t (K/V blocks, dK/dV, and a
                  scheme's all-to-all: in its first round, and back in its last)
  bytes_received  bytes it received in round t, counted the same way
  sent_intra, sent_inter   of bytes_sent, over the link in the node, to other nodes (else 0)
  kv_bytes        bytes of K/V blocks it held in round t: the block attended to
                  and the one arriving (the ring), every block (the all-gather)
  compute_s, compute_cpu_s, wait_s   wall and CPU seconds of the step, and wall
                  seconds spent waiting for a transfer (zero where not timed)
  start_s         when the step of round t started (host clock, seconds since the
                  device's ring began; the K/V transfer was posted just before)
  arrived_s       when that transfer's block was seen complete (MPI ranks; NaN elsewhere)
and `step`, the step version that ran (e.g. "v3, 2 workers"), and `threads`, how
the virtual devices shared the cores (`reference.cores`; empty elsewhere). The first four
are the `Work` that the cost model predicts without running (`reference.cost`).
Round t's step runs from start_s for compute_s, then the device waits wait_s; MPI
ranks start the ring together, after the call's agreement check. `wait_parts` splits a forward's waits into blocks not yet
sent and blocks still arriving. Each device keeps a `RoundLog` (one row of the
trace), its bytes counted by the communication objects' `Traffic`
(`RoundLog.rounds`, `tally`); `Trace.from_logs` stacks the logs, `Trace.table()`
prints the work, `write_trace` / `read_trace` keep traces in a file (``--trace-out``).

    out, lse, trace = reference.ring_attention(q, k, v, n_devices=4, trace=True)
    print(trace.table("striped"))
"""

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields

import numpy as np

from .layouts import to_host


@dataclass
class Work:
    """The work of one ring pass, per round t and device j: arrays (N, N)."""
    source: np.ndarray
    tiles_computed: np.ndarray
    tiles_skipped: np.ndarray
    pairs: np.ndarray

    @property
    def n_devices(self):
        return self.pairs.shape[1]

    def critical_path(self, field="pairs"):
        """Sum over rounds of the busiest device's `field`."""
        return getattr(self, field).max(axis=1).sum()

    def table(self, title=""):
        return work_table(self.pairs, self.tiles_computed, self.tiles_skipped, self.source, title)


@dataclass
class Trace(Work):
    """A run's Work, with the bytes each device sent and its timings."""
    bytes_sent: np.ndarray
    compute_s: np.ndarray
    compute_cpu_s: np.ndarray
    wait_s: np.ndarray
    step: str = ""
    threads: str = ""
    start_s: np.ndarray = None      # the timeline (module docstring); NaN where not recorded
    arrived_s: np.ndarray = None
    bytes_received: np.ndarray = None
    kv_bytes: np.ndarray = None
    sent_intra: np.ndarray = None   # bytes sent over each link (module docstring); zero where not known
    sent_inter: np.ndarray = None

    def __post_init__(self):
        for name in TIMELINE:
            if getattr(self, name) is None:
                setattr(self, name, np.full(self.pairs.shape, np.nan))
        for name in MOVED:
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.pairs.shape, dtype=np.int64))

    @classmethod
    def from_logs(cls, logs, threads=""):
        """One RoundLog per device (in rank order) -> Trace with [t, j] arrays."""
        return cls(**{name: np.stack([getattr(log, name) for log in logs], axis=1) for name in FIELDS},
                   step=logs[0].step, threads=threads)

    @classmethod
    def from_dict(cls, d):
        """From `to_dict`'s dict (a trace written before the timeline fields: NaN there)."""
        return cls(**{name: np.asarray(d[name], dtype=float if name in TIMELINE else None)
                      for name in FIELDS if name in d}, step=d.get("step", ""), threads=d.get("threads", ""))

    def to_dict(self):
        return {**{name: getattr(self, name).tolist() for name in FIELDS}, "step": self.step,
                "threads": self.threads}


FIELDS = tuple(f.name for f in fields(Trace) if f.name not in ("step", "threads"))   # the [t, j] arrays
TIMELINE = ("start_s", "arrived_s")             # seconds since the device's ring began; NaN where none
MOVED = ("bytes_received", "kv_bytes", "sent_intra", "sent_inter")   # zero in a file written before they were
_REQUIRED = set(FIELDS) - set(TIMELINE) - set(MOVED)   # a trace file written before the timeline lacks it
HELD = "held"       # a Traffic entry of K/V bytes held, in its received place (`Traffic.held`)


class Traffic:
    """The bytes one device's communication objects moved, as they moved them:
    each call adds (round, tag, bytes sent, bytes received), in the round its
    ring loop is in (`RoundLog.rounds` tells it). A device's groups (its ring,
    its Ulysses group) share one Traffic, so an all-to-all before the ring's
    first round counts in round 0 and one after its last round in the last.
    Only bytes to or from another device count: a ring of one moves nothing.
    Where a move names the `link` it crosses ("intra" or "inter", the machine's
    `reference.topology` links), its bytes sent count on that link too."""

    def __init__(self):
        self.round = 0
        self.moves = []             # (round, tag, bytes sent, bytes received), until `take`
        self.crossed = []           # (round, link, bytes sent over it), until `take_links`

    def moved(self, tag, *, sent=(), received=(), link=None):
        self.moves.append((self.round, tag, _nbytes(sent), _nbytes(received)))
        if link is not None and sent:
            self.crossed.append((self.round, link, _nbytes(sent)))

    def held(self, arrays):
        """K/V held this round beside the block attended to and those arriving,
        neither sent nor received now (the double ring's outer blocks in
        flight, `reference.double_ring`): counted in kv_bytes only."""
        self.moves.append((self.round, HELD, 0, _nbytes(arrays)))

    def traded(self, pieces, got, rank, links=None):
        """An all-to-all: piece i went to group rank i and `got[i]` came from it;
        this device's own stays. `links[i]`: the link piece i crossed (None: not known)."""
        self.moved("all_to_all", sent=[p for i, p in enumerate(pieces) if i != rank],
                   received=[p for i, p in enumerate(got) if i != rank])
        for i, piece in enumerate(pieces if links is not None else ()):
            if i != rank:
                self.crossed.append((self.round, links[i], _nbytes(piece)))

    def take(self):
        """The moves counted since the last `take`."""
        moves, self.moves = self.moves, []
        return moves

    def take_links(self):
        """The (round, link, bytes sent) counted since the last `take_links`."""
        crossed, self.crossed = self.crossed, []
        return crossed


class RoundLog:
    """Per-round record of one device: its row of the Trace (`FIELDS`, each
    an array over rounds t), and the step version that ran.

    The bytes come from the communication object's `Traffic` (`tally`), the
    K/V bytes held from the blocks the loop attends to (`record`) and those
    arriving with tag `blocks`.

    With a `clock` (a device's: ``mark()`` records an event on the compute
    stream, ``seconds(a, b)`` reads the time between two), ``compute_s`` is the
    step's time on the device and ``wait_s`` the time the device sat idle
    before the next round's step (waiting for its block), both read in
    `close`; ``compute_cpu_s`` stays the host's time queueing the step.
    Without one, wall and CPU clocks around the calls."""

    FIELDS = FIELDS

    def __init__(self, n_rounds, step="", clock=None, traffic=None, blocks=None):
        for name in FIELDS:
            setattr(self, name, np.zeros(n_rounds, dtype=float if name.endswith("_s") else np.int64))
        for name in TIMELINE:
            getattr(self, name).fill(np.nan)
        self.step = step            # the step version that ran
        self.clock, self._marks = clock, []      # [(t, start event, end event)]
        self.traffic, self.blocks = traffic, blocks     # the bytes moved; the tag K/V blocks travel with
        self._kept = np.zeros(n_rounds, dtype=bool)     # rounds whose K/V held were given whole (`record`)
        self.began = time.perf_counter()        # the timeline's zero

    @classmethod
    def of(cls, comm, step, blocks=None):
        """The log of a pass over `comm` (a round per device, its clock and
        Traffic where it has them) running `step` (a `reference.step.Step`)."""
        return cls(comm.size, step.label, clock=getattr(comm, "clock", None),
                   traffic=getattr(comm, "traffic", None), blocks=blocks)

    def rounds(self, count=None):
        """Rounds 0 .. N - 1 (or the first `count`), each told to the Traffic as
        it begins, so that what moves from then on is counted in that round."""
        for t in range(len(self.source) if count is None else count):
            if self.traffic is not None:
                self.traffic.round = t
            yield t

    def record(self, t, counts, block, *, kept=None):
        """The step's counts (`reference.step.StepCounts`), the device `block`
        started on (read from the block: it travels with it) and its bytes,
        held with the block arriving meanwhile; `kept`: every block the device
        holds in round t instead (the all-gather's)."""
        self.source[t] = int(to_host(block.source)[0])     # NumPy: no wait for the device
        self.tiles_computed[t] = counts.tiles_computed
        self.tiles_skipped[t] = counts.tiles_skipped
        self.pairs[t] = counts.pairs
        self.kv_bytes[t] += _nbytes(block if kept is None else kept)
        self._kept[t] = kept is not None

    def tally(self):
        """Add the bytes the Traffic counted since the last tally: sent (and on
        each link), received, and the K/V blocks arriving (held beside the one attended to)."""
        for t, tag, sent, received in self.traffic.take() if self.traffic is not None else ():
            if tag == HELD:
                self.kv_bytes[t] += received
                continue
            self.bytes_sent[t] += sent
            self.bytes_received[t] += received
            if tag == self.blocks and not self._kept[t]:
                self.kv_bytes[t] += received
        for t, link, sent in self.traffic.take_links() if self.traffic is not None else ():
            getattr(self, f"sent_{link}")[t] += sent

    @contextmanager
    def computing(self, t):
        """Wall and CPU time of the step in round t (device time with a clock)."""
        start = self.clock.mark() if self.clock else None
        wall, cpu = time.perf_counter(), time.thread_time()
        self.start_s[t] = wall - self.began
        yield
        self.compute_cpu_s[t] += time.thread_time() - cpu
        if self.clock:
            self._marks.append((t, start, self.clock.mark()))
        else:
            self.compute_s[t] += time.perf_counter() - wall

    @contextmanager
    def waiting(self, t):
        """Wall time spent waiting for a transfer in round t (with a clock:
        read from the device's idle time in `close`)."""
        wall = time.perf_counter()
        yield
        if not self.clock:
            self.wait_s[t] += time.perf_counter() - wall

    def add_transfers(self, transfers, tag):
        """When the blocks of `tag` arrived: the communication object's record
        of its shifts (`mpi_impl.comm.Transfer`: tag, round, and times of
        time.perf_counter())."""
        for transfer in transfers:
            if transfer.tag == tag and transfer.round < len(self.arrived_s):
                self.arrived_s[transfer.round] = transfer.arrived - self.began

    def close(self):
        """Tally the bytes moved; with a clock, read the device times (this
        waits for the last step), and drop the clock, so that the log pickles
        (MPI gathers it)."""
        self.tally()
        clock, self.clock = self.clock, None
        if not self._marks:
            return
        ends = [start for _, start, _ in self._marks[1:]] + [clock.mark()]
        for (t, start, end), next_start in zip(self._marks, ends):
            self.compute_s[t] += clock.seconds(start, end)
            self.wait_s[t] += clock.seconds(end, next_start)   # idle until the next step started
        self._marks = []


def wait_parts(trace):
    """A forward trace's waits, split by what the device was waiting for:
    (not_sent, in_flight), arrays [t, j] of seconds that add up to wait_s.
    not_sent: the block device j needs next had not been sent yet (device
    j - 1 sends it as it starts round t, at its start_s[t]: it was still busy
    with an earlier round); in_flight: it had been sent and had not arrived.
    NaN where the timeline was not recorded."""
    waiting = trace.start_s + trace.compute_s               # [t, j]: device j begins to wait
    sent = np.roll(trace.start_s, 1, axis=1)                # [t, j]: device j - 1's start_s[t]
    not_sent = np.clip(np.minimum(sent, waiting + trace.wait_s) - waiting, 0, None)
    return not_sent, trace.wait_s - not_sent


def _nbytes(x):
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(a) for a in x)
    return int(x.nbytes)


# -- a run's traces in a file ------------------------------------------------

def write_trace(path, doc):
    """Write `doc` as JSON, every Trace in it as its fields: a run's document,
    e.g. ``{"args": {...}, "layouts": {"striped": {"wall_s": 0.1, "forward": Trace}}}``."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=_as_json)


def read_trace(path):
    """The document `write_trace` wrote, every trace in it a Trace again."""
    with open(path) as f:
        return json.load(f, object_hook=lambda d: Trace.from_dict(d) if _REQUIRED <= set(d) else d)


def _as_json(x):
    if isinstance(x, Trace):
        return x.to_dict()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON: write_trace writes Traces, dicts, lists and numbers")


# -- printed -------------------------------------------------------------------

def work_table(pairs, computed, skipped, source=None, title=""):
    """Per round and device: visible pairs, and tiles computed / total.

    round |  dev0         dev1        ... | busiest  idlest
    """
    n_rounds, n = pairs.shape
    width = max(12, len(f"{pairs.max()} {computed.max()}/{(computed + skipped).max()}") + 2)
    head = f"{'round':>5} | " + "".join(f"{'dev%d' % j:<{width}}" for j in range(n)) + "| busiest  idlest"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for t in range(n_rounds):
        cells = "".join(f"{f'{pairs[t, j]} {computed[t, j]}/{computed[t, j] + skipped[t, j]}':<{width}}"
                        for j in range(n))
        lines.append(f"{t:>5} | {cells}| {pairs[t].max():>7}  {pairs[t].min():>6}")
    lines.append(f"critical path (sum of busiest): {pairs.max(axis=1).sum()} pairs, "
                 f"{computed.max(axis=1).sum()} tiles; total work {pairs.sum()} pairs")
    if source is not None:
        lines.append("cells: visible pairs, tiles computed/total; "
                     f"round 1 sources: {source[min(1, n_rounds - 1)].tolist()}")
    return "\n".join(lines)
