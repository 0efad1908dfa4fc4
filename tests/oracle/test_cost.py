"""The trace of a run against the cost model, and the cost model against the
paper: every visible (query, key) pair is computed exactly once over the ring,
striped is balanced to within one diagonal (c pairs) per round, contiguous is
not, Work(i, j) = c(c+1)/2 or c(c-1)/2 (section 2.2), the (2N-1)/N limit, and
the 3-of-9-tiles example of section 2.2.1.

    .venv/bin/python -m pytest tests/oracle/test_cost.py -q
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import tile_sizes
from reference import LAYOUTS, Trace, cost, positions, ring_attention, ring_attention_backward
from reference.tiles import FULL, MASKED, SKIP, classify, tile_plan, tile_shape, visible

TRACED = ("source", "tiles_computed", "tiles_skipped", "pairs")


@st.composite
def rings(draw, layouts=LAYOUTS, max_devices=8, max_c=8, causal=None):
    """(layout, S, N, tile_size, causal) of a ring small enough to run."""
    layout = draw(st.sampled_from(layouts))
    n = draw(st.integers(1, max_devices))
    per = 2 if layout == "zigzag" else 1
    c = per * draw(st.integers(1, max_c // per))
    causal = draw(st.booleans()) if causal is None else causal
    return layout, n * c, n, draw(tile_sizes(c)), causal


def run_traced(layout, S, N, tile_size, causal, backward=False, B=2, Hq=2, Hkv=1, D=3):
    rng = np.random.default_rng(S * 31 + N)
    q, dout = rng.standard_normal((B, S, Hq, D)), rng.standard_normal((B, S, Hq, D))
    k, v = rng.standard_normal((B, S, Hkv, D)), rng.standard_normal((B, S, Hkv, D))
    opts = dict(n_devices=N, layout=layout, causal=causal, tile_size=tile_size, trace=True)
    out, lse, trace = ring_attention(q, k, v, **opts)
    if backward:
        trace = ring_attention_backward(q, k, v, out, lse, dout, **opts)[-1]
    return trace, (q, k, v)


# -- trace against the cost model ------------------------------------------

@given(rings(), st.booleans())
def test_trace_equals_prediction(ring, backward):
    layout, S, N, tile_size, causal = ring
    trace, _ = run_traced(layout, S, N, tile_size, causal, backward)
    predicted = cost.predict(S, N, layout, tile_size, causal)
    for name in TRACED:
        got, want = getattr(trace, name), getattr(predicted, name)
        assert got.shape == (N, N), name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert trace.critical_path("pairs") == predicted.critical_path("pairs")


@given(rings())
def test_every_visible_pair_is_computed_exactly_once(ring):
    layout, S, N, tile_size, causal = ring
    trace, _ = run_traced(layout, S, N, tile_size, causal)
    pos = positions(S, N, layout)
    # Algorithm 1: in round t device j holds the block that started on (j - t) mod N
    t, j = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")
    np.testing.assert_array_equal(trace.source, (j - t) % N)
    # add up, in global positions, the pairs each (round, device) saw
    seen = np.zeros((S, S), dtype=int)                     # (query position, key position)
    for t in range(N):
        for j in range(N):
            src = trace.source[t, j]
            mask = visible(pos[j], pos[src], causal)
            assert trace.pairs[t, j] == mask.sum()
            seen[np.ix_(pos[j], pos[src])] += mask
    everything = np.tril(np.ones((S, S), int)) if causal else np.ones((S, S), int)
    np.testing.assert_array_equal(seen, everything)
    assert trace.pairs.sum() == (S * (S + 1) // 2 if causal else S * S)


@given(rings(layouts=("striped",), causal=True))
def test_striped_is_balanced_to_one_diagonal(ring):
    _, S, N, tile_size, _ = ring
    trace, _ = run_traced("striped", S, N, tile_size, True)
    c = S // N
    assert (trace.pairs.max(axis=1) - trace.pairs.min(axis=1) <= c).all()


@pytest.mark.parametrize("N, c", [(2, 1), (2, 5), (4, 3), (8, 4), (8, 64), (16, 32)])
def test_striped_work_is_the_papers(N, c):
    # section 2.2: Work(i, j) = c(c+1)/2 if i >= j else c(c-1)/2, for query block i
    # and key block j; every round has a device with i >= j
    p = cost.predict(N * c, N, "striped", tile_size=c)
    for t in range(N):
        for i in range(N):
            assert p.pairs[t, i] == cost.paper_work(i, p.source[t, i], c)
    assert cost.paper_work(3, 3, c) == cost.paper_work(3, 1, c) == c * (c + 1) // 2
    assert cost.paper_work(1, 3, c) == c * (c - 1) // 2
    assert (p.pairs.max(axis=1) - p.pairs.min(axis=1) <= c).all()
    assert p.critical_path("pairs") == N * c * (c + 1) // 2


@pytest.mark.parametrize("N, c, traced", [(2, 3, True), (4, 2, True), (8, 2, True), (4, 16, False),
                                          (8, 64, False)])
def test_contiguous_is_imbalanced(N, c, traced):
    # round 0: every device its own causal block, c(c+1)/2; every later round some
    # device holds a block wholly after its queries (idle) and some one wholly
    # before them (c^2)
    S = N * c
    pairs = (run_traced("contiguous", S, N, c, True)[0] if traced else cost.predict(S, N, "contiguous")).pairs
    assert (pairs[0] == c * (c + 1) // 2).all()
    for t in range(1, N):
        assert pairs[t].min() == 0 and pairs[t].max() == c * c, t
    assert pairs.max(axis=1).sum() == c * (c + 1) // 2 + (N - 1) * c * c


@pytest.mark.parametrize("N", [2, 4, 8])
def test_zigzag_is_balanced_after_round_zero(N):
    c = 8
    p = cost.predict(N * c, N, "zigzag")
    assert (p.pairs[1:] == c * c // 2).all()


# -- speedup: (2N-1)/N with element-exact skipping ---------------------------

def closed_form(N, c):
    """[c(c+1)/2 + (N-1) c^2] / [N c(c+1)/2]: contiguous over striped critical paths."""
    return (c * (c + 1) / 2 + (N - 1) * c * c) / (N * c * (c + 1) / 2)


@pytest.mark.parametrize("N", [1, 2, 3, 4, 8])
def test_speedup_approaches_the_limit(N):
    limit = cost.striped_limit(N)
    assert limit == (2 * N - 1) / N
    gaps = []
    for c in (1, 2, 4, 16, 64, 256, 1024):
        s = cost.speedup(N * c, N, "striped", tile_size=c, mode="pairs")
        assert s == pytest.approx(closed_form(N, c), rel=1e-12)
        assert s <= limit + 1e-12
        gaps.append(limit - s)
    assert gaps == sorted(gaps, reverse=True)                 # closer as S grows
    assert gaps[-1] == pytest.approx(2 * (N - 1) / (N * 1025), abs=1e-12)
    if N > 1:
        assert gaps[0] > gaps[-1]


def test_tile_skipping_example_of_section_2_2_1():
    # one device, block 1536 x 1536, tiles 512 x 512: of 9 tiles 3 are skipped,
    # 3 full, 3 masked; a 33% (not 50%) reduction of compute
    p = cost.predict(1536, 1, "contiguous", tile_size=512)
    assert (p.tiles_skipped[0, 0], p.tiles_computed[0, 0]) == (3, 6)
    assert p.tile_area[0, 0] / 1536 ** 2 == pytest.approx(2 / 3)
    pos = positions(1536, 1, "contiguous")[0]
    kinds = classify(pos, pos, 512)
    assert [(kinds == kind).sum() for kind in (SKIP, FULL, MASKED)] == [3, 3, 3]
    # "if the block were fully unmasked, we would need to compute all nine tiles"
    two = cost.predict(3072, 2, "contiguous", tile_size=512)
    assert (two.tiles_computed[1, 1], two.tiles_skipped[1, 1]) == (9, 0)
    assert (two.tiles_computed[1, 0], two.tiles_skipped[1, 0]) == (0, 9)


# -- tiles against the brute-force mask ---------------------------------------

@st.composite
def block_pairs(draw):
    """Query and key positions of any layout's blocks, or arbitrary distinct positions."""
    if draw(st.booleans()):
        layout, S, N, _, _ = draw(rings(max_c=12))
        pos = positions(S, N, layout)
        return pos[draw(st.integers(0, N - 1))], pos[draw(st.integers(0, N - 1))]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    S = draw(st.integers(2, 40))
    return (rng.choice(S, draw(st.integers(1, S)), replace=False),
            rng.choice(S, draw(st.integers(1, S)), replace=False))


