"""The per-device step (reference/step.py) on its own, against the dense oracle:
both of its implementations, the plain step (what CuPy runs, here on NumPy)
and the NumPy step, one device holding every query while the keys come in
blocks of shuffled positions (as a striped shard's do). Then what only the
NumPy step has: the redo path of its lazy max, the lazy shift switched off for
huge values, results bit for bit the same on 1, 2 or 3 worker threads. Then
what both must keep: rows with no visible key give no NaN or inf, the inputs
are left alone, the accumulator's invariants hold after a merge, and a masked
pair lets no NaN or inf through (`step._product`).

Sizes are small (S <= 256, D <= 16): each case runs the dense oracle.

    .venv/bin/python -m pytest tests/test_step.py -q
"""

import warnings

import numpy as np
import pytest

from conftest import LARGE_LOGITS_FACTOR, LARGE_LOGITS_GRAD_FACTOR, assert_close
from reference import attention, attention_backward, step
from reference.tiles import tile_plan

PATHS = ("plain", "numpy")


def perm_blocks(S, n_blocks, seed=0):
    """The key positions 0..S-1 shuffled and cut into `n_blocks` blocks: (positions,) per block."""
    perm = np.random.default_rng(seed).permutation(S)
    return np.array_split(perm, n_blocks)


def heads(q, k, v, scale):
    """Compute layout: q pre-scaled (B, Hkv, S, G, D); k, v (B, Hkv, S, D)."""
    return step.q_to_heads(q, k.shape[2]) * q.dtype.type(scale), step.kv_to_heads(k), step.kv_to_heads(v)


def attend(path, acc, q, k, v, q_pos, k_pos, causal, tile_size):
    """One block through the chosen implementation."""
    if path == "numpy":
        return step.attend_block(acc, q, k, v, q_pos, k_pos, causal=causal, tile_size=tile_size)
    plan, _ = tile_plan(q_pos, k_pos, tile_size, causal)
    step._forward_plain(acc, q, k, v, q_pos, k_pos, plan, np)


def step_forward(path, q, k, v, blocks, *, causal=True, tile_size=(7, 5)):
    """One device holding all S queries (positions 0..S-1), its keys arriving in
    `blocks`. Returns (out (B, S, Hq, D), lse (B, Hq, S), the ForwardAcc)."""
    S, D = q.shape[1], q.shape[-1]
    qh, kh, vh = heads(q, k, v, D ** -0.5)
    pos, acc = np.arange(S), step.ForwardAcc.zeros(qh)
    for blk in blocks:
        attend(path, acc, qh, kh[:, :, blk], vh[:, :, blk], pos, blk, causal, tile_size)
    out, lse = step.finish_forward(acc)
    return step.q_from_heads(out), step.rows_from_heads(lse), acc


def step_backward(path, q, k, v, out, lse, dout, blocks, *, causal=True, tile_size=(7, 5)):
    """The gradients (dq, dk, dv) in the user layout, keys in `blocks` as above."""
    S, Hkv, D = q.shape[1], k.shape[2], q.shape[-1]
    qh, kh, vh = heads(q, k, v, D ** -0.5)
    doh = step.q_to_heads(dout, Hkv)
    delta = (doh * step.q_to_heads(out, Hkv)).sum(axis=-1)             # (B, Hkv, S, G)
    lse_h = step.rows_to_heads(lse, Hkv)
    pos, dq = np.arange(S), np.zeros_like(qh)
    dk, dv = np.zeros_like(kh), np.zeros_like(vh)
    for blk in blocks:
        dkb, dvb = np.zeros_like(kh[:, :, blk]), np.zeros_like(vh[:, :, blk])
        args = (dq, dkb, dvb, qh, doh, lse_h, delta, kh[:, :, blk], vh[:, :, blk], pos, blk)
        if path == "numpy":
            step.attend_block_backward(*args, causal=causal, tile_size=tile_size)
        else:
            step._backward_plain(*args, tile_plan(pos, blk, tile_size, causal)[0], np)
        dk[:, :, blk], dv[:, :, blk] = dkb, dvb
    return step.q_from_heads(dq * D ** -0.5), step.kv_from_heads(dk), step.kv_from_heads(dv)


