"""The per-device step, version 1: the readable one, and the contract every version keeps.

This is ``AccumulateAttentionFragment`` of the paper's Algorithm 1: one device's
queries Q_j against the key/value block K_k, V_k it holds this round, cut into
tiles (section 2.2.1; `reference.tiles`). Version 1 writes the formulas on whole
tiles, every head at once, for any array module (NumPy, or CuPy on GPUs):

Forward, per tile (Rabe and Staats 2021; FlashAttention), with the running
row max ``m`` and row sum ``l`` of the scores seen so far:
    S = Q_j K_k^T                   (Q pre-scaled); masked entries -inf
    m_new = max(m, rowmax(S))
    P = exp(S - m_new)
    l = l * exp(m - m_new) + rowsum(P)
    O = O * exp(m - m_new) + P V_k
and after the last block ``out = O / l``, ``lse = m + log(l)`` (`finish_forward`).

Backward, per tile, with ``delta = rowsum(dO * out)`` computed once:
    P  = exp(S - lse)
    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - delta)
    dQ += dS K,     dK += dS^T Q

A version subclasses `Step` with ``forward_tiles`` and ``backward_tiles``,
calling ``progress`` between tiles; `Step.forward` and `Step.backward` plan
the tiles and count the work for all. The contract in full, and what rows
without a visible key and NaN get: docs/steps.md. Faster versions
(`reference.steps`) are checked against this one (tests/steps/test_step.py).

Shapes: the compute layout of `reference.heads`: q (B, Hkv, c, G, D), k, v
(B, Hkv, ck, D), m, l, lse (B, Hkv, c, G). A tile of ``tq`` queries is the view
``(B, Hkv, R, D)``, R = tq * G rows ordered query-major.
"""

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from .heads import accumulate_dtype, q_to_heads, rows_to_heads
from .layouts import array_module, to_host
from .masks import CAUSAL, any_visible, count_visible_pairs, keep_weights, resolve, visible
from .nonfinite import all_finite, block_finite, mask_rows, masked_product
from .tiles import MASKED, tile_plan, tile_shape


# -- what a step takes ----------------------------------------------------

@dataclass
class Queries:
    """Q_j: this device's queries, pre-scaled, in the accumulation dtype, with
    their global positions (NumPy, on the host: masks are made from them) and
    the mask they see keys through (`reference.masks.Mask`; `Step.forward`
    sets it from its `mask` argument)."""
    q: object            # (B, Hkv, c, G, D)
    pos: np.ndarray      # (c,) int64
    mask: object = CAUSAL
    scale: object = None  # the scale q carries (None: not known); a kernel that rounds q
                          # to 16 bits takes it off first (gpu_impl.steps.fused_v2)
    heads: object = None  # (Hq,) int: the global number of each query head held (None: 0..Hq-1);
                          # dropout keys on it, so a device holding some heads (Ulysses) drops as all do

    @classmethod
    def prepare(cls, q, n_kv_heads, q_pos, scale, heads=None):
        """From the user layout (B, c, Hq, D); `heads` as the field."""
        acc_dtype = accumulate_dtype(q.dtype)
        # Hazard: q_to_heads returns a view of the caller's q when no transpose or
        # cast is needed, so scale into a new array, never in place.
        return cls(q=q_to_heads(q, n_kv_heads, dtype=acc_dtype) * acc_dtype(scale), pos=np.asarray(q_pos),
                   scale=float(scale), heads=None if heads is None else np.asarray(heads))


class KVBlock(NamedTuple):
    """K_k, V_k: the block that travels the ring, with its keys' global
    positions and the device it started on. A tuple of arrays, so the
    communication object moves it as it is. `source` also says whether K and
    V are finite, as their owner found once (`reference.ring.own_block`), so
    that no step reads device memory on the host to know it (`block_finite`)."""
    k: object            # (B, Hkv, ck, D)
    v: object            # (B, Hkv, ck, D)
    pos: object          # (ck,) int64
    source: object       # (2,) int32: [device, 1 if K and V hold no NaN or inf else 0]; (1,): device only


@dataclass
class ForwardAcc:
    """Out_j of Algorithm 1: the unnormalised output `o`, the running row max
    `m` and row sum `l` of exp(S - m), and which query rows have a visible key
    so far (`seen`, from positions). Version 1 keeps `m` the true running max;
    a version may keep any shift below it (v3's lazy max): ``o / l`` and
    ``m + log(l)`` do not depend on the shift."""
    o: object            # (B, Hkv, c, G, D)
    m: object            # (B, Hkv, c, G)
    l: object            # (B, Hkv, c, G)
    seen: np.ndarray     # (c,) bool

    @classmethod
    def zeros(cls, q):
        xp = array_module(q)
        rows = q.shape[:-1]
        return cls(o=xp.zeros_like(q), m=xp.full(rows, -np.inf, dtype=q.dtype),
                   l=xp.zeros(rows, dtype=q.dtype), seen=np.zeros(q.shape[2], dtype=bool))


