"""The ring of N virtual devices against the dense oracle: forward (out, lse)
and backward (dq, dk, dv), every layout, N from 1 to 8, GQA and MQA, any tile
size, causal or not, any scale, float64/float32/float16, and inputs chosen to
break an online softmax: scores of a few hundred, constant score rows, one
token per device, rows that see no key of a block. Nothing may be NaN or inf.
Then NaN in an input: it reaches the rows the positions rule says, no others.

    .venv/bin/python -m pytest tests/steps/test_ring.py -q
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import Case, assert_close, assert_finite, cases
from reference import (LAYOUTS, attention, attention_backward, lockstep, positions, ring, ring_attention,
                       ring_attention_backward, shard, steps, unshard)
from reference.layouts import unit as layout_unit
from reference.masks import CAUSAL, as_mask
from reference.tiles import visible
from reference.virtual import run_devices


def dense(case, q, k, v):
    return attention(q, k, v, causal=case.causal, scale=case.scale)


def check_forward(case):
    q, k, v, _ = case.inputs()
    out, lse = ring_attention(q, k, v, **case.options())
    ref_out, ref_lse = dense(case, q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == ref_lse.dtype and lse.shape == (case.B, case.Hq, case.S)
    assert_finite(out, lse, names=("out", "lse"))
    assert_close(out, ref_out, case.dtype, "out", case.tolerance_factor)
    assert_close(lse, ref_lse, case.dtype, "lse", case.tolerance_factor)


def check_backward(case):
    # the same (out, lse, dout) go to both, so only the backward is compared
    q, k, v, dout = case.inputs()
    out, lse = dense(case, q, k, v)
    grads = ring_attention_backward(q, k, v, out, lse, dout, **case.options())
    expected = attention_backward(q, k, v, out, lse, dout, causal=case.causal, scale=case.scale)
    assert_finite(*grads, names=("dq", "dk", "dv"))
    for name, g, e, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close(g, e, case.dtype, name, case.grad_tolerance_factor)


@given(cases())
def test_forward_equals_dense(case):
    check_forward(case)


@given(cases())
def test_backward_equals_dense(case):
    check_backward(case)


# -- the lockstep form of Algorithm 1, and the tuned steps on the ring -----

@given(cases(), st.sampled_from(["v1", "v3"]))
def test_lockstep_equals_the_threaded_ring_bit_for_bit(case, step):
    # the same step in the same order on every device: not close, equal
    q, k, v, dout = case.inputs()
    out, lse = ring_attention(q, k, v, step=step, **case.options())
    lock_out, lock_lse = lockstep.ring_attention(q, k, v, step=step, **case.options())
    np.testing.assert_array_equal(lock_out, out)
    np.testing.assert_array_equal(lock_lse, lse)
    grads = ring_attention_backward(q, k, v, out, lse, dout, step=step, **case.options())
    lock_grads = lockstep.ring_attention_backward(q, k, v, out, lse, dout, step=step, **case.options())
    for name, a, b in zip(("dq", "dk", "dv"), lock_grads, grads):
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)


@given(cases(dtypes=(np.float64, np.float32)), st.sampled_from(["v2", "v3", "auto"]))
def test_the_ring_with_a_tuned_step_equals_dense(case, step):
    q, k, v, dout = case.inputs()
    out, lse = ring_attention(q, k, v, step=step, **case.options())
    ref_out, ref_lse = dense(case, q, k, v)
    assert_close(out, ref_out, case.dtype, "out", case.tolerance_factor)
    assert_close(lse, ref_lse, case.dtype, "lse", case.tolerance_factor)
    grads = ring_attention_backward(q, k, v, ref_out, ref_lse, dout, step=step, **case.options())
    expected = attention_backward(q, k, v, ref_out, ref_lse, dout, causal=case.causal, scale=case.scale)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(g, e, case.dtype, name, case.grad_tolerance_factor)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_backend_follows_the_all_minus_inf_rule(layout):
    # a query whose visible scores are all -inf: dense gives NaN, and so must
    # every step on the ring (not out = 0, lse = -inf, which is for rows with
    # no visible key at all)
    q = np.ones((1, 8, 1, 1))
    q[:, 5] = np.inf
    k, v = -np.ones((1, 8, 1, 1)), np.ones((1, 8, 1, 1))
    with np.errstate(invalid="ignore"):
        ref = attention(q, k, v)
        assert np.isnan(ref[0][:, 5]).all() and np.isnan(ref[1][:, :, 5]).all()
        for step in ("v1", "v2", "v3", "v5"):
            for run in (ring_attention, lockstep.ring_attention):
                got = run(q, k, v, n_devices=2, layout=layout, tile_size=2, step=step)
                for name, g, e in zip(("out", "lse"), got, ref):
                    what = f"{name}, {step}, {run.__module__}"
                    np.testing.assert_array_equal(np.isnan(g), np.isnan(e), err_msg=what)
                    assert_close(g[~np.isnan(e)], e[~np.isnan(e)], np.float64, what)


# -- chosen cases, so that each hazard is met whatever hypothesis draws ------

def case_of(layout="striped", n_devices=4, S=16, Hq=2, Hkv=1, D=4, tile_size=None, causal=True,
            scale=None, dtype=np.float64, kind="gaussian", B=1, seed=0):
    return Case(layout, n_devices, B, S, Hq, Hkv, D, tile_size, causal, scale, dtype, kind, seed)


def rows_without_visible_key(case):
    """How many (round, device, query) rows see no key of the block they hold."""
    pos = positions(case.S, case.n_devices, case.layout)
    n = case.n_devices
    return sum(int((~visible(pos[j], pos[(j - t) % n], case.causal).any(axis=1)).sum())
               for t in range(n) for j in range(n))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
def test_one_token_per_device(layout, n_devices, dtype):
    # c = 1 (2 for zigzag): every block is one key, invisible to the query in
    # half the rounds
    S = layout_unit(n_devices, layout)
    case = case_of(layout, n_devices, S, Hq=3, Hkv=1, tile_size=1, dtype=dtype)
    check_forward(case)
    check_backward(case)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tile_size", [1, 3, (2, 5), None])
def test_rows_with_no_visible_key_in_a_block(layout, tile_size):
    case = case_of(layout, n_devices=4, S=24, Hq=4, Hkv=2, tile_size=tile_size, dtype=np.float32)
    assert rows_without_visible_key(case) > 0          # the hazard is there
    check_forward(case)
    check_backward(case)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("kind", ["large_logits", "constant_keys", "constant"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hard_inputs(layout, kind, dtype):
    case = case_of(layout, n_devices=4, S=32, Hq=4, Hkv=2, D=16, tile_size=(3, 5), dtype=dtype,
                   kind=kind, B=2)
    q, k, _, _ = case.inputs()
    if kind == "large_logits":                         # the scores are a few hundred
        s = np.einsum("bqhd,bkhd->bhqk", q[:, :, ::2].astype(float), k.astype(float)) * case.D ** -0.5
        assert np.abs(s).max() > 300
    check_forward(case)
    check_backward(case)


@pytest.mark.parametrize("score", [None, -5e4, 5e4])
def test_constant_keys_give_the_running_mean(score):
    # every score row constant: out row i is the mean of the visible values and
    # lse = score + log(count), also when the scores are tens of thousands from zero
    case = case_of("striped", n_devices=4, S=16, kind="constant_keys", tile_size=3)
    q, k, v, _ = case.inputs()
    scale = case.D ** -0.5
    if score is not None:                              # q . k0 * scale = score for every query
        k0 = k[:, :1, :1]                              # (B, 1, 1, D), Hkv = 1
        q = np.broadcast_to(score * k0 / (scale * (k0 ** 2).sum(-1, keepdims=True)), q.shape).copy()
    out, lse = ring_attention(q, k, v, **case.options())
    count = np.arange(1, case.S + 1)[None, :, None, None]
    mean = np.cumsum(np.repeat(v, case.Hq // case.Hkv, axis=2), axis=1) / count
    assert_close(out, mean, np.float64, "out")
    s0 = scale * np.einsum("bqhd,bhd->bhq", q, k[:, 0, np.zeros(case.Hq, int)])
    assert_close(lse, s0 + np.log(count[0, :, 0, 0]), np.float64, "lse")


@given(cases(dtypes=(np.float64,)), st.sampled_from([0.25, -2.0]))
def test_scale_is_applied_once(case, scale):
    # scale s on q, k equals scale 1 on (s q, k): the scale multiplies the scores
    q, k, v, _ = case.inputs()
    opts = {**case.options(), "scale": scale}
    out, lse = ring_attention(q, k, v, **opts)
    ref_out, ref_lse = ring_attention(q * scale, k, v, **{**opts, "scale": 1.0})
    assert_close(out, ref_out, np.float64, "out", case.tolerance_factor)
    assert_close(lse, ref_lse, np.float64, "lse", case.tolerance_factor)


# -- NaN reaches the rows it should, and only those --------------------------
#
# docs/design.md: "NaN in the inputs gives NaN in the rows it reaches, not elsewhere."
# Every result row is a sum over (query, key) pairs with the key visible to the
# query (pos_k <= pos_q, causal; every pair otherwise), and a masked pair is no
# term of it: it contributes nothing, even when one of its values is NaN or inf
# (0 x NaN is NaN, so neither the dense formula nor a masked tile may multiply
# a masked weight by a value). A row is reached, and must hold a NaN, when a
# term of its sum reads a non-finite input; every other row must be finite.
# `nan_reach` gives the rows, from the terms each sum reads.

def not_finite_rows(x):
    """(B, S, H, D) -> (B, S, H) bool: the rows holding a NaN or inf."""
    return ~np.isfinite(x).all(axis=-1)


def nan_reach(case, bad):
    """The rows that must hold a NaN (or inf); all others must be finite.

    `bad`: the non-finite rows of the inputs, q, dout, out, lse (B, S, Hq) and
    k, v (B, S, Hkv) (out and lse only for the backward, where they are inputs).
    Returns {"lse", "out", "dq": (B, S, Hq), "dk", "dv": (B, S, Hkv)}.

    The terms, for a visible pair (query row i, key j) of (batch b, query head
    h, its key/value head g = h // G), positions 0..S-1 in the user's order:

        s_ij  = q_i . k_j * scale           p_ij  = exp(s_ij - lse_i)
        lse_i = log sum_j exp(s_ij)         out_i = sum_j p_ij v_j
        ds_ij = p_ij (dO_i . v_j - dO_i . out_i)
        dq_i  = sum_j ds_ij k_j             dk_j  = sum_{h of g} sum_i ds_ij q_i
        dv_j  = sum_{h of g} sum_i p_ij dO_i

    so, every sum over the visible pairs only (j <= i, causal):
        lse_i  reached  iff q_i or some visible k_j is not finite
        out_i  reached  iff lse_i is, or some visible v_j is not finite
        dq_i   reached  iff one of q_i, lse_i, dO_i, out_i is not finite (and i
                        sees a key), or some visible k_j or v_j is
        dk_j   reached  iff a query row i of g's heads that sees j has one of
                        q_i, lse_i, dO_i, out_i not finite, or k_j or v_j is
                        (and j is seen)
        dv_j   reached  iff a query row i of g's heads that sees j has one of
                        q_i, lse_i, dO_i not finite, or k_j is (and j is seen);
                        not v_j, not out_i: dv reads neither.
    """
    G = case.Hq // case.Hkv
    vis = np.ones((case.S, case.S), bool)                    # (query i, key j), positions 0..S-1
    if case.causal:
        vis = np.tril(vis)

    def per_query_head(x):                                   # (B, S, Hkv) -> (B, S, Hq)
        return np.repeat(x, G, axis=2)

    def some_visible_key(x):                                 # x (B, S_k, Hq) -> (B, S_q, Hq)
        return (vis[None, :, :, None] & x[:, None, :, :]).any(axis=2)

    def some_query_seeing(x):                                # x (B, S_q, Hq) -> (B, S_k, Hkv)
        hit = (vis.T[None, :, :, None] & x[:, None, :, :]).any(axis=2)
        return hit.reshape(case.B, case.S, case.Hkv, G).any(axis=-1)

    k, v = per_query_head(bad["k"]), per_query_head(bad["v"])
    sees_a_key = vis.any(axis=1)[None, :, None]              # query i sees some key
    seen = vis.any(axis=0)[None, :, None]                    # key j is seen by some query
    reach = {"lse": bad["q"] | some_visible_key(k)}
    reach["out"] = reach["lse"] | some_visible_key(v)
    if "out" in bad:
        row = bad["q"] | bad["lse"] | bad["dout"] | bad["out"]
        reach["dq"] = (row & sees_a_key) | some_visible_key(k | v)
        reach["dk"] = some_query_seeing(row) | ((bad["k"] | bad["v"]) & seen)
        reach["dv"] = some_query_seeing(bad["q"] | bad["lse"] | bad["dout"]) | (bad["k"] & seen)
    return reach


def reached_rows(case, source, b, p, head):
    """Boolean (B, S, Hq): the output rows a NaN at (b, p, head) of `source` reaches."""
    rows = np.zeros((case.B, case.S, case.Hq), dtype=bool)
    if source == "q":
        rows[b, p, head] = True
        return rows
    group = case.Hq // case.Hkv
    seen_by = np.arange(case.S) >= p if case.causal else np.ones(case.S, bool)
    rows[b, :, head * group:(head + 1) * group] = seen_by[:, None]
    return rows


def nan_inputs(case, source, rng):
    q, k, v, dout = case.inputs()
    x = {"q": q, "k": k, "v": v}[source]
    b, p, head, d = (int(rng.integers(n)) for n in x.shape)
    x[b, p, head, d] = np.nan
    return (q, k, v, dout), reached_rows(case, source, b, p, head)


def run_forward(case, backend, q, k, v):
    if backend == "dense":
        return dense(case, q, k, v)
    return ring_attention(q, k, v, **case.options())


def run_backward(case, backend, q, k, v, out, lse, dout):
    if backend == "dense":
        return attention_backward(q, k, v, out, lse, dout, causal=case.causal, scale=case.scale)
    return ring_attention_backward(q, k, v, out, lse, dout, **case.options())


def assert_nan_exactly_in(rows, out, what, nan=True):
    """out (B, S, H, D): a row has a NaN (with nan=False: a NaN or inf) where
    `rows` is True, and is finite elsewhere."""
    hit = np.isnan(out).any(axis=-1) if nan else ~np.isfinite(out).all(axis=-1)
    finite = np.isfinite(out).all(axis=-1)
    missing = np.argwhere(rows & ~hit)
    assert len(missing) == 0, f"{what}: NaN missing from rows it reaches, (b, s, h) = {missing.tolist()}"
    bad = np.argwhere(~rows & ~finite)
    assert len(bad) == 0, f"{what}: NaN or inf in rows it does not reach, (b, s, h) = {bad.tolist()}"


def check_nan_reach(case, source, at, value=np.nan, backward=True):
    """Put `value` at index `at` of input `source` (q, k, v or dout) and check
    that dense and the ring give non-finite values in exactly the rows of
    `nan_reach`: out and lse, then dq, dk, dv (both fed dense's out and lse)."""
    q, k, v, dout = case.inputs()
    {"q": q, "k": k, "v": v, "dout": dout}[source][at] = value
    bad = {name: not_finite_rows(x) for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout))}
    want, nan = nan_reach(case, bad), np.isnan(value)
    for backend in ("dense", "ring"):
        out, lse = run_forward(case, backend, q, k, v)
        assert_nan_exactly_in(want["out"], out, f"{backend} out, {value} in {source}", nan)
        assert_nan_exactly_in(want["lse"], lse.transpose(0, 2, 1)[..., None],
                              f"{backend} lse, {value} in {source}", nan)
    if not backward:
        return
    out, lse = dense(case, q, k, v)
    bad.update(out=not_finite_rows(out), lse=~np.isfinite(lse).transpose(0, 2, 1))
    want = nan_reach(case, bad)
    for backend in ("dense", "ring"):
        grads = run_backward(case, backend, q, k, v, out, lse, dout)
        for name, g in zip(("dq", "dk", "dv"), grads):
            assert_nan_exactly_in(want[name], g, f"{backend} {name}, {value} in {source}", nan)


