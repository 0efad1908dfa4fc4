"""Layouts: each is a permutation of positions 0..S-1 into N shards of c = S // N,
as docs/design.md defines it; `shard` deals tokens by it and `unshard` undoes it.

    .venv/bin/python -m pytest tests/oracle/test_layouts.py -q
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference import LAYOUTS, inverse_positions, positions, shard, unshard


@st.composite
def layout_sizes(draw):
    """(layout, S, N) with S a multiple of N (of 2N for zigzag)."""
    layout = draw(st.sampled_from(LAYOUTS))
    n = draw(st.integers(1, 8))
    chunks = 2 * n if layout == "zigzag" else n
    return layout, chunks * draw(st.integers(1, 8)), n


def by_definition(layout, S, N):
    """docs/design.md's words, written as loops."""
    c = S // N
    if layout == "contiguous":      # device r holds r*c .. (r+1)*c - 1
        return [[r * c + i for i in range(c)] for r in range(N)]
    if layout == "striped":         # device r holds r, r+N, r+2N, ...
        return [[r + i * N for i in range(c)] for r in range(N)]
    m = S // (2 * N)                # zigzag: chunk r, then chunk 2N-1-r, chunks of S // 2N
    return [[r * m + i for i in range(m)] + [(2 * N - 1 - r) * m + i for i in range(m)] for r in range(N)]


@given(layout_sizes())
def test_positions_follow_the_definition(sizes):
    layout, S, N = sizes
    pos = positions(S, N, layout)
    assert pos.shape == (N, S // N) and pos.dtype == np.int64
    assert pos.tolist() == by_definition(layout, S, N)


@given(layout_sizes())
def test_positions_are_a_permutation(sizes):
    layout, S, N = sizes
    flat = positions(S, N, layout).ravel()
    assert sorted(flat.tolist()) == list(range(S))
    index = inverse_positions(S, N, layout)
    assert (flat[index] == np.arange(S)).all()        # concat(shards)[index] == x
    assert (index[flat] == np.arange(S)).all()


@given(layout_sizes(), st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2]))
def test_unshard_inverts_shard(sizes, seed, axis):
    layout, S, N = sizes
    shape = [2, 3, 2]
    shape.insert(axis, S)                             # the token axis anywhere
    x = np.random.default_rng(seed).standard_normal(shape)
    shards = shard(x, N, layout, axis=axis)
    assert len(shards) == N
    pos = positions(S, N, layout)
    for j, s in enumerate(shards):                    # shard j holds exactly its positions' tokens
        np.testing.assert_array_equal(s, np.take(x, pos[j], axis=axis))
    np.testing.assert_array_equal(unshard(shards, layout, axis=axis), x)


def test_docstring_examples():
    # positions' docstring, S=8, N=4
    assert positions(8, 4, "contiguous").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert positions(8, 4, "striped").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert positions(8, 4, "zigzag").tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # inverse_positions' docstring: striped, flattened [0 4 1 5 2 6 3 7]
    assert inverse_positions(8, 4, "striped").tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    # the paper's example (section 2.2.1): 4 devices, device 0 owns 0, 4, 8, ...
    assert positions(16, 4, "striped")[0].tolist() == [0, 4, 8, 12]
    assert positions(16, 4, "striped")[1].tolist() == [1, 5, 9, 13]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_device_is_the_identity(layout):
    S = 6
    assert positions(S, 1, layout).tolist() == [list(range(S))]
    x = np.arange(2 * S).reshape(1, S, 2)
    np.testing.assert_array_equal(shard(x, 1, layout)[0], x)


def test_ulysses_positions_docstring_example():
    from reference.layouts import ulysses_positions
    assert ulysses_positions(8, 2, 2, "contiguous").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ulysses_positions(8, 2, 2, "striped").tolist() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert ulysses_positions(8, 2, 2, "zigzag").tolist() == [[0, 1], [6, 7], [2, 3], [4, 5]]
    assert ulysses_positions(8, 2, 2, "zigzag", ulysses_inner=False).tolist() == [[0, 1], [2, 3], [6, 7], [4, 5]]


def usp_by_definition(layout, S, r, u):
    """yunchang's words (comm/extract_local.py), as loops: order the tokens as the
    ring's layout deals them over r ring ranks (contiguous: as they are; striped:
    stripe 0, stripe 1, ...; zigzag: chunks i and 2r-1-i of 2r for each i), then
    rank g takes the g-th of N = r * u equal pieces."""
    if layout == "contiguous":
        order = list(range(S))
    elif layout == "striped":
        order = [t for i in range(r) for t in range(i, S, r)]
    else:
        m = S // (2 * r)
        order = [t for i in range(r) for chunk in (i, 2 * r - 1 - i) for t in range(chunk * m, (chunk + 1) * m)]
    c = S // (r * u)
    return [order[g * c:(g + 1) * c] for g in range(r * u)]


@given(layout_sizes(), st.integers(1, 4))
def test_ulysses_positions_follow_the_definition(sizes, u):
    from reference.layouts import ulysses_positions
    layout, S, r = sizes
    S *= u                                              # a multiple of the layout's unit for r * u ranks
    pos = ulysses_positions(S, r, u, layout)
    assert pos.shape == (r * u, S // (r * u)) and sorted(pos.ravel().tolist()) == list(range(S))
    assert pos.tolist() == usp_by_definition(layout, S, r, u)
    if u == 1:
        assert pos.tolist() == positions(S, r, layout).tolist()
    if r == 1:
        assert pos.tolist() == positions(S, u, "contiguous").tolist()
    # ring groups inner: rank g holds what rank (g % r) * u + g // r holds with Ulysses groups inner
    outer = ulysses_positions(S, r, u, layout, ulysses_inner=False)
    assert outer.tolist() == [pos[(g % r) * u + g // r].tolist() for g in range(r * u)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_inverse_of_a_padded_layout_holds_only_the_real_tokens(layout):
    # S = 7 on 2 devices: striped and contiguous pad to 8, zigzag to 8; the padding has no place in x
    x = np.arange(7) * 10
    index = inverse_positions(7, 2, layout)
    assert len(index) == 7
    assert (np.concatenate(shard(x, 2, layout, axis=0))[index] == x).all()

