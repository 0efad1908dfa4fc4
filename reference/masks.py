"""Masks: which keys each query sees, decided from global positions alone.

docs/design.md: masks are derived from positions, never from device indices. A
`Mask` is the whole rule, small and the same on every device, so nothing but
positions has to travel with the tokens (document ids are looked up from the
positions, in the mask every device holds):

    visible(q, k) = lo(q) <= k <= hi(q)  and  doc(q) == doc(k)

- ``causal``     hi(q) = q                      (False: hi(q) = +inf, or q + W - 1 with a window)
- ``window=W``   lo(q) = q - W + 1              (a query sees the previous W tokens, itself included)
- documents      doc from ``cu_seqlens`` (flash-attn: ``[0, l0, l0 + l1, ..., S]``) or per-token
                 ``segment_ids``: a query sees keys of its own document only
- ``seq_len``    positions >= seq_len are padding (any S, padded to the layout's multiple):
                 a padding key is never visible and a padding query sees nothing
- ``dropout=p``  each visible pair is kept with probability 1 - p and weighted 1 / (1 - p)
                 in ``P V`` (not in the softmax's sum); whether a pair is kept is a
                 counter-based hash of (seed, batch, query head, pos_q, pos_k), so it is
                 the same for every layout, N and tile size, and the backward regenerates it.

Without documents the keys a query sees are the interval [lo(q), hi(q)]; with
them, the same interval inside its document. So visible pairs are counted
exactly with sorted keys and `searchsorted` (`visible_counts`), without
building a mask: per query, per tile, per block.

    mask = make_mask(causal=True, window=128, cu_seqlens=[0, 100, 356], seq_len=356)
    visible(q_pos, k_pos, mask)              # (c, ck) bool

Legend: ``c`` queries, ``ck`` keys, ``B`` batch, ``H`` query heads.
"""

import hashlib
from dataclasses import dataclass

import numpy as np

from .layouts import padded_length

BIG = 2 ** 62          # "no bound" for lo / hi: far beyond any position


@dataclass(frozen=True, eq=False)
class Mask:
    """The rule of the module docstring. ``segments`` is the document of each
    real position (an int array (seq_len,), documents numbered 0, 1, ...)."""
    causal: bool = True
    window: object = None          # int W >= 1, or None
    segments: object = None        # (seq_len,) int64, or None (one document)
    seq_len: object = None         # int, or None (no padding)
    dropout: float = 0.0
    seed: int = 0
    spans: object = None           # (first, last) (seq_len,) of each position's document, when
                                   # every document is one run of positions (cu_seqlens always)

    @property
    def causal_only(self):
        """Visibility is the causal flag alone (no window, documents or padding)."""
        return self.window is None and self.segments is None and self.seq_len is None

    @property
    def plain(self):
        """The causal flag alone, and no dropout: the rule every step and kernel knows."""
        return self.causal_only and not self.dropout

    def key_range(self, q_pos):
        """(lo, hi), int64 (c,): the positions a query may see, before documents.
        A padding query gets an empty range (hi < lo)."""
        q = np.asarray(q_pos, dtype=np.int64)
        w = self.window
        lo = q - (w - 1) if w is not None else np.full_like(q, -BIG)
        hi = q.copy() if self.causal else (q + (w - 1) if w is not None else np.full_like(q, BIG))
        if self.spans is not None:               # one run per document: the run bounds the range
            at = np.minimum(q, len(self.spans[0]) - 1)
            lo, hi = np.maximum(lo, self.spans[0][at]), np.minimum(hi, self.spans[1][at])
        if self.seq_len is not None:
            hi = np.minimum(hi, self.seq_len - 1)
            hi = np.where(q >= self.seq_len, lo - 1, hi)
        return lo, hi

    def doc(self, pos):
        """The document of each position (0 without documents); padding takes the last one's."""
        pos = np.asarray(pos, dtype=np.int64)
        if self.segments is None:
            return np.zeros(pos.shape, dtype=np.int64)
        return self.segments[np.minimum(pos, len(self.segments) - 1)]

    def describe(self):
        """What every rank must agree on (mpi_impl's agreement check), as plain values."""
        docs = None if self.segments is None else hashlib.sha1(self.segments.tobytes()).hexdigest()[:16]
        return (bool(self.causal), self.window, docs, self.seq_len, float(self.dropout), int(self.seed))

    def __repr__(self):
        parts = ["causal" if self.causal else "not causal"]
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.segments is not None:
            parts.append(f"{int(self.segments.max()) + 1} documents")
        if self.seq_len is not None:
            parts.append(f"seq_len={self.seq_len}")
        if self.dropout:
            parts.append(f"dropout={self.dropout:g} seed={self.seed}")
        return f"Mask({', '.join(parts)})"


CAUSAL, NOT_CAUSAL = Mask(causal=True), Mask(causal=False)


