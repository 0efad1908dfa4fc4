"""What only step version 3 (reference/steps/v3.py) has: the lazy max (kept
for ordinary scores, redone exactly when a tile would overflow, off for huge
values) and worker threads (results bit for bit the same on 1, 2 or 3; the
calling thread calls `progress` while it waits for them; a unit that raises,
on any thread, raises from the call); the lazy limit on |V| of either sign;
and the units of stacked query tiles covering exactly the plan's tiles.
Its agreement with dense is tests/steps/test_step.py's, with every other version.

    .venv/bin/python -m pytest tests/steps/test_step_v3.py -q
"""

import sys
import threading
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import LARGE_LOGITS_FACTOR, assert_close
from reference import attention, steps
from reference.steps import parts
from reference.heads import q_from_heads, rows_from_heads
from reference.masks import make_mask
from reference.step import ForwardAcc, Queries, finish_forward
from reference.steps.parts import forward_units
from reference.tiles import FULL, MASKED, tile_plan
from test_step import (check_against_dense, growing_scores, key_block, perm_blocks, problem, step_backward,
                       step_forward)


@pytest.fixture
def exact_tiles(monkeypatch):
    """Counts the exact (not lazy) tiles: version 3 falls back to `parts.exact_tile`."""
    calls = []                                         # list.append: safe from the worker threads
    exact = parts.exact_tile

    def counting(*args, **kwargs):
        calls.append(1)
        return exact(*args, **kwargs)
    monkeypatch.setattr(parts, "exact_tile", counting)
    return calls


def n_blocks(S, tile_size, n_heads, G=1):
    """How many blocks the version 3 forward runs for one device holding 0..S-1, causal."""
    pos = np.arange(S)
    units = forward_units(tile_plan(pos, pos, tile_size)[0], S, G)
    return n_heads * sum(len(blocks) for _, blocks in units)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lazy_max_is_raised_when_scores_grow(dtype, exact_tiles):
    # scores grow by about 100 along the keys: each new key tile's P would
    # exceed SUM_LIMIT under the old shift, so the tile is redone exactly
    H = 2
    q, k, v, dout = growing_scores(dtype, H=H)
    check_against_dense(steps.get("v3"), q, k, v, dout, [np.arange(256)], tile_size=32, large_logits=True)
    assert len(exact_tiles) > 2 * H                    # most key tiles after the first (seeded)


def test_lazy_max_is_kept_for_gaussian_scores(exact_tiles):
    # the counterpart: ordinary scores never come near SUM_LIMIT, and a row's
    # first tile (no shift yet) is seeded (`parts.seeded_tile`): none is exact
    S, H = 256, 2
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, dtype=np.float32)
    out, lse, _ = step_forward(steps.get("v3"), q, k, v, [np.arange(S)], tile_size=32)
    assert len(exact_tiles) == 0 < n_blocks(S, 32, H)
    ref_out, ref_lse = attention(q, k, v)
    assert_close(out, ref_out, np.float32, "out")
    assert_close(lse, ref_lse, np.float32, "lse")


def hidden_spike(score, blocks, S=32, H=2, D=8, seed=6):
    """Version 3's forward on keys 24..31 that score `score` for queries
    0..23, which cannot see them (causal), and 0 for queries 24..31, which
    can; checked against dense. Returns the number of heads H."""
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, D=D, dtype=np.float64, seed=seed)
    q[..., 0] = np.where(np.arange(S) < 24, 1.0, 0.0)[None, :, None]
    k[..., 0] = np.where(np.arange(S) < 24, 0.0, score * D ** 0.5)[None, :, None]
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    out, lse, _ = step_forward(steps.get("v3"), q, k, v, blocks, tile_size=32)
    ref_out, ref_lse = attention(q, k, v)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close(out, ref_out, np.float32, "out")
    assert_close(lse, ref_lse, np.float32, "lse")
    return H


def test_a_seed_under_which_every_visible_score_underflows_is_redone(exact_tiles):
    # a fresh row's shift is seeded from a sample of its scores, masked ones
    # too: key 24 (every 8th key is in the sample) scores 100 for queries
    # 0..23, which cannot see it; under that seed their visible scores give
    # P ~ 2**-144, the row sums fall below SUM_FLOOR, and the first tile is
    # redone exactly: the answer is dense's
    H = hidden_spike(100.0, [np.arange(32)], seed=7)
    assert len(exact_tiles) == H


