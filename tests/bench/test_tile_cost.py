"""The tile-cost model's arithmetic (`reference.tile_cost`), with made-up costs, nothing timed.

A TileCosts of known per-tile seconds must predict, round by round, the
critical path counted here by hand from the tiles each device computes; the
Sharing of ranks on one machine must scale each round by the ranks computing
in it and charge the bytes its step moves; a fit of the calibration's three
blocks must give back the costs that made their times. The calibration itself
runs once, tiny, for its shape (which keys it fills), never for its figures.

    .venv/bin/python -m pytest tests/bench/test_tile_cost.py -q
"""

import numpy as np
import pytest

from reference.scheme_cost import predict_scheme
from reference.schemes import Scheme
from reference.tile_cost import Calibration, PassCost, Sharing, TileCosts

SHAPE = dict(B=1, Hq=4, Hkv=4, D=2)
COST = PassCost(full=1.0, masked=3.0, first=10.0)        # seconds, made up


def predicted(name, layout, u=None, backward=False, seq_len=16, tile=2):
    scheme = Scheme.checked(name, u, n_devices=4, Hq=4, Hkv=4)
    return predict_scheme(scheme, seq_len, layout, tile_size=tile, backward=backward, **SHAPE)


def costs_for(*costs, per=COST):
    return TileCosts({c.step_shape: per for c in costs})


def test_a_round_costs_its_full_and_masked_tiles_and_the_own_blocks_extra():
    """Ring, contiguous, S = 16 on 4 devices, tiles of 2 (a block is 2 x 2
    tiles): round 0 every device attends to its own causal block (1 full, 2
    masked, and the extra), later rounds a full block (4 full) or nothing."""
    cost = predicted("ring", "contiguous")
    seconds = costs_for(cost).seconds(cost)
    own = 1 * 1.0 + 2 * 3.0 + 10.0
    want = np.array([[own] * 4, [0, 4, 4, 4], [0, 0, 4, 4], [0, 0, 0, 4]], dtype=float)
    np.testing.assert_array_equal(seconds, want)
    assert costs_for(cost).critical_path(cost) == own + 3 * 4.0


def test_every_scheme_charges_its_own_heads_and_block():
    """Striped: every later block is triangular (1 full, 2 masked). Ulysses:
    one round of one head on the whole 16-token block (36 tiles, 8 of them
    on the diagonal). USP: two rounds of 8-token blocks."""
    ring, ulysses, usp = predicted("ring", "striped"), predicted("ulysses", "striped"), predicted("usp", "striped", 2)
    tiles = costs_for(ring, ulysses, usp)
    assert (ring.step_shape.heads, ulysses.step_shape.heads, usp.step_shape.heads) == (4, 1, 2)
    assert tiles.critical_path(ring) == (7.0 + 10.0) + 3 * 7.0
    assert tiles.critical_path(ulysses) == 28 * 1.0 + 8 * 3.0 + 10.0
    assert tiles.critical_path(usp) == (6 * 1.0 + 4 * 3.0 + 10.0) + (6 * 1.0 + 4 * 3.0)


def test_sharing_scales_each_round_by_its_busy_ranks_and_charges_the_bytes_in_flight():
    """Contiguous: 4 - t devices compute in round t; a block of 296 bytes
    travels in every round but the last (sent and received: 592 a round).
    Ulysses' all-to-alls are exposed: nothing in flight while it computes."""
    cost, ulysses = predicted("ring", "contiguous"), predicted("ulysses", "contiguous")
    factor = {(busy, b): 1 + busy / 10 for busy in range(1, 5) for b in (False, True)}
    tiles = costs_for(cost, ulysses)
    tiles.sharing = Sharing(cores=2, ranks=4, factor=factor, copy_s_per_byte=0.001)
    alone = costs_for(cost).seconds(cost)
    moved = np.array([592, 592, 592, 0])[:, None]
    np.testing.assert_allclose(tiles.seconds(cost), alone * np.array([1.4, 1.3, 1.2, 1.1])[:, None] + moved * 0.001)
    np.testing.assert_allclose(tiles.seconds(ulysses), costs_for(ulysses).seconds(ulysses) * 1.4)
    tiles.sharing = Sharing(cores=2, ranks=2, factor=factor, copy_s_per_byte=0.0)
    with pytest.raises(ValueError, match="up to 2 ranks busy, not 4"):
        tiles.seconds(cost)


def test_the_fit_gives_back_the_costs_that_made_the_times():
    cal = Calibration(*[None] * 7, counts={"own": (6, 4), "full": (16, 0), "striped": (6, 4)})
    times = {kind: full * COST.full + masked * COST.masked for kind, (full, masked) in cal.counts.items()}
    times["own"] += COST.first
    assert cal.fit(times) == pytest.approx(COST)


def test_measured_costs_cover_both_passes_and_refuse_a_shape_not_measured(tmp_path):
    """The calibration at a tiny shape fills both passes; saved and loaded, the
    same costs and sharing; a SchemeCost of another shape is refused by name."""
    cost = predicted("ring", "striped")
    tiles = TileCosts.measure([cost.step_shape], repeats=1)
    assert set(tiles.costs) == {cost.step_shape, cost.step_shape._replace(backward=True)}
    assert all(np.isfinite(per).all() and per.full > 0 for per in tiles.costs.values())
    tiles.sharing = Sharing(cores=2, ranks=4, factor={(1, False): 1.0, (1, True): 1.1}, copy_s_per_byte=1e-10)
    tiles.save(tmp_path / "costs.json")
    back = TileCosts.load(tmp_path / "costs.json")
    assert back.costs == tiles.costs and back.sharing == tiles.sharing
    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        TileCosts.measure([cost.step_shape], repeats=0)
    with pytest.raises(ValueError, match="no tile costs measured for StepShape.*heads=1"):
        tiles.seconds(predicted("ulysses", "striped"))