def as_mask(mask):
    """A Mask from a Mask or a bool (``causal=True/False``, as every entry point took before)."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, (bool, np.bool_)):
        return CAUSAL if mask else NOT_CAUSAL
    raise TypeError(f"causal must be a bool (or mask a reference.masks.Mask), got {mask!r}")


def resolve(mask=None, causal=None):
    """The Mask of a call that takes `mask` (a Mask or bool) or, as before masks,
    `causal` (a bool); neither: causal."""
    if mask is not None and causal is not None:
        raise TypeError("give mask or causal, not both")
    return as_mask(True if mask is None and causal is None else mask if mask is not None else causal)


# -- building one, with clear errors -------------------------------------

def make_mask(*, causal=True, window=None, cu_seqlens=None, segment_ids=None, dropout=0.0, seed=0,
              seq_len=None):
    """Check the mask options and return a Mask. `seq_len`: the number of real
    tokens (positions at or past it are padding); None: no padding."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if window is not None and not (_is_int(window) and window >= 1):
        raise ValueError(f"window must be a positive int (keys a query sees, itself included) or None, "
                         f"got {window!r}")
    if not isinstance(dropout, (int, float, np.floating, np.integer)) or isinstance(dropout, bool) \
            or not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    if not _is_int(seed) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    if seq_len is not None and not (_is_int(seq_len) and seq_len >= 1):
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    segments = documents(cu_seqlens, segment_ids, seq_len)
    return Mask(causal=bool(causal), window=None if window is None else int(window), segments=segments,
                seq_len=None if seq_len is None else int(seq_len), dropout=float(dropout), seed=int(seed),
                spans=None if segments is None else runs(segments))


MASK_OPTIONS = ("window", "cu_seqlens", "segment_ids", "dropout", "seed")


def check_mask_options(*, causal, seq_len=None, **mask_options):
    """The Mask of `make_mask`, or its clear error; a wrong option name is a
    TypeError naming the options there are."""
    unknown = sorted(set(mask_options) - set(MASK_OPTIONS))
    if unknown:
        raise TypeError(f"unknown mask option(s) {unknown}; the options are {list(MASK_OPTIONS)}")
    return make_mask(causal=causal, seq_len=seq_len, **mask_options)


def layout_mask(seq_len, n_devices, layout, *, causal=True, **mask_options):
    """The Mask of a ring run of `seq_len` real tokens: the options, with the
    padding rule when the layout pads `seq_len` (or documents cover it)."""
    padded = padded_length(seq_len, n_devices, layout) > seq_len
    documents = mask_options.get("cu_seqlens") is not None or mask_options.get("segment_ids") is not None
    return check_mask_options(causal=causal, seq_len=seq_len if padded or documents else None, **mask_options)


def documents(cu_seqlens, segment_ids, seq_len):
    """The document of each position, (seq_len,) int64 numbered 0, 1, ..., or None."""
    if cu_seqlens is not None and segment_ids is not None:
        raise ValueError("give cu_seqlens or segment_ids, not both")
    if cu_seqlens is None and segment_ids is None:
        return None
    if cu_seqlens is not None:
        cu = _int_array("cu_seqlens", cu_seqlens)
        seq_len = int(cu[-1]) if seq_len is None and len(cu) else seq_len
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len or (np.diff(cu) <= 0).any():
            raise ValueError(f"cu_seqlens must rise strictly from 0 to the sequence length {seq_len} "
                             f"(document boundaries, flash-attn's convention), got {cu.tolist()[:8]}"
                             f"{' ...' if len(cu) > 8 else ''}")
        return np.repeat(np.arange(len(cu) - 1, dtype=np.int64), np.diff(cu))
    ids = _int_array("segment_ids", segment_ids)
    if len(ids) != (len(ids) if seq_len is None else seq_len):
        raise ValueError(f"segment_ids must give one document id per token: {seq_len} ids, got {len(ids)}")
    return np.unique(ids, return_inverse=True)[1].astype(np.int64).reshape(-1)


def runs(segments):
    """(first, last) position of each position's document, if every document is
    one run of consecutive positions (then a query's keys are one interval); else None."""
    change = np.flatnonzero(np.diff(segments)) + 1
    starts = np.concatenate([[0], change])
    if len(starts) != len(np.unique(segments)):
        return None
    ends = np.concatenate([change, [len(segments)]]) - 1
    length = np.diff(np.append(starts, len(segments)))
    return np.repeat(starts, length), np.repeat(ends, length)


