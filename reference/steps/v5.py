"""Step version 5 (NumPy): version 3 with all heads of a key tile in one batched product.

What it changes from version 3 (`reference.steps.v3`), and why. Version 3
runs its forward one head at a time: a dozen NumPy calls per head and block
(two products, exp2, the mask, the row sums' check, the accumulation), whose
cost beyond their arithmetic a triangular block spreads over fewer tiles than
a full one. Version 5 computes a block for a group of heads at once:
``[Q, -m]`` stacked as (heads, rows, D+1) against ``[K, 1]`` as (heads, D+1,
keys) in one ``np.matmul``, then exp2, the mask, ``P @ [V, 1]`` and the check
on arrays of all those heads. Everything else is version 3's
(`reference.steps.parts`): a head that would overflow, whose |V| is huge or
not finite, or whose rows are not all in the same state goes alone through
version 3's tile, so NaN, inf and the masks follow version 3's rules. The
backward is version 3's (batched, it was 1.06 times slower: the arrays of 8
heads leave the cache).

- wider products at small tiles: neighbouring key tiles that need no mask in
  one product (`units.join_full`, `join_width`), within ``GROUP_SCORES``;
- units and threads: a unit is a stack of query tiles of one group of heads,
  the heads cut into at least `workers` groups that keep a block's scores
  within ``GROUP_SCORES`` (in cache). A head's arithmetic is the same in any
  group: results do not depend on the number of workers, bit for bit.

Measured (AMD EPYC Zen 5, against version 3 in the same process): one causal
block of 1024 to 8192 tokens and 8 heads, forward, one thread, 0.89 to 0.97
times version 3's time; on bench.kernel's S = 8192 with 2 workers a median
0.90 of its wall time, so ``auto`` takes it on NumPy. In full: docs/steps.md,
"What versions 3 and 5 bought".

Shapes as in version 2, with a leading axis of ``Hg`` heads per group.
"""

import numpy as np

from ..step import Step, no_progress
from .parts import (SUM_LIMIT, backward_cols, exact_update, keep_seeded, lazy_product, lazy_tile, seed_fits,
                    seeded_product, threaded_backward, threaded_forward)
from .units import UNIT_ROWS, check_workers, workers_label

# a group's scores (heads x stacked rows x keys of a tile) at most this many: 2 MiB of float32, so that
# they stay in a core's cache (groups of 8 heads at tiles of 256, 4 MiB, measured 1.03 to 1.04 times
# version 3's time on blocks of 4096 and 8192 tokens; 4 heads 0.97 to 0.99)
GROUP_SCORES = 2 ** 19


class HeadBatchedStep(Step):
    """Version 5: version 3 with a group of heads a product, `workers` threads;
    the backward is version 3's."""
    name = "v5"
    array_modules = ("numpy",)
    takes_workers = True

    def __init__(self, workers=1):
        self.workers = check_workers(workers)

    label = property(lambda self: workers_label(self.name, self.workers))

    def forward_tiles(self, acc, queries, block, plan, progress=no_progress):
        # version 3's units and threads, each unit a group of heads, each tile `heads_tile`
        _, Hkv, _, G, _ = queries.q.shape
        tq = max(qs.stop - qs.start for qs, _, _ in plan)
        tk = max(ks.stop - ks.start for _, ks, _ in plan)
        rows = max(UNIT_ROWS, tq * G)                    # a unit's rows at most (`forward_units`)
        most = max(1, GROUP_SCORES // (rows * tk))       # heads a group at most
        threaded_forward(acc, queries, block, plan, heads_tile, self.workers, progress,
                         groups=head_groups(Hkv, self.workers, most), join=join_width(Hkv, most, rows, tk))

    def backward_tiles(self, grads, queries, rows, block, plan, progress=no_progress):
        # version 3's: heads stacked measured slower (module docstring)
        threaded_backward(grads, queries, rows, block, plan, backward_cols, self.workers, progress)


def join_width(n_heads, most, rows, tk):
    """Full key tiles a product (`units.join_full`): as many as keep the
    scores of the largest group the heads may form within GROUP_SCORES. It
    depends on the heads, not on the workers, so results do not either."""
    return max(1, GROUP_SCORES // (min(n_heads, most) * rows * tk))


def head_groups(n_heads, workers, most=None):
    """The heads 0..n_heads-1 cut into groups of neighbours, as slices: at
    least min(n_heads, workers) groups, and none of more than `most` heads."""
    n = max(min(n_heads, workers), -(-n_heads // (most or n_heads)))
    cuts = np.linspace(0, n_heads, n + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]


def heads_tile(st, s, heads, ks, where):
    """One tile of a group of heads (`parts.Base2Rows` st and scores s
    with a leading axis of heads; `heads` a `KeyHead` of the group): lazy,
    or seeded where no row has a shift yet, all heads in one pass each. A
    head whose row sums do not pass the check is redone exactly alone; when
    the heads are not all lazy or their rows not all in one state, each head
    goes through version 3's `lazy_tile`."""
    fits = seed = None
    if heads.lazy.all() and np.isfinite(st.m2).all():
        lazy_product(st, s, heads, ks, where)
        fits = st.inc[..., -1].max(axis=-1) <= SUM_LIMIT      # (Hg,) False for inf and NaN too
        if fits.all():
            st.ol += st.inc
            return
    elif heads.lazy.all() and (st.m2 == -np.inf).all():
        seed = seeded_product(st, s, heads, ks, where)
        fits = seed_fits(st)                                  # (Hg,)
        if fits.all():
            keep_seeded(st, seed)
            return
    for h in range(len(s)):                                   # rare: one head at a time
        one = st[h]
        if fits is None:
            lazy_tile(one, s[h], heads[h], ks, where)
        elif not fits[h]:
            exact_update(one, s[h], heads[h], ks, where)
        elif seed is None:
            one.ol += one.inc
        else:
            keep_seeded(one, seed[h])


__all__ = ["HeadBatchedStep", "GROUP_SCORES", "head_groups", "heads_tile", "join_width"]
