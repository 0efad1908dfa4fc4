"""The dropout hash (`reference.masks.keep_weights`) on its own, not through
the dense oracle (which calls the same hash, so every comparison with it
agrees with itself): known answers from the formula written again in plain
Python integers, and pinned bits; each (batch, head), each position pair and
each seed drawing independent coins.

    .venv/bin/python -m pytest tests/oracle/test_dropout_hash.py -q
"""

import itertools

import numpy as np
import pytest

from reference.masks import keep_weights, make_mask

MASK64 = 2 ** 64 - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix(z):
    """SplitMix64's finalizer on a Python int (the module docstring's hash, written again)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def kept(seed, b, h, q, k, p):
    """Whether pair (b, h, q, k) is kept: hash(seed, b, h, q, k) >= p * 2**64."""
    key = mix(mix((b * GOLDEN + h + mix(seed)) & MASK64))
    return mix(mix((q << 32) | k) ^ key) >= min(int(p * 2.0 ** 64), MASK64)


@pytest.mark.parametrize("seed, p", [(0, 0.5), (7, 0.1), (2 ** 63 - 1, 0.9), (12345, 0.3)])
def test_keep_weights_are_the_formula(seed, p):
    B, H, q_pos, k_pos = 2, 3, np.array([0, 5, 31, 1000]), np.array([0, 1, 999, 2 ** 20])
    z = keep_weights(make_mask(dropout=p, seed=seed), np.arange(B), np.arange(H), q_pos, k_pos)
    want = np.array([[[[kept(seed, b, h, int(q), int(k), p) for k in k_pos] for q in q_pos]
                      for h in range(H)] for b in range(B)])
    np.testing.assert_array_equal(z != 0, want)
    assert set(np.unique(z).tolist()) <= {0.0, np.float32(1 / (1 - p))}


def test_keep_weights_are_pinned():
    # the dropped pairs are part of the results users record: pinned here, so
    # a change of the hash is seen as one (seed 3, p = 0.5, 8 x 8 pairs of b=1, h=2)
    z = keep_weights(make_mask(dropout=0.5, seed=3), [1], [2], np.arange(8), np.arange(8))[0, 0]
    bits = int("".join("1" if x else "0" for x in (z != 0).ravel()), 2)
    assert bits == 0x743F63C3DBFBD28, hex(bits)          # the formula above gives it too


def _agreement(a, b):
    return float(((a == 0) == (b == 0)).mean())


def test_every_batch_and_head_draws_its_own_coins():
    # p = 1/2: two independent streams agree on half the pairs (4,096 pairs:
    # sd 0.008, the bound 6 sd); (b, h) and (h, b), and b + h equal, included
    p, B, H = 0.5, 4, 4
    z = keep_weights(make_mask(dropout=p, seed=11), np.arange(B), np.arange(H), np.arange(64), np.arange(64))
    for (b1, h1), (b2, h2) in itertools.combinations(itertools.product(range(B), range(H)), 2):
        assert abs(_agreement(z[b1, h1], z[b2, h2]) - 0.5) < 0.05, ((b1, h1), (b2, h2))


def test_every_pair_and_seed_draws_its_own_coin():
    p, n = 0.5, 64
    mask = make_mask(dropout=p, seed=5)
    z = keep_weights(mask, [0], [0], np.arange(n), np.arange(n))[0, 0]
    # neighbours along the rows, the columns and the diagonals (q + k, q - k kept)
    for a, b in ((z[1:], z[:-1]), (z[:, 1:], z[:, :-1]), (z[1:, :-1], z[:-1, 1:]), (z[1:, 1:], z[:-1, :-1]),
                 (z, z.T)):
        assert abs(_agreement(a, b) - 0.5) < 0.05
    for seed in (6, 5 + 2 ** 32, 2 ** 62 + 5):
        other = keep_weights(make_mask(dropout=p, seed=seed), [0], [0], np.arange(n), np.arange(n))[0, 0]
        assert abs(_agreement(z, other) - 0.5) < 0.05, seed


def test_the_kept_fraction_is_one_minus_p_for_every_p():
    for p in (0.01, 0.25, 0.5, 0.9):
        z = keep_weights(make_mask(dropout=p, seed=1), [0, 1], [0], np.arange(200), np.arange(200))
        assert abs((z == 0).mean() - p) < 6 * (p * (1 - p) / z.size) ** 0.5 + 1e-3, p
        np.testing.assert_allclose(z[z != 0], 1 / (1 - p), rtol=1e-6)
    assert keep_weights(make_mask(), [0], [0], np.arange(3), np.arange(3)) is None