@pytest.mark.parametrize("source", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("tile_size", [1, 3, (2, 5), None])
@pytest.mark.parametrize("n_devices", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_reaches_exactly_its_rows(layout, n_devices, tile_size, source):
    # S = 6N: c = 6 tokens a device (3 a zigzag chunk), cut into masked tiles
    # that hold keys some of their rows cannot see; the NaN sits away from the
    # ends of the sequence, so that it has rows on both sides
    S = 6 * n_devices
    case = case_of(layout, n_devices, S, Hq=4, Hkv=2, D=3, tile_size=tile_size, B=2,
                   seed=n_devices)
    rng = np.random.default_rng([n_devices, len(source), S])
    heads = case.Hq if source in ("q", "dout") else case.Hkv
    at = (int(rng.integers(case.B)), int(rng.integers(1, S - 1)), int(rng.integers(heads)),
          int(rng.integers(case.D)))
    check_nan_reach(case, source, at)


@pytest.mark.parametrize("value", [np.inf, -np.inf])
@pytest.mark.parametrize("tile_size", [3, None])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_inf_in_v_reaches_exactly_its_rows(layout, tile_size, value):
    # an inf value gives inf (or NaN) in the rows that see it: 0 x inf is NaN
    # too, so a masked pair must not multiply it either
    case = case_of(layout, n_devices=2, S=12, Hq=2, Hkv=1, tile_size=tile_size, B=2)
    check_nan_reach(case, "v", (1, 7, 0, 2), value, backward=False)


@given(cases(dtypes=(np.float64, np.float32)), st.sampled_from(["q", "k", "v", "dout"]),
       st.integers(0, 2**32 - 1))
def test_nan_anywhere_reaches_exactly_its_rows(case, source, seed):
    rng = np.random.default_rng(seed)
    shape = (case.B, case.S, case.Hq if source in ("q", "dout") else case.Hkv, case.D)
    check_nan_reach(case, source, tuple(int(rng.integers(n)) for n in shape))


@given(cases(dtypes=(np.float64, np.float32)), st.sampled_from(["q", "k"]), st.integers(0, 2**32 - 1))
def test_nan_in_q_or_k_reaches_only_its_rows(case, source, seed):
    (q, k, v, _), rows = nan_inputs(case, source, np.random.default_rng(seed))
    out, _ = run_forward(case, "ring", q, k, v)
    assert_nan_exactly_in(rows, out, f"out, NaN in {source}")


# The three hazards below, each once by hand: (a) `l > 0` is False for a NaN
# row sum, which would read "no visible key" and give lse = -inf; (b) P V with
# P = 0 at masked pairs: 0 x NaN = NaN, which would carry a NaN value to rows
# that cannot see its key; (c) a NaN query row has lse = NaN, so exp(-inf - NaN)
# would make its P NaN at masked pairs too, and dS = P (dP - delta) is 0 x NaN
# there: dK, dV of keys it cannot see would become NaN.
NAN_CASE = case_of("contiguous", n_devices=2, S=8, Hq=2, Hkv=1, tile_size=4, B=2)


@pytest.mark.parametrize("source", ["q", "k"])
@pytest.mark.parametrize("backend", ["dense", "ring"])
def test_nan_reaches_lse_of_its_rows(backend, source):
    # (a) NaN at query 5 (or key 5): lse is NaN exactly in the rows reached
    (q, k, v, _) = NAN_CASE.inputs()
    {"q": q, "k": k}[source][1, 5, 0, 2] = np.nan
    rows = reached_rows(NAN_CASE, source, 1, 5, 0)
    _, lse = run_forward(NAN_CASE, backend, q, k, v)
    assert_nan_exactly_in(rows, lse.transpose(0, 2, 1)[..., None], f"lse, NaN in {source}")


@pytest.mark.parametrize("backend, tile_size", [
    ("dense", None),                                   # every row before it
    ("ring", 4),                                       # rows of the same masked tile
    ("ring", 1),                                       # 1x1 tiles: masked tiles are skipped
])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_in_v_reaches_only_its_rows(backend, tile_size, layout):
    # (b) NaN in value 5: rows 5.. see it; rows 0..4 must stay finite (query 4
    # shares a 4x4 tile with key 5 on contiguous and zigzag, and striped's
    # blocks have masked tiles in every round)
    case = case_of(layout, n_devices=2, S=8, Hq=2, Hkv=1, tile_size=tile_size, B=2)
    q, k, v, _ = case.inputs()
    v[1, 5, 0, 2] = np.nan
    out, lse = run_forward(case, backend, q, k, v)
    assert_nan_exactly_in(reached_rows(case, "v", 1, 5, 0), out, "out, NaN in v")
    assert np.isfinite(lse).all()                      # values do not enter lse


def reached_by_query_in_backward(case, b, p, h):
    """NaN in query p (b, head h): dq row (b, p, h); dk and dv rows (b, j, h // G)
    of the keys j that query p sees. Returns three boolean (B, S, H) arrays."""
    dq = np.zeros((case.B, case.S, case.Hq), bool)
    dq[b, p, h] = True
    dkv = np.zeros((case.B, case.S, case.Hkv), bool)
    dkv[b, :, h // (case.Hq // case.Hkv)] = np.arange(case.S) <= p if case.causal else True
    return dq, dkv, dkv


@pytest.mark.parametrize("backend, tile_size", [
    ("dense", None),                                   # every key of its head
    ("ring", 4),                                       # keys of the same masked tile
    ("ring", 1),
])
def test_nan_in_q_reaches_only_its_gradients(backend, tile_size):
    # (c) NaN in query 5 (its out and lse NaN too): only its own gradients
    case = case_of("contiguous", n_devices=2, S=8, Hq=2, Hkv=1, tile_size=tile_size, B=2)
    q, k, v, dout = case.inputs()
    q[1, 5, 0, 2] = np.nan
    out, lse = dense(case, q, k, v)
    grads = run_backward(case, backend, q, k, v, out, lse, dout)
    for name, g, rows in zip(("dq", "dk", "dv"), grads, reached_by_query_in_backward(case, 1, 5, 0)):
        assert_nan_exactly_in(rows, g, f"{name}, NaN in q")


# -- the per-device ring with keys dealt differently from queries ---------------
#
# Through the public functions a device always meets its own block first, and
# the first key tile of that block holds a key every query sees (a layout's first
# local key is its smallest). To reach a row whose *first* block shows it no key
# (the running max is still -inf: the step's hazard), deal the K/V blocks to the
# devices in reverse order; positions travel with them, so the answer must not
# change.

def run_ring(q_shards, k_shards, v_shards, q_pos, k_pos, *, causal=True, scale=None, tile_size=None,
             backward_inputs=None):
    """ring.ring_forward (or ring_backward) on N virtual devices with the given
    shards and positions; returns the per-device results."""
    n = len(q_shards)
    scale = q_shards[0].shape[-1] ** -0.5 if scale is None else scale
    # copies: ring_forward may scale its q in place (test_ring_leaves_its_inputs_alone)
    q_shards = [x.copy() for x in q_shards]
    opts = dict(mask=as_mask(causal), scale=scale, tile_size=tile_size, step=steps.get("auto", xp=np))

    def device(j, comm):
        if backward_inputs is None:
            return ring.ring_forward(q_shards[j], k_shards[j], v_shards[j], q_pos[j], k_pos[j], comm, **opts)
        out, lse, dout = (x[j] for x in backward_inputs)
        return ring.ring_backward(q_shards[j], k_shards[j], v_shards[j], out, lse, dout,
                                  q_pos[j], k_pos[j], comm, **opts)
    return list(zip(*run_devices(n, device)))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("tile_size", [1, 2, (3, 2), None])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_block_shows_some_rows_no_key(layout, tile_size, dtype):
    N, S = 4, 16
    case = case_of(layout, N, S, Hq=2, Hkv=1, tile_size=tile_size, dtype=dtype, B=2)
    q, k, v, dout = case.inputs()
    pos = positions(S, N, layout)
    k_owner = [N - 1 - j for j in range(N)]                # device j starts with block N-1-j
    k_pos = [pos[o] for o in k_owner]
    first = visible(pos[0], k_pos[0])                      # device 0 meets the last block first
    assert not first.any(axis=1).all()                     # some rows see nothing in it
    ref_out, ref_lse = dense(case, q, k, v)
    qs, os_, dos = (shard(x, N, layout) for x in (q, ref_out, dout))
    ks, vs = ([np.take(x, p, axis=1) for p in k_pos] for x in (k, v))
    out, lse, _ = run_ring(qs, ks, vs, pos, k_pos, tile_size=tile_size)
    assert_finite(*out, *lse)
    assert_close(unshard(out, layout), ref_out, dtype, "out")
    assert_close(unshard(lse, layout, axis=2), ref_lse, dtype, "lse")

    lses = shard(ref_lse, N, layout, axis=2)
    dq, dk, dv, _ = run_ring(qs, ks, vs, pos, k_pos, tile_size=tile_size, backward_inputs=(os_, lses, dos))
    ref = attention_backward(q, k, v, ref_out, ref_lse, dout)
    dk_full, dv_full = np.empty_like(k), np.empty_like(v)
    for j in range(N):                                     # dK, dV come home with their keys
        dk_full[:, k_pos[j]], dv_full[:, k_pos[j]] = dk[j], dv[j]
    for name, g, e in zip(("dq", "dk", "dv"), (unshard(dq, layout), dk_full, dv_full), ref):
        assert_finite(g, names=(name,))
        assert_close(g, e, dtype, name)


def masked_attention(q, k, v, q_pos, k_pos, scale):
    """float64 attention with the mask from positions (key visible iff
    k_pos <= q_pos), one query row at a time; a row that sees no key gets
    out = 0, lse = -inf. q (B, Sq, H, D), k, v (B, Sk, H, D)."""
    B, Sq, H, D = q.shape
    out, lse = np.zeros(q.shape), np.full((B, H, Sq), -np.inf)
    for i in range(Sq):
        keys = k_pos <= q_pos[i]
        if keys.any():
            s = np.einsum("bhd,bkhd->bhk", q[:, i], k[:, keys]) * scale     # (B, H, keys)
            m = s.max(axis=-1, keepdims=True)
            w = np.exp(s - m)
            lse[:, :, i] = (m + np.log(w.sum(axis=-1, keepdims=True)))[..., 0]
            out[:, i] = np.einsum("bhk,bkhd->bhd", w / w.sum(axis=-1, keepdims=True), v[:, keys])
    return out, lse


@pytest.mark.parametrize("tile_size", [1, 3, None])
def test_rows_that_see_no_key_at_all(tile_size):
    # keys sit at positions offset..offset+S-1: queries before `offset` see no key
    # anywhere; their out is 0 and lse -inf (step.finish_forward), nothing is NaN,
    # and in the backward they add nothing
    N, S, offset, scale = 2, 8, 3, 0.5
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, S, 1, 4)) for _ in range(4))
    pos = positions(S, N, "striped")
    qs, ks, vs, dos = (shard(x, N, "striped") for x in (q, k, v, dout))
    out, lse, _ = run_ring(qs, ks, vs, pos, pos + offset, scale=scale, tile_size=tile_size)
    out, lse = unshard(out, "striped"), unshard(lse, "striped", axis=2)
    ref_out, ref_lse = masked_attention(q, k, v, np.arange(S), np.arange(S) + offset, scale)
    blind = np.arange(S) < offset
    assert (out[:, blind] == 0).all() and np.isneginf(lse[..., blind]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[..., ~blind]).all()
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse[..., ~blind], ref_lse[..., ~blind], rtol=1e-12)

    os_, lses = shard(out, N, "striped"), shard(lse, N, "striped", axis=2)
    dq, dk, dv, _ = run_ring(qs, ks, vs, pos, pos + offset, scale=scale, tile_size=tile_size,
                             backward_inputs=(os_, lses, dos))
    dq = unshard(dq, "striped")
    assert_finite(dq, *dk, *dv)
    assert (dq[:, blind] == 0).all()
    # a blind row's dout changes nothing: the gradients equal those with its dout zeroed
    dos_zero = shard(np.where(blind[None, :, None, None], 0.0, dout), N, "striped")
    again = run_ring(qs, ks, vs, pos, pos + offset, scale=scale, tile_size=tile_size,
                     backward_inputs=(os_, lses, dos_zero))
    for got, want in zip((dk, dv), again[1:3]):
        np.testing.assert_array_equal(np.concatenate(got, axis=1), np.concatenate(want, axis=1))


