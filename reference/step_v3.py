"""Step version 3 (NumPy): version 2 with a lazy max, taller products and worker threads.

What it changes from version 2 (`reference.step_v2`), and why:

- a lazy max: the running shift ``m`` is raised only when a tile would
  overflow. Any shift gives the same ``O / l`` and ``m + log(l)``; it only has
  to keep ``exp`` finite. So a tile is first computed with the current ``m``:
  no row max, no subtraction, no rescaling. If some row's sum exceeds
  ``SUM_LIMIT`` (or is NaN) the tile is redone exactly, as in version 2. Rows
  that have seen no key yet (``m = -inf``) always take the exact path, and so
  does a head whose |V| could overflow O under a lazy shift (``V_LIMIT``).
  After this version, ``acc.m`` is a shift, not the running max;
- taller products: the forward stacks neighbouring query tiles (up to
  ``UNIT_ROWS`` rows) and computes a key tile they share in one product; the
  stacks cover exactly the plan's tiles, so the work counted is the work done;
- threads: the work is cut into independent units (a stack of query tiles of
  one head forward, a whole head backward, whose key tiles all add to the
  head's dQ) run on `workers` threads, with BLAS held to one thread meanwhile
  (two levels of threads on the same cores oversubscribe them: measured
  several times slower). A unit owns the rows it writes, so results do not
  depend on the number of workers, bit for bit. NumPy's element-wise passes
  run on one core, BLAS on all: with workers, both use every core.

Measured (``python -m bench.kernel --step v3 --threads 2``, BENCHMARKS.md;
AMD EPYC, 2 cores, OpenBLAS): 65% of the float32 matmul rate forward, 72%
backward at S = 8192, H = 8, D = 64 (60% and 69% at S = 4096); forward 1.03x
and backward 0.92x the time of torch's CPU scaled_dot_product_attention on
the same shapes and threads.

Shapes as in version 2; ``W`` workers.
"""

import ctypes
import threading
from contextlib import contextmanager

import numpy as np

from .step_v2 import ExactBase2Step, by_tile, exp2_visible, shifted_scores
from .masks import visible
from .tiles import FULL, MASKED

SUM_LIMIT = 2.0 ** 32   # a lazy tile's row sum may reach this before the tile is redone
V_LIMIT = 2.0 ** 64     # above this |V|, O could overflow under a lazy shift: stay exact


class LazyThreadedStep(ExactBase2Step):
    """Version 3: lazy max, taller products, `workers` threads."""
    name = "v3"
    takes_workers = True

    def __init__(self, workers=1):
        if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        self.workers = int(workers)

    @property
    def label(self):
        return f"{self.name}, {self.workers} worker{'s' if self.workers > 1 else ''}"

    # -- forward ----------------------------------------------------------

    def forward_tiles(self, acc, queries, block, plan):
        q, (B, Hkv, c, G, D) = queries.q, queries.q.shape
        heads = {}

        def prepare(b, h):
            heads[b, h] = self.prepare_head(block.k[b, h], block.v[b, h])

        def unit(b, h, qs, blocks):
            with np.errstate(over="ignore", invalid="ignore"):   # a lazy tile may overflow; it is redone
                self.forward_rows(acc.o[b, h, qs], acc.m[b, h, qs], acc.l[b, h, qs], q[b, h, qs],
                                  heads[b, h], queries.pos[qs], block.pos, blocks, queries.mask)

        pairs = [(b, h) for b in range(B) for h in range(Hkv)]
        units = sorted(((b, h, qs, blocks) for qs, blocks in forward_units(plan, c, G) for b, h in pairs),
                       key=lambda u: -len(u[3]))         # most blocks first: workers finish together
        run_units(prepare, pairs, self.workers)
        run_units(unit, units, self.workers)

    def prepare_head(self, k, v):
        head = super().prepare_head(k, v)
        head.lazy = max(v.max(initial=0.0), -v.min(initial=0.0)) <= V_LIMIT   # False for NaN
        return head

    def update(self, ol, m2, q2, s, head, ks, tile_pos, inc):
        """A lazy tile with the current shift if it stays in range, else an exact one."""
        if head.lazy and np.isfinite(m2).all():
            mask = None if tile_pos is None else visible(*tile_pos)
            shifted_scores(s, q2, head.k1[ks], None)     # S - m, base 2   (rows, tk)
            exp2_visible(s, mask)                        # P, 0 where masked; may overflow to inf
            np.matmul(s, head.v1[ks], out=inc)           # [P V, rowsum(P)]   (rows, D+1)
            if inc[:, -1].max() <= SUM_LIMIT:            # False for inf and NaN too
                ol += inc
                return m2
        return super().update(ol, m2, q2, s, head, ks, tile_pos, inc)

    # -- backward ---------------------------------------------------------

    def backward_tiles(self, grads, queries, rows, block, plan):
        B, Hkv = queries.q.shape[:2]
        columns = by_tile(plan, 1)

        def unit(b, h):
            self.backward_head(grads, queries, rows, block, columns, b, h)
        run_units(unit, [(b, h) for b in range(B) for h in range(Hkv)], self.workers)


