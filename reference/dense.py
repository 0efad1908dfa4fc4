"""The oracle's oracle: dense attention straight from the formula.

    out = softmax(Q K^T * scale + C) V,   C = -inf where pos_k > pos_q (causal)
    lse = log sum_k exp(Q K^T * scale + C)

and its gradients (the standard softmax backward):

    P = exp(S - lse),  dV = P^T dO,  dP = dO V^T,
    dS = P * (dP - rowsum(dO * out)),  dQ = dS K * scale,  dK = dS^T Q * scale

It builds the whole (S, S) score matrix per head, so it is for checking, not
for long sequences. Grouped-query heads: query head h reads key/value head
``h // (Hq // Hkv)``.

Shapes: q (B, S, Hq, D), k, v (B, S, Hkv, D), out like q, lse (B, Hq, S).
"""

import numpy as np

from . import checks
from .step import accumulate_dtype


def _expand_kv(x, n_q_heads):
    """(B, S, Hkv, D) -> (B, S, Hq, D), each key/value head repeated for its group."""
    return np.repeat(x, n_q_heads // x.shape[2], axis=2)


def _scores(q, k, scale, causal):
    """S = Q K^T * scale with the causal mask applied: (B, Hq, S, S)."""
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        n = q.shape[1]
        s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
    return s


def attention(q, k, v, *, causal=True, scale=None):
    """Dense attention. Returns (out like q, lse (B, Hq, S))."""
    B, S, Hq, Hkv, D = checks.check_qkv(q, k, v)
    scale = checks.check_options(layout="contiguous", causal=causal, scale=scale,
                                 tile_size=None, head_dim=D)
    acc, dtype = accumulate_dtype(q.dtype), q.dtype
    q, k, v = q.astype(acc), _expand_kv(k, Hq).astype(acc), _expand_kv(v, Hq).astype(acc)
    s = _scores(q, k, scale, causal)                              # (B, Hq, S, S)
    m = s.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]   # (B, Hq, S)
    p = np.exp(s - lse[..., None])
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    return out.astype(dtype), lse


def attention_backward(q, k, v, out, lse, dout, *, causal=True, scale=None):
    """Dense gradients (dq, dk, dv) of sum(out * dout), with q's, k's, v's shapes and dtype."""
    B, S, Hq, Hkv, D = checks.check_qkv(q, k, v)
    checks.check_grads_inputs(q, out, lse, dout)
    scale = checks.check_options(layout="contiguous", causal=causal, scale=scale,
                                 tile_size=None, head_dim=D)
    acc = accumulate_dtype(q.dtype)
    dtype = q.dtype
    q, out, dout = q.astype(acc), out.astype(acc), dout.astype(acc)
    ke, ve = _expand_kv(k, Hq).astype(acc), _expand_kv(v, Hq).astype(acc)
    p = np.exp(_scores(q, ke, scale, causal) - lse.astype(acc)[..., None])    # (B, Hq, S, S)
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)                             # (B, S, Hq, D)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, ve)
    delta = np.einsum("bqhd,bqhd->bhq", dout, out)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    # a key/value head's gradient is the sum over the query heads that read it
    group = Hq // Hkv
    dk = dk.reshape(B, S, Hkv, group, D).sum(axis=3)
    dv = dv.reshape(B, S, Hkv, group, D).sum(axis=3)
    return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype)
