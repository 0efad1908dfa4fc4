"""Step version 4 (NumPy): version 3 with masked tiles computed in sub-tiles.

What it changes from version 3 (`reference.steps.v3`), and why. A masked tile
(one that holds both visible and hidden pairs: a causal block's diagonal, and
every tile of striped's triangular blocks that the diagonal crosses) cost 1.3
to 1.5 times a full tile in version 3: the whole tile is computed, then a mask
is built from positions and applied with a masked copy, two element-wise
passes over the tile. Version 4 cuts a masked tile into sub-tiles of ``SUB``
queries by ``SUB`` keys, classified from positions like tiles are
(`reference.tiles.classify`), and for each run of ``SUB`` queries computes
one product over the span of keys its visible sub-tiles cover: the sub-tiles
that no query sees are not computed, and the mask is built and applied on the
masked sub-tiles only (a band of width ``SUB`` along the diagonal). A masked
256 x 256 tile then does 10/16 of the products and a quarter of the mask
work. Everything else is version 3's, from `reference.steps.parts`: the lazy
shift's test and its exact fall-back, taller products, worker threads.

Measured (``OPENBLAS_NUM_THREADS=1 python -m bench.block_shapes --steps v3 v4``,
BENCHMARKS.md; AMD EPYC, one thread, S = 8192 and 16384, N = 4, tiles of
256): a tile of a triangular block costs 0.97 to 1.02 times a full block's
forward (version 3: 1.10 to 1.12) and 0.99 to 1.02 backward (version 3: 0.99
to 1.08). At tiles of 128 on blocks of 1024 it does not help: there the
sub-tiles' small products and their per-product overhead cost as much as the
mask did, and both versions' triangular tiles cost 1.3 times a full one. On
the whole-kernel benchmark it was not faster than version 3, so ``auto``
did not take it.

Shapes as in version 2; per sub-row ``Ra = SUB * G`` rows, ``w`` the key span.
"""

import functools

import numpy as np

from ..masks import visible
from ..step import Step, no_progress
from ..tiles import FULL, SKIP, classify
from .parts import SUM_LIMIT, backward_cols, exact_update, lazy_tile, threaded_backward, threaded_forward
from .units import check_workers, workers_label

SUB = 64          # the side of a sub-tile: masked tiles are computed SUB x SUB at a time


