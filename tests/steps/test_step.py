"""Every registered block step (`reference.steps`) against the dense oracle,
with one test body: one device holding every query while the keys come in
blocks of shuffled positions (as a striped shard's do). Forward, backward,
grouped-query heads, float64 and float32 (float16 is the ring's business: it
travels as float16 and is computed in float32), tiles of every shape, rows
that see no key of a block, rows whose visible scores are all -inf, large
logits, NaN reaching the rows dense says; the inputs are left alone, and the
accumulator's invariants hold after a merge; `progress` is called between
tiles on the calling thread. Adding a step to the registry
adds it here. What only one version has is in its own file
(tests/steps/test_step_v3.py: the lazy max, worker threads).

Sizes are small (S <= 256, D <= 16): each case runs the dense oracle.

    .venv/bin/python -m pytest tests/steps/test_step.py -q
"""

import threading

import numpy as np
import pytest

from conftest import LARGE_LOGITS_FACTOR, LARGE_LOGITS_GRAD_FACTOR, assert_close
from reference import attention, attention_backward, steps
from reference.heads import kv_from_heads, q_from_heads, rows_from_heads
from reference.ring import own_block
from reference.step import BackwardRows, ForwardAcc, Grads, Queries, finish_forward, masked_product
from reference.steps.v4 import SubTiledStep

# every registered step that computes with NumPy, v3 with worker threads, and
# v4 with sub-tiles small enough to cut these small tiles
OPTIONS = {"v3 with 2 workers": lambda: steps.get("v3", workers=2),
           "v5 with 3 workers": lambda: steps.get("v5", workers=3),
           "v4 with sub-tiles of 3": lambda: SubTiledStep(workers=2, sub=3)}
STEPS = [name for name in steps.STEPS if "numpy" in steps.get(name).array_modules] + list(OPTIONS)


@pytest.fixture(params=STEPS)
def step(request):
    return OPTIONS[request.param]() if request.param in OPTIONS else steps.get(request.param)


def perm_blocks(S, n_blocks, seed=0):
    """The key positions 0..S-1 shuffled and cut into `n_blocks` blocks: (positions,) per block."""
    perm = np.random.default_rng(seed).permutation(S)
    return np.array_split(perm, n_blocks)


def key_block(k, v, k_pos):
    """The block holding the keys at positions `k_pos` (user layout k, v (B, S, Hkv, D))."""
    return own_block(k[:, k_pos], v[:, k_pos], k_pos, 0)


def step_forward(step, q, k, v, blocks, *, causal=True, tile_size=(7, 5), q_pos=None, progress=None):
    """One device holding the queries at `q_pos` (default 0..S-1), its keys
    arriving in `blocks`. Returns (out (B, S, Hq, D), lse (B, Hq, S), the ForwardAcc)."""
    D = q.shape[-1]
    q_pos = np.arange(q.shape[1]) if q_pos is None else q_pos
    queries = Queries.prepare(q, k.shape[2], q_pos, D ** -0.5)
    acc = ForwardAcc.zeros(queries.q)
    for blk in blocks:
        step.forward(acc, queries, key_block(k, v, blk), causal=causal, tile_size=tile_size, progress=progress)
    out, lse = finish_forward(acc)
    return q_from_heads(out), rows_from_heads(lse), acc


def step_backward(step, q, k, v, out, lse, dout, blocks, *, causal=True, tile_size=(7, 5), progress=None):
    """The gradients (dq, dk, dv) in the user layout, keys in `blocks` as above."""
    S, Hkv, D = q.shape[1], k.shape[2], q.shape[-1]
    queries = Queries.prepare(q, Hkv, np.arange(S), D ** -0.5)
    rows = BackwardRows.prepare(out, lse, dout, Hkv, queries.q.dtype)
    dq = np.zeros_like(queries.q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for blk in blocks:
        block = key_block(k, v, blk)
        grads = Grads(dq, np.zeros_like(block.k), np.zeros_like(block.v))
        step.backward(grads, queries, rows, block, causal=causal, tile_size=tile_size, progress=progress)
        dk[:, blk], dv[:, blk] = kv_from_heads(grads.dk), kv_from_heads(grads.dv)
    return q_from_heads(dq * D ** -0.5), dk, dv


def problem(B=2, S=40, Hq=4, Hkv=2, D=8, dtype=np.float64, seed=1):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((B, S, Hq, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, S, Hkv, D)).astype(dtype) for _ in range(2))
    return q, k, v, dout


