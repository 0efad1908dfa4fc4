"""The work of a tuned NumPy step cut into units, and the units run on worker threads.

What `reference.steps.parts` computes a unit at a time, arranged for a CPU of
several cores (`reference.steps.v3`, `v4`):

- taller products (`forward_units`): neighbouring query tiles stacked up to
  ``UNIT_ROWS`` rows, a key tile they share computed in one product; the
  stacks cover exactly the plan's tiles, so the work counted is the work done;
  wider ones (`join_full`): neighbouring key tiles of a stack that need no
  mask in one product (`v5`, at small tiles);
- worker threads (`run_units`): units taken in order by `workers` threads,
  with BLAS held to one thread meanwhile, the calling thread calling
  `progress` while it waits (`on_this_thread`: only it may move a transfer);
- scratch memory (`scratch`): each thread reuses its arrays from call to call.

Shapes: ``c`` queries, ``G`` query heads per key/value head.
"""

import threading

import numpy as np

from ..cores import blas_limit, budget
from ..step import no_progress
from ..tiles import MASKED, by_tile

UNIT_ROWS = 512         # the forward stacks query tiles up to this many rows: taller products run faster
# the backward stacks a key tile's query tiles up to this many pairs: tiles of 128 four at a time
# (measured 0.86x the time of one at a time); tiles of 256 stacked in twos measured no gain
COLUMN_PAIRS = 512 * 128
PROGRESS_S = 0.002      # while its workers compute, the calling thread calls `progress` this often


# -- taller products --------------------------------------------------------------

def forward_units(plan, c, G):
    """Consecutive query tiles stacked into groups of up to UNIT_ROWS rows.
    Returns [(query slice of the group, blocks)], blocks being the group's tiles
    as (query slice within the group, key slice, masked rows): a key tile
    shared by neighbouring query tiles of the group is one block, one product.
    Blocks cover exactly the plan's tiles. ``masked rows`` is the slice of the
    block's query rows that holds its masked tiles (None: every pair is
    visible): only those rows need the mask. In a triangular block a stack of
    4 query tiles shares a key tile of which one is diagonal, so the mask is
    made and applied on a quarter of the rows."""
    groups = []
    for qs, tiles in by_tile(plan, 0):
        stop = min(qs.stop, c)
        last = groups[-1] if groups else None
        if last and last[-1][0].stop == qs.start and (stop - last[0][0].start) * G <= UNIT_ROWS:
            last.append((slice(qs.start, stop), tiles))
        else:
            groups.append([(slice(qs.start, stop), tiles)])
    return [(slice(g[0][0].start, g[-1][0].stop), _blocks(g)) for g in groups]


def join_full(units, width):
    """`forward_units`' units with runs of up to `width` neighbouring key
    tiles of the same rows, none masked, joined into one block (one product
    over their keys: the lazy softmax takes any number of keys at once).
    Blocks still cover exactly the plan's tiles; masked ones are kept as they are."""
    if width <= 1:
        return units
    out = []
    for qs, blocks in units:
        joined = []                                   # [rows, key slice, masked rows, tiles joined]
        for rows, ks, part in blocks:
            last = joined[-1] if joined else None
            if (last and part is None and last[2] is None and last[0] == rows and last[1].stop == ks.start
                    and last[3] < width):
                last[1], last[3] = slice(last[1].start, ks.stop), last[3] + 1
            else:
                joined.append([rows, ks, part, 1])
        out.append((qs, [(rows, ks, part) for rows, ks, part, _ in joined]))
    return out


def _blocks(group):
    """The blocks of one group of query tiles (see `forward_units`)."""
    first = group[0][0].start
    users = {}                                           # key tile -> [(member, kind)]
    for i, (qs, tiles) in enumerate(group):
        for ks, kind in tiles:
            users.setdefault((ks.start, ks.stop), (ks, []))[1].append((i, kind))
    blocks = []
    for ks, members in users.values():
        run = [members[0]]
        for member in members[1:] + [None]:              # runs of neighbouring query tiles
            if member is not None and member[0] == run[-1][0] + 1:
                run.append(member)
                continue
            rows = slice(group[run[0][0]][0].start - first, group[run[-1][0]][0].stop - first)
            blocks.append((rows, ks, _masked_rows(group, run, first + rows.start)))
            run = [member]
    return blocks


