"""The pieces the tuned NumPy steps (`v2` to `v5`) are built from.

Each version is a `reference.step.Step` that composes these functions; read a
version top to bottom with `reference.step` (the contract, version 1) and this
module open. What the pieces do is version 1's arithmetic (the formulas of
`reference.step`) arranged for a CPU:

- base 2: ``exp2`` is about twice as fast as ``exp``, so ``log2(e)`` is folded
  into Q once and ``m`` and ``lse`` are carried in base 2 inside a run of rows;
- folded columns, one product instead of a pass:
  ``[Q, -m] @ [K, 1]^T = S - m`` and ``P @ [V, 1] = [P V, rowsum(P)]``; in the
  backward ``[Q, -lse] @ [K, 1]^T = S - lse`` and ``[dO, -delta] @ [V, 1]^T = dP - delta``;
- mask after exp2: masked scores are cleared after ``exp2`` rather than set to
  -inf before it where a version can (NumPy's exp2 takes a slow path for -inf);
- one (batch, head) at a time, on contiguous 2-D matrices (`v5`: a group of heads);
- the lazy shift (`lazy_tile`): a tile first tried with the current shift,
  redone exactly (`exact_tile`) only if a row sum could overflow, a row's first
  tile shifted by a sample of its scores (`seeded_tile`);
- the forward in stacks of query tiles and the backward by head, on worker
  threads (`threaded_forward`, `threaded_backward`; `reference.steps.units`),
  a block's mask on its masked rows only (`reference.steps.tile_masks`).

A forward runs over a *run* of query rows of one head (`QueryRun`), in base 2
(`Base2Rows`), tile by tile through a tile function ``update(st, s, head, ks,
where)`` that a version chooses (`exact_update`, `lazy_tile`, or its own). A
backward runs over one key tile's column of query tiles (`backward_cols`, or a
version's own with the same parameters).

Shapes per (batch, head): q (c, G, D), k, v (ck, D); R = tq * G rows of a run;
``[X, y]`` is X with the column y appended (D + 1 columns).
"""

from dataclasses import dataclass

import numpy as np

from ..nonfinite import all_finite, mask_rows, masked_product
from ..step import no_progress
from ..tiles import by_tile
from .tile_masks import TilePos, exp2_visible, hide, weigh
from .units import column_runs, forward_units, join_full, on_this_thread, run_units, scratch

LOG2E = float(np.log2(np.e))
SUM_LIMIT = 2.0 ** 32   # a lazy tile's row sum may reach this before the tile is redone
V_LIMIT = 2.0 ** 64     # above this |V|, O could overflow under a lazy shift: stay exact
SUM_FLOOR = 2.0 ** -64  # a seeded tile's row sum must reach this: its largest P is then far above underflow
SEED_STRIDE = 8         # a fresh row's first shift: the largest of every 8th score of its first tile


# -- what a forward tile reads and updates -------------------------------------------

@dataclass
class QueryRun:
    """A run of query rows of one (batch, head): views of the accumulator
    (updated at the end of `forward_rows`), the pre-scaled queries, their
    positions and the mask."""
    o: np.ndarray        # (tq, G, D)
    m: np.ndarray        # (tq, G)
    l: np.ndarray        # (tq, G)
    q: np.ndarray        # (tq, G, D)
    pos: np.ndarray      # (tq,)
    mask: object
    masks: dict          # the tiles' masks, made once for all heads (`tile_masks`)

    @classmethod
    def of(cls, acc, queries, b, h, qs, masks):
        return cls(acc.o[b, h, qs], acc.m[b, h, qs], acc.l[b, h, qs], queries.q[b, h, qs], queries.pos[qs],
                   queries.mask, masks)


