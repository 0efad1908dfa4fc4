"""Layouts: which device holds which tokens (paper, section 2.2 and Figure 1).

A layout is a permutation of the positions ``0 .. S-1`` cut into N shards of
``c = S // N`` tokens. It is named once, here, and everything else asks
`positions` for it. Positions travel with the tokens, so masks never need to
know which layout made them.

Any S: a sequence whose length is not a multiple of N (of 2N for zigzag) is
padded at its end to the next multiple (`padded_length`); the padding
positions ``S .. S'-1`` are dealt like any others, and the mask makes them
invisible (`reference.masks`, ``seq_len``). `shard` pads with zeros and
``unshard(..., seq_len=S)`` drops the padding again.

Legend: ``N`` devices, ``S`` tokens, ``c = S // N`` tokens per device.

    positions(16, 4, "striped")   # dev0 [0 4 8 12]  dev1 [1 5 9 13]  dev2 [2 6 10 14]  dev3 [3 7 11 15]
"""

import numpy as np

LAYOUTS = ("contiguous", "striped", "zigzag")


def check_layout(layout, seq_len, n_devices):
    """Raise ValueError unless `layout` can deal `seq_len` tokens (any positive
    number, padded to `padded_length`) to `n_devices`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(n_devices, bool) or not isinstance(n_devices, (int, np.integer)) or n_devices < 1:
        raise ValueError(f"n_devices must be a positive int, got {n_devices!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"sequence length must be a positive int, got {seq_len!r}")


def unit(n_devices, layout):
    """The layout's unit of division: N tokens (one per device), 2N for zigzag
    (two chunks per device). S is padded to a multiple of it."""
    return 2 * n_devices if layout == "zigzag" else n_devices


def padded_length(seq_len, n_devices, layout):
    """S rounded up to the layout's unit (`unit`): S=6, N=4 -> 8."""
    check_layout(layout, seq_len, n_devices)
    step = unit(n_devices, layout)
    return -(-int(seq_len) // step) * step


def positions(seq_len, n_devices, layout):
    """Global positions held by each device, as an int64 array ``(N, c)``.

    S=8, N=4:
      contiguous  dev0 [0 1]  dev1 [2 3]  dev2 [4 5]  dev3 [6 7]
      striped     dev0 [0 4]  dev1 [1 5]  dev2 [2 6]  dev3 [3 7]
      zigzag      dev0 [0 7]  dev1 [1 6]  dev2 [2 5]  dev3 [3 4]

    contiguous is Ring Attention's layout: device r holds ``r*c .. (r+1)*c - 1``.
    striped is the paper's: device r holds ``r, r+N, r+2N, ...``.
    zigzag cuts the sequence into 2N chunks of ``S // (2N)``; device r holds
    chunk r followed by chunk ``2N-1-r``.
    The inverse permutation is `inverse_positions`.

    Any S is padded first (`padded_length`); positions >= S are padding:
      S=6, N=4, striped: dev0 [0 4]  dev1 [1 5]  dev2 [2 6]  dev3 [3 7]   (6, 7 padding)
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)):
        raise TypeError(f"seq_len must be an int, got {seq_len!r}")
    tokens = np.arange(padded_length(seq_len, n_devices, layout), dtype=np.int64)
    if layout == "contiguous":
        return tokens.reshape(n_devices, -1)
    if layout == "striped":
        return np.ascontiguousarray(tokens.reshape(-1, n_devices).T)
    chunks = tokens.reshape(2 * n_devices, -1)                 # (2N, S // 2N)
    return np.concatenate([chunks[:n_devices], chunks[::-1][:n_devices]], axis=1)


def ulysses_positions(seq_len, ring_degree, ulysses_degree, layout, ulysses_inner=True):
    """Global positions held by each of N = ring_degree * ulysses_degree ranks
    when Ulysses (DeepSpeed-Ulysses: an all-to-all that trades a sequence
    shard for a head shard) is composed with a ring (USP): ring rank i holds
    `positions(S, ring_degree, layout)[i]`, cut into `ulysses_degree`
    contiguous pieces dealt to its Ulysses group in group-rank order, so that
    the Ulysses all-to-all over those u ranks puts ring rank i's tokens back in
    order. (B, c, H, D) per rank -> all-to-all -> (B, u*c, H/u, D) per ring rank.

    With `ulysses_inner` (yunchang's `set_seq_parallel_pg(...,
    use_ulysses_low=True)`, ringmaster's (ring, ulysses) mesh) the Ulysses
    groups are consecutive ranks: rank g is piece g % u of ring rank g // u.
    Without it (`use_ulysses_low=False`) the ring groups are: rank g is piece
    g // r of ring rank g % r.

    S=8, ring_degree=2, ulysses_degree=2, ulysses_inner:
      contiguous  rank0 [0 1]  rank1 [2 3]  rank2 [4 5]  rank3 [6 7]
      striped     rank0 [0 2]  rank1 [4 6]  rank2 [1 3]  rank3 [5 7]
      zigzag      rank0 [0 1]  rank1 [6 7]  rank2 [2 3]  rank3 [4 5]
    the same, ring groups inner (ulysses_inner=False):
      zigzag      rank0 [0 1]  rank1 [2 3]  rank2 [6 7]  rank3 [4 5]

    ulysses_degree=1 is `positions(S, ring_degree, layout)`; ring_degree=1
    is contiguous over N whatever the layout. S is padded as `positions`
    pads it for ring_degree * ulysses_degree ranks.
    """
    n = ring_degree * ulysses_degree
    ring = positions(padded_length(seq_len, n, layout), ring_degree, layout)   # (r, P // r)
    pieces = ring.reshape(ring_degree, ulysses_degree, -1)                     # (ring rank, Ulysses rank, c)
    if not ulysses_inner:
        pieces = pieces.transpose(1, 0, 2)                                     # rank g = (g // r, g % r)
    return np.ascontiguousarray(pieces.reshape(n, -1))


def inverse_positions(seq_len, n_devices, layout):
    """Where each global position lives: ``index[p]`` is its place in the
    concatenation of all shards, so that ``concat(shards)[index] == x``.

    S=8, N=4, striped: positions flattened [0 4 1 5 2 6 3 7], inverse [0 2 4 6 1 3 5 7].
    With padding, the first `seq_len` entries are the real tokens'.
    """
    flat = positions(seq_len, n_devices, layout).ravel()
    index = np.empty_like(flat)
    index[flat] = np.arange(len(flat))
    return index[:seq_len]


def shard(x, n_devices, layout, axis=1):
    """Cut `x` (natural token order along `axis`) into the N shards of `layout`,
    padded with zeros at the end to `padded_length` first."""
    _check_sharded_array("x", x)
    axis = _check_axis(axis, x.ndim, f"x of shape {tuple(x.shape)}")
    return shard_at(x, positions(x.shape[axis], n_devices, layout), axis)


def shard_at(x, pos, axis=1):
    """Device j's shard holds the tokens at positions pos[j] (`pos` (N, c), any
    dealing, e.g. `ulysses_positions`); positions past x's length are zero padding."""
    xp = array_module(x)
    S = x.shape[axis]
    if pos.size > S:
        pad = list(x.shape)
        pad[axis] = pos.size - S
        x = xp.concatenate([x, xp.zeros(pad, dtype=x.dtype)], axis=axis)
    return [xp.take(x, xp.asarray(p), axis=axis) for p in pos]


def unshard(shards, layout, axis=1, seq_len=None):
    """Inverse of `shard`: put the N shards back into natural token order, the
    first `seq_len` tokens (None: all, padding included)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(shards, (str, bytes)) or not hasattr(shards, "__len__") or len(shards) == 0:
        got = f"an empty {type(shards).__name__}" if hasattr(shards, "__len__") and len(shards) == 0 \
            else repr(shards) if isinstance(shards, (str, bytes)) else type(shards).__name__
        raise ValueError(f"shards must be a non-empty list of arrays, one per device, got {got}")
    for i, s in enumerate(shards):
        _check_sharded_array(f"shards[{i}]", s)
    axis = _check_axis(axis, shards[0].ndim, f"shards of shape {tuple(shards[0].shape)}")
    for i, s in enumerate(shards):
        if tuple(s.shape) != tuple(shards[0].shape):
            raise ValueError(f"shards must all have one shape, got {tuple(shards[0].shape)} for shards[0] "
                             f"and {tuple(s.shape)} for shards[{i}]")
    total, n = sum(s.shape[axis] for s in shards), len(shards)
    seq_len = total if seq_len is None else seq_len
    if padded_length(seq_len, n, layout) != total:
        raise ValueError(f"seq_len {seq_len} does not pad to the {total} tokens of the shards "
                         f"(layout {layout!r}, {n} devices)")
    return unshard_at(shards, positions(total, n, layout), seq_len, axis)


def unshard_at(shards, pos, seq_len, axis=1):
    """Inverse of `shard_at`: the first `seq_len` tokens in natural order."""
    xp = array_module(shards[0])
    joined = xp.concatenate(list(shards), axis=axis)
    index = np.empty(pos.size, dtype=np.int64)
    index[pos.ravel()] = np.arange(pos.size)               # where each position lies in `joined`
    return xp.take(joined, xp.asarray(index[:seq_len]), axis=axis)


def _check_sharded_array(name, x):
    if not (hasattr(x, "shape") and hasattr(x, "ndim") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}; convert it with np.asarray")


def _check_axis(axis, ndim, what):
    """`axis` as a non-negative int, or a ValueError naming it."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for {what}: "
                         f"the token axis must be in {-ndim} .. {ndim - 1}")
    return int(axis) % ndim


def array_module(x):
    """NumPy for NumPy arrays, CuPy for CuPy arrays, without importing CuPy otherwise."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def to_host(x):
    """An array as NumPy, wherever it lives (CuPy's come through host memory)."""
    return x.get() if hasattr(x, "get") else np.asarray(x)