def check_against_dense(step, q, k, v, dout, blocks, causal=True, tile_size=(7, 5), large_logits=False):
    """Forward and backward of the step against dense (conftest's tolerances,
    widened for scores of a few hundred as there)."""
    dtype = q.dtype
    factor, grad_factor = (LARGE_LOGITS_FACTOR, LARGE_LOGITS_GRAD_FACTOR) if large_logits else (1, 1)
    ref_out, ref_lse = attention(q, k, v, causal=causal)
    out, lse, _ = step_forward(step, q, k, v, blocks, causal=causal, tile_size=tile_size)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_close(out, ref_out, dtype, "out", factor)
    assert_close(lse, ref_lse, dtype, "lse", factor)
    ref = attention_backward(q, k, v, ref_out, ref_lse, dout, causal=causal)
    grads = step_backward(step, q, k, v, ref_out, ref_lse, dout, blocks, causal=causal, tile_size=tile_size)
    for name, g, e in zip(("dq", "dk", "dv"), grads, ref):
        assert np.isfinite(g).all(), name
        assert_close(g, e, dtype, name, grad_factor)


# -- every step against dense ----------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("tile_size", [(7, 5), 1, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_step_equals_dense(step, causal, tile_size, dtype):
    # GQA (G = 2), keys in 3 shuffled blocks: masked tiles everywhere, a tile
    # larger than the block (64), 1x1 tiles (skipped, full, none masked)
    q, k, v, dout = problem(dtype=dtype)
    check_against_dense(step, q, k, v, dout, perm_blocks(40, 3), causal, tile_size)


def growing_scores(dtype, S=256, H=2, D=16):
    """Scores that grow by about 100 along the keys: each key tile's dwarf the last's."""
    q, k, v, dout = problem(B=1, S=S, Hq=H, Hkv=H, D=D, dtype=np.float64, seed=3)
    q[..., 0] = 10
    k[..., 0] = np.linspace(0, 40, S)[None, :, None]
    return tuple(x.astype(dtype) for x in (q, k, v, dout))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_step_with_large_logits(step, dtype):
    q, k, v, dout = growing_scores(dtype)
    check_against_dense(step, q, k, v, dout, [np.arange(256)], tile_size=32, large_logits=True)


@pytest.mark.parametrize("tile_size", [(7, 5), 1])
def test_multi_query_heads(step, tile_size):
    q, k, v, dout = problem(Hq=3, Hkv=1, seed=7)
    check_against_dense(step, q, k, v, dout, perm_blocks(40, 2, seed=1), True, tile_size)


def test_steps_agree_with_the_readable_one_bit_for_bit_where_they_should(step):
    # the counts are the plan's: every version reports the same tiles and pairs
    q, k, v, _ = problem()
    queries = Queries.prepare(q, 2, np.arange(40), 0.3)
    counts = [s.forward(ForwardAcc.zeros(queries.q), queries, key_block(k, v, blk), causal=True,
                        tile_size=(7, 5)) for s in (steps.get("v1"), step) for blk in perm_blocks(40, 3)]
    assert counts[:3] == counts[3:]


# -- rows with no visible key; rows whose visible scores are all -inf --------------------