def test_a_sum_that_overflows_is_redone(exact_tiles):
    # the second half of the keys scores 200 more than the first: under the
    # shift of the first half, exp2 overflows float32 to inf (2**288), the row
    # sum is inf, and the tile is redone; no warning escapes, the answer is dense's
    S, H, D = 64, 2, 8
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, D=D, dtype=np.float64, seed=4)
    q[..., 0] = 1.0
    k[..., 0] = np.where(np.arange(S) < S // 2, 0.0, 200.0 * D ** 0.5)[None, :, None]
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    first, second = np.arange(S // 2), np.arange(S // 2, S)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse, _ = step_forward(steps.get("v3"), q, k, v, [first, second], tile_size=8)
    ref_out, ref_lse = attention(q, k, v)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close(out, ref_out, np.float32, "out", LARGE_LOGITS_FACTOR)
    assert_close(lse, ref_lse, np.float32, "lse", LARGE_LOGITS_FACTOR)
    # one exact tile a head, the overflowing one (the first is seeded);
    # scores like the first block's would give none (the gaussian test above)
    assert len(exact_tiles) == H


def test_a_masked_pair_that_overflows_is_redone(exact_tiles):
    # version 3 clears masked pairs by a product with 0 (`tile_masks.weigh`):
    # a masked score that overflows exp2 gives inf x 0 = NaN, which must send
    # the tile to the exact path, not into O. Keys 24..31 score 700 for the
    # queries that cannot see them; the second block is the one redone
    H = hidden_spike(700.0, [np.arange(16), np.arange(16, 32)])
    assert len(exact_tiles) == H                  # the redone one; the first is seeded


def test_lazy_shift_is_off_for_huge_values(exact_tiles):
    # |V| of 1e25: O under a lazy shift could overflow, so every block is exact
    S, H = 64, 2
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, dtype=np.float32)
    v = v * np.float32(1e25)
    out, lse, _ = step_forward(steps.get("v3"), q, k, v, [np.arange(S)], tile_size=8)
    ref_out, ref_lse = attention(q, k, v)
    assert len(exact_tiles) == n_blocks(S, 8, H)
    assert np.isfinite(out).all()
    assert_close(out / 1e25, ref_out / 1e25, np.float32, "out")
    assert_close(lse, ref_lse, np.float32, "lse")


def test_nan_in_v_turns_the_lazy_shift_off(exact_tiles):
    # a NaN value at key 5: rows 0..4 do not see it and stay finite. A lazy
    # tile multiplies P = 0 by V at masked pairs (0 x NaN = NaN), so a head
    # whose V holds a NaN is exact, with the guard, like a huge one
    S, H = 16, 1
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, D=4)
    v[0, 5, 0, 0] = np.nan
    out, lse, _ = step_forward(steps.get("v3"), q, k, v, [np.arange(S)], tile_size=4)
    ref_out, _ = attention(q, k, v)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    assert np.isfinite(out[:, :5]).all() and len(exact_tiles) == n_blocks(S, 4, H)


@pytest.mark.parametrize("name", ["v3", "v5"])
def test_results_do_not_depend_on_the_worker_count(name):
    # a unit owns the rows it writes, so 1, 2 or 3 workers give the same bits
    # (v5: the heads cut into 1, 2 or 3 groups)
    q, k, v, dout = problem(B=2, S=96, Hq=6, Hkv=3, D=8, seed=5)
    out, lse = attention(q, k, v)
    blocks = perm_blocks(96, 3)
    results = []
    for workers in (1, 2, 3):
        step = steps.get(name, workers=workers)
        o, l, _ = step_forward(step, q, k, v, blocks, tile_size=(5, 7))
        results.append((o, l) + step_backward(step, q, k, v, out, lse, dout, blocks, tile_size=(5, 7)))
    for other in results[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[0], other):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} differs between worker counts")


def test_workers_are_explicit():
    assert steps.get("v3").workers == 1                # no environment variable decides
    assert steps.get("v3", workers=3).workers == 3
    with pytest.raises(ValueError, match="workers must be a positive int"):
        steps.get("v3", workers=0)
    with pytest.raises(ValueError, match="runs on the calling thread"):
        steps.get("v1", workers=2)


