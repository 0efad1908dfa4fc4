"""The per-device step: one query shard against one key/value block, tiled.

This is ``AccumulateAttentionFragment`` of the paper's Algorithm 1, forward and
backward, written once for every backend: it takes the array module of its
inputs (NumPy here, CuPy on GPUs), so the virtual ring, MPI and GPU runs differ
only in how blocks move.

Forward, per tile (Rabe and Staats 2021; FlashAttention):
    S = Q_j K_k^T * scale            masked entries set to -inf
    m_new = max(m, rowmax(S))
    P = exp(S - m_new)
    l = l * exp(m - m_new) + rowsum(P)
    O = O * exp(m - m_new) + P V_k
and at the end ``out = O / l``, ``lse = m + log(l)``.

Backward, per tile, with ``delta = rowsum(dO * out)`` computed once:
    P  = exp(S - lse)
    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - delta)
    dQ += dS K * scale,   dK += dS^T Q * scale

Two implementations of the same tiles sit side by side:

- the plain step (`_forward_tile`, `_backward_tile`), the formulas above on
  whole tiles of every head at once, for any array module (CuPy runs this one);
- the NumPy step (`_forward_rows`, `_backward_cols`), the same arithmetic
  arranged for a CPU, where a tile's element-wise passes cost as much as its
  two matrix products. At S=8192, H=8, D=64, causal, float32 on 2 cores it
  reaches about 65% of the float32 matmul rate forward and 70% backward, the
  plain step about 30% (``python -m bench.kernel``). What it does:
    * base 2: ``exp2`` is twice as fast as ``exp``, so ``log2(e)`` is folded
      into Q and ``m``, ``lse`` are carried in base 2 inside a tile loop;
    * one product instead of a pass: ``[Q, -m] @ [K, 1]^T = S - m`` and
      ``P @ [V, 1] = [P V, rowsum(P)]``; in the backward
      ``[dO, -delta] @ [V, 1]^T = dP - delta``;
    * a lazy max: the running ``m`` is raised only when a tile would overflow.
      Any shift gives the same ``O / l`` and ``m + log(l)``; the shift only has
      to keep ``exp`` finite. So a tile is first computed with the current
      ``m`` and no row max, no subtraction and no rescaling; if some row's sum
      exceeds ``_SUM_LIMIT`` (or is NaN) the tile is redone exactly as above.
      Rows that have seen no key yet (``m = -inf``) always take the exact path;
    * taller products: the forward stacks neighbouring query tiles (up to
      ``_UNIT_ROWS`` rows) and computes a key tile they share in one product;
      the blocks cover exactly the plan's tiles, so the work counted is the
      work done;
    * threads: the work is cut into independent units (a group of query tiles
      of one head in the forward, a whole head in the backward, whose key
      tiles all add to the head's dQ) run on as many threads as BLAS would
      use, with BLAS held to one thread meanwhile. NumPy's element-wise passes
      run on one core, BLAS on all; per unit both run on the unit's core, and
      the cores stay busy. A unit owns the rows it writes, so results do not
      depend on the number of threads, bit for bit.

Non-finite inputs (DESIGN.md: NaN reaches the rows it reaches, not elsewhere):
a masked (query, key) pair contributes nothing, even when one of its values is
NaN or inf. Both steps set masked scores to -inf after every shift, so P is
exactly 0 there even where lse is NaN; but 0 x NaN = NaN, so a product of a
matrix that is 0 at masked pairs with one that holds a NaN row (P V, P^T dO,
dS K, dS^T Q) goes through `_product`, and dS = P (dP - delta), NaN where dP
or delta is, is zeroed at masked pairs first. Finite inputs are checked once
per block (`_all_finite`; in the NumPy forward it costs nothing: the lazy
shift's test on |V| already fails for NaN and inf) and skip all of this.

Compute layout: grouped-query heads share their key/value head, so the G query
heads of one key/value head are stacked as extra rows of one matrix product.
    q, out, dq:    (B, Hkv, c, G, D)    G = Hq // Hkv
    k, v, dk, dv:  (B, Hkv, ck, D)
    m, l, lse:     (B, Hkv, c, G)
A tile of ``tq`` queries is then a view ``(B, Hkv, tq*G, D)`` (rows ordered
query-major), and its mask ``(tq, 1, tk)`` broadcasts over G.

Legend: ``B`` batch, ``H`` heads, ``c`` queries held, ``ck`` keys in the block,
``D`` head dim, ``R = tq*G`` rows of a tile, ``W`` worker threads.
"""

