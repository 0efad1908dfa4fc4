"""The oracle's oracle: dense attention straight from the formula.

    out = (softmax(Q K^T * scale + C) * Z) V,   C = -inf where key k is not visible to query q
    lse = log sum_k exp(Q K^T * scale + C)

with visibility from positions (causal: pos_k <= pos_q; windows, documents:
`reference.masks`), Z the dropout weights (1 without dropout; 0 or 1 / (1 - p),
`masks.keep_weights`), and its gradients (the standard softmax backward):

    P = exp(S - lse),  dV = (P Z)^T dO,  dP = (dO V^T) Z,
    dS = P * (dP - rowsum(dO * out)),  dQ = dS K * scale,  dK = dS^T Q * scale

Given positions, it is the attention of any shard to any block: the
per-device oracle of a ring. `merge` combines two such partial results over
disjoint key sets, as the online softmax does block by block.

Rows (docs/design.md): a row with no visible key gets out = 0 and lse = -inf; a
row whose visible scores are all -inf follows the formula (0 / 0: NaN). Every
product over (query, key) pairs is a masked sum over the visible pairs only,
so a masked pair contributes nothing, even when one of its values is NaN or
inf (`_masked_sum`). NaN in an input then reaches exactly the rows whose sums
read it.

It builds the whole (Sq, Sk) score matrix per head, so it is for checking, not
for long sequences. Grouped-query heads: query head h reads key/value head
``h // (Hq // Hkv)``.

Shapes: q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D), out like q, lse (B, Hq, Sq);
inside, heads first: (B, Hq, S, D) and scores (B, Hq, Sq, Sk).
"""

import numpy as np

from . import checks
from .heads import accumulate_dtype
from .masks import keep_weights, make_mask
from .masks import visible as _visible


