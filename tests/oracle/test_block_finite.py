"""Whether a block's K and V are finite is its flag where it has one, and a
look at K and V where it has none, whatever device it started on
(`reference.nonfinite.block_finite`): a NaN in a key that a query cannot see
reaches only the rows that see it (docs/design.md), however the block was made.

    .venv/bin/python -m pytest tests/oracle/test_block_finite.py -q
"""

import numpy as np
import pytest

import reference
from reference.heads import kv_to_heads, q_from_heads, rows_from_heads
from reference.nonfinite import block_finite
from reference.step import ForwardAcc, KVBlock, Queries, finish_forward

OWNERS = (0, 1, 3)


def block(k, v, source):
    return KVBlock(kv_to_heads(k), kv_to_heads(v), np.arange(k.shape[1]), np.array(source, np.int32))


@pytest.mark.parametrize("owner", OWNERS)
def test_a_block_without_its_flag_is_looked_at_whoever_owns_it(owner):
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((1, 8, 2, 4)) for _ in range(2))
    assert block_finite(np, block(k, v, [owner]))
    k[0, 5, 1, 2] = np.nan
    assert not block_finite(np, block(k, v, [owner]))
    v[...] = np.inf
    assert not block_finite(np, block(k * 0, v, [owner]))


@pytest.mark.parametrize("owner", OWNERS)
def test_a_blocks_flag_is_believed_whoever_owns_it(owner):
    k = v = np.zeros((1, 8, 2, 4))
    assert not block_finite(np, block(k, v, [owner, 0]))
    assert block_finite(np, block(k, v, [owner, 1]))


@pytest.mark.parametrize("step", ["v1", "v5"])
@pytest.mark.parametrize("owner", OWNERS)
def test_a_nan_reaches_only_the_rows_that_see_it_in_a_block_without_its_flag(step, owner):
    rng = np.random.default_rng(1)
    S, D = 16, 4
    q, k, v = (rng.standard_normal((1, S, 2, D)) for _ in range(3))
    v[0, 9, 0, 1] = np.nan          # value 9: rows 9.. see it (causal); 0 x NaN would reach row 8 too
    want, want_lse = reference.attention(q, k, v)
    queries = Queries.prepare(q, 2, np.arange(S), D ** -0.5)
    acc = ForwardAcc.zeros(queries.q)
    reference.steps.get(step).forward(acc, queries, block(k, v, [owner]), causal=True, tile_size=4)
    out, lse = (q_from_heads(x) if x.ndim == 5 else rows_from_heads(x) for x in finish_forward(acc))
    assert np.isfinite(out[:, :9]).all() and np.isnan(out[:, 9:, 0, 1]).all()
    np.testing.assert_allclose(out[:, :9], want[:, :9], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse[..., :9], want_lse[..., :9], rtol=1e-12, atol=1e-12)


def test_bfloat16_bits_are_finite_where_their_value_is():
    """Every one of the 65,536 bfloat16 bit patterns, held as uint16 (as CuPy
    holds bfloat16): finite exactly where ml_dtypes' bfloat16 value is
    (`isfinite` on the integers would call them all finite)."""
    from reference.checks import BFLOAT16
    from reference.nonfinite import finite
    bits = np.arange(2 ** 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):         # ml_dtypes 0.6 flags the signalling NaNs' patterns
        expected = np.isfinite(bits.view(BFLOAT16))
    np.testing.assert_array_equal(finite(np, bits), expected)
