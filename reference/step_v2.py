"""Step version 2 (NumPy): version 1's arithmetic arranged for a CPU.

On a CPU a tile's element-wise passes (subtract the max, exp, row sums, the
mask) cost as much as its two matrix products, so version 2 removes passes;
the formulas are version 1's (`reference.step`), tile by tile, exact max:

- base 2: ``exp2`` is about twice as fast as ``exp``, so ``log2(e)`` is folded
  into Q once and ``m`` and ``lse`` are carried in base 2 inside a tile loop;
- folded columns, one product instead of a pass:
  ``[Q, -m] @ [K, 1]^T = S - m`` and ``P @ [V, 1] = [P V, rowsum(P)]``; in the
  backward ``[Q, -lse] @ [K, 1]^T = S - lse`` and ``[dO, -delta] @ [V, 1]^T = dP - delta``;
- mask after exp2: masked scores are cleared after ``exp2`` rather than set to
  -inf before it, because NumPy's exp2 takes a slow path for -inf (4 to 5 times
  slower per element), which made a diagonal tile cost several full ones;
- one (batch, head) at a time, on contiguous 2-D matrices.

Measured (``python -m bench.kernel``, BENCHMARKS.md; AMD EPYC, 2 cores,
OpenBLAS): at S = 4096, H = 8, D = 64, 30% of the float32 matmul rate forward
and 49% backward, against version 1's 36% and 47%: on its own, one head at a
time, its element-wise passes run on one core while version 1's whole-tile
products keep both busy. Version 3 puts both cores to work on it.

Shapes per (batch, head): q (c, G, D), k, v (ck, D); R = tq * G rows of a tile.
"""

import numpy as np

from .step import ReadableStep, all_finite, mask_rows, masked_product
from .masks import visible
from .tiles import MASKED

LOG2E = float(np.log2(np.e))


