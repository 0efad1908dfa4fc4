"""How the tuned NumPy steps mask a block: a block's mask made once for all heads, on its masked rows only.

`reference.steps.parts` computes a block of stacked query tiles at a time
(`reference.steps.units.forward_units`); only the rows of its masked tiles
need the mask (`TilePos.part`). Masks come from positions
(`reference.masks.visible`), are made once per step call for all heads
(`tile_masks`), and are applied either by ``copyto(..., where=)`` (`hide`:
exact, whatever the value under the mask) or by a product with a 0/1 matrix
(`weigh`: about 3.5 times faster, but inf x 0 = NaN x 0 = NaN).

Shapes: a block of ``tq`` queries x ``G`` query heads = ``R`` rows, query-major, and ``tk`` keys.
"""

from typing import NamedTuple

import numpy as np

from ..masks import as_mask, visible
from ..tiles import MASKED


class TilePos(NamedTuple):
    """What makes a masked block's mask: its query and key positions, the
    rule, where masks already made are kept (`tile_masks`), and `part`, the
    query rows that hold its masked tiles (`units.forward_units`): the
    other rows see every key, so only `part` is masked."""
    q_pos: np.ndarray
    k_pos: np.ndarray
    rule: object
    masks: dict
    part: slice = slice(None)

    def mask(self):
        return tile_masks(self.masks, self.q_pos, self.k_pos, self.rule)[0]     # (tq, tk) bool, True: visible

    def rows(self, s):
        """The rows of `part` of the block's s (..., R, tk), R = tq * G query-major:
        a view (..., tq of part, G, tk)."""
        return s.reshape(s.shape[:-2] + (len(self.q_pos), -1, s.shape[-1]))[..., self.part, :, :]

    def hidden(self):
        """(rows of `part`, tk) bool, True: masked."""
        return tile_masks(self.masks, self.q_pos[self.part], self.k_pos, self.rule)[1]

    def weights(self, dtype):
        """(rows of `part`, tk) of `dtype`: 1 where visible, 0 where masked."""
        seen, _, by_dtype = tile_masks(self.masks, self.q_pos[self.part], self.k_pos, self.rule)
        found = by_dtype.get(dtype)
        if found is None:
            found = by_dtype[dtype] = seen.astype(dtype)
        return found


def tile_masks(masks, q_pos, k_pos, rule):
    """(visible, hidden, {dtype: weights}) of the tile of these positions,
    (tq, tk) bool each, made once and kept in `masks` (a dict living for one
    step call, so one rule): every head of a block has the same positions, so
    its tiles have the same masks. The key is the positions themselves (bytes:
    about 1 us for a tile, against 10 for the address of a view); under the
    causal flag alone, where what a query sees depends on q - k only, the
    positions less the tile's first query, so that tiles that differ by a
    shift share one mask (a striped triangular block's diagonal tiles: one
    mask for the block instead of one a tile)."""
    if as_mask(rule).causal_only and len(q_pos) and q_pos.dtype.kind == k_pos.dtype.kind == "i":
        q_pos, k_pos = q_pos - q_pos[0], k_pos - q_pos[0]
    key = (len(q_pos), q_pos.tobytes(), k_pos.tobytes())
    found = masks.get(key)
    if found is None:
        seen = visible(q_pos, k_pos, rule)
        found = masks[key] = (seen, ~seen, {})
    return found


def weigh(s, where):
    """s (R, tk) *= 1 where visible, 0 at the masked pairs of `where` (None:
    none), on the rows of its masked tiles only. A product by a 0/1 matrix runs
    about 3.5 times faster than ``copyto(..., where=)`` (5 against 18 us a tile
    of 128 x 128), but inf x 0 = NaN x 0 = NaN: only for a tile whose row sums
    are checked afterwards, and redone where one is not finite (`lazy_tile`)."""
    if where is not None:
        rows = where.rows(s)
        np.multiply(rows, where.weights(s.dtype)[:, None, :], out=rows)


def hide(s, hidden, value):
    """s (tq, G, tk) := `value` at the masked pairs of `hidden` (tq, tk) (True: masked)."""
    np.copyto(s, value, where=hidden[:, None, :])


def exp2_visible(p, hq, col, qs, members):
    """The backward's P (`parts.backward_cols`: hq, col its queries and
    key column): p (R, tk) := exp2(p), then 0 at the masked pairs of the
    masked tiles among `members` [(query slice, kind)] of the run `qs`. A
    masked entry may overflow to inf or be NaN before it is cleared; it
    contributes nothing either way. Returns the last masked tile's visible
    mask (tq, tk), None if none: a guarded run holds one tile."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.exp2(p, out=p)
    rows, mask = p.reshape(qs.stop - qs.start, -1, p.shape[1]), None
    for ms, kind in members:
        if kind == MASKED:
            mask, hidden = tile_masks(hq.masks, hq.pos[ms], col.pos, hq.mask)[:2]
            hide(rows[ms.start - qs.start:ms.stop - qs.start], hidden, 0)
    return mask
