"""What only step version 5 (reference/steps/v5.py) has: a group of heads
computed together, lazy or seeded, and a head that does not pass the row
sums' check (or cannot be lazy) redone alone while the others keep their
batched result. Each case here is built so that some heads of a group take
one path and others another: a bug in the per-head fall-back shows in the
answer (against dense) or in the count of exact tiles. Also: the groups of
heads, and the registration. Results bit for bit the same on 1, 2 or 3
workers: tests/steps/test_step_v3.py, with version 3.
Agreement with dense on every mask is tests/steps/test_step.py's and test_masks.py's.

    .venv/bin/python -m pytest tests/steps/test_step_v5.py -q
"""

import numpy as np
import pytest

from conftest import LARGE_LOGITS_FACTOR, assert_close
from reference import attention, steps
from reference.steps import parts, units, v5
from reference.steps.v5 import head_groups
from test_step_v3 import exact_tiles, n_blocks  # noqa: F401 (a fixture)
from test_step import check_against_dense, growing_scores, problem, step_forward


def forward_against_dense(q, k, v, blocks, tile_size, factor=1):
    """Version 5's forward (heads in one group) against dense, finite everywhere."""
    out, lse, _ = step_forward(steps.get("v5"), q, k, v, blocks, tile_size=tile_size)
    ref_out, ref_lse = attention(q, k, v)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close(out, ref_out, np.float32, "out", factor)
    assert_close(lse, ref_lse, np.float32, "lse", factor)


def one_head_spiked(score, blocks, S=32, H=3, D=8, head=1, seed=6):
    """Keys 24..31 score `score` in head `head` only, for queries 0..23,
    which cannot see them (causal); the other heads' scores are gaussian.
    Version 5's forward against dense; H heads, one group."""
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, D=D, dtype=np.float64, seed=seed)
    q[:, :, head, 0] = np.where(np.arange(S) < 24, 1.0, 0.0)[None, :]
    k[:, :, head, 0] = np.where(np.arange(S) < 24, 0.0, score * D ** 0.5)[None, :]
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    forward_against_dense(q, k, v, blocks, tile_size=32)


def test_gaussian_scores_stay_batched(exact_tiles):
    # ordinary scores, keys in two blocks in order: every tile of every head
    # lazy or seeded, none exact (shuffled blocks leave some rows of a tile
    # without a key, and those tiles are exact in version 3 as here)
    q, k, v, _ = problem(B=2, S=128, Hq=4, Hkv=4, dtype=np.float32)
    forward_against_dense(q, k, v, [np.arange(64), np.arange(64, 128)], tile_size=16)
    assert len(exact_tiles) == 0


def test_one_heads_seed_that_underflows_is_redone_alone(exact_tiles):
    # head 1's first tile: its seed comes from a masked key scoring 100, under
    # which its visible scores underflow; it alone is redone exactly, heads 0
    # and 2 keep their seeded tile
    one_head_spiked(100.0, [np.arange(32)], seed=7)
    assert len(exact_tiles) == 1


def test_one_heads_sum_that_overflows_is_redone_alone(exact_tiles):
    # head 1's second block: a masked score of 700 overflows exp2 (inf x 0 =
    # NaN in the row sums); it alone is redone, the other heads' lazy tiles kept
    one_head_spiked(700.0, [np.arange(16), np.arange(16, 32)])
    assert len(exact_tiles) == 1


def test_one_head_whose_scores_grow_is_redone_and_the_others_are_not(exact_tiles):
    # head 0's scores grow by about 100 a key tile (each tile redone exactly),
    # head 1's are gaussian: its tiles stay lazy in the same group
    # (the same tiles version 3 redoes, a head at a time)
    q, k, v, dout = growing_scores(np.float32, H=2)
    k[:, :, 1, 0] = k[:, :128, 1, 1].mean()
    step_forward(steps.get("v3"), q, k, v, [np.arange(256)], tile_size=32)
    by_v3 = len(exact_tiles)
    exact_tiles.clear()
    check_against_dense(steps.get("v5"), q, k, v, dout, [np.arange(256)], tile_size=32, large_logits=True)
    assert len(exact_tiles) == by_v3 and 2 < by_v3 < n_blocks(256, 32, 1)


@pytest.mark.parametrize("bad", ["huge", "nan"])
def test_a_head_that_cannot_be_lazy_sends_its_group_one_head_at_a_time(bad, exact_tiles):
    # head 2's V is huge (O could overflow under a lazy shift) or holds a NaN:
    # it is exact on every tile, heads 0 and 1 stay lazy (version 3's tile, a
    # head at a time), and a NaN reaches only the rows that see it
    S, H = 64, 3
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, dtype=np.float32)
    if bad == "huge":
        v[:, :, 2] *= np.float32(1e25)
    else:
        v[0, 40, 2, 0] = np.nan
    out, lse, _ = step_forward(steps.get("v5"), q, k, v, [np.arange(S)], tile_size=16)
    ref_out, ref_lse = attention(q, k, v)
    assert len(exact_tiles) == n_blocks(S, 16, 1)         # every block of head 2, none of the others
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    seen = ~np.isnan(ref_out)
    scale = np.abs(ref_out[seen]).max()
    assert_close(out[seen] / scale, ref_out[seen] / scale, np.float32, "out")
    assert_close(lse[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)], np.float32, "lse")