class SubTiledStep(Step):
    """Version 4: version 3, masked tiles in sub-tiles of `sub` x `sub`."""
    name = "v4"
    array_modules = ("numpy",)
    takes_workers = True

    def __init__(self, workers=1, sub=SUB):
        self.workers = check_workers(workers)
        if isinstance(sub, bool) or not isinstance(sub, (int, np.integer)) or sub < 1:
            raise ValueError(f"sub must be a positive int, got {sub!r}")
        self.sub = int(sub)

    @property
    def label(self):
        return workers_label(self.name, self.workers) + ("" if self.sub == SUB else f", sub-tiles of {self.sub}")

    def forward_tiles(self, acc, queries, block, plan, progress=no_progress):
        # version 3's forward, with `subtiled_tile` for its tiles
        threaded_forward(acc, queries, block, plan, self.subtiled_tile, self.workers, progress)

    def subtiled_tile(self, st, s, head, ks, where):
        """A masked tile with a lazy shift, in sub-tiles; any other as version 3 (`lazy_tile`)."""
        if where is None or not head.lazy or not np.isfinite(st.m2).all():
            return lazy_tile(st, s, head, ks, where)
        G = len(st.q2) // len(where.q_pos)
        k1, v1 = head.k1[ks], head.v1[ks]
        for qa, lo, hi, masks in sub_rows(where.q_pos, where.k_pos, where.rule, self.sub):
            rows = slice(qa.start * G, qa.stop * G)
            if hi == lo:                                 # no query of these rows sees a key
                st.inc[rows] = 0
                continue
            sa = s.reshape(-1)[:(rows.stop - rows.start) * (hi - lo)].reshape(-1, hi - lo)   # (Ra, w)
            np.matmul(st.q2[rows], k1[lo:hi].T, out=sa)  # S - m, base 2
            np.exp2(sa, out=sa)                          # P; hidden entries may overflow: cleared next
            for kc, mask in masks:                       # the masked and skipped sub-tiles of the span
                sub = sa[:, kc.start - lo:kc.stop - lo].reshape(qa.stop - qa.start, G, -1)
                np.copyto(sub, 0, where=~mask[:, None, :])
            np.matmul(sa, v1[lo:hi], out=st.inc[rows])   # [P V, rowsum(P)]
        if st.inc[:, -1].max() <= SUM_LIMIT:             # False for inf and NaN too
            st.ol += st.inc
            return
        exact_update(st, s, head, ks, where)

    def backward_tiles(self, grads, queries, rows, block, plan, progress=no_progress):
        # version 3's backward, with `subtiled_cols` for its key tiles
        threaded_backward(grads, queries, rows, block, plan, self.subtiled_cols, self.workers, progress)

    def subtiled_cols(self, hq, col, dq, tiles, guard, tick=no_progress):
        """`parts.backward_cols`, with the masked tiles in sub-tiles (not
        when the inputs hold NaN or inf: the guarded products are version 2's)."""
        full = [(qs, kind) for qs, kind in tiles if kind == FULL]
        if guard or len(full) == len(tiles):
            return backward_cols(hq, col, dq, tiles, guard, tick)
        if full:
            backward_cols(hq, col, dq, full, guard, tick)
        G, D = hq.q.shape[1], hq.q.shape[2]
        for qs, kind in tiles:
            if kind == FULL:
                continue
            for qa, lo, hi, masks in sub_rows(hq.pos[qs], col.pos, hq.mask, self.sub):
                if hi == lo:
                    continue
                rows = slice(qs.start + qa.start, qs.start + qa.stop)
                Ra = (qa.stop - qa.start) * G
                p = hq.q2[rows].reshape(Ra, D + 1) @ col.k1[lo:hi].T     # S - lse, base 2   (Ra, w)
                with np.errstate(over="ignore", invalid="ignore"):       # hidden entries: cleared next
                    np.exp2(p, out=p)                                    # P = exp(S - lse)
                for kc, mask in masks:
                    np.copyto(p[:, kc.start - lo:kc.stop - lo].reshape(qa.stop - qa.start, G, -1), 0,
                              where=~mask[:, None, :])
                col.dv[lo:hi] += p.T @ hq.do[rows].reshape(Ra, D)       # dV += P^T dO
                ds = hq.do1[rows].reshape(Ra, D + 1) @ col.v1[lo:hi].T  # dP - delta   (Ra, w)
                ds *= p                                                  # dS = P (dP - delta)
                dq[rows] += (ds @ col.k[lo:hi]).reshape(-1, G, D)       # dQ += dS K
                col.dk[lo:hi] += ds.T @ hq.q[rows].reshape(Ra, D)       # dK += dS^T Q
            tick()


def sub_rows(q_pos, k_pos, rule=True, sub=SUB):
    """A masked tile (queries `q_pos`, keys `k_pos`, the mask `rule`: a
    `reference.masks.Mask` or causal bool) cut into runs of `sub` queries. For
    each run: its query slice, the span [lo, hi) of keys covered by its
    visible sub-tiles (lo = hi: none), and the masks of the sub-tiles of that
    span that are not fully visible, as [(key slice, (queries, keys) bool)].
    Neighbouring runs that see the same span without a mask are one run: one
    product. Every head of a block has the same positions, so the answer is
    cached (the key holds the rule itself: a Mask is compared by identity)."""
    return _sub_rows(q_pos.tobytes(), k_pos.tobytes(), q_pos.dtype.str, rule, sub)


@functools.lru_cache(maxsize=512)
def _sub_rows(q_bytes, k_bytes, dtype, rule, sub):
    q_pos, k_pos = np.frombuffer(q_bytes, dtype), np.frombuffer(k_bytes, dtype)
    kinds = classify(q_pos, k_pos, sub, rule)
    runs = []
    for a in range(kinds.shape[0]):
        qa = slice(a * sub, min((a + 1) * sub, len(q_pos)))
        seen = np.flatnonzero(kinds[a] != SKIP)
        lo, hi = (0, 0) if len(seen) == 0 else (seen[0] * sub, min((seen[-1] + 1) * sub, len(k_pos)))
        masks = []
        for c in range(seen[0], seen[-1] + 1) if len(seen) else ():
            if kinds[a, c] != FULL:
                kc = slice(c * sub, min((c + 1) * sub, len(k_pos)))
                masks.append((kc, visible(q_pos[qa], k_pos[kc], rule)))
        last = runs[-1] if runs else None
        if last and not masks and not last[3] and (last[1], last[2]) == (lo, hi):
            runs[-1] = (slice(last[0].start, qa.stop), lo, hi, [])
        else:
            runs.append((qa, lo, hi, masks))
    return tuple(runs)


__all__ = ["SubTiledStep", "SUB", "sub_rows"]
