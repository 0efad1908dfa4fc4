"""Step v5 joins neighbouring full key tiles into one product
(`reference.steps.units.join_full`): only neighbours, never across a key tile
that is skipped or masked, so a document split by a whole tile of another
still sees only its own keys.

    .venv/bin/python -m pytest tests/steps/test_join.py -q
"""

import numpy as np

import reference
from reference.steps import units

ROWS = slice(0, 8)


def test_only_neighbouring_full_tiles_are_joined():
    # key tiles 0-7 and 16-23 are full, 8-15 is skipped (absent): two products, never one over 0-23
    blocks = [(ROWS, slice(0, 8), None), (ROWS, slice(16, 24), None), (ROWS, slice(24, 32), None)]
    (qs, joined), = units.join_full([(slice(0, 8), blocks)], width=8)
    assert joined == [(ROWS, slice(0, 8), None), (ROWS, slice(16, 32), None)]
    # a masked tile between two full ones breaks the run too
    masked = [(ROWS, slice(0, 8), None), (ROWS, slice(8, 16), slice(0, 8)), (ROWS, slice(16, 24), None)]
    assert units.join_full([(slice(0, 8), masked)], width=8)[0][1] == masked
    # and at most `width` tiles a product
    run = [(ROWS, slice(8 * i, 8 * i + 8), None) for i in range(5)]
    assert [b[1] for b in units.join_full([(slice(0, 8), run)], width=2)[0][1]] == \
        [slice(0, 16), slice(16, 32), slice(32, 40)]


def test_a_document_split_by_a_whole_key_tile_of_another_sees_only_itself():
    # 2 devices of 24 tokens, tiles of 8: tokens 8-15 are one document, the rest another. In round 1
    # device 1 (queries 24-47) holds device 0's keys: tiles 0-7 and 16-23 are full, 8-15 skipped, so
    # v5 must not join 0-7 with 16-23 into one product over 0-23
    rng = np.random.default_rng(0)
    S, H, D = 48, 2, 8
    q, k, v = (rng.standard_normal((1, S, H, D)) for _ in range(3))
    segment_ids = np.array([0] * 8 + [1] * 8 + [0] * 32)
    for causal in (True, False):
        want, want_lse = reference.attention(q, k, v, causal=causal, segment_ids=segment_ids)
        out, lse = reference.ring_attention(q, k, v, n_devices=2, layout="contiguous", causal=causal,
                                            tile_size=8, step="v5", segment_ids=segment_ids)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