def test_large_logits_in_every_head(exact_tiles):
    q, k, v, dout = growing_scores(np.float32, H=3)
    forward_against_dense(q, k, v, [np.arange(256)], tile_size=32, factor=LARGE_LOGITS_FACTOR)
    assert len(exact_tiles) > 3 * 2


@pytest.mark.parametrize("n_heads, workers, most, sizes", [
    (8, 1, None, [8]), (8, 2, None, [4, 4]), (3, 2, None, [2, 1]), (2, 5, None, [1, 1]), (7, 3, None, [2, 3, 2]),
    (8, 1, 4, [4, 4]), (8, 1, 3, [3, 2, 3]), (8, 4, 4, [2, 2, 2, 2]), (5, 1, 1, [1] * 5), (2, 1, 8, [2])])
def test_head_groups_cover_every_head_once(n_heads, workers, most, sizes):
    # at least `workers` groups, none of more than `most` heads
    groups = head_groups(n_heads, workers, most)
    assert [g.stop - g.start for g in groups] == sizes
    assert [h for g in groups for h in range(g.start, g.stop)] == list(range(n_heads))


def test_v5_is_registered_and_refuses_dropout():
    assert "v5" in steps.names() and steps.get("v5", workers=2).workers == 2
    with pytest.raises(ValueError, match="step 'v5' has no dropout; use step='v1'"):
        steps.check_step("v5", np, dropout=True)


@pytest.mark.parametrize("scores, G, sizes", [(None, 1, {4}), (512 * 8 * 2, 1, {2}), (512 * 8 * 2, 128, {1})])
def test_a_group_holds_as_many_heads_as_its_scores_allow(scores, G, sizes, monkeypatch):
    # tiles of 8 keys: GROUP_SCORES of 512 rows x 8 keys x 2 heads makes groups of 2 of the 4 heads; with
    # 128 query heads a key/value head, a tile of 8 queries is 1024 rows: groups of one head
    if scores is not None:
        monkeypatch.setattr(v5, "GROUP_SCORES", scores)
    seen, real = set(), parts.forward_rows

    def recording(run, *args, **kwargs):
        seen.add(run.q.shape[0])                       # the group's heads (a leading axis)
        return real(run, *args, **kwargs)
    monkeypatch.setattr(parts, "forward_rows", recording)
    q, k, v, _ = problem(B=1, S=32, Hq=4 * G, Hkv=4, D=4, dtype=np.float32)
    forward_against_dense(q, k, v, [np.arange(32)], tile_size=8)
    assert seen == sizes


@pytest.mark.parametrize("scores, widths", [(None, {1, 2, 4, 6}), (16 * 8 * 4 * 2, {1, 2}), (16 * 8 * 4, {1})])
def test_full_key_tiles_are_joined_as_far_as_the_scores_allow(scores, widths, monkeypatch):
    # 4 heads, stacks of 2 query tiles of 8 (16 rows), tiles of 8 keys, S = 64 in one causal block: the stacks
    # see 2, 4, 6 full key tiles, all joined; a budget of 16 x 8 x 4 x 2 joins them in pairs, 16 x 8 x 4 not at
    # all; a masked tile is never joined (the diagonal ones stay 8 keys wide); the result is dense's
    monkeypatch.setattr(units, "UNIT_ROWS", 16)
    monkeypatch.setattr(v5, "UNIT_ROWS", 16)
    if scores is not None:
        monkeypatch.setattr(v5, "GROUP_SCORES", scores)
    seen, real = set(), parts.forward_rows

    def recording(run, head, blocks, *args, **kwargs):
        seen.update((ks.stop - ks.start) // 8 for _, ks, _ in blocks)
        assert all(ks.stop - ks.start == 8 for _, ks, part in blocks if part is not None)
        return real(run, head, blocks, *args, **kwargs)
    monkeypatch.setattr(parts, "forward_rows", recording)
    q, k, v, _ = problem(B=1, S=64, Hq=4, Hkv=4, D=4, dtype=np.float32)
    forward_against_dense(q, k, v, [np.arange(64)], tile_size=8)
    assert seen == widths


def test_join_width_keeps_the_largest_groups_scores_within_the_budget():
    # 4 heads of 512 rows and tiles of 128: pairs; groups of 8 heads, or tiles of 256: none
    assert v5.join_width(4, 8, 512, 128) == 2 and v5.join_width(8, 8, 512, 128) == 1
    assert v5.join_width(4, 4, 512, 256) == 1 and v5.join_width(1, 1, 512, 128) == 8
    # more heads than a group holds: the largest group's scores set the width, not all the heads'
    assert v5.join_width(16, 4, 512, 128) == v5.join_width(4, 4, 512, 128) == 2