@pytest.mark.parametrize("tile_size", [2, 3, (4, 2)])
def test_rows_that_see_no_key_of_a_block(step, tile_size):
    # queries 0..7, first block keys 4..11: rows 0..3 see no key of the whole
    # block, and several tiles hold rows that see none of theirs; the second
    # block (keys 0..3) shows every row a key. Nothing may be NaN or inf.
    B, S, Hq, Hkv, D = 1, 12, 2, 1, 4
    q, k, v, dout = problem(B, S, Hq, Hkv, D)
    q = q[:, :8]                                       # queries at positions 0..7
    queries = Queries.prepare(q, Hkv, np.arange(8), D ** -0.5)
    first, second = np.arange(4, 12), np.arange(0, 4)
    acc = ForwardAcc.zeros(queries.q)
    step.forward(acc, queries, key_block(k, v, first), causal=True, tile_size=tile_size)
    blind = queries.pos < 4
    assert np.isfinite(acc.o).all() and np.isfinite(acc.l).all()
    assert (acc.o[:, :, blind] == 0).all() and (acc.l[:, :, blind] == 0).all()
    assert np.isneginf(acc.m[:, :, blind]).all() and np.isfinite(acc.m[:, :, ~blind]).all()
    assert (acc.seen == ~blind).all()
    step.forward(acc, queries, key_block(k, v, second), causal=True, tile_size=tile_size)
    out, lse = finish_forward(acc)
    ref_out, ref_lse, _ = masked_dense(q, k, v, np.arange(S))
    assert_close(q_from_heads(out), ref_out, np.float64, "out")
    assert_close(rows_from_heads(lse), ref_lse, np.float64, "lse")


def test_backward_rows_that_see_no_key_of_a_block(step):
    # the backward of the same first block: blind rows add nothing, and no NaN
    B, S, Hq, Hkv, D = 1, 12, 2, 1, 4
    q, k, v, dout = problem(B, S, Hq, Hkv, D)
    out, lse = attention(q, k, v)
    keys = [np.arange(4, 12), np.arange(0, 4)]
    dq, dk, dv = step_backward(step, q, k, v, out, lse, dout, keys, tile_size=3)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    for name, g, e in zip(("dq", "dk", "dv"), (dq, dk, dv), attention_backward(q, k, v, out, lse, dout)):
        assert_close(g, e, np.float64, name)


def test_a_block_no_row_can_see_is_skipped(step):
    B, Hq, Hkv, D = 1, 2, 1, 4
    q, k, v, _ = problem(B, 16, Hq, Hkv, D)
    queries = Queries.prepare(q[:, :8], Hkv, np.arange(8), D ** -0.5)
    acc = ForwardAcc.zeros(queries.q)
    counts = step.forward(acc, queries, key_block(k, v, np.arange(8, 16)), causal=True, tile_size=3)
    assert counts.tiles_computed == 0 and counts.pairs == 0 and counts.tiles_skipped > 0
    assert (acc.o == 0).all() and (acc.l == 0).all() and np.isneginf(acc.m).all()
    out, lse = finish_forward(acc)
    assert (out == 0).all() and np.isneginf(lse).all()  # no key at all: out 0, lse -inf


def test_rows_whose_visible_scores_are_all_minus_inf_follow_dense(step):
    # q = +inf against keys of -1: every visible score of query 2 is -inf, so
    # dense gives 0 / 0 = NaN there (out and lse); queries that see no key at
    # all (positions before every key) get out 0, lse -inf. Both rules, one block.
    B, Hq, Hkv, D = 1, 1, 1, 1
    q = np.ones((B, 4, Hq, D))
    q[:, 2] = np.inf
    k, v = -np.ones((B, 4, Hkv, D)), np.ones((B, 4, Hkv, D))
    q_pos, k_pos = np.array([0, 1, 5, 6]), np.array([2, 3, 4, 5])
    ref_out, ref_lse = attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
    assert np.isnan(ref_out[:, 2]).all() and np.isnan(ref_lse[:, :, 2]).all()
    assert (ref_out[:, :2] == 0).all() and np.isneginf(ref_lse[:, :, :2]).all()
    queries = Queries.prepare(q, Hkv, q_pos, 1.0)
    acc = ForwardAcc.zeros(queries.q)
    with np.errstate(invalid="ignore"):
        step.forward(acc, queries, own_block(k, v, k_pos, 0), causal=True, tile_size=2)
    out, lse = finish_forward(acc)
    np.testing.assert_array_equal(q_from_heads(out), ref_out)
    np.testing.assert_array_equal(rows_from_heads(lse), ref_lse)