def _heads_first(x, n_q_heads, dtype):
    """(B, S, H, D) -> (B, Hq, S, D) in `dtype`, a key/value head repeated for its group."""
    x = np.repeat(x, n_q_heads // x.shape[2], axis=2)
    return x.transpose(0, 2, 1, 3).astype(dtype)


def _dropout(mask, B, Hq, q_pos, k_pos, dtype):
    """Z (B, Hq, Sq, Sk), or 1 without dropout."""
    z = keep_weights(mask, np.arange(B), np.arange(Hq), q_pos, k_pos, dtype=dtype)
    return 1.0 if z is None else z


def _positions(name, pos, n, mask):
    """Positions as an int array of length n (default 0..n-1)."""
    if pos is None:
        pos = np.arange(n)
    pos = np.asarray(pos)
    if pos.shape != (n,) or pos.dtype.kind not in "iu":
        raise ValueError(f"{name} must be {n} integer positions, got {pos.dtype} array of shape {pos.shape}")
    if mask.segments is not None and len(pos) and not 0 <= pos.min() <= pos.max() < len(mask.segments):
        raise ValueError(f"{name} must lie in 0..{len(mask.segments) - 1}, the positions the documents of "
                         f"cu_seqlens or segment_ids cover, got {int(pos.min())}..{int(pos.max())}")
    return pos


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


def attention(q, k, v, *, q_pos=None, k_pos=None, causal=True, scale=None, window=None, cu_seqlens=None,
              segment_ids=None, dropout=0.0, seed=0):
    """Dense attention of q to k, v; positions default to 0..S-1.
    Mask options (`reference.masks.make_mask`): a sliding `window`, documents
    (`cu_seqlens` or `segment_ids`, over positions), `dropout` with its `seed`.
    Returns (out like q, lse (B, Hq, Sq))."""
    B, Sq, Hq, Hkv, D = checks.check_qkv(q, k, v, same_length=False)
    scale = checks.check_options(causal=causal, scale=scale, head_dim=D)
    mask = make_mask(causal=causal, window=window, cu_seqlens=cu_seqlens, segment_ids=segment_ids,
                     dropout=dropout, seed=seed)
    q_pos, k_pos = _positions("q_pos", q_pos, Sq, mask), _positions("k_pos", k_pos, k.shape[1], mask)
    visible = _visible(q_pos, k_pos, mask)
    acc_dtype, dtype = accumulate_dtype(q.dtype), q.dtype
    q, k, v = (_heads_first(x, Hq, acc_dtype) for x in (q, k, v))   # (B, Hq, S, D)
    s = _scores(q, k, scale, visible)                              # (B, Hq, Sq, Sk)
    # Hazard: a row with no visible key has max -inf, and -inf - -inf is NaN: shift it by 0.
    seen = visible.any(axis=-1)[:, None]                           # (Sq, 1)
    m = np.where(seen, s.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]   # (B, Hq, Sq)
        p = np.exp(s - lse[..., None])
    p = p * _dropout(mask, B, Hq, q_pos, k_pos, acc_dtype)         # P Z
    out = _masked_sum(p, v, visible)                               # P V   (B, Hq, Sq, D)
    return out.transpose(0, 2, 1, 3).astype(dtype), lse


def merge(a, b):
    """The online-softmax merge of two partial results over disjoint key sets:
    (out_a, lse_a), (out_b, lse_b) -> (out, lse), in the user layout
    (out (B, S, Hq, D), lse (B, Hq, S)):

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

    A row that saw no key in one part (lse -inf) takes the other part as it
    is; in neither, out = 0 and lse = -inf."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    checks.check_partial("a", out_a, lse_a)
    checks.check_partial("b", out_b, lse_b, like=(out_a, lse_a))
    acc_dtype = accumulate_dtype(out_a.dtype)
    lse = np.logaddexp(lse_a, lse_b)                               # (B, Hq, S)
    lse_safe = np.where(np.isneginf(lse), 0.0, lse)                # neither part saw a key: weights 0
    w_a, w_b = (np.exp(x - lse_safe).transpose(0, 2, 1)[..., None] for x in (lse_a, lse_b))  # (B, S, Hq, 1)
    out = w_a * out_a.astype(acc_dtype) + w_b * out_b.astype(acc_dtype)
    return out.astype(out_a.dtype), lse


def attention_backward(q, k, v, out, lse, dout, *, q_pos=None, k_pos=None, causal=True, scale=None,
                       window=None, cu_seqlens=None, segment_ids=None, dropout=0.0, seed=0):
    """Dense gradients (dq, dk, dv) of sum(out * dout), with q's, k's, v's shapes
    and dtype; mask options as `attention` (dropout regenerates its Z)."""
    B, Sq, Hq, Hkv, D = checks.check_qkv(q, k, v, same_length=False)
    checks.check_grads_inputs(q, out, lse, dout)
    scale = checks.check_options(causal=causal, scale=scale, head_dim=D)
    mask = make_mask(causal=causal, window=window, cu_seqlens=cu_seqlens, segment_ids=segment_ids,
                     dropout=dropout, seed=seed)
    Sk = k.shape[1]
    q_pos, k_pos = _positions("q_pos", q_pos, Sq, mask), _positions("k_pos", k_pos, Sk, mask)
    visible = _visible(q_pos, k_pos, mask)
    acc_dtype, dtype = accumulate_dtype(q.dtype), q.dtype
    q, k, v, out, dout = (_heads_first(x, Hq, acc_dtype) for x in (q, k, v, out, dout))   # (B, Hq, S, D)
    with np.errstate(invalid="ignore"):                # NaN at masked pairs of rows without a key: not read
        p = np.exp(_scores(q, k, scale, visible) - lse.astype(acc_dtype)[..., None])   # (B, Hq, Sq, Sk)
    z = _dropout(mask, B, Hq, q_pos, k_pos, acc_dtype)              # Z, regenerated
    dv = _masked_sum((p * z).swapaxes(-1, -2), dout, visible.T)     # (P Z)^T dO
    dp = (dout @ v.swapaxes(-1, -2)) * z                            # (dO V^T) Z (read at visible pairs)
    delta = (dout * out).sum(axis=-1)                               # (B, Hq, Sq)
    ds = p * (dp - delta[..., None])
    dq = _masked_sum(ds, k, visible) * scale                        # dS K
    dk = _masked_sum(ds.swapaxes(-1, -2), q, visible.T) * scale     # dS^T Q
    # back to (B, S, H, D); a key/value head's gradient is the sum over the query heads that read it
    dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    group = Hq // Hkv
    dk = dk.reshape(B, Sk, Hkv, group, D).sum(axis=3)
    dv = dv.reshape(B, Sk, Hkv, group, D).sum(axis=3)
    return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype)