@pytest.mark.parametrize("name", ["v3", "v4", "v5"])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_progress_is_called_while_waiting_for_the_workers(name, kind, monkeypatch):
    # two heads, two workers: the calling thread computes one head's unit, the
    # worker the other, and the worker's unit does not start until the calling
    # thread, its own unit done, has called `progress` three times: only a
    # step that calls it while it waits lets the worker go (no timing involved)
    patched = "forward_rows" if kind == "forward" else "backward_head"
    real, caller = getattr(parts, patched), threading.get_ident()
    own_done, go, calls = threading.Event(), threading.Event(), []

    def unit(*args, **kwargs):
        if threading.get_ident() == caller:
            real(*args, **kwargs)
            own_done.set()
        else:
            assert go.wait(timeout=20), "the calling thread never called progress while waiting"
            real(*args, **kwargs)
    monkeypatch.setattr(parts, patched, unit)

    def progress():
        calls.append(threading.get_ident())
        if own_done.is_set() and len(calls) >= 3:
            go.set()

    q, k, v, dout = problem(B=1, S=16, Hq=2, Hkv=2, D=4)
    step = steps.get(name, workers=2)
    if kind == "forward":
        step_forward(step, q, k, v, [np.arange(16)], tile_size=16, progress=progress)
    else:
        step_backward(step, q, k, v, *attention(q, k, v), dout, [np.arange(16)], tile_size=16, progress=progress)
    assert go.is_set() and set(calls) == {caller}


# -- a unit that raises, a lazy limit on both signs, blocks that cover the plan -------

def _failing(monkeypatch, kind, fail):
    """Patch the unit of `kind` (forward: a run of query tiles of one head;
    backward: one head) so that ``fail(args)`` decides whether it raises."""
    patched = "forward_rows" if kind == "forward" else "backward_head"
    real = getattr(parts, patched)

    def unit(*args, **kwargs):
        if fail(args):
            raise RuntimeError("unit failed")
        return real(*args, **kwargs)
    monkeypatch.setattr(parts, patched, unit)


def _run(kind, step, q, k, v, dout):
    if kind == "forward":
        return step_forward(step, q, k, v, [np.arange(q.shape[1])], tile_size=8)
    return step_backward(step, q, k, v, *attention(q, k, v), dout, [np.arange(q.shape[1])], tile_size=8)


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("name", ["v3", "v4"])      # v5's forward: as many units as workers, not heads
def test_a_unit_that_raises_raises_from_the_call(name, kind, workers, monkeypatch):
    # four heads, four units; the third one fails, whichever thread takes it:
    # the call raises it (a swallowed error would return rows never computed)
    q, k, v, dout = problem(B=1, S=16, Hq=4, Hkv=4, D=4)
    taken = []

    def third(args):
        taken.append(1)
        return len(taken) == 3
    _failing(monkeypatch, kind, third)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="unit failed"):
        _run(kind, steps.get(name, workers=workers), q, k, v, dout)
    assert threading.active_count() == before         # every worker stopped before the call returned


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("name", ["v3", "v4", "v5"])
def test_a_worker_threads_error_reaches_the_caller(name, kind, monkeypatch):
    # two heads, two workers: the calling thread's unit waits until the other
    # thread has taken the second unit, which raises there (no timing involved)
    q, k, v, dout = problem(B=1, S=16, Hq=2, Hkv=2, D=4)
    caller, worker_took = threading.get_ident(), threading.Event()

    def on_the_worker(args):
        if threading.get_ident() == caller:
            assert worker_took.wait(timeout=20), "the worker thread never took a unit"
            return False
        worker_took.set()
        return True
    _failing(monkeypatch, kind, on_the_worker)
    with pytest.raises(RuntimeError, match="unit failed"):
        _run(kind, steps.get(name, workers=2), q, k, v, dout)
    assert worker_took.is_set()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_lazy_shift_is_off_for_huge_values_of_either_sign(sign, exact_tiles):
    # |V| of 1e25 all of one sign: the limit is on |V|, so negative values
    # alone turn the lazy shift off as positive ones do
    S, H = 64, 2
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, dtype=np.float32)
    v = np.float32(sign * 1e25) * np.abs(v)
    out, lse, _ = step_forward(steps.get("v3"), q, k, v, [np.arange(S)], tile_size=8)
    assert len(exact_tiles) == n_blocks(S, 8, H)
    ref_out, ref_lse = attention(q, k, v)
    assert_close(out / 1e25, ref_out / 1e25, np.float32, "out")
    assert_close(lse, ref_lse, np.float32, "lse")


UNIT_ROWS = sys.modules[forward_units.__module__].UNIT_ROWS     # where forward_units lives


