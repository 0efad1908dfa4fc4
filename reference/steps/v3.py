"""Step version 3 (NumPy): version 2 with a lazy max, taller products and worker threads.

What it changes from version 2 (`reference.steps.v2`), and why (the pieces
are in `reference.steps.parts`, the units and threads in `reference.steps.units`):

- a lazy max (`lazy_tile`): the running shift ``m`` is raised only when a
  tile would overflow. Any shift gives the same ``O / l`` and ``m + log(l)``;
  it only has to keep ``exp`` finite. So a tile is first computed with the
  current ``m``: no row max, no subtraction, no rescaling. If some row's sum
  exceeds ``SUM_LIMIT`` (or is NaN) the tile is redone exactly, as in version
  2. Rows that have seen no key yet (``m = -inf``) take as shift the largest
  of every 8th score of their first tile (`seeded_tile`: the exact row max
  reads every score, and costs more than exp2), kept if the row sums lie in
  [``SUM_FLOOR``, ``SUM_LIMIT``], else exact. A head whose |V| could
  overflow O under a lazy shift (``V_LIMIT``) is always exact. After this
  version, ``acc.m`` is a shift, not the running max;
- masks on the masked rows only: a stack of query tiles sharing a key tile
  is masked only on the rows of its masked tiles (`forward_units`), and a
  lazy tile clears them by a product with a 0/1 matrix (`tile_masks.weigh`; a masked
  inf or NaN turns to NaN there, and the tile is redone exactly);
- taller products (`forward_units`): the forward stacks neighbouring query
  tiles (up to ``UNIT_ROWS`` rows) and computes a key tile they share in one
  product; the stacks cover exactly the plan's tiles, so the work counted is
  the work done. The backward stacks a key tile's query tiles the same way
  (`column_runs`, up to ``COLUMN_PAIRS``: tiles of 128 four at a time, 0.86x
  the time of one at a time);
- threads (`run_units`): the work is cut into independent units (a stack of
  query tiles of one head forward, a whole head backward, whose key tiles all
  add to the head's dQ) run on `workers` threads, with BLAS held to one thread
  meanwhile. A unit owns the rows it writes, so results do not depend on the
  number of workers, bit for bit. NumPy's element-wise passes run on one core,
  BLAS on all: with workers, both use every core. The calling thread works
  too, calls `progress` between its own tiles, and while it waits for the others.

Measured (``python -m bench.kernel --step v3 --threads 2``, BENCHMARKS.md;
AMD EPYC, 2 cores, OpenBLAS): 65% of the float32 matmul rate forward, 72%
backward at S = 8192, H = 8, D = 64 (60% and 69% at S = 4096); forward 1.03x
and backward 0.92x the time of torch's CPU scaled_dot_product_attention on
the same shapes and threads. Blocks the size a ring computes, one thread, by
CPU time against one core's sgemm (BENCHMARKS.md, AMD EPYC Zen 5, AVX-512):
c = 1024 forward 35-37%, backward 47-49%; c = 2048 43-50% and 54-59%
(masks on the masked rows and the seeded first tile: forward 0.79x to 0.94x
the time before them); a triangular block's tile 1.2x a full one's forward
at tiles of 128 (was about 1.26x).

Shapes as in version 2; ``W`` workers.
"""

from ..step import Step, no_progress
from .parts import backward_cols, lazy_tile, threaded_backward, threaded_forward
from .units import check_workers, workers_label


class LazyThreadedStep(Step):
    """Version 3: lazy max, taller products, `workers` threads."""
    name = "v3"
    array_modules = ("numpy",)
    takes_workers = True

    def __init__(self, workers=1):
        self.workers = check_workers(workers)

    @property
    def label(self):
        return workers_label(self.name, self.workers)

    def forward_tiles(self, acc, queries, block, plan, progress=no_progress):
        # units of stacked query tiles on the workers; each tile lazy, exact if it would overflow
        threaded_forward(acc, queries, block, plan, lazy_tile, self.workers, progress)

    def backward_tiles(self, grads, queries, rows, block, plan, progress=no_progress):
        # one unit per head on the workers; version 2's key tiles
        threaded_backward(grads, queries, rows, block, plan, backward_cols, self.workers, progress)