def cu_seqlens_from_lengths(lengths):
    """Document lengths -> cu_seqlens: [3, 5] -> [0, 3, 8]."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _int_array(name, x):
    a = np.asarray(x)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D array of ints, got {a.dtype} array of shape {a.shape}")
    return a.astype(np.int64)


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


# -- the rule, and counting it ------------------------------------------

def visible(q_pos, k_pos, mask=CAUSAL):
    """True where key k is visible to query q. ``(c, ck)`` bool."""
    mask = as_mask(mask)
    k = np.asarray(k_pos, dtype=np.int64)[None, :]
    if mask.causal_only:
        if not mask.causal:
            return np.ones((len(q_pos), k.shape[1]), dtype=bool)
        return np.asarray(q_pos)[:, None] >= k
    lo, hi = mask.key_range(q_pos)
    seen = (k >= lo[:, None]) & (k <= hi[:, None])
    if mask.segments is not None and mask.spans is None:    # documents that are not one run each
        seen &= mask.doc(q_pos)[:, None] == mask.doc(k_pos)[None, :]
    return seen


def visible_counts(q_pos, k_pos, mask=CAUSAL, groups=None):
    """How many keys each query sees, ``(G, c)`` int64, counting only the keys
    of each group when `groups` (a list of G key index slices) is given, else
    ``(c,)`` over all keys.

    Sort the keys by (document, position); query q sees the keys whose code
    ``doc * M + pos`` lies in ``[doc(q) * M + lo(q), doc(q) * M + hi(q)]``
    (M above every position, lo and hi clipped to [0, M), so that no range
    reaches into another document), two searchsorted per query and group."""
    mask = as_mask(mask)
    q_pos, k_pos = np.asarray(q_pos, dtype=np.int64), np.asarray(k_pos, dtype=np.int64)
    M = int(max(q_pos.max(initial=0), k_pos.max(initial=0))) + 1
    lo, hi = mask.key_range(q_pos)
    empty = hi < lo
    lo, hi = np.clip(lo, 0, M - 1), np.clip(hi, -1, M - 1)
    dq = mask.doc(q_pos) * M
    lo, hi = dq + lo, dq + hi                                        # (c,) codes
    dk = mask.doc(k_pos)
    code = dk * M + k_pos                                            # (ck,)
    one = groups is None
    groups = [slice(0, len(k_pos))] if one else groups
    # every group sorted apart, one searchsorted: group g's codes are offset by g * span
    span = (int(max(dq.max(initial=0) // M, dk.max(initial=0))) + 1) * M
    sorted_codes = np.concatenate([np.sort(code[s]) + g * span for g, s in enumerate(groups)])
    offsets = (np.arange(len(groups), dtype=np.int64) * span)[:, None]   # (G, 1)
    counts = (np.searchsorted(sorted_codes, hi[None, :] + offsets, side="right")
              - np.searchsorted(sorted_codes, lo[None, :] + offsets, side="left"))   # (G, c)
    counts[:, empty] = 0
    return counts[0] if one else counts


def any_visible(q_pos, k_pos, mask=CAUSAL):
    """(c,) bool: which queries can see at least one of the keys."""
    mask = as_mask(mask)
    if len(k_pos) == 0:
        return np.zeros(len(q_pos), dtype=bool)
    if mask.causal_only:
        return np.asarray(q_pos) >= np.min(k_pos) if mask.causal else np.ones(len(q_pos), dtype=bool)
    return visible_counts(q_pos, k_pos, mask) > 0


def count_visible_pairs(q_pos, k_pos, mask=CAUSAL):
    """Visible (query, key) pairs, without building the mask."""
    mask = as_mask(mask)
    if mask.causal_only and not mask.causal:
        return len(q_pos) * len(k_pos)
    return int(visible_counts(q_pos, k_pos, mask).sum())


# -- dropout: a counter-based random stream ------------------------------

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z):
    """SplitMix64's finalizer: a bijection of uint64 that scrambles every bit."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def keep_weights(mask, batch, heads, q_pos, k_pos, xp=np, dtype=np.float32):
    """Dropout weights ``(len(batch), len(heads), c, ck)``: 0 for a dropped pair,
    1 / (1 - p) for a kept one; None without dropout.

    Pair (b, h, q, k) is kept iff hash(seed, b, h, q, k) >= p * 2**64: a hash of
    global indices only, so every layout, tile and device count drops the same
    pairs, and the backward finds them again."""
    if not mask.dropout:
        return None
    with np.errstate(over="ignore"):
        bh = np.asarray(batch, np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15) \
            + np.asarray(heads, np.uint64)[None, :] + _mix(np.uint64(mask.seed))
        key = xp.asarray(_mix(_mix(bh)))[:, :, None, None]                     # (B, H, 1, 1)
        pair = (xp.asarray(np.asarray(q_pos, np.uint64))[:, None] << np.uint64(32)) \
            | xp.asarray(np.asarray(k_pos, np.uint64))[None, :]                 # (c, ck)
        u = _mix(_mix(pair)[None, None] ^ key)                                  # (B, H, c, ck)
    threshold = np.uint64(min(int(mask.dropout * 2.0 ** 64), 2 ** 64 - 1))
    return xp.where(u >= threshold, dtype(1.0 / (1.0 - mask.dropout)), dtype(0.0)).astype(dtype, copy=False)
