"""bench.tile_parts times step_parts' passes by patching the module: it must
put everything back and count the passes it names. No timing is asserted: only which passes ran (tiny blocks: S = 64, N = 4,
tiles of 8, one repeat)."""

import numpy as np

from bench import tile_parts
from bench.block_shapes import SHAPES
from reference import step_masks, step_parts


def test_timed_parts_puts_the_modules_back_even_after_an_error():
    before = [dict(vars(m)) for m in (step_parts, step_masks)]
    try:
        with tile_parts.timed_parts({}):
            assert step_parts.np is not np and step_masks.weigh is not step_parts.weigh
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert step_parts.np is np and step_masks.np is np
    assert [dict(vars(m)) for m in (step_parts, step_masks)] == before


def test_only_a_triangular_block_makes_masks():
    for backward in (False, True):
        best = tile_parts.measure("v3", 64, 4, 2, 8, 8, repeats=1, backward=backward)
        full, triangle = best[SHAPES[0]], best[SHAPES[1]]
        assert {"products", "exp2", "total", "rest"} <= set(full) & set(triangle)
        assert "masks made" not in full
        assert "masks made" in triangle