@dataclass
class BackwardRows:
    """What the backward needs of this device's query rows, fixed over the
    rounds (for the same `Queries`). A step may keep what it derives from them
    once in `cache` and reuse it every round."""
    do: object           # (B, Hkv, c, G, D) dO
    lse: object          # (B, Hkv, c, G), 0 where -inf (a row with no visible key)
    delta: object        # (B, Hkv, c, G) rowsum(dO * out)
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    finite: bool = None  # q, dO and delta hold no NaN or inf, found once before the rounds (None: the step looks)

    @classmethod
    def prepare(cls, out, lse, dout, n_kv_heads, dtype):
        """From the user layout: out, dout (B, c, Hq, D), lse (B, Hq, c)."""
        do = q_to_heads(dout, n_kv_heads, dtype=dtype)
        delta = (do * q_to_heads(out, n_kv_heads, dtype=dtype)).sum(axis=-1)
        xp = array_module(do)
        lse = rows_to_heads(lse, n_kv_heads).astype(dtype, copy=False)
        # Hazard: lse = -inf only for a row with no visible key; all its scores
        # are -inf too, and exp(-inf - 0) = 0 keeps it out of every sum.
        return cls(do=do, lse=xp.where(xp.isneginf(lse), 0.0, lse).astype(dtype, copy=False),
                   delta=delta)


@dataclass
class Grads:
    """The gradients a backward step adds to: this device's dQ (kept over the
    rounds, unscaled: the ring multiplies by `scale` at the end) and the dK, dV
    of the block it holds (complete, since Q is pre-scaled)."""
    dq: object           # (B, Hkv, c, G, D)
    dk: object           # (B, Hkv, ck, D)
    dv: object           # (B, Hkv, ck, D)


@dataclass
class StepCounts:
    """What one step did, for the trace."""
    tiles_computed: int = 0
    tiles_skipped: int = 0
    pairs: int = 0


def no_progress():
    """The `progress` of a step called without one: nothing to move."""


# -- the contract ---------------------------------------------------------

class Step:
    """One version of the block step. Subclasses implement the two `*_tiles`
    methods on the plan's tiles; everything around them is here, once."""
    name = "v1"
    array_modules = ("numpy", "cupy")    # the array modules it computes with
    has_backward = True
    has_dropout = False                  # True: its tiles apply `masks.keep_weights`
    takes_workers = False                # True: its constructor takes `workers` threads
    takes_masks = True                   # False: causal=True/False only (reference.masks' plain)
    dtypes = ()                          # the input dtypes "auto" may pick it for (empty: any)
    reads_float16 = False                # True: takes float16 K, V as they travel (the ring does not
                                         # cast them to the accumulation dtype: the fused kernels)

    def refuses(self, call):
        """Why this version cannot take a call (`reference.steps.Call`: dtype,
        head dim, query heads per key/value head, tile size; None where not
        known), as a sentence for a ValueError, or None."""
        return None

    def tile(self, tile_size, head_dim):
        """The (tq, tk) this version computes with, a `reference.tiles.Tile`,
        resolved once at the door (`reference.call`) and handed to every step
        call, which takes it as it is; None: the version picks it per call
        (a kernel's configuration by head group and pass)."""
        return tile_shape(tile_size)

    def forward(self, acc, queries, block, *, tile_size, mask=None, causal=None, progress=None):
        """Accumulate attention of `queries` to `block` into `acc`. Returns StepCounts.
        `tile_size`: the call's resolved `Tile` (an int, a pair or None is resolved
        here, by `tile`). `mask`: a `reference.masks.Mask` (or `causal`, a bool, as before masks).
        `progress`: called on this thread between tiles (module docstring)."""
        queries, block, mask = self._with_mask(queries, block, mask, causal)
        plan, skipped = tile_plan(queries.pos, block.pos, self.tile(tile_size, queries.q.shape[-1]), mask)
        acc.seen |= any_visible(queries.pos, block.pos, mask)
        if plan:                                         # a block no query sees costs nothing more
            self.forward_tiles(acc, queries, block, plan, progress=progress or no_progress)
        return _count(plan, skipped, queries.pos, block.pos, mask)

    def backward(self, grads, queries, rows, block, *, tile_size, mask=None, causal=None, progress=None):
        """Add this block's share to `grads` (dQ, and the block's dK, dV). Returns StepCounts."""
        queries, block, mask = self._with_mask(queries, block, mask, causal)
        plan, skipped = tile_plan(queries.pos, block.pos, self.tile(tile_size, queries.q.shape[-1]), mask)
        if plan:
            self.backward_tiles(grads, queries, rows, block, plan, progress=progress or no_progress)
        return _count(plan, skipped, queries.pos, block.pos, mask)

    def _with_mask(self, queries, block, mask, causal):
        """The queries carrying the mask (the tiles read it there), the block's
        positions on the host. Whether this version takes the mask was asked at
        the door (`reference.steps.check_step`)."""
        mask = resolve(mask, causal)
        return replace(queries, mask=mask), block._replace(pos=to_host(block.pos)), mask

    def forward_tiles(self, acc, queries, block, plan, progress=no_progress):
        raise NotImplementedError

    def backward_tiles(self, grads, queries, rows, block, plan, progress=no_progress):
        raise NotImplementedError

    @property
    def label(self):
        """The version and its options, as tables print it."""
        return self.name

    def __repr__(self):
        return f"<step {self.label}>"


