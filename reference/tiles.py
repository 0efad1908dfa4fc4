"""Tiles: cut one (query shard, key block) pair into tiles and say which to skip.

Paper, section 2.2.1: a block of queries against a block of keys is cut into
tiles of ``tq`` queries by ``tk`` keys, in local index order. With the causal
rule "key k is visible to query q iff pos_k <= pos_q", a tile is

- SKIP   when no pair in it is visible:   max(pos_q) <  min(pos_k),
- FULL   when every pair is visible:      min(pos_q) >= max(pos_k),
- MASKED otherwise: computed with the mask ``q_pos[:, None] >= k_pos[None, :]``.

Both rules follow from the pair rule by taking the extreme pair of the tile,
so they hold for every layout. Other masks (`reference.masks`: windows,
documents, padding) are classified exactly from the number of visible pairs
in each tile, counted without building the mask (`masks.visible_counts`):
SKIP at none, FULL at all of them. The attention step and the cost model both
read this plan, so the work they count is the work that is done.

Legend: ``c`` queries, ``ck`` keys, ``T`` tiles.
"""

from typing import NamedTuple

import numpy as np

from .masks import as_mask, visible_counts
# the pair rule and its counts live in `masks`; importable from here as they were
from .masks import any_visible, count_visible_pairs, visible  # noqa: F401

SKIP, FULL, MASKED = 0, 1, 2
DEFAULT_TILE_SIZE = 256


class Tile(NamedTuple):
    """A tile size resolved: ``tq`` queries by ``tk`` keys. A call resolves its
    tile once, at the door (`reference.call`); `tile_shape` returns a Tile as it is."""
    tq: int
    tk: int


def tile_shape(tile_size):
    """The `Tile` of an int, a ``(tq, tk)`` pair, or None (the default); a Tile as it is."""
    if isinstance(tile_size, Tile):
        return tile_size
    if tile_size is None:
        return Tile(DEFAULT_TILE_SIZE, DEFAULT_TILE_SIZE)
    pair = tuple(tile_size) if isinstance(tile_size, (tuple, list)) else (tile_size, tile_size)
    if len(pair) != 2 or not all(_is_int(t) and t >= 1 for t in pair):
        raise ValueError(f"tile_size must be a positive int or a (tq, tk) pair of them, got {tile_size!r}")
    return Tile(int(pair[0]), int(pair[1]))


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def plan_tile(plan):
    """The (tq, tk) a non-empty `tile_plan` was cut with: its slices are
    ``slice(i, i + tq)`` and ``slice(j, j + tk)``, the last ones included."""
    qs, ks, _ = plan[0]
    return qs.stop - qs.start, ks.stop - ks.start


def by_tile(plan, which):
    """Group the plan by its query tiles (which=0) or key tiles (which=1):
    a list of (slice, [(other slice, kind), ...]) in plan order."""
    groups = {}
    for entry in plan:
        own = entry[which]
        groups.setdefault((own.start, own.stop), (own, []))[1].append((entry[1 - which], entry[2]))
    return list(groups.values())


def tile_edges(n, t):
    """Start of each tile of length `t` over `n` items (the last may be shorter)."""
    return np.arange(0, n, t)


def classify(q_pos, k_pos, tile_size, mask=True):
    """Kind of every tile, an int array ``(Tq, Tk)`` of SKIP, FULL or MASKED.
    `mask`: a `reference.masks.Mask`, or a bool (causal or not)."""
    mask = as_mask(mask)
    tq, tk = tile_shape(tile_size)
    qe, ke = tile_edges(len(q_pos), tq), tile_edges(len(k_pos), tk)
    if not mask.causal_only:
        return _classify_by_count(q_pos, k_pos, qe, ke, tq, tk, mask)
    if not mask.causal:
        return np.full((len(qe), len(ke)), FULL, dtype=np.int8)
    q_min, q_max = np.minimum.reduceat(q_pos, qe), np.maximum.reduceat(q_pos, qe)  # (Tq,)
    k_min, k_max = np.minimum.reduceat(k_pos, ke), np.maximum.reduceat(k_pos, ke)  # (Tk,)
    kinds = np.full((len(qe), len(ke)), MASKED, dtype=np.int8)
    kinds[q_min[:, None] >= k_max[None, :]] = FULL
    kinds[q_max[:, None] < k_min[None, :]] = SKIP
    return kinds


def _classify_by_count(q_pos, k_pos, qe, ke, tq, tk, mask):
    """Exact kinds from each tile's visible pairs: none SKIP, all FULL."""
    groups = [slice(j, j + tk) for j in ke]
    per_query = visible_counts(q_pos, k_pos, mask, groups)                 # (Tk, c)
    pairs = np.add.reduceat(per_query, qe, axis=1).T                        # (Tq, Tk)
    rows = np.diff(np.append(qe, len(q_pos)))[:, None]                       # (Tq, 1)
    cols = np.diff(np.append(ke, len(k_pos)))[None, :]                       # (1, Tk)
    kinds = np.full(pairs.shape, MASKED, dtype=np.int8)
    kinds[pairs == rows * cols] = FULL
    kinds[pairs == 0] = SKIP
    return kinds


def tile_plan(q_pos, k_pos, tile_size, mask=True):
    """The tiles to compute, in order: a list of ``(q_slice, k_slice, kind)``,
    and the number of tiles skipped."""
    tile = tq, tk = tile_shape(tile_size)
    kinds = classify(q_pos, k_pos, tile, mask)
    plan = []
    for a, i in enumerate(tile_edges(len(q_pos), tq)):
        for b, j in enumerate(tile_edges(len(k_pos), tk)):
            if kinds[a, b] != SKIP:
                plan.append((slice(i, i + tq), slice(j, j + tk), int(kinds[a, b])))
    return plan, int((kinds == SKIP).sum())
