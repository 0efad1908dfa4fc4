"""The oracle's oracle: dense attention straight from the formula.

    out = softmax(Q K^T * scale + C) V,   C = -inf where pos_k > pos_q (causal)
    lse = log sum_k exp(Q K^T * scale + C)

and its gradients (the standard softmax backward):

    P = exp(S - lse),  dV = P^T dO,  dP = dO V^T,
    dS = P * (dP - rowsum(dO * out)),  dQ = dS K * scale,  dK = dS^T Q * scale

Every product over (query, key) pairs above is a masked sum: it runs over the
visible pairs only, so a masked pair contributes nothing, even when one of its
values is NaN or inf (`_masked_sum`). NaN in an input then reaches exactly the
rows whose sums read it.

It builds the whole (S, S) score matrix per head, so it is for checking, not
for long sequences. Grouped-query heads: query head h reads key/value head
``h // (Hq // Hkv)``.

Shapes: q (B, S, Hq, D), k, v (B, S, Hkv, D), out like q, lse (B, Hq, S);
inside, heads first: (B, Hq, S, D) and scores (B, Hq, S, S).
"""

import numpy as np

from . import checks
from .step import accumulate_dtype


def _heads_first(x, n_q_heads, dtype):
    """(B, S, H, D) -> (B, Hq, S, D) in `dtype`, a key/value head repeated for its group."""
    x = np.repeat(x, n_q_heads // x.shape[2], axis=2)
    return x.transpose(0, 2, 1, 3).astype(dtype)


def _visible(n, causal):
    """(S, S) bool: key j is visible to query i (pos_j <= pos_i when causal)."""
    return np.tril(np.ones((n, n), dtype=bool)) if causal else np.ones((n, n), dtype=bool)


def _scores(q, k, scale, visible):
    """S = Q K^T * scale + C: (B, Hq, S, S), -inf at the masked pairs."""
    return np.where(visible, q @ k.swapaxes(-1, -2) * scale, -np.inf)


def _masked_sum(w, x, visible):
    """sum over c of w[.., r, c] x[.., c, :] over the visible pairs (r, c) only:
    w (B, H, R, C), x (B, H, C, D), visible (R, C) -> (B, H, R, D).

    Not w @ x with w set to 0 at masked pairs: 0 x NaN = NaN (0 x inf too), so
    a masked weight does not stop a non-finite value, and a NaN at x[c] would
    reach rows that cannot see c. So the product takes x with its non-finite
    entries zeroed, and their terms are added at the visible pairs only.
    """
    finite = np.isfinite(x)
    out = np.where(visible, w, 0.0) @ np.where(finite, x, 0.0)
    with np.errstate(invalid="ignore"):                     # 0 x inf at a masked pair, dropped
        for b, h, c, d in zip(*np.nonzero(~finite)):      # the few non-finite entries
            out[b, h, :, d] += np.where(visible[:, c], w[b, h, :, c] * x[b, h, c, d], 0.0)
    return out


def attention(q, k, v, *, causal=True, scale=None):
    """Dense attention. Returns (out like q, lse (B, Hq, S))."""
    B, S, Hq, Hkv, D = checks.check_qkv(q, k, v)
    scale = checks.check_options(layout="contiguous", causal=causal, scale=scale,
                                 tile_size=None, head_dim=D)
    acc, dtype = accumulate_dtype(q.dtype), q.dtype
    q, k, v = (_heads_first(x, Hq, acc) for x in (q, k, v))      # (B, Hq, S, D)
    visible = _visible(S, causal)                                  # (S, S)
    s = _scores(q, k, scale, visible)                              # (B, Hq, S, S)
    m = s.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]   # (B, Hq, S)
    p = np.exp(s - lse[..., None])
    out = _masked_sum(p, v, visible)                               # P V   (B, Hq, S, D)
    return out.transpose(0, 2, 1, 3).astype(dtype), lse


def attention_backward(q, k, v, out, lse, dout, *, causal=True, scale=None):
    """Dense gradients (dq, dk, dv) of sum(out * dout), with q's, k's, v's shapes and dtype."""
    B, S, Hq, Hkv, D = checks.check_qkv(q, k, v)
    checks.check_grads_inputs(q, out, lse, dout)
    scale = checks.check_options(layout="contiguous", causal=causal, scale=scale,
                                 tile_size=None, head_dim=D)
    acc, dtype = accumulate_dtype(q.dtype), q.dtype
    q, k, v, out, dout = (_heads_first(x, Hq, acc) for x in (q, k, v, out, dout))   # (B, Hq, S, D)
    visible = _visible(S, causal)
    p = np.exp(_scores(q, k, scale, visible) - lse.astype(acc)[..., None])   # (B, Hq, S, S)
    dv = _masked_sum(p.swapaxes(-1, -2), dout, visible.T)          # P^T dO
    dp = dout @ v.swapaxes(-1, -2)                                  # dO V^T (read at visible pairs)
    delta = (dout * out).sum(axis=-1)                               # (B, Hq, S)
    ds = p * (dp - delta[..., None])
    dq = _masked_sum(ds, k, visible) * scale                        # dS K
    dk = _masked_sum(ds.swapaxes(-1, -2), q, visible.T) * scale     # dS^T Q
    # back to (B, S, H, D); a key/value head's gradient is the sum over the query heads that read it
    dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    group = Hq // Hkv
    dk = dk.reshape(B, S, Hkv, group, D).sum(axis=3)
    dv = dv.reshape(B, S, Hkv, group, D).sum(axis=3)
    return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype)
