"""NaN and inf at masked pairs: the hazard every step guards against, written once.

A masked pair contributes nothing, even where one of its values is NaN or inf
(docs/design.md). But 0 x NaN = NaN, and 0 x inf too: in a product ``w @ x`` whose
weights ``w`` are 0 at the masked pairs, a NaN in row t of ``x`` still reaches
every row of ``w``, also those that cannot see t. So whether a block's
inputs are finite is found once (`all_finite`: by the block's owner, who sends
the answer with it, `block_finite`; the query side's before the rounds), and
only where they are not does a step compute its products through
`masked_product`, which leaves the non-finite rows out and adds their terms
back where visible.

Legend: ``R`` rows of a tile (queries x query heads per key/value head),
``T`` keys of a tile, ``E`` columns.
"""

import numpy as np

from .layouts import array_module, to_host


def mask_rows(mask, R, xp):
    """A tile's mask (tq, tk) as rows (R, tk), R = tq*G query-major, on xp's device; None stays None."""
    if mask is None:
        return None
    return xp.asarray(np.repeat(mask, R // mask.shape[0], axis=0))


def finite(xp, x):
    """Elementwise: x is neither NaN nor inf. bfloat16 held as its bits (uint16:
    CuPy has no bfloat16) is finite where its 8 exponent bits are not all ones;
    `isfinite` would call every integer finite."""
    if x.dtype == np.uint16:
        return (x & 0x7F80) != 0x7F80
    return xp.isfinite(x)


def all_finite(xp, *arrays):
    """True when no array holds a NaN or inf: one pass per array (a block, not a tile),
    read on the host (on a GPU, a wait for the kernels queued so far)."""
    return all(bool(finite(xp, x).all()) for x in arrays)


def block_finite(xp, block):
    """True when a `reference.step.KVBlock`'s K and V hold no NaN or inf: the
    flag its owner set (host memory, read without waiting for a device), or,
    for a block made without one, a look at K and V (`all_finite`)."""
    source = to_host(block.source)
    return bool(source[1]) if source.size > 1 else all_finite(xp, block.k, block.v)


def converted(block, k, v, *, widened):
    """`block` (a `reference.step.KVBlock`) with K, V in another form, and its
    finiteness flag right for them: carried over where the conversion
    `widened` a float (every value kept: NaN and inf stay, nothing new
    overflows), found again otherwise (bits read as another type, a narrowing;
    a wait for a device)."""
    if widened or to_host(block.source).size < 2:
        return block._replace(k=k, v=v)
    flag = int(all_finite(array_module(k), k, v))
    return block._replace(k=k, v=v, source=np.array([int(to_host(block.source)[0]), flag], dtype=np.int32))


def masked_product(w, x, vis):
    """w @ x over the visible pairs only: w (..., M, T) is 0 at the masked pairs,
    x (..., T, E), vis (M, T) bool (None: a plain product, for a tile with no
    masked pair or a block with finite inputs).

    Hazard: 0 x NaN = NaN (and 0 x inf): a masked weight does not stop a
    non-finite value, so in w @ x a NaN in row t of x reaches every row of w,
    also those that cannot see t. The rows of x that are not finite are left
    out of the product and their terms added back only where visible. Only
    blocks whose inputs hold a NaN or inf get a `vis` (callers check once per
    block with `all_finite`).
    """
    if vis is None:
        return w @ x
    xp = array_module(w)
    zero = x.dtype.type(0)
    bad = ~xp.isfinite(x).all(axis=-1)                   # (..., T) rows of x with a NaN or inf
    out = w @ xp.where(bad[..., None], zero, x)          # every finite term   (..., M, E)
    cols = to_host(bad.reshape(-1, bad.shape[-1]).any(axis=0))   # (T,) t with a bad row in some head
    with np.errstate(invalid="ignore"):                  # 0 x inf at a masked pair: dropped below
        for t in np.flatnonzero(cols):
            xt = xp.where(bad[..., t, None], x[..., t, :], zero)     # (..., E) the bad rows t only
            out += xp.where(vis[:, t, None], w[..., :, t, None] * xt[..., None, :], zero)
    return out