@dataclass
class KeyHead:
    """One (batch, head) of the key/value block, prepared for the forward; or
    several heads (h a slice: a leading axis of heads, flags per head, ``[i]``
    the i-th head alone; `v5`)."""
    k1: np.ndarray       # (ck, D+1) [K, 1]
    v1: np.ndarray       # (ck, D+1) [V, 1]
    pos: np.ndarray      # (ck,)
    guard: np.ndarray    # bool: V holds a NaN or inf: guard the masked pairs (`masked_product`)
    lazy: np.ndarray     # bool: a lazy shift is safe (|V| <= V_LIMIT)

    @classmethod
    def of(cls, block, b, h):
        k, v = block.k[b, h], block.v[b, h]
        key = (b, str(h))                                    # a slice is not hashable
        k1 = augment(k, 1.0, scratch(("k1", key), k.shape[:-1] + (k.shape[-1] + 1,), k.dtype))
        v1 = augment(v, 1.0, scratch(("v1", key), v.shape[:-1] + (v.shape[-1] + 1,), v.dtype))
        hi, lo = v.max(axis=(-2, -1), initial=0.0), v.min(axis=(-2, -1), initial=0.0)   # NaN where V holds one
        return cls(k1=k1, v1=v1, pos=block.pos, guard=~(np.isfinite(hi) & np.isfinite(lo)),
                   lazy=np.maximum(hi, -lo) <= V_LIMIT)                         # False for NaN

    def __getitem__(self, i):
        return KeyHead(self.k1[i], self.v1[i], self.pos, self.guard[i], self.lazy[i])


@dataclass
class Base2Rows:
    """A run's online softmax in base 2 with folded columns; ``st[rows]`` is a
    view of some rows; with a leading axis of heads, ``st[:, rows]`` (and ``st[i]``, head i)."""
    ol: np.ndarray       # (R, D+1) [O, l]
    q2: np.ndarray       # (R, D+1) [Q log2(e), -m2] (0 for -m2 where m2 = -inf)
    m2: np.ndarray       # (R,) the running shift, base 2
    inc: np.ndarray      # (R, D+1) scratch: one tile's [P V, rowsum(P)]

    def __getitem__(self, rows):
        return Base2Rows(self.ol[rows], self.q2[rows], self.m2[rows], self.inc[rows])


# -- the forward ------------------------------------------------------------------

def forward_rows(run, head, blocks, update, tick=no_progress):
    """The online softmax of a run of query rows over `blocks`, a list of
    (query slice within the run, key slice, masked rows: a slice of the
    block's query rows, or None), each through ``update(st, s, head, ks,
    where)``; `tick` after each. A run of several heads (a leading axis
    ``H``, `v5`) gives `update` that axis in front: s (H, rows, tk)."""
    *lead, tq, G, D = run.q.shape
    R, dtype, n = tq * G, run.q.dtype, int(np.prod(lead, dtype=int))
    m2_in = run.m.reshape(*lead, R) * LOG2E          # (..., R) the running shift, base 2
    q2 = scratch("q2+", (*lead, R, D + 1), dtype)     # [Q log2(e), -m2], the last column by set_shift
    np.multiply(run.q.reshape(*lead, R, D), dtype.type(LOG2E), out=q2[..., :D])
    st = Base2Rows(ol=augment(run.o.reshape(*lead, R, D), run.l.reshape(*lead, R),
                              scratch("ol", (*lead, R, D + 1), dtype)),          # [O, l]
                   q2=q2, m2=m2_in.copy(), inc=scratch("inc", (*lead, R, D + 1), dtype))
    set_shift(st.q2, st.m2)
    buf = scratch("s", (n * R * max(len(head.pos[ks]) for _, ks, _ in blocks),), dtype)
    heads = (slice(None),) * len(lead)
    for qr, ks, part in blocks:
        rows = slice(qr.start * G, qr.stop * G)      # the block's rows of the run
        tk = len(head.pos[ks])
        s = buf[:n * (rows.stop - rows.start) * tk].reshape(*lead, -1, tk)        # (..., rows, tk)
        where = None if part is None else TilePos(run.pos[qr], head.pos[ks], run.mask, run.masks, part)
        update(st[heads + (rows,)], s, head, ks, where)
        tick()
    run.o[...] = st.ol[..., :D].reshape(run.o.shape)
    run.l[...] = st.ol[..., D].reshape(run.l.shape)
    # converting m to base e and back rounds it: write only the rows that moved
    run.m[...] = np.where(st.m2 == m2_in, run.m.reshape(*lead, R), st.m2 / LOG2E).reshape(run.m.shape)


def exact_update(st, s, head, ks, where):
    """One exact tile: scores S - m into `s` (masked entries -inf), then `exact_tile`."""
    shifted_scores(s, st.q2, head.k1[ks], where)
    guarded = head.guard and where is not None
    exact_tile(st, s, head.v1[ks], mask_rows(where.mask(), len(s), np) if guarded else None)