def _masked_rows(group, run, start):
    """The rows of a run of query tiles (members of `group`, the block's rows
    starting at query `start`) from its first masked tile to its last, as a
    slice of the block's rows; None when all its tiles are full."""
    masked = [group[i][0] for i, kind in run if kind == MASKED]
    return slice(masked[0].start - start, masked[-1].stop - start) if masked else None


def column_runs(tiles, c, G, tk, alone=False):
    """A key tile's query tiles `tiles` [(query slice, kind)] as runs of
    neighbouring tiles of up to COLUMN_PAIRS (rows x tk) pairs (each tile
    alone if `alone`): [(query slice of the run, [(query slice, kind)])],
    slices clipped to c. The backward computes a run's products at once:
    taller products, as the forward's."""
    runs = []
    for qs, kind in tiles:
        qs = slice(qs.start, min(qs.stop, c))
        last = runs[-1] if runs else None
        if not alone and last and last[0].stop == qs.start and (qs.stop - last[0].start) * G * tk <= COLUMN_PAIRS:
            runs[-1] = (slice(last[0].start, qs.stop), last[1] + [(qs, kind)])
        else:
            runs.append((qs, [(qs, kind)]))
    return runs


# -- worker threads ---------------------------------------------------------------

def check_workers(workers):
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    return int(workers)


def workers_label(name, workers):
    return f"{name}, {workers} worker{'s' if workers > 1 else ''}"


def on_this_thread(progress):
    """`progress` when called from the thread that made it, nothing on others
    (a worker's tile loop calls it; only the calling thread may progress a transfer)."""
    me = threading.get_ident()

    def tick():
        if threading.get_ident() == me:
            progress()
    return tick


def run_units(fn, units, workers, progress=no_progress):
    """fn(*unit) for every unit, taken in order by `workers` threads (this one
    included), with BLAS held to one thread meanwhile (two levels of threads
    on the same cores oversubscribe them: measured several times slower). A
    unit owns the rows it writes, so results do not depend on `workers`, bit
    for bit. This thread calls `progress` every PROGRESS_S while it waits for
    the others. The first exception is raised here, after all stop. Never
    more workers than the caller's budget of cores (`reference.cores.budget`)."""
    workers = min(workers, budget())
    if workers <= 1 or len(units) <= 1:
        for u in units:
            fn(*u)
        return
    pending, lock, errors = iter(units), threading.Lock(), []

    def work():
        while not errors:
            with lock:
                u = next(pending, None)
            if u is None:
                return
            try:
                fn(*u)
            except BaseException as e:   # re-raised by the caller below
                errors.append(e)

    with blas_limit(1):
        threads = [threading.Thread(target=work, daemon=True) for _ in range(1, workers)]
        for t in threads:
            t.start()
        work()
        for t in threads:
            while t.is_alive():
                t.join(PROGRESS_S)
                progress()
    if errors:
        raise errors[0]


# -- scratch memory ---------------------------------------------------------------

_SCRATCH = threading.local()


def scratch(key, shape, dtype):
    """An uninitialised array of `shape` for this thread, under `key`: the same
    memory from call to call, grown when too small. A fresh array of a block's
    size pays its page faults on every call (measured: a fifth of the CPU time
    of a forward of a block of 1024 tokens). It is this thread's until it asks
    for `key` again, so a key names one use that ends before the next begins."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    n, dtype = int(np.prod(shape)), np.dtype(dtype)
    buf = bufs.get((key, dtype))
    if buf is None or buf.size < n:
        buf = bufs[key, dtype] = np.empty(n, dtype)
    return buf[:n].reshape(shape)