import ctypes
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .layouts import array_module
from .tiles import FULL, MASKED, tile_plan, visible


def accumulate_dtype(dtype):
    """float16 and float32 accumulate in float32, float64 in float64."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


# -- layout conversions: user layout (B, S, H, D) <-> compute layout ---------

def q_to_heads(x, n_kv_heads, dtype=None):
    """(B, c, Hq, D) -> (B, Hkv, c, G, D), contiguous."""
    xp = array_module(x)
    B, c, H, D = x.shape
    x = x.reshape(B, c, n_kv_heads, H // n_kv_heads, D).transpose(0, 2, 1, 3, 4)
    return xp.ascontiguousarray(x, dtype=dtype)


def kv_to_heads(x, dtype=None):
    """(B, ck, Hkv, D) -> (B, Hkv, ck, D), contiguous."""
    return array_module(x).ascontiguousarray(x.transpose(0, 2, 1, 3), dtype=dtype)


def q_from_heads(x):
    """(B, Hkv, c, G, D) -> (B, c, Hq, D)."""
    B, Hkv, c, G, D = x.shape
    return array_module(x).ascontiguousarray(x.transpose(0, 2, 1, 3, 4).reshape(B, c, Hkv * G, D))


def kv_from_heads(x):
    """(B, Hkv, ck, D) -> (B, ck, Hkv, D)."""
    return array_module(x).ascontiguousarray(x.transpose(0, 2, 1, 3))


def rows_to_heads(r, n_kv_heads):
    """(B, Hq, c) -> (B, Hkv, c, G)."""
    B, H, c = r.shape
    xp = array_module(r)
    return xp.ascontiguousarray(r.reshape(B, n_kv_heads, H // n_kv_heads, c).transpose(0, 1, 3, 2))


def rows_from_heads(r):
    """(B, Hkv, c, G) -> (B, Hq, c)."""
    B, Hkv, c, G = r.shape
    return array_module(r).ascontiguousarray(r.transpose(0, 1, 3, 2).reshape(B, Hkv * G, c))


# -- forward --------------------------------------------------------------

@dataclass
class ForwardAcc:
    """Running softmax state of one device's queries: unnormalised output `o`,
    shift `m` and row sum `l` (Algorithm 1's Out_j). ``o / l`` is the output
    and ``m + log(l)`` the log-sum-exp so far; `m` is the running row max, or
    below it by a bounded amount (the NumPy step's lazy max)."""
    o: object   # (B, Hkv, c, G, D)
    m: object   # (B, Hkv, c, G)
    l: object   # (B, Hkv, c, G)

    @classmethod
    def zeros(cls, q):
        xp = array_module(q)
        rows = q.shape[:-1]
        return cls(o=xp.zeros_like(q), m=xp.full(rows, -np.inf, dtype=q.dtype),
                   l=xp.zeros(rows, dtype=q.dtype))


@dataclass
class StepCounts:
    """What one step did, for the trace."""
    tiles_computed: int = 0
    tiles_skipped: int = 0
    pairs: int = 0


def _step_counts(plan, skipped, q_pos, k_pos):
    counts = StepCounts(tiles_computed=len(plan), tiles_skipped=skipped)
    for qs, ks, kind in plan:
        counts.pairs += (int(visible(q_pos[qs], k_pos[ks]).sum()) if kind == MASKED
                         else len(q_pos[qs]) * len(k_pos[ks]))
    return counts


def attend_block(acc, q, k, v, q_pos, k_pos, *, causal, tile_size):
    """Accumulate attention of queries `q` (pre-scaled) to one key/value block
    into `acc`, tile by tile, skipping tiles that no query can see.

    q (B, Hkv, c, G, D); k, v (B, Hkv, ck, D) in q's dtype; q_pos (c,), k_pos (ck,)
    NumPy int arrays. Returns StepCounts.
    """
    xp = array_module(q)
    plan, skipped = tile_plan(q_pos, k_pos, tile_size, causal)
    if xp is np:
        _forward_numpy(acc, q, k, v, q_pos, k_pos, plan)
    else:
        _forward_plain(acc, q, k, v, q_pos, k_pos, plan, xp)
    return _step_counts(plan, skipped, q_pos, k_pos)


def finish_forward(acc):
    """out = O / l and lse = m + log(l); a row with no visible key at all gets
    out = 0 and lse = -inf, a row that met a NaN keeps it in both.
    Returns (out (B,Hkv,c,G,D), lse (B,Hkv,c,G))."""
    xp = array_module(acc.o)
    seen = ~(acc.l == 0)          # not `l > 0`: that is False for NaN, which would read "no key"
    l_safe = xp.where(seen, acc.l, 1.0)
    out = acc.o / l_safe[..., None]
    lse = xp.where(seen, acc.m + xp.log(l_safe), -np.inf)
    return out, lse


# -- the plain step: any array module -------------------------------------

def _rows(x, qs):
    """Tile rows of a compute-layout array as a matrix: (B, Hkv, c, G, ...) -> (B, Hkv, tq*G, ...)."""
    t = x[:, :, qs]
    return t.reshape(t.shape[:2] + (t.shape[2] * t.shape[3],) + t.shape[4:])


def _apply_mask(s, mask, xp):
    """Set invisible entries of scores ``s`` (..., tq*G, tk) to -inf, in place."""
    R, tk = s.shape[-2:]
    s5 = s.reshape(s.shape[:-2] + (mask.shape[0], R // mask.shape[0], tk))
    xp.copyto(s5, -np.inf, where=~xp.asarray(mask)[:, None, :])


def _mask_rows(mask, R, xp):
    """A tile's mask (tq, tk) as rows (R, tk), R = tq*G query-major, on xp's device; None stays None."""
    if mask is None:
        return None
    return xp.asarray(np.repeat(mask, R // mask.shape[0], axis=0))


def _all_finite(xp, *arrays):
    """True when no array holds a NaN or inf: one pass per array (a block, not a tile)."""
    return all(bool(xp.isfinite(x).all()) for x in arrays)


def _product(w, x, vis, xp):
    """w @ x over the visible pairs only: w (..., M, T) is 0 at the masked pairs,
    x (..., T, E), vis (M, T) bool (None: a plain product, for a tile with no
    masked pair or a block with finite inputs).

    Hazard: 0 x NaN = NaN (and 0 x inf): a masked weight does not stop a
    non-finite value, so in w @ x a NaN in row t of x reaches every row of w,
    also those that cannot see t. The rows of x that are not finite are left
    out of the product and their terms added back only where visible. Only
    blocks whose inputs hold a NaN or inf get a `vis` (callers check once per
    block with `_all_finite`).
    """
    if vis is None:
        return w @ x
    zero = x.dtype.type(0)
    bad = ~xp.isfinite(x).all(axis=-1)                   # (..., T) rows of x with a NaN or inf
    out = w @ xp.where(bad[..., None], zero, x)          # every finite term   (..., M, E)
    cols = bad.reshape(-1, bad.shape[-1]).any(axis=0)    # (T,) t with a bad row in some head
    cols = cols.get() if hasattr(cols, "get") else cols  # (CuPy: to the host)
    with np.errstate(invalid="ignore"):                  # 0 x inf at a masked pair: dropped below
        for t in np.flatnonzero(cols):
            xt = xp.where(bad[..., t, None], x[..., t, :], zero)     # (..., E) the bad rows t only
            out += xp.where(vis[:, t, None], w[..., :, t, None] * xt[..., None, :], zero)
    return out


def _forward_plain(acc, q, k, v, q_pos, k_pos, plan, xp):
    guard = not _all_finite(xp, v)                       # a NaN or inf in V: guard the masked pairs
    for qs, ks, kind in plan:
        mask = visible(q_pos[qs], k_pos[ks]) if kind == MASKED else None
        _forward_tile(_rows(acc.o, qs), _rows(acc.m, qs), _rows(acc.l, qs),
                      _rows(q, qs), k[:, :, ks], v[:, :, ks], mask, xp, guard)


def _forward_tile(o, m, l, q, k, v, mask, xp, guard=False):
    """One tile of the online softmax, updating the views o (B,Hkv,R,D), m, l (B,Hkv,R).
    `guard`: V may hold NaN or inf, which a masked pair must not let through."""
    s = q @ k.swapaxes(-1, -2)                           # S = Q K^T   (B, Hkv, R, tk)
    if mask is not None:
        _apply_mask(s, mask, xp)
    m_new = xp.maximum(m, s.max(axis=-1))                # (B, Hkv, R)
    # Hazard: a row that has seen no visible key yet has m_new = -inf, and
    # exp(-inf - -inf) is NaN. Subtracting 0 instead leaves exp(-inf) = 0.
    m_safe = xp.where(xp.isneginf(m_new), 0.0, m_new).astype(s.dtype, copy=False)
    s -= m_safe[..., None]
    p = xp.exp(s, out=s)                                 # P = exp(S - m_new)
    alpha = xp.exp(m - m_safe)                           # rescales the old o and l
    l *= alpha
    l += p.sum(axis=-1)
    o *= alpha[..., None]
    vis = _mask_rows(mask, q.shape[-2], xp) if guard else None   # (R, tk) or None
    o += _product(p, v, vis, xp)                         # O += P V   (B, Hkv, R, D)
    m[...] = m_new


# -- the NumPy step: base 2, folded columns, lazy max, threads ------------

LOG2E = float(np.log2(np.e))
_SUM_LIMIT = 2.0 ** 32   # a lazy tile's row sum may reach this before the tile is redone
_V_LIMIT = 2.0 ** 64     # above this |V|, O could overflow under a lazy shift: stay exact


def _augment(x, column, out=None):
    """[x, column] along the last axis: (..., D) -> (..., D+1)."""
    if out is None:
        out = np.empty(x.shape[:-1] + (x.shape[-1] + 1,), dtype=x.dtype)
    out[..., :-1] = x
    out[..., -1] = column
    return out


def _by_tile(plan, which):
    """Group the plan by its query tiles (which=0) or key tiles (which=1):
    a list of (slice, [(other slice, kind), ...]) in plan order."""
    groups = {}
    for entry in plan:
        own = entry[which]
        groups.setdefault((own.start, own.stop), (own, []))[1].append((entry[1 - which], entry[2]))
    return list(groups.values())


_UNIT_ROWS = 512   # the forward stacks query tiles up to this many rows: taller products run faster


def _forward_units(plan, c, G):
    """Consecutive query tiles stacked into groups of up to _UNIT_ROWS rows.
    Returns [(query slice of the group, blocks)], blocks being the group's tiles
    as (query slice within the group, key slice, kind): a key tile shared by
    neighbouring query tiles of the group is one block, one product. Blocks
    cover exactly the plan's tiles."""
    groups = []
    for qs, tiles in _by_tile(plan, 0):
        stop = min(qs.stop, c)
        last = groups[-1] if groups else None
        if last and last[-1][0].stop == qs.start and (stop - last[0][0].start) * G <= _UNIT_ROWS:
            last.append((slice(qs.start, stop), tiles))
        else:
            groups.append([(slice(qs.start, stop), tiles)])
    return [(slice(g[0][0].start, g[-1][0].stop), _blocks(g)) for g in groups]


def _blocks(group):
    """The blocks of one group of query tiles (see `_forward_units`)."""
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


def _forward_numpy(acc, q, k, v, q_pos, k_pos, plan):
    """The plan's tiles, one unit of work per (batch, key/value head, group of query tiles)."""
    B, Hkv, c, G, D = q.shape
    heads = [(b, h) for b in range(B) for h in range(Hkv)]
    units = sorted(((b, h, qs, blocks) for qs, blocks in _forward_units(plan, c, G) for b, h in heads),
                   key=lambda u: -len(u[3]))             # most blocks first: workers finish together
    workers = _BLAS.threads(len(units))
    k1 = np.empty(k.shape[:-1] + (D + 1,), dtype=k.dtype)   # [K, 1]   (B, Hkv, ck, D+1)
    v1 = np.empty_like(k1)                               # [V, 1]: P [V, 1] = [P V, rowsum(P)]
    lazy = np.zeros((B, Hkv), dtype=bool)
    guard = np.zeros((B, Hkv), dtype=bool)              # V holds a NaN or inf: guard the masked pairs

    def prepare(worker, b, h):
        _augment(k[b, h], 1.0, out=k1[b, h])
        _augment(v[b, h], 1.0, out=v1[b, h])
        lazy[b, h] = max(v[b, h].max(initial=0.0), -v[b, h].min(initial=0.0)) <= _V_LIMIT   # False for NaN
        guard[b, h] = not lazy[b, h] and not _all_finite(np, v[b, h])

    def unit(worker, b, h, qs, blocks):
        with np.errstate(over="ignore", invalid="ignore"):   # a lazy tile may overflow; it is redone
            _forward_rows(acc.o[b, h, qs], acc.m[b, h, qs], acc.l[b, h, qs], q[b, h, qs],
                          k1[b, h], v1[b, h], q_pos[qs], k_pos, blocks, lazy[b, h], guard[b, h])
    _run_units(prepare, heads, workers)
    _run_units(unit, units, workers)


def _forward_rows(o, m, l, q, k1, v1, q_pos, k_pos, blocks, lazy, guard):
    """The online softmax of one group of query tiles of one head over its blocks.
    o (tq, G, D), m, l (tq, G): views of the accumulator, updated at the end;
    q (tq, G, D) pre-scaled; k1, v1 (ck, D+1) = [K, 1], [V, 1]. `lazy`: V is
    small enough for a lazy shift; `guard`: V holds NaN or inf (never lazy)."""
    tq, G, D = q.shape
    R = tq * G
    m2_in = m.reshape(R) * LOG2E                         # (R,) the shift, base 2
    m2 = m2_in.copy()
    q2 = _augment(q.reshape(R, D) * LOG2E, 0.0)          # [Q log2(e), -m2]   (R, D+1)
    _set_shift(q2, m2)
    ol = _augment(o.reshape(R, D), l.reshape(R))         # [O, l]             (R, D+1)
    inc = np.empty_like(ol)
    buf = np.empty(R * max(len(k1[ks]) for _, ks, _ in blocks), dtype=q.dtype)
    all_seen = np.isfinite(m2).all()                     # every row has a shift: any block may be lazy
    for qr, ks, kind in blocks:
        rows = slice(qr.start * G, qr.stop * G)          # the block's rows of the group
        kt, vt = k1[ks], v1[ks]                          # (tk, D+1)
        s = buf[:(rows.stop - rows.start) * len(kt)].reshape(-1, len(kt))
        mask = visible(q_pos[qr], k_pos[ks]) if kind == MASKED else None
        if lazy and (all_seen or np.isfinite(m2[rows]).all()):
            _shifted_scores(s, q2[rows], kt, None)       # S - m, base 2   (rows, tk)
            _exp2_visible(s, mask)                       # P, 0 where masked; may overflow to inf
            np.matmul(s, vt, out=inc[rows])              # [P V, rowsum(P)]   (rows, D+1)
            if inc[rows, D].max() <= _SUM_LIMIT:         # False for inf and NaN too
                ol[rows] += inc[rows]
                continue
        _shifted_scores(s, q2[rows], kt, mask)           # the exact tile: masked scores -inf
        vis = _mask_rows(mask, len(s), np) if guard else None
        m2[rows] = _exact_tile(ol[rows], m2[rows], q2[rows], s, vt, inc[rows], vis)
        all_seen = np.isfinite(m2).all()
    o[...] = ol[:, :D].reshape(tq, G, D)
    l[...] = ol[:, D].reshape(tq, G)
    # converting m to base e and back rounds it: write only the rows that moved
    m[...] = np.where(m2 == m2_in, m.reshape(R), m2 / LOG2E).reshape(tq, G)


def _set_shift(q2, m2):
    """Last column of [Q log2(e), -m2] := -m2, or 0 where no key has been seen (m2 = -inf)."""
    q2[:, -1] = np.where(np.isfinite(m2), -m2, 0.0)


def _shifted_scores(s, q2, kt, mask):
    """s (R, tk) := [Q log2(e), -m2] @ [K, 1]^T = (S - m) in base 2, masked entries -inf."""
    np.matmul(q2, kt.T, out=s)
    if mask is not None:
        tq, tk = mask.shape
        np.copyto(s.reshape(tq, -1, tk), -np.inf, where=~mask[:, None, :])


def _exp2_visible(s, mask):
    """s := exp2(s), then 0 at the masked pairs of `mask` (tq, tk) (None: none).

    Masking after exp2 rather than before (-inf scores) is for speed: NumPy's
    exp2 takes a slow path for -inf and very negative arguments, 4 to 5 times
    slower per element than for ordinary scores, which made every diagonal tile
    cost as much as several full ones. A masked entry may overflow to inf or be
    NaN before it is cleared; it contributes nothing either way.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        np.exp2(s, out=s)
    if mask is not None:
        tq, tk = mask.shape
        np.copyto(s.reshape(tq, -1, tk), 0, where=~mask[:, None, :])


def _exact_tile(ol, m2, q2, s, vt, inc, vis=None):
    """One exact online-softmax tile (module docstring), in base 2, on scores
    s = S - shift. Updates ol = [O, l] and q2's shift column; returns the new m2.
    `vis` (R, tk): the mask, when vt may hold NaN or inf (`_product`)."""
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
        inc[...] = _product(s, vt, vis, np)
    ol += inc
    _set_shift(q2, m_new)
    return m_new


# -- backward -------------------------------------------------------------

def attend_block_backward(dq, dk, dv, q, do, lse, delta, k, v, q_pos, k_pos, *, causal, tile_size):
    """Accumulate the gradients of one query shard against one key/value block.

    dq (B,Hkv,c,G,D) and dk, dv (B,Hkv,ck,D) are accumulated in place, unscaled
    for dq (multiply by `scale` at the end) and complete for dk, dv because `q`
    is pre-scaled. do (B,Hkv,c,G,D); lse, delta (B,Hkv,c,G). Returns StepCounts.
    """
    xp = array_module(q)
    # Hazard: lse = -inf only for a row with no visible key anywhere; all its
    # scores are -inf too, and exp(-inf - 0) = 0 keeps it out of every sum.
    lse = xp.where(xp.isneginf(lse), 0.0, lse).astype(q.dtype, copy=False)
    plan, skipped = tile_plan(q_pos, k_pos, tile_size, causal)
    if xp is np:
        _backward_numpy(dq, dk, dv, q, do, lse, delta, k, v, q_pos, k_pos, plan)
    else:
        _backward_plain(dq, dk, dv, q, do, lse, delta, k, v, q_pos, k_pos, plan, xp)
    return _step_counts(plan, skipped, q_pos, k_pos)


def _backward_plain(dq, dk, dv, q, do, lse, delta, k, v, q_pos, k_pos, plan, xp):
    guard = not _all_finite(xp, q, do, delta, k, v)     # a NaN or inf: guard the masked pairs
    for qs, ks, kind in plan:
        mask = visible(q_pos[qs], k_pos[ks]) if kind == MASKED else None
        _backward_tile(_rows(dq, qs), dk[:, :, ks], dv[:, :, ks], _rows(q, qs), _rows(do, qs),
                       _rows(lse, qs), _rows(delta, qs), k[:, :, ks], v[:, :, ks], mask, xp, guard)


def _backward_tile(dq, dk, dv, q, do, lse, delta, k, v, mask, xp, guard=False):
    """One tile of the backward; dq (B,Hkv,R,D), dk, dv (B,Hkv,tk,D) are views updated in place.
    `guard`: the inputs may hold NaN or inf, which a masked pair must not let through."""
    s = q @ k.swapaxes(-1, -2)                           # S = Q K^T   (B, Hkv, R, tk)
    s -= lse[..., None]
    if mask is not None:                                 # after lse: -inf - NaN would be NaN, not -inf
        _apply_mask(s, mask, xp)
    p = xp.exp(s, out=s)                                 # P = exp(S - lse), exactly 0 where masked
    vis = _mask_rows(mask, q.shape[-2], xp) if guard else None    # (R, tk) or None
    vis_t = None if vis is None else vis.T
    dv += _product(p.swapaxes(-1, -2), do, vis_t, xp)   # dV += P^T dO   (B, Hkv, tk, D)
    dp = do @ v.swapaxes(-1, -2)                         # dP = dO V^T    (B, Hkv, R, tk)
    dp -= delta[..., None]
    ds = xp.multiply(p, dp, out=dp)                      # dS = P * (dP - delta)
    if vis is not None:                                  # 0 x NaN: P = 0 does not clear a NaN dP - delta
        xp.copyto(ds, 0, where=~vis)
    dq += _product(ds, k, vis, xp)                       # dQ += dS K     (B, Hkv, R, D)
    dk += _product(ds.swapaxes(-1, -2), q, vis_t, xp)   # dK += dS^T Q   (B, Hkv, tk, D)


def _backward_numpy(dq, dk, dv, q, do, lse, delta, k, v, q_pos, k_pos, plan):
    """The plan's tiles, one unit of work per (batch, key/value head): all key
    tiles of a head add to the same rows of dQ, so a head stays on one thread,
    which keeps the sums in one order whatever the number of threads (results
    are bitwise the same on 1 or 2 threads, as MPI ranks and the virtual ring
    compare them)."""
    B, Hkv, c, G, D = q.shape
    heads = [(b, h) for b in range(B) for h in range(Hkv)]
    columns = _by_tile(plan, 1)                          # [(key slice, [(query slice, kind)])]

    def unit(worker, b, h):
        q2 = _augment(q[b, h] * LOG2E, -lse[b, h] * LOG2E)   # [Q log2(e), -lse]   (c, G, D+1)
        do1 = _augment(do[b, h], -delta[b, h])               # [dO, -delta]        (c, G, D+1)
        k1, v1 = _augment(k[b, h], 1.0), _augment(v[b, h], 1.0)   # [K, 1], [V, 1]   (ck, D+1)
        guard = not _all_finite(np, q[b, h], do1, k[b, h], v[b, h])   # NaN or inf: guard masked pairs
        for ks, tiles in columns:
            _backward_cols(dq[b, h], dk[b, h, ks], dv[b, h, ks], q[b, h], q2, do[b, h], do1,
                           k[b, h, ks], k1[ks], v1[ks], q_pos, k_pos[ks], tiles, guard)
    _run_units(unit, heads, _BLAS.threads(len(heads)))


def _backward_cols(dq, dk, dv, q, q2, do, do1, k, k1, v1, q_pos, k_pos, tiles, guard):
    """The backward of one key tile of one head over its query tiles.
    dq (c, G, D), dk, dv (tk, D): views, added to; q, do (c, G, D);
    q2, do1 (c, G, D+1) = [Q log2(e), -lse], [dO, -delta]; k (tk, D); k1, v1 (tk, D+1).
    `guard`: the inputs may hold NaN or inf, which a masked pair must not let through.
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
        mask = visible(q_pos[qs], k_pos) if kind == MASKED else None
        _shifted_scores(p, q2[qs].reshape(R, D + 1), k1, None)   # S - lse, base 2
        _exp2_visible(p, mask)                                   # P = exp(S - lse), 0 where masked
        vis = _mask_rows(mask, R, np) if guard else None         # (R, tk) or None
        vis_t = None if vis is None else vis.T
        dv_t += _product(p.T, do[qs].reshape(R, D), vis_t, np)  # dV += P^T dO
        np.matmul(do1[qs].reshape(R, D + 1), v1.T, out=ds)       # dP - delta   (R, tk)
        np.multiply(p, ds, out=ds)                               # dS = P * (dP - delta)
        if vis is not None:                                      # 0 x NaN: P = 0 does not clear a NaN dP - delta
            np.copyto(ds, 0, where=~vis)
        dq[qs] += _product(ds, k, vis, np).reshape(tq, G, D)     # dQ += dS K
        dk_t += _product(ds.T, q[qs].reshape(R, D), vis_t, np)  # dK += dS^T Q
    dk += dk_t
    dv += dv_t


# -- worker threads and the BLAS thread count -----------------------------

def _run_units(fn, units, workers):
    """fn(worker, *unit) for every unit, taken in order by `workers` threads
    (this one included). The first exception is raised here, after all stop."""
    if workers <= 1 or len(units) <= 1:
        for u in units:
            fn(0, *u)
        return
    pending, lock, errors = iter(units), threading.Lock(), []

    def work(worker):
        while not errors:
            with lock:
                u = next(pending, None)
            if u is None:
                return
            try:
                fn(worker, *u)
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

    The NumPy step runs as many threads of its own as BLAS would use, and holds
    BLAS to one thread meanwhile: two levels of threads on the same cores
    oversubscribe them (measured: several times slower). The count is global
    to the process, so steps running at once (the virtual ring's devices)
    share one hold: the first sets it, the last restores it. Without OpenBLAS
    (another BLAS, not Linux) the step runs on the calling thread alone.
    """

    def __init__(self):
        self._lib = None        # (get, set) once looked up; () when there is none
        self._lock = threading.Lock()
        self._holders = 0
        self._saved = 1

    def threads(self, n_units):
        """Workers for `n_units` units: BLAS's thread count outside any hold."""
        with self._lock:
            if not self._find():
                return 1
            count = self._saved if self._holders else self._lib[0]()
        return max(1, min(count, n_units))

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
