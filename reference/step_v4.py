"""Step version 4 (NumPy): version 3 with masked tiles computed in sub-tiles.

What it changes from version 3 (`reference.step_v3`), and why. A masked tile
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
work. The lazy shift's test and the exact fall-back are version 3's.

Measured (``OPENBLAS_NUM_THREADS=1 python -m bench.block_shapes --steps v3 v4``,
BENCHMARKS.md; AMD EPYC, one thread, S = 8192 and 16384, N = 4, tiles of
256): a tile of a triangular block costs 0.97 to 1.02 times a full block's
forward (version 3: 1.10 to 1.12) and 0.99 to 1.02 backward (version 3: 0.99
to 1.08). At tiles of 128 on blocks of 1024 it does not help: there the
sub-tiles' small products and their per-product overhead cost as much as the
mask did, and both versions' triangular tiles cost 1.3 times a full one. On
the whole-kernel benchmark it was not faster than version 3, so ``auto``
stays version 3.

Shapes as in version 2; per sub-row ``Ra = SUB * G`` rows, ``w`` the key span.
"""

import functools

import numpy as np

from .step_v2 import ExactBase2Step
from .step_v3 import SUM_LIMIT, LazyThreadedStep
from .masks import visible
from .tiles import FULL, SKIP, classify

SUB = 64          # the side of a sub-tile: masked tiles are computed SUB x SUB at a time


class SubTiledStep(LazyThreadedStep):
    """Version 4: version 3, masked tiles in sub-tiles of `sub` x `sub`."""
    name = "v4"

    def __init__(self, workers=1, sub=SUB):
        super().__init__(workers)
        if isinstance(sub, bool) or not isinstance(sub, (int, np.integer)) or sub < 1:
            raise ValueError(f"sub must be a positive int, got {sub!r}")
        self.sub = int(sub)

    @property
    def label(self):
        return super().label + ("" if self.sub == SUB else f", sub-tiles of {self.sub}")

    # -- forward ----------------------------------------------------------

    def update(self, ol, m2, q2, s, head, ks, tile_pos, inc):
        """A masked tile with a lazy shift: in sub-tiles; else as version 3."""
        if tile_pos is None or not head.lazy or not np.isfinite(m2).all():
            return super().update(ol, m2, q2, s, head, ks, tile_pos, inc)
        q_pos, k_pos, rule = tile_pos
        G = len(q2) // len(q_pos)
        k1, v1 = head.k1[ks], head.v1[ks]
        for qa, lo, hi, masks in sub_rows(q_pos, k_pos, rule, self.sub):
            rows = slice(qa.start * G, qa.stop * G)
            if hi == lo:                                 # no query of these rows sees a key
                inc[rows] = 0
                continue
            sa = s.reshape(-1)[:(rows.stop - rows.start) * (hi - lo)].reshape(-1, hi - lo)   # (Ra, w)
            np.matmul(q2[rows], k1[lo:hi].T, out=sa)    # S - m, base 2
            np.exp2(sa, out=sa)                         # P; hidden entries may overflow: cleared next
            for kc, mask in masks:                      # the masked and skipped sub-tiles of the span
                sub = sa[:, kc.start - lo:kc.stop - lo].reshape(qa.stop - qa.start, G, -1)
                np.copyto(sub, 0, where=~mask[:, None, :])
            np.matmul(sa, v1[lo:hi], out=inc[rows])     # [P V, rowsum(P)]
        if inc[:, -1].max() <= SUM_LIMIT:               # False for inf and NaN too
            ol += inc
            return m2
        return ExactBase2Step.update(self, ol, m2, q2, s, head, ks, tile_pos, inc)

    # -- backward ---------------------------------------------------------

    def backward_cols(self, dq, dk, dv, q, q2, do, do1, k, k1, v1, q_pos, k_pos, tiles, guard, rule=True):
        """Version 2's `backward_cols`, with the masked tiles in sub-tiles (not
        when the inputs hold NaN or inf: the guarded products are version 2's)."""
        if guard or all(kind == FULL for _, kind in tiles):
            return super().backward_cols(dq, dk, dv, q, q2, do, do1, k, k1, v1, q_pos, k_pos, tiles, guard, rule)
        full = [(qs, kind) for qs, kind in tiles if kind == FULL]
        if full:
            super().backward_cols(dq, dk, dv, q, q2, do, do1, k, k1, v1, q_pos, k_pos, full, guard, rule)
        G, D = q.shape[1], q.shape[2]
        for qs, kind in tiles:
            if kind == FULL:
                continue
            for qa, lo, hi, masks in sub_rows(q_pos[qs], k_pos, rule, self.sub):
                if hi == lo:
                    continue
                rows = slice(qs.start + qa.start, qs.start + qa.stop)
                Ra = (qa.stop - qa.start) * G
                p = q2[rows].reshape(Ra, D + 1) @ k1[lo:hi].T          # S - lse, base 2   (Ra, w)
                with np.errstate(over="ignore", invalid="ignore"):     # hidden entries: cleared next
                    np.exp2(p, out=p)                                  # P = exp(S - lse)
                for kc, mask in masks:
                    np.copyto(p[:, kc.start - lo:kc.stop - lo].reshape(qa.stop - qa.start, G, -1), 0,
                              where=~mask[:, None, :])
                dv[lo:hi] += p.T @ do[rows].reshape(Ra, D)             # dV += P^T dO
                ds = do1[rows].reshape(Ra, D + 1) @ v1[lo:hi].T        # dP - delta   (Ra, w)
                ds *= p                                                # dS = P (dP - delta)
                dq[rows] += (ds @ k[lo:hi]).reshape(-1, G, D)          # dQ += dS K
                dk[lo:hi] += ds.T @ q[rows].reshape(Ra, D)             # dK += dS^T Q


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
