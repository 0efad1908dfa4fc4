"""Step version 2 (NumPy): version 1's arithmetic arranged for a CPU.

On a CPU a tile's element-wise passes (subtract the max, exp, row sums, the
mask) cost as much as its two matrix products, so version 2 removes passes;
the formulas are version 1's (`reference.step`), tile by tile, exact max,
with the pieces of `reference.steps.parts`:

- base 2: ``exp2`` is about twice as fast as ``exp``, so ``log2(e)`` is folded
  into Q once and ``m`` and ``lse`` are carried in base 2 inside a tile loop;
- folded columns, one product instead of a pass:
  ``[Q, -m] @ [K, 1]^T = S - m`` and ``P @ [V, 1] = [P V, rowsum(P)]``; in the
  backward ``[Q, -lse] @ [K, 1]^T = S - lse`` and ``[dO, -delta] @ [V, 1]^T = dP - delta``;
- mask after exp2 in the backward: masked scores are cleared after ``exp2``
  rather than set to -inf before it, because NumPy's exp2 takes a slow path
  for -inf (4 to 5 times slower per element), which made a diagonal tile cost
  several full ones;
- one (batch, head) at a time, on contiguous 2-D matrices.

Measured (``python -m bench.kernel``, BENCHMARKS.md; AMD EPYC, 2 cores,
OpenBLAS): at S = 4096, H = 8, D = 64, 30% of the float32 matmul rate forward
and 49% backward, against version 1's 36% and 47%: on its own, one head at a
time, its element-wise passes run on one core while version 1's whole-tile
products keep both busy. Version 3 puts both cores to work on it.

Shapes per (batch, head): q (c, G, D), k, v (ck, D); R = tq * G rows of a tile.
"""

from ..step import Step, no_progress
from ..tiles import FULL
from .parts import (KeyHead, QueryRun, backward_cols, backward_head, by_tile, exact_update,
                    forward_rows)


class ExactBase2Step(Step):
    """Version 2: exact max, base 2, folded columns, one head at a time."""
    name = "v2"
    array_modules = ("numpy",)

    def forward_tiles(self, acc, queries, block, plan, progress=no_progress):
        B, Hkv = queries.q.shape[:2]
        rows, masks = by_tile(plan, 0), {}              # [(query slice, [(key slice, kind)])], masks of all heads
        for b in range(B):
            for h in range(Hkv):
                head = KeyHead.of(block, b, h)           # [K, 1], [V, 1] of this head
                for qs, tiles in rows:                   # one query tile against its key tiles
                    run = QueryRun.of(acc, queries, b, h, qs, masks)
                    whole = slice(0, len(run.pos))
                    blocks = [(whole, ks, None if kind == FULL else whole) for ks, kind in tiles]   # masked rows
                    forward_rows(run, head, blocks, exact_update, progress)

    def backward_tiles(self, grads, queries, rows, block, plan, progress=no_progress):
        B, Hkv = queries.q.shape[:2]
        columns = by_tile(plan, 1), {}                   # [(key slice, [(query slice, kind)])], masks
        for b in range(B):
            for h in range(Hkv):
                backward_head(grads, queries, rows, block, (b, h), columns, backward_cols, progress)