def problem(B=2, S=40, Hq=4, Hkv=2, D=8, dtype=np.float64, seed=1):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((B, S, Hq, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, S, Hkv, D)).astype(dtype) for _ in range(2))
    return q, k, v, dout


def check_against_dense(path, q, k, v, dout, blocks, causal=True, tile_size=(7, 5), large_logits=False):
    """Forward and backward of the step against dense (conftest's tolerances,
    widened for scores of a few hundred as there)."""
    dtype = q.dtype
    factor, grad_factor = (LARGE_LOGITS_FACTOR, LARGE_LOGITS_GRAD_FACTOR) if large_logits else (1, 1)
    ref_out, ref_lse = attention(q, k, v, causal=causal)
    out, lse, _ = step_forward(path, q, k, v, blocks, causal=causal, tile_size=tile_size)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close(out, ref_out, dtype, "out", factor)
    assert_close(lse, ref_lse, dtype, "lse", factor)
    ref = attention_backward(q, k, v, ref_out, ref_lse, dout, causal=causal)
    grads = step_backward(path, q, k, v, ref_out, ref_lse, dout, blocks, causal=causal, tile_size=tile_size)
    for name, g, e in zip(("dq", "dk", "dv"), grads, ref):
        assert np.isfinite(g).all(), name
        assert_close(g, e, dtype, name, grad_factor)


# -- both implementations against dense --------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("tile_size", [(7, 5), 1, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("path", PATHS)
def test_step_equals_dense(path, causal, tile_size, dtype):
    # GQA (G = 2), keys in 3 shuffled blocks: masked tiles everywhere, a tile
    # larger than the block (64), 1x1 tiles (skipped, full, none masked)
    q, k, v, dout = problem(dtype=dtype)
    check_against_dense(path, q, k, v, dout, perm_blocks(40, 3), causal, tile_size)


# -- the NumPy step's lazy max --------------------------------------------------

@pytest.fixture
def exact_tiles(monkeypatch):
    """Counts the NumPy step's exact (not lazy) tiles."""
    calls = []                                         # list.append: safe from the worker threads
    exact = step._exact_tile

    def counting(*args, **kwargs):
        calls.append(1)
        return exact(*args, **kwargs)
    monkeypatch.setattr(step, "_exact_tile", counting)
    return calls


def n_blocks(S, tile_size, n_heads, G=1):
    """How many blocks the NumPy forward runs for one device holding 0..S-1, causal."""
    pos = np.arange(S)
    units = step._forward_units(tile_plan(pos, pos, tile_size)[0], S, G)
    return n_heads * sum(len(blocks) for _, blocks in units)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lazy_max_is_raised_when_scores_grow(dtype, exact_tiles):
    # scores grow by about 100 along the keys: each new key tile's P would
    # exceed _SUM_LIMIT under the old shift, so the tile is redone exactly
    S, H, D = 256, 2, 16
    q, k, v, dout = problem(B=1, S=S, Hq=H, Hkv=H, D=D, dtype=np.float64, seed=3)
    q[..., 0] = 10
    k[..., 0] = np.linspace(0, 40, S)[None, :, None]
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    check_against_dense("numpy", q, k, v, dout, [np.arange(S)], tile_size=32, large_logits=True)
    assert len(exact_tiles) > 2 * H                    # more than the first tile of each unit


def test_lazy_max_is_kept_for_gaussian_scores(exact_tiles):
    # the counterpart: ordinary scores never come near _SUM_LIMIT, so only a
    # row's first tile (no shift yet) is exact; all others are lazy
    S, H = 256, 2
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, dtype=np.float32)
    step_forward("numpy", q, k, v, [np.arange(S)], tile_size=32)
    assert len(exact_tiles) == H < n_blocks(S, 32, H)  # one unit of 256 rows per head