class ExactBase2Step(ReadableStep):
    """Version 2: exact max, base 2, folded columns, one head at a time."""
    name = "v2"
    array_modules = ("numpy",)
    has_dropout = False

    # -- forward ----------------------------------------------------------

    def forward_tiles(self, acc, queries, block, plan):
        q, (B, Hkv, c, G, D) = queries.q, queries.q.shape
        for b in range(B):
            for h in range(Hkv):
                head = self.prepare_head(block.k[b, h], block.v[b, h])
                for qs, tiles in by_tile(plan, 0):
                    self.forward_rows(acc.o[b, h, qs], acc.m[b, h, qs], acc.l[b, h, qs], q[b, h, qs],
                                      head, queries.pos[qs], block.pos,
                                      [(slice(0, len(queries.pos[qs])), ks, kind) for ks, kind in tiles],
                                      queries.mask)

    def prepare_head(self, k, v):
        """[K, 1] and [V, 1] (ck, D+1), and whether V holds a NaN or inf."""
        return Head(k1=augment(k, 1.0), v1=augment(v, 1.0), guard=not all_finite(np, v))

    def forward_rows(self, o, m, l, q, head, q_pos, k_pos, blocks, rule=True):
        """The online softmax of a run of query rows of one head over `blocks`,
        a list of (query slice within the run, key slice, kind).
        o (tq, G, D), m, l (tq, G): views of the accumulator, updated at the end;
        q (tq, G, D) pre-scaled."""
        tq, G, D = q.shape
        R = tq * G
        m2_in = m.reshape(R) * LOG2E                     # (R,) the running max, base 2
        m2 = m2_in.copy()
        q2 = augment(q.reshape(R, D) * LOG2E, 0.0)       # [Q log2(e), -m2]   (R, D+1)
        set_shift(q2, m2)
        ol = augment(o.reshape(R, D), l.reshape(R))      # [O, l]             (R, D+1)
        inc = np.empty_like(ol)
        buf = np.empty(R * max(len(head.k1[ks]) for _, ks, _ in blocks), dtype=q.dtype)
        for qr, ks, kind in blocks:
            rows = slice(qr.start * G, qr.stop * G)      # the block's rows of the run
            s = buf[:(rows.stop - rows.start) * len(head.k1[ks])].reshape(-1, len(head.k1[ks]))   # (rows, tk)
            tile_pos = (q_pos[qr], k_pos[ks], rule) if kind == MASKED else None   # what makes the mask
            m2[rows] = self.update(ol[rows], m2[rows], q2[rows], s, head, ks, tile_pos, inc[rows])
        o[...] = ol[:, :D].reshape(tq, G, D)
        l[...] = ol[:, D].reshape(tq, G)
        # converting m to base e and back rounds it: write only the rows that moved
        m[...] = np.where(m2 == m2_in, m.reshape(R), m2 / LOG2E).reshape(tq, G)

    def update(self, ol, m2, q2, s, head, ks, tile_pos, inc):
        """One exact tile: scores into `s`, then `exact_tile`. `tile_pos`: the
        (query, key) positions and the mask rule of a masked tile, None for a
        full one. Returns the new m2."""
        mask = None if tile_pos is None else visible(*tile_pos)
        shifted_scores(s, q2, head.k1[ks], mask)
        vis = mask_rows(mask, len(s), np) if head.guard else None
        return exact_tile(ol, m2, q2, s, head.v1[ks], inc, vis)

    # -- backward ---------------------------------------------------------

    def backward_tiles(self, grads, queries, rows, block, plan):
        B, Hkv = queries.q.shape[:2]
        columns = by_tile(plan, 1)                       # [(key slice, [(query slice, kind)])]
        for b in range(B):
            for h in range(Hkv):
                self.backward_head(grads, queries, rows, block, columns, b, h)

    def backward_head(self, grads, queries, rows, block, columns, b, h):
        """Every key tile of one (batch, head): all add to the head's dQ."""
        q, do, k, v = queries.q[b, h], rows.do[b, h], block.k[b, h], block.v[b, h]
        if ("v2", b, h) not in rows.cache:                   # the same every round: made once
            q2 = augment(q * LOG2E, -rows.lse[b, h] * LOG2E)     # [Q log2(e), -lse]   (c, G, D+1)
            do1 = augment(do, -rows.delta[b, h])                 # [dO, -delta]        (c, G, D+1)
            rows.cache["v2", b, h] = q2, do1, all_finite(np, q, do1)
        q2, do1, rows_finite = rows.cache["v2", b, h]
        k1, v1 = augment(k, 1.0), augment(v, 1.0)                # [K, 1], [V, 1]      (ck, D+1)
        guard = not (rows_finite and all_finite(np, k, v))       # NaN or inf: guard masked pairs
        for ks, tiles in columns:
            self.backward_cols(grads.dq[b, h], grads.dk[b, h, ks], grads.dv[b, h, ks], q, q2, do, do1,
                               k[ks], k1[ks], v1[ks], queries.pos, block.pos[ks], tiles, guard, queries.mask)

    def backward_cols(self, *args):
        backward_cols(*args)


class Head:
    """One (batch, head) of the block, prepared for the forward."""

    def __init__(self, k1, v1, guard, lazy=False):
        self.k1, self.v1, self.guard, self.lazy = k1, v1, guard, lazy


def backward_cols(dq, dk, dv, q, q2, do, do1, k, k1, v1, q_pos, k_pos, tiles, guard, rule=True):
    """The backward of one key tile of one head over its query tiles.
    dq (c, G, D), dk, dv (tk, D): views, added to; q, do (c, G, D);
    q2, do1 (c, G, D+1) = [Q log2(e), -lse], [dO, -delta]; k (tk, D); k1, v1 (tk, D+1).
    P is exactly 0 where masked, even where lse is NaN: the mask clears it after exp2."""
    tk, D = k.shape
    G = q.shape[1]
    dk_t, dv_t = np.zeros_like(dk), np.zeros_like(dv)   # (tk, D) kept in cache over the tiles
    R_max = G * max(len(q_pos[qs]) for qs, _ in tiles)
    buf_p, buf_ds = np.empty(R_max * tk, q.dtype), np.empty(R_max * tk, q.dtype)
    for qs, kind in tiles:
        tq = len(q_pos[qs])
        R = tq * G
        p, ds = buf_p[:R * tk].reshape(R, tk), buf_ds[:R * tk].reshape(R, tk)
        mask = visible(q_pos[qs], k_pos, rule) if kind == MASKED else None
        shifted_scores(p, q2[qs].reshape(R, D + 1), k1, None)   # S - lse, base 2
        exp2_visible(p, mask)                                    # P = exp(S - lse), 0 where masked
        vis = mask_rows(mask, R, np) if guard else None          # (R, tk) or None
        vis_t = None if vis is None else vis.T
        dv_t += masked_product(p.T, do[qs].reshape(R, D), vis_t)     # dV += P^T dO
        np.matmul(do1[qs].reshape(R, D + 1), v1.T, out=ds)       # dP - delta   (R, tk)
        np.multiply(p, ds, out=ds)                               # dS = P * (dP - delta)
        if vis is not None:                                      # 0 x NaN: P = 0 does not clear a NaN dP - delta
            np.copyto(ds, 0, where=~vis)
        dq[qs] += masked_product(ds, k, vis).reshape(tq, G, D)  # dQ += dS K
        dk_t += masked_product(ds.T, q[qs].reshape(R, D), vis_t)    # dK += dS^T Q
    dk += dk_t
    dv += dv_t