def _count(plan, skipped, q_pos, k_pos, mask):
    # a skipped tile has no visible pair, so the block's visible pairs are the tiles'
    return StepCounts(tiles_computed=len(plan), tiles_skipped=skipped,
                      pairs=count_visible_pairs(q_pos, k_pos, mask))


def finish_forward(acc):
    """out = O / l and lse = m + log(l), with the rules of the module docstring.
    Returns (out (B,Hkv,c,G,D), lse (B,Hkv,c,G))."""
    xp = array_module(acc.o)
    empty = xp.asarray(~acc.seen)[None, None, :, None]  # rows with no visible key at all
    l_safe = xp.where(empty, 1.0, acc.l)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = acc.o / l_safe[..., None]                  # l = 0 on a seen row: 0 / 0 = NaN
        lse = acc.m + xp.log(l_safe)
    lse = xp.where(empty, -np.inf, xp.where(acc.l == 0, np.nan, lse))
    return out, lse


# -- version 1: the formulas on whole tiles -------------------------------

class ReadableStep(Step):
    """Version 1: the formulas of the module docstring, one tile at a time,
    every (batch, head) at once, any array module; with dropout, P V becomes
    (P Z) V and dP becomes (dO V^T) Z, Z regenerated per tile from positions."""
    name = "v1"
    has_dropout = True

    def forward_tiles(self, acc, queries, block, plan, progress=no_progress):
        xp = array_module(queries.q)
        guard = not block_finite(xp, block)             # a NaN or inf in V (or K): guard the masked pairs
        for qs, ks, kind in plan:
            mask = visible(queries.pos[qs], block.pos[ks], queries.mask) if kind == MASKED else None
            tile = ForwardTile(o=tile_rows(acc.o, qs), m=tile_rows(acc.m, qs), l=tile_rows(acc.l, qs),
                               q=tile_rows(queries.q, qs), k=block.k[:, :, ks], v=block.v[:, :, ks],
                               z=dropout_rows(queries, block, qs, ks))
            forward_tile(tile, mask, guard)
            progress()

    def backward_tiles(self, grads, queries, rows, block, plan, progress=no_progress):
        xp = array_module(queries.q)
        rows_finite = all_finite(xp, queries.q, rows.do, rows.delta) if rows.finite is None else rows.finite
        guard = not (rows_finite and block_finite(xp, block))
        for qs, ks, kind in plan:
            mask = visible(queries.pos[qs], block.pos[ks], queries.mask) if kind == MASKED else None
            tile = BackwardTile(dq=tile_rows(grads.dq, qs), dk=grads.dk[:, :, ks], dv=grads.dv[:, :, ks],
                                q=tile_rows(queries.q, qs), do=tile_rows(rows.do, qs),
                                lse=tile_rows(rows.lse, qs), delta=tile_rows(rows.delta, qs),
                                k=block.k[:, :, ks], v=block.v[:, :, ks], z=dropout_rows(queries, block, qs, ks))
            backward_tile(tile, mask, guard)
            progress()


def dropout_rows(queries, block, qs, ks):
    """Z of one tile as rows (B, Hkv, R, tk), R = tq * G query-major (query head
    h = kv head * G + g), or None without dropout."""
    B, Hkv, _, G, _ = queries.q.shape
    xp = array_module(queries.q)
    heads = np.arange(Hkv * G) if queries.heads is None else queries.heads
    z = keep_weights(queries.mask, np.arange(B), heads, queries.pos[qs], block.pos[ks],
                     xp, queries.q.dtype.type)                  # (B, Hq, tq, tk)
    if z is None:
        return None
    tq, tk = z.shape[-2:]
    return z.reshape(B, Hkv, G, tq, tk).transpose(0, 1, 3, 2, 4).reshape(B, Hkv, tq * G, tk)