def test_a_sum_that_overflows_is_redone(exact_tiles):
    # the second half of the keys scores 200 more than the first: under the
    # shift of the first half, exp2 overflows float32 to inf (2**288), the row
    # sum is inf, and the tile is redone; no warning escapes, the answer is
    # dense's (the forward: the lazy max is the forward's)
    S, H, D = 64, 2, 8
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, D=D, dtype=np.float64, seed=4)
    q[..., 0] = 1.0
    k[..., 0] = np.where(np.arange(S) < S // 2, 0.0, 200.0 * D ** 0.5)[None, :, None]
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    first, second = np.arange(S // 2), np.arange(S // 2, S)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse, _ = step_forward("numpy", q, k, v, [first, second], tile_size=8)
    ref_out, ref_lse = attention(q, k, v)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close(out, ref_out, np.float32, "out", LARGE_LOGITS_FACTOR)
    assert_close(lse, ref_lse, np.float32, "lse", LARGE_LOGITS_FACTOR)
    # two exact tiles a head: the first (no shift yet) and the overflowing one;
    # scores like the first block's would give one (the gaussian test above)
    assert len(exact_tiles) == 2 * H


def test_lazy_shift_is_off_for_huge_values(exact_tiles):
    # |V| of 1e25: O under a lazy shift could overflow, so every block is exact
    S, H = 64, 2
    q, k, v, _ = problem(B=1, S=S, Hq=H, Hkv=H, dtype=np.float32)
    v = v * np.float32(1e25)
    out, lse, _ = step_forward("numpy", q, k, v, [np.arange(S)], tile_size=8)
    ref_out, ref_lse = attention(q, k, v)
    assert len(exact_tiles) == n_blocks(S, 8, H)
    assert np.isfinite(out).all()
    assert_close(out / 1e25, ref_out / 1e25, np.float32, "out")
    assert_close(lse, ref_lse, np.float32, "lse")


# -- threads -----------------------------------------------------------------------

def test_results_do_not_depend_on_the_worker_count(monkeypatch):
    # a unit owns the rows it writes, so 1, 2 or 3 workers give the same bits
    q, k, v, dout = problem(B=2, S=96, Hq=6, Hkv=3, D=8, seed=5)
    out, lse = attention(q, k, v)
    blocks = perm_blocks(96, 3)
    results = []
    for workers in (1, 2, 3):
        monkeypatch.setattr(step._BLAS, "threads", lambda n, w=workers: min(w, n))
        o, l, _ = step_forward("numpy", q, k, v, blocks, tile_size=(5, 7))
        results.append((o, l) + step_backward("numpy", q, k, v, out, lse, dout, blocks, tile_size=(5, 7)))
    for other in results[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[0], other):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} differs between worker counts")


# -- rows with no visible key ---------------------------------------------------------

@pytest.mark.parametrize("tile_size", [2, 3, (4, 2)])
@pytest.mark.parametrize("path", PATHS)
def test_rows_that_see_no_key_of_a_block(path, tile_size):
    # queries 0..7, first block keys 4..11: rows 0..3 see no key of the whole
    # block, and several tiles hold rows that see none of theirs; the second
    # block (keys 0..3) shows every row a key. Nothing may be NaN or inf.
    B, S, Hq, Hkv, D = 1, 12, 2, 1, 4
    q, k, v, dout = problem(B, S, Hq, Hkv, D)
    q = q[:, :8]                                       # queries at positions 0..7
    qh, kh, vh = heads(q, k, v, D ** -0.5)
    q_pos, first, second = np.arange(8), np.arange(4, 12), np.arange(0, 4)
    acc = step.ForwardAcc.zeros(qh)
    attend(path, acc, qh, kh[:, :, first], vh[:, :, first], q_pos, first, True, tile_size)
    blind = q_pos < 4
    assert np.isfinite(acc.o).all() and np.isfinite(acc.l).all()
    assert (acc.o[:, :, blind] == 0).all() and (acc.l[:, :, blind] == 0).all()
    assert np.isneginf(acc.m[:, :, blind]).all() and np.isfinite(acc.m[:, :, ~blind]).all()
    attend(path, acc, qh, kh[:, :, second], vh[:, :, second], q_pos, second, True, tile_size)
    out, lse = step.finish_forward(acc)
    ref_out, ref_lse, _ = masked_dense(q, k, v, np.arange(S))
    assert_close(step.q_from_heads(out), ref_out, np.float64, "out")
    assert_close(step.rows_from_heads(lse), ref_lse, np.float64, "lse")


@pytest.mark.parametrize("path", PATHS)
def test_backward_rows_that_see_no_key_of_a_block(path):
    # the backward of the same first block: blind rows add nothing, and no NaN
    B, S, Hq, Hkv, D = 1, 12, 2, 1, 4
    q, k, v, dout = problem(B, S, Hq, Hkv, D)
    out, lse = attention(q, k, v)
    keys = [np.arange(4, 12), np.arange(0, 4)]
    dq, dk, dv = step_backward(path, q, k, v, out, lse, dout, keys, tile_size=3)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    for name, g, e in zip(("dq", "dk", "dv"), (dq, dk, dv), attention_backward(q, k, v, out, lse, dout)):
        assert_close(g, e, np.float64, name)


def test_a_block_no_row_can_see_is_skipped():
    B, Hq, Hkv, D = 1, 2, 1, 4
    q, k, v, _ = problem(B, 8, Hq, Hkv, D)
    qh, kh, vh = heads(q, k, v, D ** -0.5)
    acc = step.ForwardAcc.zeros(qh)
    counts = step.attend_block(acc, qh, kh, vh, np.arange(8), np.arange(8) + 8, causal=True, tile_size=3)
    assert counts.tiles_computed == 0 and counts.pairs == 0 and counts.tiles_skipped > 0
    assert (acc.o == 0).all() and (acc.l == 0).all() and np.isneginf(acc.m).all()
    out, lse = step.finish_forward(acc)
    assert (out == 0).all() and np.isneginf(lse).all()  # no key at all: out 0, lse -inf


# -- inputs and the accumulator ----------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_attend_block_leaves_its_inputs_alone(path):
    q, k, v, dout = problem(S=24)
    qh, kh, vh = heads(q, k, v, 0.5)
    doh = step.q_to_heads(dout, 2)
    lse, delta = np.zeros(qh.shape[:-1]), np.ones(qh.shape[:-1])
    inputs = (qh, kh, vh, doh, lse, delta)
    kept = [x.copy() for x in inputs]
    pos, blk = np.arange(24), perm_blocks(24, 2)[0]
    acc = step.ForwardAcc.zeros(qh)
    attend(path, acc, qh, kh[:, :, blk], vh[:, :, blk], pos, blk, True, (5, 3))   # a copy of k, v
    attend(path, acc, qh, kh, vh, pos, pos, True, (5, 3))                           # the arrays themselves
    dq, dk, dv = np.zeros_like(qh), np.zeros_like(kh), np.zeros_like(vh)
    if path == "numpy":
        step.attend_block_backward(dq, dk, dv, qh, doh, lse, delta, kh, vh, pos, pos, causal=True,
                                   tile_size=(5, 3))
    else:
        step._backward_plain(dq, dk, dv, qh, doh, lse, delta, kh, vh, pos, pos,
                             tile_plan(pos, pos, (5, 3))[0], np)
    for name, now, before in zip(("q", "k", "v", "dout", "lse", "delta"), inputs, kept):
        np.testing.assert_array_equal(now, before, err_msg=f"{name} was written to")


@pytest.mark.parametrize("path", PATHS)
def test_accumulator_after_a_merge(path):
    # after two blocks, every row that has seen a key: o / l = out and
    # m + log l = lse of dense over the keys seen; m is a shift at most 32 ln 2
    # below the row's max score (the NumPy step's lazy max keeps a tile while
    # its base-2 row sum stays under _SUM_LIMIT = 2**32), exactly the max for
    # the plain step. A row that has seen none keeps o = l = 0, m = -inf.
    q, k, v, _ = problem(S=40)
    blocks = np.array_split(np.random.default_rng(2).permutation(np.arange(5, 40)), 2)   # not keys 0..4
    keys = np.sort(np.concatenate(blocks))
    _, _, acc = step_forward(path, q, k, v, blocks)
    out, lse, row_max = masked_dense(q, k[:, keys], v[:, keys], keys)
    rows = np.isfinite(lse)                            # (B, Hq, S): rows that have seen a key
    assert not rows.all()                              # and some that have not
    o, l, m = step.q_from_heads(acc.o), step.rows_from_heads(acc.l), step.rows_from_heads(acc.m)
    rows_q = rows.transpose(0, 2, 1)                   # (B, S, Hq)
    assert_close(o[rows_q] / l.transpose(0, 2, 1)[rows_q][:, None], out[rows_q], np.float64, "O / l")
    assert_close(m[rows] + np.log(l[rows]), lse[rows], np.float64, "m + log l")
    gap = row_max[rows] - m[rows]
    assert (gap >= -1e-12).all() and (gap <= 32 * np.log(2) + 1e-9).all()
    if path == "plain":
        np.testing.assert_allclose(m[rows], row_max[rows], rtol=1e-13, atol=1e-13)
    assert (o[~rows_q] == 0).all() and (l[~rows] == 0).all() and np.isneginf(m[~rows]).all()


def masked_dense(q, k, v, k_pos):
    """Dense attention, float64, of queries at positions 0..S-1 to keys at
    `k_pos` (causal): (out (B, S, Hq, D), lse (B, Hq, S), row max of the scores);
    a row that sees no key gets out = 0, lse = row max = -inf."""
    G = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = np.where(k_pos[None, None, None, :] <= np.arange(q.shape[1])[None, None, :, None], s, -np.inf)
    row_max = s.max(-1)
    shift = np.where(np.isfinite(row_max), row_max, 0.0)[..., None]
    l = np.exp(s - shift).sum(-1)
    with np.errstate(divide="ignore"):
        lse = np.log(l) + shift[..., 0]
    p = np.exp(s - shift) / np.where(l > 0, l, 1.0)[..., None]
    return np.einsum("bhqk,bkhd->bqhd", p, v), lse, row_max


# -- NaN and inf: a masked pair contributes nothing ------------------------------------------

def test_product_is_the_masked_sum():
    # step._product against a loop over the visible pairs, with NaN and inf in x
    rng = np.random.default_rng(6)
    M, T, E = 6, 5, 3
    vis = rng.random((M, T)) < 0.5
    w = np.where(vis, rng.standard_normal((2, M, T)), 0.0)     # (2, M, T): 0 at masked pairs
    x = rng.standard_normal((2, T, E))
    x[0, 1, 2], x[1, 3, 0], x[1, 4, :] = np.nan, np.inf, -np.inf
    want = np.zeros((2, M, E))
    for b in range(2):
        for m in range(M):
            for t in range(T):
                if vis[m, t]:
                    want[b, m] += w[b, m, t] * x[b, t]
    got = step._product(w, x, vis, np)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-13, atol=1e-13)


