"""A ring attention in JAX, checked by the kit from the command line.

    conformance/.venv/bin/python -m reference.testing check examples/jax_ring.py:JaxRing --world-sizes 1,2,3,4

(`make conformance` makes conformance/.venv, with the `peers` extra's jax[cpu];
or `pip install 'jax[cpu]'`.) Each device holds c tokens of q, k, v in any
layout: positions travel with the tokens, and the mask (causal or not, a
window, packed documents, padding) comes from them. In each round a device
attends its queries to the K/V block it holds and passes the block, with its
positions, one device on (paper, Algorithm 1); the online softmax merges the
blocks. The backward is JAX's autodiff of the forward (ppermute's transpose
sends dK, dV back round the ring). Shapes: B batch, c tokens per device,
Hq / Hkv heads, D head dim.
"""

import jax
import jax.numpy as jnp
import numpy as np

from reference.testing import MASKS
from reference.testing.harness.jax import JaxAdapter


def ring_attention(q, k, v, pos, *, axis, n, visible, scale=None, kv_dtype=None):
    """This device's out (B, c, Hq, D) in q's dtype and lse (B, Hq, c), for its
    tokens at global positions `pos` (c,); `visible(q_pos, k_pos)` (c, c) says
    which keys a query sees. K and V travel in `kv_dtype` (default: the sums'
    dtype); so do dK and dV, by autodiff."""
    dtype = q.dtype
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32         # 16-bit inputs: float32 sums
    q, k, v = q.astype(acc), k.astype(kv_dtype or acc), v.astype(kv_dtype or acc)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]                                     # query head h reads kv head h // group
    m = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, acc)   # running max (B, Hq, c)
    l = jnp.zeros_like(m)                                                # running sum (B, Hq, c)
    o = jnp.zeros(q.shape, acc)                                          # unnormalized out (B, c, Hq, D)
    k_pos = pos                                                          # the positions of the K/V block held
    for t in range(n):
        kh, vh = (jnp.repeat(x.astype(acc), group, axis=2) for x in (k, v))   # (B, c, Hq, D), kv head per q head
        s = jnp.einsum("bihd,bjhd->bhij", q, kh) * scale                      # (B, Hq, c, c)
        s = jnp.where(visible(pos, k_pos), s, -jnp.inf)
        # the max only keeps exp in range (the result does not depend on it): no gradient through it
        m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)               # hazard: a row with no visible key yet
        p, alpha = jnp.exp(s - safe[..., None]), jnp.exp(m - safe)
        l = alpha * l + p.sum(-1)
        o = alpha.transpose(0, 2, 1)[..., None] * o + jnp.einsum("bhij,bjhd->bihd", p, vh)
        m = m_new
        if t < n - 1:                                   # pass K, V and their positions one device on
            perm = [(j, (j + 1) % n) for j in range(n)]
            k, v, k_pos = (jax.lax.ppermute(x, axis, perm) for x in (k, v, k_pos))
    seen = l > 0                                        # a row that saw no key: out 0, lse -inf
    out = o / jnp.where(seen, l, 1.0).transpose(0, 2, 1)[..., None]
    lse = jnp.where(seen, safe + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out.astype(dtype), lse


def visible_keys(case):
    """The case's mask as a function of positions: (q_pos (c,), k_pos (c,)) -> (c, c) bool."""
    real = np.arange(case.padded) < case.S                   # positions >= S are padding: never seen
    if case.cu_seqlens is not None:                          # the document of each real position
        doc = np.searchsorted(case.cu_seqlens, np.arange(case.S), side="right") - 1
    else:
        doc = np.asarray(case.segment_ids or np.zeros(case.S, int))
    doc = np.concatenate([doc, np.full(case.padded - case.S, -1)])

    def visible(q_pos, k_pos):
        is_real, docs = jnp.asarray(real), jnp.asarray(doc)
        seen = is_real[k_pos][None, :] & (docs[q_pos][:, None] == docs[k_pos][None, :])
        if case.causal:
            seen &= k_pos[None, :] <= q_pos[:, None]
        if case.window is not None:                           # W keys, the query's own included
            seen &= jnp.abs(q_pos[:, None] - k_pos[None, :]) < case.window
        return seen
    return visible


class JaxRing(JaxAdapter):
    """The kit's adapter: every layout, dtype and mask."""
    name = "examples/jax_ring.py"
    masks = MASKS

    def compute(self, case, shard):
        out, lse = ring_attention(shard.q, shard.k, shard.v, shard.positions, axis=shard.axis,
                                  n=shard.world_size, visible=visible_keys(case), scale=case.scale_value)
        return dict(out=out, lse=lse)