@given(block_pairs(), st.one_of(st.integers(1, 14), st.tuples(st.integers(1, 14), st.integers(1, 14))),
       st.booleans())
def test_tile_classification_agrees_with_the_mask(blocks, tile_size, causal):
    q_pos, k_pos = blocks
    tq, tk = tile_shape(tile_size)
    mask = visible(q_pos, k_pos, causal)                  # (c, ck)
    kinds = classify(q_pos, k_pos, tile_size, causal)
    assert kinds.shape == (-(-len(q_pos) // tq), -(-len(k_pos) // tk))
    for a in range(kinds.shape[0]):
        for b in range(kinds.shape[1]):
            tile = mask[a * tq:(a + 1) * tq, b * tk:(b + 1) * tk]
            want = SKIP if not tile.any() else FULL if tile.all() else MASKED
            assert kinds[a, b] == want, (a, b)
    plan, skipped = tile_plan(q_pos, k_pos, tile_size, causal)
    assert skipped == (kinds == SKIP).sum() and len(plan) == (kinds != SKIP).sum()
    covered = np.zeros_like(mask)                         # the plan's tiles hold every visible pair
    for qs, ks, _ in plan:
        covered[qs, ks] = True
    assert not (mask & ~covered).any()


# -- the trace itself ----------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_sent(layout):
    # forward: K, V and their positions move every round but the last (Algorithm 1);
    # backward: K, V move the same way, and dK, dV every round (the last brings them home)
    N, S = 4, 16
    fwd, (q, k, v) = run_traced(layout, S, N, 2, True)
    bwd, _ = run_traced(layout, S, N, 2, True, backward=True)
    kv = (k.nbytes + v.nbytes) // N                       # one device's K and V block
    assert (fwd.bytes_sent[-1] == 0).all()
    assert (fwd.bytes_sent[:-1] >= kv).all() and (fwd.bytes_sent[:-1] <= kv + 8 * (S // N + 1)).all()
    np.testing.assert_array_equal(bwd.bytes_sent[:-1], fwd.bytes_sent[:-1] + kv)
    assert (bwd.bytes_sent[-1] == kv).all()


def test_trace_round_trips_and_prints():
    trace, _ = run_traced("contiguous", 16, 4, 2, True)
    again = Trace.from_dict(trace.to_dict())
    for name in TRACED + ("bytes_sent",):
        np.testing.assert_array_equal(getattr(again, name), getattr(trace, name))
    table = trace.table("contiguous")
    assert "dev3" in table
    assert f"critical path (sum of busiest): {trace.critical_path('pairs')} pairs" in table


def test_trace_file_gives_back_every_trace_in_the_document(tmp_path):
    from reference.trace import FIELDS, RoundLog, read_trace, write_trace
    fwd, _ = run_traced("striped", 16, 4, 2, True)
    bwd, _ = run_traced("striped", 16, 4, 2, True, backward=True)
    doc = {"args": {"seq_len": 16}, "layouts": {"striped": {"wall_s": np.float64(0.5), "forward": fwd,
                                                            "backward": bwd}}}
    write_trace(tmp_path / "run.json", doc)
    again = read_trace(tmp_path / "run.json")
    assert again["args"] == {"seq_len": 16} and again["layouts"]["striped"]["wall_s"] == 0.5
    for kind, trace in (("forward", fwd), ("backward", bwd)):
        got = again["layouts"]["striped"][kind]
        assert isinstance(got, Trace) and got.step == trace.step
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(got, name), getattr(trace, name), err_msg=name)
    # the fields are declared once: a device's log, the trace and the prediction share them
    assert RoundLog.FIELDS == FIELDS and set(TRACED) <= set(cost.Prediction.__dataclass_fields__)
    with pytest.raises(TypeError, match="set is not JSON"):
        write_trace(tmp_path / "bad.json", {"x": {1, 2}})


# -- counts held to a brute force that shares nothing with reference.tiles ------

def brute_force_counts(q_pos, k_pos, tile_size, causal):
    """(tiles with a visible pair, tiles without, their area, visible pairs) by
    cutting the mask, built here from the pair rule, into tiles one by one."""
    tq, tk = tile_size if isinstance(tile_size, tuple) else (tile_size, tile_size)
    mask = (q_pos[:, None] >= k_pos[None, :]) if causal else np.ones((len(q_pos), len(k_pos)), bool)
    computed = skipped = area = 0
    for i in range(0, len(q_pos), tq):
        for j in range(0, len(k_pos), tk):
            tile = mask[i:i + tq, j:j + tk]
            if tile.any():
                computed, area = computed + 1, area + tile.size
            else:
                skipped += 1
    return computed, skipped, area, int(mask.sum())


@given(rings(), st.booleans())
def test_trace_and_prediction_equal_a_brute_force_count(ring, backward):
    layout, S, N, tile_size, causal = ring
    tile = 256 if tile_size is None else tile_size
    trace, _ = run_traced(layout, S, N, tile_size, causal, backward)
    predicted = cost.predict(S, N, layout, tile_size, causal)
    pos = positions(S, N, layout)
    for t in range(N):
        for j in range(N):
            computed, skipped, area, pairs = brute_force_counts(pos[j], pos[(j - t) % N], tile, causal)
            assert (trace.tiles_computed[t, j], trace.tiles_skipped[t, j], trace.pairs[t, j]) == \
                   (computed, skipped, pairs), (t, j)
            assert (predicted.tiles_computed[t, j], predicted.tile_area[t, j]) == (computed, area), (t, j)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_tiles_count_by_their_real_area(layout):
    # tiles of 1000 on blocks of c = 2048: the last tile of each side is 48 long
    S, N, tile = 4096, 2, 1000
    predicted = cost.predict(S, N, layout, tile)
    pos = positions(S, N, layout)
    for t in range(N):
        for j in range(N):
            _, _, area, _ = brute_force_counts(pos[j], pos[(j - t) % N], tile, True)
            assert predicted.tile_area[t, j] == area, (t, j)


def test_trace_table_reads_computed_out_of_total():
    # striped, S=64, N=4, tiles of 4: the README's table; every cell "pairs computed/total"
    trace, _ = run_traced("striped", 64, 4, 4, True)
    lines = trace.table().splitlines()
    rows = [line for line in lines if line.strip()[:1].isdigit()]
    assert len(rows) == 4
    for t, line in enumerate(rows):
        cells = line.split("|")[1].split()
        pairs, fractions = cells[0::2], cells[1::2]
        assert [int(p) for p in pairs] == trace.pairs[t].tolist()
        computed, total = zip(*(map(int, f.split("/")) for f in fractions))
        assert list(computed) == trace.tiles_computed[t].tolist()
        assert list(total) == (trace.tiles_computed[t] + trace.tiles_skipped[t]).tolist() == [16] * 4