@dataclass
class ForwardTile:
    """One tile as `forward_tile` reads it: views of the accumulator (updated in
    place), the queries, the keys and values; R = tq * G rows, query-major."""
    o: object            # (B, Hkv, R, D)
    m: object            # (B, Hkv, R)
    l: object            # (B, Hkv, R)
    q: object            # (B, Hkv, R, D)
    k: object            # (B, Hkv, tk, D)
    v: object            # (B, Hkv, tk, D)
    z: object = None     # (B, Hkv, R, tk) dropout weights, or None: they weigh P V, not the sum l


def forward_tile(t, mask, guard=False):
    """One tile of the online softmax on the ForwardTile `t`. mask (tq, tk) or
    None (every pair visible). `guard`: V may hold NaN or inf."""
    xp = array_module(t.q)
    s = t.q @ t.k.swapaxes(-1, -2)                       # S = Q K^T   (B, Hkv, R, tk)
    if mask is not None:
        apply_mask(s, mask)                              # -inf where masked
    m_new = xp.maximum(t.m, s.max(axis=-1))              # (B, Hkv, R)
    # Hazard: a row that has seen no visible key yet has m_new = -inf, and
    # exp(-inf - -inf) is NaN. Subtracting 0 instead leaves exp(-inf) = 0.
    m_safe = xp.where(xp.isneginf(m_new), 0.0, m_new).astype(s.dtype, copy=False)
    p = xp.exp(s - m_safe[..., None])                    # P = exp(S - m_new)
    alpha = xp.exp(t.m - m_safe)                         # rescales the old l and O
    t.l[...] = t.l * alpha + p.sum(axis=-1)
    vis = mask_rows(mask, t.q.shape[-2], xp) if guard else None   # (R, tk) or None
    pz = p if t.z is None else p * t.z                   # P Z: dropout leaves l alone
    t.o[...] = t.o * alpha[..., None] + masked_product(pz, t.v, vis)   # O = O alpha + P Z V
    t.m[...] = m_new


@dataclass
class BackwardTile:
    """One tile as `backward_tile` reads it: views of dQ and of the block's dK,
    dV (added to in place), then what the formulas read; R = tq * G rows."""
    dq: object           # (B, Hkv, R, D)
    dk: object           # (B, Hkv, tk, D)
    dv: object           # (B, Hkv, tk, D)
    q: object            # (B, Hkv, R, D)
    do: object           # (B, Hkv, R, D)
    lse: object          # (B, Hkv, R)
    delta: object        # (B, Hkv, R) rowsum(dO * out), dropout included
    k: object            # (B, Hkv, tk, D)
    v: object            # (B, Hkv, tk, D)
    z: object = None     # (B, Hkv, R, tk) dropout weights, or None


def backward_tile(t, mask, guard=False):
    """One tile of the backward on the BackwardTile `t`. `guard`: the inputs
    may hold NaN or inf."""
    xp = array_module(t.q)
    s = t.q @ t.k.swapaxes(-1, -2) - t.lse[..., None]    # S - lse   (B, Hkv, R, tk)
    if mask is not None:                                 # after lse: -inf - NaN would be NaN, not -inf
        apply_mask(s, mask)
    p = xp.exp(s)                                        # P = exp(S - lse), exactly 0 where masked
    vis = mask_rows(mask, t.q.shape[-2], xp) if guard else None    # (R, tk) or None
    vis_t = None if vis is None else vis.T
    pz = p if t.z is None else p * t.z
    t.dv += masked_product(pz.swapaxes(-1, -2), t.do, vis_t)   # dV += (P Z)^T dO   (B, Hkv, tk, D)
    dp = t.do @ t.v.swapaxes(-1, -2)                     # dP = dO V^T    (B, Hkv, R, tk)
    if t.z is not None:
        dp *= t.z                                        # dP = (dO V^T) Z
    ds = p * (dp - t.delta[..., None])                   # dS = P (dP - delta)
    if vis is not None:                                  # 0 x NaN: P = 0 does not clear a NaN dP - delta
        xp.copyto(ds, 0, where=~vis)
    t.dq += masked_product(ds, t.k, vis)                 # dQ += dS K     (B, Hkv, R, D)
    t.dk += masked_product(ds.swapaxes(-1, -2), t.q, vis_t)    # dK += dS^T Q   (B, Hkv, tk, D)


# -- helpers shared by the versions ---------------------------------------

def tile_rows(x, qs):
    """Tile rows of a compute-layout array as a matrix: (B, Hkv, c, G, ...) -> (B, Hkv, tq*G, ...)."""
    t = x[:, :, qs]
    return t.reshape(t.shape[:2] + (t.shape[2] * t.shape[3],) + t.shape[4:])


def apply_mask(s, mask):
    """Set invisible entries of scores ``s`` (..., tq*G, tk) to -inf, in place."""
    xp = array_module(s)
    R, tk = s.shape[-2:]
    s5 = s.reshape(s.shape[:-2] + (mask.shape[0], R // mask.shape[0], tk))
    xp.copyto(s5, -np.inf, where=~xp.asarray(mask)[:, None, :])
