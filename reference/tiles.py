"""Tiles: cut one (query shard, key block) pair into tiles and say which to skip.

Paper, section 2.2.1: a block of queries against a block of keys is cut into
tiles of ``tq`` queries by ``tk`` keys, in local index order. With the causal
rule "key k is visible to query q iff pos_k <= pos_q", a tile is

- SKIP   when no pair in it is visible:   max(pos_q) <  min(pos_k),
- FULL   when every pair is visible:      min(pos_q) >= max(pos_k),
- MASKED otherwise: computed with the mask ``q_pos[:, None] >= k_pos[None, :]``.

Both rules follow from the pair rule by taking the extreme pair of the tile,
so they hold for every layout. The attention step and the cost model both read
this plan, so the work they count is the work that is done.

Legend: ``c`` queries, ``ck`` keys, ``T`` tiles.
"""

import numpy as np

SKIP, FULL, MASKED = 0, 1, 2
DEFAULT_TILE_SIZE = 256


def tile_shape(tile_size):
    """``(tq, tk)`` from an int, a pair, or None (the default)."""
    if tile_size is None:
        return DEFAULT_TILE_SIZE, DEFAULT_TILE_SIZE
    pair = tuple(tile_size) if isinstance(tile_size, (tuple, list)) else (tile_size, tile_size)
    if len(pair) != 2 or not all(_is_int(t) and t >= 1 for t in pair):
        raise ValueError(f"tile_size must be a positive int or a (tq, tk) pair of them, got {tile_size!r}")
    return int(pair[0]), int(pair[1])


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def tile_edges(n, t):
    """Start of each tile of length `t` over `n` items (the last may be shorter)."""
    return np.arange(0, n, t)


def classify(q_pos, k_pos, tile_size, causal=True):
    """Kind of every tile, an int array ``(Tq, Tk)`` of SKIP, FULL or MASKED."""
    tq, tk = tile_shape(tile_size)
    qe, ke = tile_edges(len(q_pos), tq), tile_edges(len(k_pos), tk)
    if not causal:
        return np.full((len(qe), len(ke)), FULL, dtype=np.int8)
    q_min, q_max = np.minimum.reduceat(q_pos, qe), np.maximum.reduceat(q_pos, qe)  # (Tq,)
    k_min, k_max = np.minimum.reduceat(k_pos, ke), np.maximum.reduceat(k_pos, ke)  # (Tk,)
    kinds = np.full((len(qe), len(ke)), MASKED, dtype=np.int8)
    kinds[q_min[:, None] >= k_max[None, :]] = FULL
    kinds[q_max[:, None] < k_min[None, :]] = SKIP
    return kinds


def tile_plan(q_pos, k_pos, tile_size, causal=True):
    """The tiles to compute, in order: a list of ``(q_slice, k_slice, kind)``,
    and the number of tiles skipped."""
    tq, tk = tile_shape(tile_size)
    kinds = classify(q_pos, k_pos, (tq, tk), causal)
    plan = []
    for a, i in enumerate(tile_edges(len(q_pos), tq)):
        for b, j in enumerate(tile_edges(len(k_pos), tk)):
            if kinds[a, b] != SKIP:
                plan.append((slice(i, i + tq), slice(j, j + tk), int(kinds[a, b])))
    return plan, int((kinds == SKIP).sum())


def visible(q_pos, k_pos, causal=True):
    """The mask from positions: True where key k is visible to query q. ``(c, ck)``"""
    if not causal:
        return np.ones((len(q_pos), len(k_pos)), dtype=bool)
    return q_pos[:, None] >= k_pos[None, :]


def any_visible(q_pos, k_pos, causal=True):
    """(c,) bool: which queries can see at least one of the keys."""
    if len(k_pos) == 0:
        return np.zeros(len(q_pos), dtype=bool)
    if not causal:
        return np.ones(len(q_pos), dtype=bool)
    return q_pos >= k_pos.min()


def count_visible_pairs(q_pos, k_pos, causal=True):
    """Visible (query, key) pairs without building the mask: for each query, the
    number of keys at or before it."""
    if not causal:
        return len(q_pos) * len(k_pos)
    return int(np.searchsorted(np.sort(k_pos), q_pos, side="right").sum())