def exact_tile(st, s, vt, vis=None):
    """One exact online-softmax tile (reference.step), in base 2, on scores
    s = S - shift; updates `st` (O, l, the shift). `vis` (R, tk): the mask,
    when vt may hold NaN or inf (`masked_product`)."""
    shift = -st.q2[:, -1]                                # (R,) m2, or 0 where m2 = -inf
    m_new = np.maximum(st.m2, shift + s.max(axis=1))    # (R,)
    # Hazard: a row with no visible key yet keeps m_new = -inf; shifting it by
    # 0 leaves its P = exp2(-inf) = 0 and its alpha = 1 on O = l = 0, no NaN.
    seen = np.isfinite(m_new)
    s -= np.where(seen, m_new - shift, 0.0)[:, None]
    np.exp2(s, out=s)                                    # P = exp(S - m_new)
    alpha = np.exp2(st.m2 - np.where(seen, m_new, 0.0))  # rescales the old O and l
    st.ol *= np.where(seen, alpha, 1.0)[:, None]
    if vis is None:
        np.matmul(s, vt, out=st.inc)                     # [P V, rowsum(P)]
    else:
        st.inc[...] = masked_product(s, vt, vis)
    st.ol += st.inc
    set_shift(st.q2, m_new)
    st.m2[...] = m_new


def lazy_tile(st, s, head, ks, where):
    """A tile with the current shift, no row max, no rescaling, if its row sums
    stay at most SUM_LIMIT (any shift gives the same O / l and m + log(l));
    else `exact_update`. Rows that have seen no key yet (m = -inf) take a
    seeded shift (`seeded_tile`); heads whose |V| could overflow O
    (``head.lazy`` False) are always exact."""
    if head.lazy and np.isfinite(st.m2).all():
        lazy_product(st, s, head, ks, where)
        if st.inc[:, -1].max() <= SUM_LIMIT:             # False for inf and NaN too: redone exactly
            st.ol += st.inc
            return
    elif head.lazy and (st.m2 == -np.inf).all() and seeded_tile(st, s, head, ks, where):
        return
    exact_update(st, s, head, ks, where)


def lazy_product(st, s, head, ks, where):
    """s := P = exp2(S - m) under the current shift, 0 where masked (may
    overflow: inf, or NaN at a masked pair), and st.inc := [P V, rowsum(P)];
    over any leading axes of heads."""
    shifted_scores(s, st.q2, head.k1[..., ks, :], None)  # S - m, base 2   (..., rows, tk)
    np.exp2(s, out=s)                                    # P; may overflow
    weigh(s, where)                                      # 0 where masked; a masked inf or NaN becomes NaN
    np.matmul(s, head.v1[..., ks, :], out=st.inc)        # [P V, rowsum(P)]   (..., rows, D+1)


def seeded_tile(st, s, head, ks, where):
    """The first tile of rows that have seen no key (m = -inf, O = l = 0),
    shifted by the largest of every SEED_STRIDE-th score of each row, visible
    or not (the exact row max costs more than exp2). Kept, and True, if
    every row sum lies in [SUM_FLOOR, SUM_LIMIT]: no overflow, and no row whose
    visible scores all fell far below a masked score. Else nothing changed, False."""
    seed = seeded_product(st, s, head, ks, where)
    if not seed_fits(st):
        return False
    keep_seeded(st, seed)
    return True


def seeded_product(st, s, head, ks, where):
    """`seeded_tile`'s products, over any leading axes of heads: st.inc :=
    [P V, rowsum(P)] under the seed, which it returns (..., rows)."""
    shifted_scores(s, st.q2, head.k1[..., ks, :], None)  # S, base 2: the shift column is 0 where m = -inf
    seed = s[..., ::SEED_STRIDE].max(axis=-1)            # (..., rows) NaN or inf fail the check below
    s -= seed[..., None]
    np.exp2(s, out=s)                                    # P under the seed; may overflow
    weigh(s, where)
    np.matmul(s, head.v1[..., ks, :], out=st.inc)        # [P V, rowsum(P)]
    return seed


def seed_fits(st):
    """The seeded row sums of st.inc all in [SUM_FLOOR, SUM_LIMIT]? (One bool, or one a head.)"""
    return (st.inc[..., -1].min(axis=-1) >= SUM_FLOOR) & (st.inc[..., -1].max(axis=-1) <= SUM_LIMIT)


