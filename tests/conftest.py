"""Shared pieces of the test suite: hypothesis profiles, named tolerances per
dtype, input makers and the strategy that draws one attention problem.

Sizes are tiny on purpose (S <= 64, D <= 16, a few heads): every case runs the
dense oracle, which builds the whole (S, S) score matrix, and N virtual devices
as threads, on a shared 2-core machine.

Hypothesis profiles: "ci" (more examples, loaded when the CI environment
variable is set) and "dev" (few examples, the default).

    .venv/bin/python -m pytest tests -q                # dev profile
    CI=true .venv/bin/python -m pytest tests -q        # ci profile
"""

import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from reference import LAYOUTS

# CI is deterministic (derandomize), like Hypothesis's built-in "ci" profile.
settings.register_profile("ci", max_examples=150, deadline=None, print_blob=True, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI", "").lower() not in ("", "0", "false") else "dev")

DTYPES = (np.float64, np.float32, np.float16)
MAX_DEVICES = 8
MAX_SEQ = 64
MAX_HEAD_DIM = 16


@dataclass(frozen=True)
class Tolerance:
    """|actual - expected| <= atol * max(1, max|expected|) + rtol * |expected|."""
    rtol: float
    atol: float


# Ring against dense, both accumulating in the same precision (DESIGN.md):
# they differ only by summation order (measured: float64 1e-15, float32 1e-6);
# float16 results are rounded to float16 at the end, so one unit in the last
# place (2**-10) may differ.
TOL = {
    np.dtype(np.float64): Tolerance(rtol=1e-10, atol=1e-10),
    np.dtype(np.float32): Tolerance(rtol=2e-5, atol=2e-5),
    np.dtype(np.float16): Tolerance(rtol=2e-3, atol=2e-3),
}
# bfloat16 (ml_dtypes) keeps 8 significant bits: results rounded to it once at
# the end may differ by one unit in the last place, 2**-7 of the value (lse is
# float32). Measured in tests/test_masks.py (test_bfloat16_tolerance_is_measured).
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
TOL[BFLOAT16] = Tolerance(rtol=2 ** -7, atol=2 ** -7)
# Scores of a few hundred: an error of eps * |score| in a score is a relative
# error of that size in its softmax weight (measured: float32 6e-5, float64 4e-13).
LARGE_LOGITS_FACTOR = 10
# Gradients with large logits: the softmax is nearly one-hot, so dS = P (dP - delta)
# subtracts nearly equal numbers and its error is relative to |dP|, not to |dS|
# (measured over 6000 draws: scaled error up to 3e-4 in float32, 16 times TOL).
LARGE_LOGITS_GRAD_FACTOR = 100


def assert_close(actual, expected, dtype, what="", factor=1):
    """Assert actual ~ expected within TOL[dtype] (times `factor`), scaled by
    the size of `expected`."""
    tol = TOL[np.dtype(dtype)]
    tol = Tolerance(tol.rtol * factor, tol.atol * factor)
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    size = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=tol.rtol, atol=tol.atol * size, err_msg=what)


def assert_finite(*arrays, names=None):
    """No NaN and no inf anywhere (DESIGN.md, online softmax)."""
    for i, x in enumerate(arrays):
        name = names[i] if names else f"array {i}"
        assert np.isfinite(np.asarray(x, np.float64)).all(), f"{name} has NaN or inf"


# -- inputs ---------------------------------------------------------------

INPUT_KINDS = ("gaussian", "large_logits", "constant_keys", "constant")


def make_qkv(rng, shape_q, shape_kv, dtype, kind="gaussian", scale=None):
    """q (B, S, Hq, D), k, v (B, S, Hkv, D) of one kind:

    gaussian       standard normal;
    large_logits   q and k scaled so that scores q.k * scale are a few hundred;
    constant_keys  every key of a (batch, head) is the same vector, so every
                   score row is constant (a uniform softmax over what is visible);
    constant       every entry of q, k, v is the same number.
    """
    D = shape_q[-1]
    scale = abs(D ** -0.5 if scale is None else scale)
    if kind == "constant":
        return tuple(np.full(s, 0.75, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))
    q, k, v = (rng.standard_normal(s) for s in (shape_q, shape_kv, shape_kv))
    if kind == "large_logits":
        # std of q.k * scale is sigma^2 * sqrt(D) * scale; aim at ~200
        sigma = np.sqrt(200.0 / (np.sqrt(D) * scale))
        q, k = q * sigma, k * sigma
    elif kind == "constant_keys":
        k = np.broadcast_to(k[:, :1], k.shape).copy()
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


# -- the strategy ---------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One attention problem for the ring: shapes, options and inputs' kind."""
    layout: str
    n_devices: int
    B: int
    S: int
    Hq: int
    Hkv: int
    D: int
    tile_size: object
    causal: bool
    scale: object
    dtype: type
    kind: str
    seed: int

    @property
    def c(self):
        return self.S // self.n_devices

    def inputs(self):
        rng = np.random.default_rng(self.seed)
        q, k, v = make_qkv(rng, (self.B, self.S, self.Hq, self.D), (self.B, self.S, self.Hkv, self.D),
                           self.dtype, self.kind, self.scale)
        dout = rng.standard_normal(q.shape).astype(self.dtype)
        return q, k, v, dout

    @property
    def tolerance_factor(self):
        return LARGE_LOGITS_FACTOR if self.kind == "large_logits" else 1

    @property
    def grad_tolerance_factor(self):
        return LARGE_LOGITS_GRAD_FACTOR if self.kind == "large_logits" else 1

    def options(self):
        return dict(n_devices=self.n_devices, layout=self.layout, causal=self.causal,
                    scale=self.scale, tile_size=self.tile_size)


def tile_sizes(c):
    """An int, a rectangular (tq, tk) pair, or None (the default, larger than any
    block here). Sizes run from about c/6 (few tiles, to stay fast) to past the
    block (a tile larger than the block); most do not divide c."""
    side = st.integers(min_value=max(1, c // 6), max_value=c + 3)
    return st.one_of(side, st.tuples(side, side), st.just(None))


@st.composite
def cases(draw, dtypes=DTYPES, layouts=LAYOUTS, kinds=INPUT_KINDS, max_devices=MAX_DEVICES,
          causal=None):
    """A random `Case`: every layout, N in 1..8, c down to one token per device
    (two for zigzag), GQA (Hkv < Hq) and MQA (Hkv = 1), any D, tile and scale."""
    layout = draw(st.sampled_from(layouts))
    n = draw(st.integers(1, max_devices))
    chunks = 2 * n if layout == "zigzag" else n          # the layout's unit of division
    S = chunks * draw(st.integers(1, max(1, MAX_SEQ // chunks)))
    Hkv = draw(st.integers(1, 3))
    Hq = Hkv * draw(st.integers(1, 3))
    return Case(
        layout=layout, n_devices=n, B=draw(st.integers(1, 2)), S=S, Hq=Hq, Hkv=Hkv,
        D=draw(st.integers(1, MAX_HEAD_DIM)), tile_size=draw(tile_sizes(S // n)),
        causal=draw(st.booleans()) if causal is None else causal,
        scale=draw(st.sampled_from([None, None, 0.3, 1.0, -0.7])),
        dtype=draw(st.sampled_from(dtypes)), kind=draw(st.sampled_from(kinds)),
        seed=draw(st.integers(0, 2**32 - 1)))
