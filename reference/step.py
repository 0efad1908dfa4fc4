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

Compute layout: grouped-query heads share their key/value head, so the G query
heads of one key/value head are stacked as extra rows of one matrix product.
    q, out, dq:    (B, Hkv, c, G, D)    G = Hq // Hkv
    k, v, dk, dv:  (B, Hkv, ck, D)
    m, l, lse:     (B, Hkv, c, G)
A tile of ``tq`` queries is then a view ``(B, Hkv, tq*G, D)`` (rows ordered
query-major), and its mask ``(tq, 1, tk)`` broadcasts over G.

Legend: ``B`` batch, ``H`` heads, ``c`` queries held, ``ck`` keys in the block,
``D`` head dim, ``R = tq*G`` rows of a tile.
"""

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
    row max `m` and row sum `l` (Algorithm 1's Out_j)."""
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


def _rows(x, qs):
    """Tile rows of a compute-layout array as a matrix: (B, Hkv, c, G, ...) -> (B, Hkv, tq*G, ...)."""
    t = x[:, :, qs]
    return t.reshape(t.shape[:2] + (t.shape[2] * t.shape[3],) + t.shape[4:])


def _apply_mask(s, mask, xp):
    """Set invisible entries of scores ``s`` (B, Hkv, tq*G, tk) to -inf, in place."""
    B, Hkv, R, tk = s.shape
    s5 = s.reshape(B, Hkv, mask.shape[0], R // mask.shape[0], tk)
    xp.copyto(s5, -np.inf, where=~xp.asarray(mask)[:, None, :])


def _count(counts, kind, mask, qs_len, ks_len):
    counts.tiles_computed += 1
    counts.pairs += int(mask.sum()) if kind == MASKED else qs_len * ks_len


def attend_block(acc, q, k, v, q_pos, k_pos, *, causal, tile_size):
    """Accumulate attention of queries `q` (pre-scaled) to one key/value block
    into `acc`, tile by tile, skipping tiles that no query can see.

    q (B, Hkv, c, G, D); k, v (B, Hkv, ck, D) in q's dtype; q_pos (c,), k_pos (ck,)
    NumPy int arrays. Returns StepCounts.
    """
    xp = array_module(q)
    plan, skipped = tile_plan(q_pos, k_pos, tile_size, causal)
    counts = StepCounts(tiles_skipped=skipped)
    for qs, ks, kind in plan:
        mask = visible(q_pos[qs], k_pos[ks]) if kind == MASKED else None
        _count(counts, kind, mask, len(q_pos[qs]), len(k_pos[ks]))
        _forward_tile(_rows(acc.o, qs), _rows(acc.m, qs), _rows(acc.l, qs),
                      _rows(q, qs), k[:, :, ks], v[:, :, ks], mask, xp)
    return counts


def _forward_tile(o, m, l, q, k, v, mask, xp):
    """One tile of the online softmax, updating the views o (B,Hkv,R,D), m, l (B,Hkv,R)."""
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
    o += p @ v                                           # O += P V   (B, Hkv, R, D)
    m[...] = m_new


def finish_forward(acc):
    """out = O / l and lse = m + log(l); a row with no visible key at all gets
    out = 0 and lse = -inf. Returns (out (B,Hkv,c,G,D), lse (B,Hkv,c,G))."""
    xp = array_module(acc.o)
    seen = acc.l > 0
    l_safe = xp.where(seen, acc.l, 1.0)
    out = acc.o / l_safe[..., None]
    lse = xp.where(seen, acc.m + xp.log(l_safe), -np.inf)
    return out, lse


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
    counts = StepCounts(tiles_skipped=skipped)
    for qs, ks, kind in plan:
        mask = visible(q_pos[qs], k_pos[ks]) if kind == MASKED else None
        _count(counts, kind, mask, len(q_pos[qs]), len(k_pos[ks]))
        _backward_tile(_rows(dq, qs), dk[:, :, ks], dv[:, :, ks], _rows(q, qs), _rows(do, qs),
                       _rows(lse, qs), _rows(delta, qs), k[:, :, ks], v[:, :, ks], mask, xp)
    return counts


def _backward_tile(dq, dk, dv, q, do, lse, delta, k, v, mask, xp):
    """One tile of the backward; dq (B,Hkv,R,D), dk, dv (B,Hkv,tk,D) are views updated in place."""
    s = q @ k.swapaxes(-1, -2)                           # S = Q K^T   (B, Hkv, R, tk)
    if mask is not None:
        _apply_mask(s, mask, xp)
    s -= lse[..., None]
    p = xp.exp(s, out=s)                                 # P = exp(S - lse)
    dv += p.swapaxes(-1, -2) @ do                        # dV += P^T dO   (B, Hkv, tk, D)
    dp = do @ v.swapaxes(-1, -2)                         # dP = dO V^T    (B, Hkv, R, tk)
    dp -= delta[..., None]
    ds = xp.multiply(p, dp, out=dp)                      # dS = P * (dP - delta)
    dq += ds @ k                                         # dQ += dS K     (B, Hkv, R, D)
    dk += ds.swapaxes(-1, -2) @ q                        # dK += dS^T Q   (B, Hkv, tk, D)