# -- taller products ------------------------------------------------------

UNIT_ROWS = 512   # the forward stacks query tiles up to this many rows: taller products run faster


def forward_units(plan, c, G):
    """Consecutive query tiles stacked into groups of up to UNIT_ROWS rows.
    Returns [(query slice of the group, blocks)], blocks being the group's tiles
    as (query slice within the group, key slice, kind): a key tile shared by
    neighbouring query tiles of the group is one block, one product. Blocks
    cover exactly the plan's tiles."""
    groups = []
    for qs, tiles in by_tile(plan, 0):
        stop = min(qs.stop, c)
        last = groups[-1] if groups else None
        if last and last[-1][0].stop == qs.start and (stop - last[0][0].start) * G <= UNIT_ROWS:
            last.append((slice(qs.start, stop), tiles))
        else:
            groups.append([(slice(qs.start, stop), tiles)])
    return [(slice(g[0][0].start, g[-1][0].stop), _blocks(g)) for g in groups]


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
            blocks.append((rows, ks, MASKED if any(kind == MASKED for _, kind in run) else FULL))
            run = [member]
    return blocks


# -- worker threads and the BLAS thread count -----------------------------

def run_units(fn, units, workers):
    """fn(*unit) for every unit, taken in order by `workers` threads
    (this one included). The first exception is raised here, after all stop."""
    if workers <= 1 or len(units) <= 1:
        for u in units:
            fn(*u)
        return
    pending, lock, errors = iter(units), threading.Lock(), []

    def work(worker):
        while not errors:
            with lock:
                u = next(pending, None)
            if u is None:
                return
            try:
                fn(*u)
            except BaseException as e:   # re-raised by the caller below
                errors.append(e)

    with _BLAS.one_thread():
        threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(1, workers)]
        for t in threads:
            t.start()
        work(0)
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


class _BlasThreads:
    """The thread count of the OpenBLAS that NumPy uses, found through ctypes.

    While its workers run, version 3 holds BLAS to one thread: two levels of
    threads on the same cores oversubscribe them (measured: several times
    slower). The count is global to the process, so steps running at once (the
    virtual ring's devices) share one hold: the first sets it, the last restores it. Without OpenBLAS
    (another BLAS, not Linux) there is nothing to hold.
    """

    def __init__(self):
        self._lib = None        # (get, set) once looked up; () when there is none
        self._lock = threading.Lock()
        self._holders = 0
        self._saved = 1

    @contextmanager
    def one_thread(self):
        with self._lock:
            if self._holders == 0 and self._find():
                self._saved = self._lib[0]()
                self._lib[1](1)
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._find():
                    self._lib[1](self._saved)

    def _find(self):
        if self._lib is None:
            self._lib = _openblas_thread_functions()
        return bool(self._lib)


def _openblas_thread_functions():
    """(get, set) of the loaded OpenBLAS's thread count, or () if there is none."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower()})
    except OSError:
        return ()
    # NumPy's own copy first (wheels ship scipy-openblas under numpy.libs)
    for path in sorted(paths, key=lambda p: "numpy" not in p):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"),
                               ("openblas", "")):
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
                return get, set_
    return ()


_BLAS = _BlasThreads()


def one_blas_thread():
    """Hold OpenBLAS to one thread inside a `with` block (shared with the workers' hold)."""
    return _BLAS.one_thread()