@pytest.mark.parametrize("Hq, Hkv, S, N", [
    (4, 2, 8, 2),
    (2, 1, 8, 2),   # MQA: the transpose moves nothing, so q_to_heads may return a view
    (4, 2, 2, 2),   # one token per device: likewise
])
@pytest.mark.parametrize("backward", [False, True])
def test_ring_leaves_its_inputs_alone(Hq, Hkv, S, N, backward):
    # the per-device functions are what mpi_impl and gpu_impl call on the user's
    # own shards, so they must not write to them
    rng = np.random.default_rng(2)
    q, dout = rng.standard_normal((1, S, Hq, 4)), rng.standard_normal((1, S, Hq, 4))
    k, v = rng.standard_normal((1, S, Hkv, 4)), rng.standard_normal((1, S, Hkv, 4))
    out, lse = attention(q, k, v)
    pos = positions(S, N, "striped")
    inputs = [shard(x, N, "striped") for x in (q, k, v, out, dout)] + [shard(lse, N, "striped", axis=2)]
    kept = [[x.copy() for x in xs] for xs in inputs]
    qs, ks, vs, os_, dos, lses = inputs

    def device(j, comm):
        opts = dict(mask=CAUSAL, scale=0.5, tile_size=None, step=steps.get("auto", xp=np))
        if backward:
            return ring.ring_backward(qs[j], ks[j], vs[j], os_[j], lses[j], dos[j], pos[j], pos[j], comm, **opts)
        return ring.ring_forward(qs[j], ks[j], vs[j], pos[j], pos[j], comm, **opts)
    run_devices(N, device)
    for name, now, before in zip(("q", "k", "v", "out", "dout", "lse"), inputs, kept):
        for a, b in zip(now, before):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} was written to")


def test_public_functions_leave_their_inputs_alone():
    case = case_of("striped", n_devices=2, S=8, Hq=2, Hkv=1)
    q, k, v, dout = case.inputs()
    out, lse = ring_attention(q, k, v, **case.options())
    kept = [x.copy() for x in (q, k, v, out, lse, dout)]
    ring_attention_backward(q, k, v, out, lse, dout, **case.options())
    ring_attention(q, k, v, **case.options())
    for now, before in zip((q, k, v, out, lse, dout), kept):
        np.testing.assert_array_equal(now, before)