def not_finite_rows(x):
    return ~np.isfinite(x).all(axis=-1)


@pytest.mark.parametrize("source", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("tile_size", [(7, 5), 4])
@pytest.mark.parametrize("path", PATHS)
def test_nan_reaches_the_rows_dense_says(path, tile_size, source):
    # the rows holding a NaN are dense's, for out, lse, dq, dk, dv (which rows
    # those are, from the positions rule, is tests/test_ring.py's NaN section),
    # and every finite value equals dense's
    q, k, v, dout = problem(S=40)
    {"q": q, "k": k, "v": v, "dout": dout}[source][1, 21, 1, 3] = np.nan
    blocks = perm_blocks(40, 3)
    ref = attention(q, k, v)
    got = step_forward(path, q, k, v, blocks, tile_size=tile_size)[:2]
    ref += attention_backward(q, k, v, *ref, dout)
    got += step_backward(path, q, k, v, *ref[:2], dout, blocks, tile_size=tile_size)
    assert 0 < not_finite_rows(ref[2]).sum() < not_finite_rows(ref[2]).size   # dq: some rows, not all
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        if name == "lse":
            g, e = g[..., None], e[..., None]
        np.testing.assert_array_equal(not_finite_rows(g), not_finite_rows(e), err_msg=name)
        rows = ~not_finite_rows(e)
        assert_close(g[rows], e[rows], np.float64, name)
