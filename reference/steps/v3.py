"""Step version 3 (NumPy): version 2 with a lazy max, taller products and worker threads.

What it changes from version 2 (`reference.steps.v2`), and why (the pieces
are in `reference.steps.parts`, the units and threads in `reference.steps.units`):

- a lazy max (`lazy_tile`): any shift gives the same ``O / l`` and
  ``m + log(l)``, so a tile is first computed with the current shift (no row
  max, no rescaling) and redone exactly only if a row sum could overflow; a
  row's first tile takes a sampled shift (`seeded_tile`). After this version
  ``acc.m`` is a shift, not the running max;
- masks on the masked rows only (`forward_units`, `tile_masks.weigh`);
- taller products: neighbouring query tiles stacked on a key tile they share
  (forward, up to ``UNIT_ROWS`` rows), a key tile's query tiles together
  (backward, `column_runs`: tiles of 128 four at a time, 0.86x the time);
- threads (`run_units`): independent units (a stack of query tiles of one head
  forward, a whole head backward) on `workers` threads, BLAS held to one
  thread meanwhile. A unit owns the rows it writes, so results do not depend
  on the number of workers, bit for bit; NumPy's element-wise passes, on one
  core alone, then use every core. The calling thread works too, and calls
  `progress` between its own tiles and while it waits for the others.

Measured (``python -m bench.kernel --step v3 --threads 2``; AMD EPYC, 2 cores,
OpenBLAS): 65% of the float32 matmul rate forward and 72% backward at
S = 8192, H = 8, D = 64; forward 1.03x and backward 0.92x the time of torch's
CPU attention on the same shapes and threads. Ring-sized blocks, one thread:
docs/steps.md, "What versions 3 and 5 bought".

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