# -- inputs and the accumulator ----------------------------------------------------------

def test_step_leaves_its_inputs_alone(step):
    q, k, v, dout = problem(S=24)
    queries = Queries.prepare(q, 2, np.arange(24), 0.5)
    rows = BackwardRows(do=Queries.prepare(dout, 2, np.arange(24), 1.0).q,
                        lse=np.zeros(queries.q.shape[:-1]), delta=np.ones(queries.q.shape[:-1]))
    own, part = own_block(k, v, np.arange(24), 0), key_block(k, v, perm_blocks(24, 2)[0])
    inputs = (queries.q, rows.do, rows.lse, rows.delta, own.k, own.v, part.k, part.v)
    kept = [x.copy() for x in inputs]
    acc = ForwardAcc.zeros(queries.q)
    for block in (part, own):
        step.forward(acc, queries, block, causal=True, tile_size=(5, 3))
        step.backward(Grads(np.zeros_like(queries.q), np.zeros_like(block.k), np.zeros_like(block.v)),
                      queries, rows, block, causal=True, tile_size=(5, 3))
    for i, (now, before) in enumerate(zip(inputs, kept)):
        np.testing.assert_array_equal(now, before, err_msg=f"input {i} was written to")


def test_accumulator_after_a_merge(step):
    # after two blocks, every row that has seen a key: o / l = out and
    # m + log l = lse of dense over the keys seen; m is a shift at most 32 ln 2
    # below the row's max score (v3's lazy max keeps a tile while its base-2
    # row sum stays under SUM_LIMIT = 2**32), exactly the max for v1 and v2.
    # A row that has seen none keeps o = l = 0, m = -inf.
    q, k, v, _ = problem(S=40)
    blocks = np.array_split(np.random.default_rng(2).permutation(np.arange(5, 40)), 2)   # not keys 0..4
    keys = np.sort(np.concatenate(blocks))
    _, _, acc = step_forward(step, q, k, v, blocks)
    out, lse, row_max = masked_dense(q, k[:, keys], v[:, keys], keys)
    rows = np.isfinite(lse)                            # (B, Hq, S): rows that have seen a key
    assert not rows.all()                              # and some that have not
    o, l, m = q_from_heads(acc.o), rows_from_heads(acc.l), rows_from_heads(acc.m)
    rows_q = rows.transpose(0, 2, 1)                   # (B, S, Hq)
    assert_close(o[rows_q] / l.transpose(0, 2, 1)[rows_q][:, None], out[rows_q], np.float64, "O / l")
    assert_close(m[rows] + np.log(l[rows]), lse[rows], np.float64, "m + log l")
    gap = row_max[rows] - m[rows]
    assert (gap >= -1e-12).all() and (gap <= 32 * np.log(2) + 1e-9).all()
    if step.name in ("v1", "v2"):                      # the true running max
        np.testing.assert_allclose(m[rows], row_max[rows], rtol=1e-13, atol=1e-13)
    assert (o[~rows_q] == 0).all() and (l[~rows] == 0).all() and np.isneginf(m[~rows]).all()


def test_the_readable_step_keeps_the_true_running_max():
    # version 1's m is the row max of the visible scores seen so far, after
    # every block, not only at the end (notebook 1 prints it as such)
    q, k, v, _ = problem(S=40)
    queries = Queries.prepare(q, 2, np.arange(40), 8 ** -0.5)
    acc, seen = ForwardAcc.zeros(queries.q), []
    for blk in perm_blocks(40, 3):
        steps.get("v1").forward(acc, queries, key_block(k, v, blk), causal=True, tile_size=(7, 5))
        seen.append(blk)
        keys = np.sort(np.concatenate(seen))
        _, _, row_max = masked_dense(q, k[:, keys], v[:, keys], keys)
        np.testing.assert_allclose(rows_from_heads(acc.m), row_max, rtol=1e-13, atol=1e-13)


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

def test_masked_product_is_the_masked_sum():
    # masked_product against a loop over the visible pairs, with NaN and inf in x
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
    got = masked_product(w, x, vis)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-13, atol=1e-13)


