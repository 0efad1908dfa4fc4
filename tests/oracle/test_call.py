"""A ring call checked at the door (`reference.call.check_call`): what ranks
compare is the call as resolved, not as written, and each refusal names the
rule it breaks.

    .venv/bin/python -m pytest tests/oracle/test_call.py -q
"""

import numpy as np
import pytest

from reference.call import check_call


def shard(c=4, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, c, 2, 4)) for _ in range(3))


def test_ranks_that_write_the_same_tile_two_ways_agree():
    # MPI ranks compare describe(): 64 and (64, 64) are one tile, as are None and the default tile
    one = check_call(*shard(), n_devices=2, per_device=True, tile_size=64).describe()
    two = check_call(*shard(seed=1), n_devices=2, per_device=True, tile_size=(64, 64)).describe()
    assert one == two
    assert one["tile_size"] == (64, 64)
    other = check_call(*shard(), n_devices=2, per_device=True, tile_size=(64, 32)).describe()
    assert other != one


def test_an_odd_zigzag_shard_is_refused_for_what_it_is_with_or_without_seq_len():
    for seq_len in (None, 6, 5):
        with pytest.raises(ValueError, match="zigzag' needs an even number of tokens per rank .* got 3 tokens "
                                             "per rank on 2 ranks"):
            check_call(*shard(c=3), n_devices=2, layout="zigzag", per_device=True, seq_len=seq_len)
    with pytest.raises(ValueError, match="seq_len must be the real sequence length"):
        check_call(*shard(c=4), n_devices=2, layout="zigzag", per_device=True, seq_len=3)


def test_the_call_resolves_its_tile_once_and_every_step_takes_it_as_it_is(monkeypatch):
    """The call carries (tq, tk), a Tile; the N x N steps of a ring read it as
    it is: an int, a pair or None is resolved once, at the door."""
    import reference
    from reference import step, tiles

    call = check_call(*shard(), n_devices=2, per_device=True, tile_size=3)
    assert call.tile == (3, 3) and isinstance(call.tile, tiles.Tile)
    assert check_call(*shard(), n_devices=2, per_device=True).tile == (tiles.DEFAULT_TILE_SIZE,) * 2
    resolved = []
    real = tiles.tile_shape

    def counting(tile_size):
        if not isinstance(tile_size, tiles.Tile):
            resolved.append(tile_size)
        return real(tile_size)
    monkeypatch.setattr(tiles, "tile_shape", counting)
    monkeypatch.setattr(step, "tile_shape", counting)
    q, k, v = (np.random.default_rng(1).standard_normal((1, 16, 2, 4)) for _ in range(3))
    reference.ring_attention(q, k, v, n_devices=4, tile_size=(2, 3))
    assert resolved == [(2, 3)]
