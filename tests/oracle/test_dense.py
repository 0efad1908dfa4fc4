"""The oracle's oracle: dense attention and its backward against a plain Python
loop over (batch, head, query, key), and the backward against central finite
differences of the loss sum(out * dout), in float64.

Sizes are a handful of tokens: the loops are scalar Python.

    .venv/bin/python -m pytest tests/oracle/test_dense.py -q
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import assert_close, make_qkv
from reference import attention, attention_backward

LOOP_TOL = 1e-12      # float64 loop against float64 einsum: summation order only
FD_EPS = 1e-6         # central differences: truncation eps^2 ~ 1e-12, round-off 1e-16 / eps ~ 1e-10
FD_TOL = 1e-7


def loop_attention(q, k, v, causal, scale):
    """out[b, i, h] = sum_j softmax_j(q_i . k_j * scale) v_j over visible j, one
    scalar at a time. Returns (out, lse) in float64."""
    B, S, Hq, D = q.shape
    group = Hq // k.shape[2]
    out, lse = np.zeros(q.shape), np.zeros((B, Hq, S))
    for b in range(B):
        for h in range(Hq):
            g = h // group                          # the key/value head this query head reads
            for i in range(S):
                keys = range(i + 1) if causal else range(S)
                s = {j: scale * sum(float(q[b, i, h, d]) * float(k[b, j, g, d]) for d in range(D))
                     for j in keys}
                m = max(s.values())
                w = {j: math.exp(s[j] - m) for j in keys}
                l = sum(w.values())
                lse[b, h, i] = m + math.log(l)
                for d in range(D):
                    out[b, i, h, d] = sum(w[j] * float(v[b, j, g, d]) for j in keys) / l
    return out, lse


def loop_backward(q, k, v, out, lse, dout, causal, scale):
    """The softmax backward, one (query, key) pair at a time:
    p = exp(s - lse), dv_j += p do_i, ds = p (do_i . v_j - do_i . out_i),
    dq_i += ds k_j scale, dk_j += ds q_i scale."""
    B, S, Hq, D = q.shape
    group = Hq // k.shape[2]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(B):
        for h in range(Hq):
            g = h // group
            for i in range(S):
                delta = float(np.dot(dout[b, i, h], out[b, i, h]))
                for j in (range(i + 1) if causal else range(S)):
                    p = math.exp(scale * float(np.dot(q[b, i, h], k[b, j, g])) - lse[b, h, i])
                    ds = p * (float(np.dot(dout[b, i, h], v[b, j, g])) - delta)
                    dv[b, j, g] += p * dout[b, i, h]
                    dq[b, i, h] += ds * k[b, j, g] * scale
                    dk[b, j, g] += ds * q[b, i, h] * scale
    return dq, dk, dv


@st.composite
def tiny(draw):
    """(q, k, v, dout, causal, scale) in float64 with S <= 5, GQA and MQA included."""
    S, D, Hkv = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 3))
    B = draw(st.integers(1, 2))
    kind = draw(st.sampled_from(["gaussian", "large_logits", "constant_keys"]))
    scale = draw(st.sampled_from([None, 0.5, -1.3]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = make_qkv(rng, (B, S, Hq, D), (B, S, Hkv, D), np.float64, kind, scale)
    dout = rng.standard_normal(q.shape)
    return q, k, v, dout, draw(st.booleans()), scale


def _scale(scale, D):
    return D ** -0.5 if scale is None else scale


@given(tiny())
def test_forward_equals_loop(problem):
    q, k, v, _, causal, scale = problem
    out, lse = attention(q, k, v, causal=causal, scale=scale)
    ref_out, ref_lse = loop_attention(q, k, v, causal, _scale(scale, q.shape[-1]))
    np.testing.assert_allclose(out, ref_out, rtol=LOOP_TOL, atol=LOOP_TOL)
    # scores of a few hundred: lse's absolute error is eps * |score|
    np.testing.assert_allclose(lse, ref_lse, rtol=LOOP_TOL, atol=LOOP_TOL * max(1, np.abs(ref_lse).max()))


@given(tiny())
def test_backward_equals_loop(problem):
    q, k, v, dout, causal, scale = problem
    out, lse = attention(q, k, v, causal=causal, scale=scale)
    grads = attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale)
    expected = loop_backward(q, k, v, out, lse, dout, causal, _scale(scale, q.shape[-1]))
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        size = max(1.0, np.abs(e).max())
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-9 * size, err_msg=name)


def _loss(q, k, v, dout, causal, scale):
    return float((attention(q, k, v, causal=causal, scale=scale)[0] * dout).sum())


def finite_differences(q, k, v, dout, causal, scale):
    """d loss / d x for x in (q, k, v), loss = sum(out * dout), by central differences."""
    grads = []
    for which in range(3):
        args = [q.copy(), k.copy(), v.copy()]
        x, g = args[which], np.zeros_like(args[which])
        for idx in np.ndindex(x.shape):
            keep = x[idx]
            x[idx] = keep + FD_EPS
            up = _loss(*args, dout, causal, scale)
            x[idx] = keep - FD_EPS
            down = _loss(*args, dout, causal, scale)
            x[idx] = keep
            g[idx] = (up - down) / (2 * FD_EPS)
        grads.append(g)
    return grads


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (4, 2), (3, 1)])        # MHA, GQA, MQA
def test_backward_equals_finite_differences(causal, Hq, Hkv):
    rng = np.random.default_rng(7 + Hq + 10 * causal)
    B, S, D, scale = 2, 5, 3, 0.8
    q, k, v = (rng.standard_normal(s) for s in ((B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D)))
    dout = rng.standard_normal(q.shape)
    out, lse = attention(q, k, v, causal=causal, scale=scale)
    grads = attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale)
    for name, g, e in zip(("dq", "dk", "dv"), grads, finite_differences(q, k, v, dout, causal, scale)):
        np.testing.assert_allclose(g, e, rtol=FD_TOL, atol=FD_TOL, err_msg=name)


def test_causal_first_row_sees_only_itself():
    # The mask comes from positions: query 0 sees key 0 only, so out[0] = v[0]
    # and lse[0] = q0 . k0 * scale, whatever the other keys hold.
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 6, 2, 4)) for _ in range(3))
    out, lse = attention(q, k, v, scale=0.5)
    np.testing.assert_allclose(out[:, 0], v[:, 0], rtol=1e-14)
    np.testing.assert_allclose(lse[0, :, 0], 0.5 * (q[0, 0] * k[0, 0]).sum(-1), rtol=1e-14)


@pytest.mark.parametrize("dtype, lse_dtype", [(np.float16, np.float32), (np.float32, np.float32),
                                              (np.float64, np.float64)])
def test_dtypes_follow_the_conventions(dtype, lse_dtype):
    # float16 and float32 accumulate in float32, float64 in float64; out has q's
    # dtype, lse is float32 (float64 for float64 inputs); and the result is the
    # float64 one to the dtype's tolerance.
    rng = np.random.default_rng(11)
    q64, k64, v64 = make_qkv(rng, (2, 8, 4, 8), (2, 8, 2, 8), np.float64)
    q, k, v = (x.astype(dtype) for x in (q64, k64, v64))
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse = attention(q, k, v)
    grads = attention_backward(q, k, v, out, lse, dout)
    assert out.dtype == dtype and lse.dtype == lse_dtype
    assert [g.dtype for g in grads] == [dtype] * 3
    ref_out, ref_lse = attention(*(x.astype(np.float64) for x in (q, k, v)))
    # the same (rounded) inputs in float64: only accumulation and final rounding differ
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")


# -- positions: attention of any shard to any block, and the merge -----------

def loop_with_positions(q, k, v, q_pos, k_pos, scale):
    """The causal loop over the pairs pos_k <= pos_q; a row with no visible key: out 0, lse -inf."""
    B, Sq, Hq, D = q.shape
    group = Hq // k.shape[2]
    out, lse = np.zeros(q.shape), np.full((B, Hq, Sq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            for i in range(Sq):
                keys = [j for j in range(k.shape[1]) if k_pos[j] <= q_pos[i]]
                if not keys:
                    continue
                s = {j: scale * float(q[b, i, h] @ k[b, j, h // group]) for j in keys}
                m = max(s.values())
                l = sum(math.exp(x - m) for x in s.values())
                lse[b, h, i] = m + math.log(l)
                out[b, i, h] = sum(math.exp(s[j] - m) / l * v[b, j, h // group] for j in keys)
    return out, lse


def test_attention_with_positions_equals_the_loop():
    # queries at striped positions of device 1 (N=4, S=16) against device 2's keys:
    # query 1 sees no key (2 > 1), the others see some
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 4, h, 3)) for h in (4, 2, 2))
    q_pos, k_pos = np.array([1, 5, 9, 13]), np.array([2, 6, 10, 14])
    out, lse = attention(q, k, v, q_pos=q_pos, k_pos=k_pos)
    want_out, want_lse = loop_with_positions(q, k, v, q_pos, k_pos, 3 ** -0.5)
    np.testing.assert_allclose(out, want_out, rtol=LOOP_TOL, atol=LOOP_TOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert np.isneginf(lse[:, :, 0]).all() and (out[:, 0] == 0).all()
    np.testing.assert_allclose(lse[:, :, 1:], want_lse[:, :, 1:], rtol=LOOP_TOL)


def test_merge_of_two_key_sets_is_attention_over_both():
    # keys at positions 0..11 split in two interleaved halves; queries at 0..11:
    # query 0 sees no key of the odd half; merging the halves gives dense over all
    from reference import merge
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 12, h, 4)) for h in (2, 1, 1))
    pos = np.arange(12)
    even, odd = pos[::2], pos[1::2]
    a = attention(q, k[:, even], v[:, even], q_pos=pos, k_pos=even)
    b = attention(q, k[:, odd], v[:, odd], q_pos=pos, k_pos=odd)
    assert np.isneginf(b[1][:, :, 0]).all()
    out, lse = merge(a, b)
    want_out, want_lse = attention(q, k, v)
    assert_close(out, want_out, np.float64, "out")
    assert_close(lse, want_lse, np.float64, "lse")
    none = attention(q[:, :2], k[:, 5:7], v[:, 5:7], q_pos=pos[:2], k_pos=pos[5:7])   # neither sees a key
    out, lse = merge(none, none)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_merge_rejects_mismatched_parts():
    from reference import merge
    out, lse = np.zeros((1, 4, 2, 3)), np.zeros((1, 2, 4))
    with pytest.raises(ValueError, match="lse_b must be"):
        merge((out, lse), (out, lse[:, :1]))
    with pytest.raises(TypeError, match="out_a must be"):
        merge((out.tolist(), lse), (out, lse))


def test_backward_with_positions_gives_the_rows_of_the_full_gradient():
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 10, h, 3)) for h in (2, 2, 2, 2))
    out, lse = attention(q, k, v)
    dq = attention_backward(q, k, v, out, lse, dout)[0]
    rows = np.array([2, 5, 9])
    dq_rows = attention_backward(q[:, rows], k, v, out[:, rows], lse[:, :, rows], dout[:, rows],
                                 q_pos=rows, k_pos=np.arange(10))[0]
    np.testing.assert_allclose(dq_rows, dq[:, rows], rtol=1e-12, atol=1e-12)
