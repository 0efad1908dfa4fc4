"""The compute layout: heads first, grouped-query heads stacked as rows.

Users pass the flash-attn layout, q (B, S, Hq, D) and k, v (B, S, Hkv, D). The
steps work heads first, with the G = Hq // Hkv query heads that share a
key/value head stacked beside each query, so that one matrix product serves the
whole group (query head h reads key/value head h // G, as in flash-attn):

    q, out, dq:    (B, Hkv, c, G, D)
    k, v, dk, dv:  (B, Hkv, ck, D)
    m, l, lse:     (B, Hkv, c, G)

Example, Hq = 4, Hkv = 2 (G = 2): query heads 0, 1 read key/value head 0 and
sit at [:, 0, :, 0] and [:, 0, :, 1]; query heads 2, 3 read head 1.

Legend: ``B`` batch, ``c`` queries held, ``ck`` keys in a block, ``D`` head dim.
"""

import numpy as np

from .layouts import array_module


def accumulate_dtype(dtype):
    """float16 and float32 accumulate in float32, float64 in float64."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def q_to_heads(x, n_kv_heads, dtype=None):
    """(B, c, Hq, D) -> (B, Hkv, c, G, D), contiguous."""
    xp = array_module(x)
    B, c, H, D = x.shape
    x = x.reshape(B, c, n_kv_heads, H // n_kv_heads, D).transpose(0, 2, 1, 3, 4)
    return xp.ascontiguousarray(x, dtype=dtype)


def q_from_heads(x):
    """(B, Hkv, c, G, D) -> (B, c, Hq, D)."""
    B, Hkv, c, G, D = x.shape
    return array_module(x).ascontiguousarray(x.transpose(0, 2, 1, 3, 4).reshape(B, c, Hkv * G, D))


def kv_to_heads(x, dtype=None):
    """(B, ck, Hkv, D) -> (B, Hkv, ck, D), contiguous."""
    return array_module(x).ascontiguousarray(x.transpose(0, 2, 1, 3), dtype=dtype)


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
