"""The layers of the model, each a forward and a hand-written backward.

Every layer is a pair of functions:

    y, cache = name_forward(x, ...)          # cache: what the backward needs
    dx, (grads of its weights) = name_backward(dy, cache)

and every one is checked against finite differences in float64 by
tests/model/test_model.py. All of them except attention work on each token by itself
(a row of the last axes), so they run unchanged on any shard of tokens, in any
order: that is why only attention has to know about the ring. Rotary embeddings
read each token's *global* position, which travels with the token.

Legend: B sequences, c tokens (a shard, or the whole sequence), d = d_model,
H heads, D = d // H head dim, f = d_ff, V vocabulary.

    python -m pytest tests/model/test_model.py -q -k layer
"""

import numpy as np

RMS_EPS = 1e-6
GELU_C = float(np.sqrt(2 / np.pi))     # a Python float: keeps float32 arrays float32


# -- token embedding -------------------------------------------------------------

def embedding_forward(ids, wte):
    """ids (B, c) ints, wte (V, d) -> (B, c, d)."""
    return wte[ids], (ids, wte.shape)


def embedding_backward(dy, cache):
    """d wte: each token's row collects the gradient of every place it was read."""
    ids, shape = cache
    dwte = np.zeros(shape, dtype=dy.dtype)
    np.add.at(dwte, ids.ravel(), dy.reshape(-1, shape[1]))
    return dwte


# -- linear (no bias) --------------------------------------------------------------

def linear_forward(x, w):
    """x (..., din), w (din, dout) -> (..., dout)."""
    return x @ w, (x, w)


def linear_backward(dy, cache):
    x, w = cache
    dw = x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])       # (din, dout)
    return dy @ w.T, dw


# -- RMSNorm -------------------------------------------------------------------------

def rmsnorm_forward(x, g, eps=RMS_EPS):
    """y = x / rms(x) * g over the last axis; x (..., d), g (d,)."""
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)          # (..., 1)
    xhat = x * r
    return xhat * g, (xhat, r, g)


def rmsnorm_backward(dy, cache):
    xhat, r, g = cache
    dg = (dy * xhat).reshape(-1, g.shape[0]).sum(axis=0)
    dxhat = dy * g
    # xhat = x r(x) with dr/dx = -r^3 x / d, so dx = r (dxhat - xhat mean(dxhat xhat))
    dx = r * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dg


# -- rotary position embeddings ------------------------------------------------------

def rotary_angles(pos, head_dim, base=10000.0, dtype=np.float64):
    """cos and sin of pos * base^(-2i/D) for i < D/2: each (c, 1, D/2), for (B, c, H, D) inputs.
    `pos` are the tokens' GLOBAL positions (c,): a striped shard's are r, r+N, r+2N, ..."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # (D/2,)
    angle = np.asarray(pos, dtype=np.float64)[:, None] * inv_freq[None, :]         # (c, D/2)
    return np.cos(angle)[:, None, :].astype(dtype), np.sin(angle)[:, None, :].astype(dtype)


def rotary_forward(x, cos, sin):
    """Rotate each pair (x1[i], x2[i]) of the two halves of the head dim by
    pos * freq[i] (GPT-NeoX layout). x (B, c, H, D) -> same."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1), (cos, sin)


def rotary_backward(dy, cache):
    """A rotation's gradient is the inverse rotation (its transpose)."""
    cos, sin = cache
    h = dy.shape[-1] // 2
    d1, d2 = dy[..., :h], dy[..., h:]
    return np.concatenate([d1 * cos + d2 * sin, -d1 * sin + d2 * cos], axis=-1)


# -- GELU (tanh approximation, as GPT-2) ---------------------------------------------

def gelu_forward(x):
    t = np.tanh(GELU_C * (x + 0.044715 * x * x * x))     # x * x * x: x ** 3 is a slow pow
    return 0.5 * x * (1 + t), (x, t)


def gelu_backward(dy, cache):
    x, t = cache
    du = GELU_C * (1 + 3 * 0.044715 * x * x)
    return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du)


# -- cross-entropy ---------------------------------------------------------------------

IGNORE = -1      # a label that counts for nothing (no loss, no gradient)


def cross_entropy_forward(logits, labels, n_total):
    """Sum over this shard's labelled tokens of -log softmax(logits)[label], divided by
    `n_total`, the number of labelled tokens in the WHOLE batch (every shard), so that
    the shards' losses add up to the mean. logits (B, c, V), labels (B, c) -> float."""
    m = logits.max(axis=-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(logits - m).sum(axis=-1))                 # (B, c)
    valid = labels != IGNORE
    picked = np.take_along_axis(logits, np.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    loss = np.where(valid, lse - picked, 0.0).sum() / n_total
    return loss, (logits, lse, labels, valid, n_total)


def cross_entropy_backward(cache):
    """d loss / d logits = (softmax - onehot(label)) / n_total at labelled tokens, 0 elsewhere."""
    logits, lse, labels, valid, n_total = cache
    p = np.exp(logits - lse[..., None])
    np.put_along_axis(p, np.where(valid, labels, 0)[..., None],
                      np.take_along_axis(p, np.where(valid, labels, 0)[..., None], axis=-1) - 1, axis=-1)
    return p * (valid[..., None] / n_total).astype(p.dtype)