def keep_seeded(st, seed):
    """A seeded tile kept: O = l = 0 before, the seed the rows' shift."""
    st.ol += st.inc
    st.m2[...] = seed
    set_shift(st.q2, st.m2)


# -- the backward -----------------------------------------------------------------

@dataclass
class BackwardQueries:
    """One (batch, head) of the queries as the backward reads them, the same
    every round: made once and kept in `BackwardRows.cache`."""
    q: np.ndarray        # (c, G, D)
    q2: np.ndarray       # (c, G, D+1) [Q log2(e), -lse log2(e)]
    do: np.ndarray       # (c, G, D)
    do1: np.ndarray      # (c, G, D+1) [dO, -delta]
    pos: np.ndarray      # (c,)
    mask: object
    finite: bool         # q, dO and delta hold no NaN or inf
    masks: dict          # the tiles' masks, made once for all heads (`tile_masks`)

    @classmethod
    def of(cls, queries, rows, b, h, masks):
        key = ("base2", b, h)
        if key not in rows.cache:
            q, do = queries.q[b, h], rows.do[b, h]
            q2 = augment(q * LOG2E, -rows.lse[b, h] * LOG2E)
            do1 = augment(do, -rows.delta[b, h])
            rows.cache[key] = (q2, do1, all_finite(np, q, do1))
        q2, do1, finite = rows.cache[key]
        return cls(q=queries.q[b, h], q2=q2, do=rows.do[b, h], do1=do1, pos=queries.pos,
                   mask=queries.mask, finite=finite, masks=masks)


@dataclass
class KeyColumn:
    """One key tile of one head in the backward, and its gradients (views, added to)."""
    k: np.ndarray        # (tk, D)
    k1: np.ndarray       # (tk, D+1) [K, 1]
    v1: np.ndarray       # (tk, D+1) [V, 1]
    pos: np.ndarray      # (tk,)
    dk: np.ndarray       # (tk, D)
    dv: np.ndarray       # (tk, D)


def backward_head(grads, queries, rows, block, bh, columns, cols, tick=no_progress):
    """Every key tile of one (batch, head) `bh`, each through
    ``cols(hq, column, dq, tiles, guard, tick)``: all add to the head's dQ.
    `columns`: the plan by key tile, ``by_tile(plan, 1)``, and the dict
    where the tiles' masks are kept for all heads: ``(by_tile(plan, 1), {})``."""
    b, h = bh
    columns, masks = columns
    hq = BackwardQueries.of(queries, rows, b, h, masks)
    k, v = block.k[b, h], block.v[b, h]
    wide = k.shape[:-1] + (k.shape[-1] + 1,)
    k1 = augment(k, 1.0, scratch("bk1", wide, k.dtype))       # [K, 1]   (ck, D+1)
    v1 = augment(v, 1.0, scratch("bv1", wide, v.dtype))       # [V, 1]
    guard = not (hq.finite and all_finite(np, k, v))            # NaN or inf: guard masked pairs
    for ks, tiles in columns:
        column = KeyColumn(k[ks], k1[ks], v1[ks], block.pos[ks], grads.dk[b, h, ks], grads.dv[b, h, ks])
        cols(hq, column, grads.dq[b, h], tiles, guard, tick)