# -- the pieces -----------------------------------------------------------

def augment(x, column, out=None):
    """[x, column] along the last axis: (..., D) -> (..., D+1)."""
    if out is None:
        out = np.empty(x.shape[:-1] + (x.shape[-1] + 1,), dtype=x.dtype)
    out[..., :-1] = x
    out[..., -1] = column
    return out


def by_tile(plan, which):
    """Group the plan by its query tiles (which=0) or key tiles (which=1):
    a list of (slice, [(other slice, kind), ...]) in plan order."""
    groups = {}
    for entry in plan:
        own = entry[which]
        groups.setdefault((own.start, own.stop), (own, []))[1].append((entry[1 - which], entry[2]))
    return list(groups.values())


def set_shift(q2, m2):
    """Last column of [Q log2(e), -m2] := -m2, or 0 where no key has been seen (m2 = -inf)."""
    q2[:, -1] = np.where(np.isfinite(m2), -m2, 0.0)


def shifted_scores(s, q2, kt, mask):
    """s (R, tk) := [Q log2(e), -m2] @ [K, 1]^T = (S - m) in base 2, masked entries -inf."""
    np.matmul(q2, kt.T, out=s)
    if mask is not None:
        tq, tk = mask.shape
        np.copyto(s.reshape(tq, -1, tk), -np.inf, where=~mask[:, None, :])


def exp2_visible(s, mask):
    """s := exp2(s), then 0 at the masked pairs of `mask` (tq, tk) (None: none).
    A masked entry may overflow to inf or be NaN before it is cleared; it
    contributes nothing either way."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.exp2(s, out=s)
    if mask is not None:
        tq, tk = mask.shape
        np.copyto(s.reshape(tq, -1, tk), 0, where=~mask[:, None, :])


def exact_tile(ol, m2, q2, s, vt, inc, vis=None):
    """One exact online-softmax tile (reference.step), in base 2, on scores
    s = S - shift. Updates ol = [O, l] and q2's shift column; returns the new m2.
    `vis` (R, tk): the mask, when vt may hold NaN or inf (`masked_product`)."""
    shift = -q2[:, -1]                                   # (R,) m2, or 0 where m2 = -inf
    m_new = np.maximum(m2, shift + s.max(axis=1))       # (R,)
    # Hazard: a row with no visible key yet keeps m_new = -inf; shifting it by
    # 0 leaves its P = exp2(-inf) = 0 and its alpha = 1 on O = l = 0, no NaN.
    seen = np.isfinite(m_new)
    s -= np.where(seen, m_new - shift, 0.0)[:, None]
    np.exp2(s, out=s)                                    # P = exp(S - m_new)
    alpha = np.exp2(m2 - np.where(seen, m_new, 0.0))     # rescales the old O and l
    ol *= np.where(seen, alpha, 1.0)[:, None]
    if vis is None:
        np.matmul(s, vt, out=inc)                        # [P V, rowsum(P)]
    else:
        inc[...] = masked_product(s, vt, vis)
    ol += inc
    set_shift(q2, m_new)
    return m_new
