"""bench.tile_parts times parts' passes by patching the module: it must
put everything back and count the passes it names. No timing is asserted: only which passes ran (tiny blocks: S = 64, N = 4,
tiles of 8, one repeat)."""

import numpy as np

from bench import tile_parts
from bench.block_shapes import SHAPES
from reference.steps import parts, tile_masks


def test_timed_parts_puts_the_modules_back_even_after_an_error():
    before = [dict(vars(m)) for m in (parts, tile_masks)]
    try:
        with tile_parts.timed_parts({}):
            assert parts.np is not np and tile_masks.weigh is not parts.weigh
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert parts.np is np and tile_masks.np is np
    assert [dict(vars(m)) for m in (parts, tile_masks)] == before


def test_only_a_triangular_block_makes_masks():
    for backward in (False, True):
        best = tile_parts.measure("v3", 64, 4, 2, 8, 8, repeats=1, backward=backward)
        full, triangle = best[SHAPES[0]], best[SHAPES[1]]
        assert {"products", "exp2", "total", "rest"} <= set(full) & set(triangle)
        assert "masks made" not in full
        assert "masks made" in triangle