def covered(plan, c, G):
    """{(query slice, key slice): kind} of the tiles `forward_units` computes,
    from its units, each block spread back over the plan's query tiles it
    spans, MASKED where the block's masked rows cover the tile; and the query
    slices of the units, in order."""
    q_tiles = sorted({(qs.start, min(qs.stop, c)) for qs, _, _ in plan})
    tiles, units = {}, []
    for unit, blocks in forward_units(plan, c, G):
        units.append((unit.start, unit.stop))
        for rows, ks, part in blocks:
            lo, hi = unit.start + rows.start, unit.start + rows.stop
            spanned = [t for t in q_tiles if lo <= t[0] and t[1] <= hi]
            assert spanned and spanned[0][0] == lo and spanned[-1][1] == hi, (rows, ks)
            for t in spanned:
                assert (t, (ks.start, ks.stop)) not in tiles, f"tile {t} x {ks} computed twice"
                masked = part is not None and lo + part.start <= t[0] and t[1] <= lo + part.stop
                tiles[t, (ks.start, ks.stop)] = MASKED if masked else FULL
    return tiles, units


def check_units_cover_the_plan(q_pos, k_pos, tile_size, mask, G):
    plan, _ = tile_plan(q_pos, k_pos, tile_size, mask)
    c = len(q_pos)
    want = {((qs.start, min(qs.stop, c)), (ks.start, ks.stop)): kind for qs, ks, kind in plan}
    got, units = covered(plan, c, G)
    assert set(got) == set(want), "the blocks do not cover exactly the plan's tiles"
    for tile, kind in got.items():
        # a FULL block spread over a MASKED tile would attend to hidden keys
        assert kind == MASKED or want[tile] == FULL, f"tile {tile} is {want[tile]} but its block is FULL"
    q_tiles = {t for t, _ in want}
    for (start, stop), (next_start, _) in zip(units, units[1:]):
        assert stop <= next_start                    # units own their rows
    for start, stop in units:                        # a unit is one tile, or stacks at most UNIT_ROWS rows
        assert (start, stop) in q_tiles or (stop - start) * G <= UNIT_ROWS
        inside = sorted(t for t in q_tiles if start <= t[0] < stop)      # of neighbouring tiles of the plan
        assert inside[0][0] == start and inside[-1][1] == stop and all(
            a[1] == b[0] for a, b in zip(inside, inside[1:])), f"unit {start}..{stop} holds rows of no tile"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_units_cover_exactly_the_plans_tiles(data):
    # drawn positions (a shuffled block, as a striped shard's), tile shapes,
    # heads per group and masks, documents interleaved included
    S = data.draw(st.integers(1, 48), "S")
    perm = np.random.default_rng(data.draw(st.integers(0, 99), "seed")).permutation(S)
    cut = data.draw(st.integers(0, S), "cut")
    q_pos, k_pos = np.sort(perm[:cut]) if data.draw(st.booleans(), "sorted") else perm[:cut], perm[cut:]
    if len(q_pos) == 0 or len(k_pos) == 0:
        q_pos = k_pos = np.arange(S)
    options = dict(causal=data.draw(st.booleans(), "causal"))
    if data.draw(st.booleans(), "window"):
        options["window"] = data.draw(st.integers(1, S), "W")
    if data.draw(st.booleans(), "documents"):
        options["segment_ids"] = data.draw(st.lists(st.integers(0, 2), min_size=S, max_size=S), "ids")
    tile = (data.draw(st.integers(1, 9), "tq"), data.draw(st.integers(1, 9), "tk"))
    G = data.draw(st.sampled_from([1, 2, 64, 200]), "G")      # 64, 200: units of one or a few tiles
    check_units_cover_the_plan(q_pos, k_pos, tile, make_mask(**options), G)


def test_units_do_not_merge_query_tiles_that_are_not_neighbours():
    # documents interleaved by tile: query tiles 0 and 2 see key tile 0 (all
    # visible), tile 1 (another document) does not. One block over tiles 0..2
    # would be FULL and give tile 1 rows the other document's keys
    ids = np.repeat([0, 1, 0, 1], 4)
    mask = make_mask(causal=False, segment_ids=ids)
    pos = np.arange(16)
    q, k, v, _ = problem(B=1, S=16, Hq=1, Hkv=1, D=4, seed=6)
    queries = Queries.prepare(q, 1, pos, 0.5)
    acc = ForwardAcc.zeros(queries.q)
    steps.get("v3").forward(acc, queries, key_block(k, v, pos), mask=mask, tile_size=4)
    out, lse = (f(x) for f, x in zip((q_from_heads, rows_from_heads), finish_forward(acc)))
    ref_out, ref_lse = attention(q, k, v, scale=0.5, causal=False, segment_ids=ids)
    assert_close(out, ref_out, np.float64, "out")
    assert_close(lse, ref_lse, np.float64, "lse")
    check_units_cover_the_plan(pos, pos, 4, mask, 1)