def backward_cols(hq, col, dq, tiles, guard, tick=no_progress):
    """The backward of one key tile over its query tiles `tiles` [(query
    slice, kind)], neighbouring ones stacked into one product
    (`column_runs`; a tile at a time where the inputs hold NaN or inf); dq
    (c, G, D) and the column's dk, dv are added to. P is exactly 0 where
    masked, even where lse is NaN: the mask clears it after exp2."""
    tk, D = col.k.shape
    G, dtype = hq.q.shape[1], hq.q.dtype
    dk_t, dv_t = scratch("dk_t", col.dk.shape, dtype), scratch("dv_t", col.dv.shape, dtype)
    dk_t.fill(0)                                                 # (tk, D) kept in cache over the tiles
    dv_t.fill(0)
    runs = column_runs(tiles, len(hq.pos), G, tk, alone=guard)
    R_max = G * max(qs.stop - qs.start for qs, _ in runs)
    buf_p, buf_ds = scratch("p", (R_max * tk,), dtype), scratch("ds", (R_max * tk,), dtype)
    for qs, members in runs:
        tq = qs.stop - qs.start
        R = tq * G
        p, ds = buf_p[:R * tk].reshape(R, tk), buf_ds[:R * tk].reshape(R, tk)
        shifted_scores(p, hq.q2[qs].reshape(R, D + 1), col.k1, None)    # S - lse, base 2
        mask = exp2_visible(p, hq, col, qs, members)             # P = exp(S - lse), 0 where masked
        vis = mask_rows(mask, R, np) if guard else None          # (R, tk) or None; guarded runs are one tile
        vis_t = None if vis is None else vis.T
        dv_t += masked_product(p.T, hq.do[qs].reshape(R, D), vis_t)   # dV += P^T dO
        np.matmul(hq.do1[qs].reshape(R, D + 1), col.v1.T, out=ds)     # dP - delta   (R, tk)
        np.multiply(p, ds, out=ds)                               # dS = P * (dP - delta)
        if vis is not None:                                      # 0 x NaN: P = 0 does not clear a NaN dP - delta
            np.copyto(ds, 0, where=~vis)
        dq[qs] += masked_product(ds, col.k, vis).reshape(tq, G, D)      # dQ += dS K
        dk_t += masked_product(ds.T, hq.q[qs].reshape(R, D), vis_t)    # dK += dS^T Q
        tick()
    col.dk += dk_t
    col.dv += dv_t


# -- small pieces -------------------------------------------------------------------

def augment(x, column, out=None):
    """[x, column] along the last axis: (..., D) -> (..., D+1)."""
    if out is None:
        out = np.empty(x.shape[:-1] + (x.shape[-1] + 1,), dtype=x.dtype)
    out[..., :-1] = x
    out[..., -1] = column
    return out


def set_shift(q2, m2):
    """Last column of [Q log2(e), -m2] := -m2, or 0 where no key has been seen (m2 = -inf)."""
    q2[..., -1] = np.where(np.isfinite(m2), -m2, 0.0)


def shifted_scores(s, q2, kt, where):
    """s (..., R, tk) := [Q log2(e), -m2] @ [K, 1]^T = (S - m) in base 2, -inf at
    the masked pairs of `where` (a `TilePos`; None: none)."""
    np.matmul(q2, kt.swapaxes(-1, -2), out=s)
    if where is not None:
        hide(where.rows(s), where.hidden(), -np.inf)


# -- on worker threads (reference.steps.units) --------------------------------------

def threaded_forward(acc, queries, block, plan, update, workers, progress=no_progress, groups=None, join=1):
    """A forward in units of stacked query tiles (`forward_units`) of one head,
    or of a group of heads (`groups`: slices of them, `v5`), on `workers`
    threads (`run_units`), each tile through `update`; up to `join` full key
    tiles of a stack in one product (`join_full`)."""
    B, Hkv, c, G, _ = queries.q.shape
    pairs = [(i, b, h) for i, (b, h) in enumerate((b, h) for b in range(B) for h in groups or range(Hkv))]
    heads, masks, tick = {}, {}, on_this_thread(progress)

    def prepare(i, b, h):                                # [K, 1], [V, 1] of each head, once
        heads[i] = KeyHead.of(block, b, h)

    def unit(i, b, h, qs, blocks):
        with np.errstate(over="ignore", invalid="ignore"):   # a lazy tile may overflow; it is redone
            forward_rows(QueryRun.of(acc, queries, b, h, qs, masks), heads[i], blocks, update, tick)

    units = sorted(((*p, qs, blocks) for qs, blocks in join_full(forward_units(plan, c, G), join) for p in pairs),
                   key=lambda u: -len(u[4]))             # most blocks first: workers finish together
    run_units(prepare, pairs, workers, progress)
    run_units(unit, units, workers, progress)


def threaded_backward(grads, queries, rows, block, plan, cols, workers, progress=no_progress):
    """A backward in units of one whole head (its key tiles all add to its dQ)
    on `workers` threads, each key tile through `cols` (`backward_head`)."""
    B, Hkv = queries.q.shape[:2]
    columns, tick = (by_tile(plan, 1), {}), on_this_thread(progress)

    def unit(b, h):
        backward_head(grads, queries, rows, block, (b, h), columns, cols, tick)
    run_units(unit, [(b, h) for b in range(B) for h in range(Hkv)], workers, progress)