def not_finite_rows(x):
    return ~np.isfinite(x).all(axis=-1)


@pytest.mark.parametrize("source", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("tile_size", [(7, 5), 4])
def test_nan_reaches_the_rows_dense_says(step, tile_size, source):
    # the rows holding a NaN are dense's, for out, lse, dq, dk, dv (which rows
    # those are, from the positions rule, is tests/steps/test_ring.py's NaN section),
    # and every finite value equals dense's
    q, k, v, dout = problem(S=40)
    {"q": q, "k": k, "v": v, "dout": dout}[source][1, 21, 1, 3] = np.nan
    blocks = perm_blocks(40, 3)
    ref = attention(q, k, v)
    got = step_forward(step, q, k, v, blocks, tile_size=tile_size)[:2]
    ref += attention_backward(q, k, v, *ref, dout)
    got += step_backward(step, q, k, v, *ref[:2], dout, blocks, tile_size=tile_size)
    assert 0 < not_finite_rows(ref[2]).sum() < not_finite_rows(ref[2]).size   # dq: some rows, not all
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        if name == "lse":
            g, e = g[..., None], e[..., None]
        np.testing.assert_array_equal(not_finite_rows(g), not_finite_rows(e), err_msg=name)
        rows = ~not_finite_rows(e)
        assert_close(g[rows], e[rows], np.float64, name)


# -- progress: called on the calling thread, between tiles ----------------------------------

def test_progress_is_called_between_tiles_on_the_calling_thread(step):
    # the ring passes its communication object's `progress`: a transfer in
    # flight moves only while it is called, so a step must call it during its
    # work (not once at the end), and only on the thread that called the step
    q, k, v, dout = problem(S=40)
    queries = Queries.prepare(q, 2, np.arange(40), 0.3)
    rows = BackwardRows.prepare(*attention(q, k, v), dout, 2, queries.q.dtype)
    block = key_block(k, v, np.arange(40))
    for kind in ("forward", "backward"):
        calls = []
        progress = lambda: calls.append(threading.get_ident())   # noqa: E731
        if kind == "forward":
            counts = step.forward(ForwardAcc.zeros(queries.q), queries, block, causal=True, tile_size=(7, 5),
                                  progress=progress)
        else:
            grads = Grads(np.zeros_like(queries.q), np.zeros_like(block.k), np.zeros_like(block.v))
            counts = step.backward(grads, queries, rows, block, causal=True, tile_size=(7, 5), progress=progress)
        assert counts.tiles_computed > 20
        assert set(calls) <= {threading.get_ident()}, f"{kind}: progress called on another thread"
        if getattr(step, "workers", 1) == 1:            # with workers, the calling thread may do no tile
            # (waiting for workers: tests/steps/test_step_v3.py)
            assert len(calls) >= 2, f"{kind}: progress called {len(calls)} times over {counts.tiles_computed} tiles"


# -- the registry -----------------------------------------------------------------

def test_the_registry_imports_no_backend():
    """Every name the reference registers is its own: asking for each (and for
    "auto" on every array module it knows) imports neither gpu_impl nor mpi_impl."""
    import subprocess
    import sys
    code = ("import sys, numpy as np\n"
            "from reference import steps\n"
            "[steps.get(name, xp=np) for name in steps.names()]\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('gpu_impl', 'mpi_impl', 'mpi4py')], "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('gpu_impl', 'mpi_impl', 'mpi4py'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_registered_step_is_tried_first_by_auto_for_its_arrays(monkeypatch):
    class Mine(steps.Step):
        name = "mine"
        array_modules = ("numpy",)
        has_backward = False

    monkeypatch.setattr(steps, "STEPS", dict(steps.STEPS))
    monkeypatch.setattr(steps, "AUTO", {k: list(v) for k, v in steps.AUTO.items()})
    steps.register(Mine, auto_for="numpy")
    assert "mine" in steps.names()
    assert steps.check_step("auto", np).name == "mine"
    assert steps.check_step("auto", np, backward=True).name == "v5"      # it has no backward
    with pytest.raises(TypeError, match="subclass of reference.step.Step"):
        steps.register(object)
