"""Comparison: one output against its expected value, element by element, in words.

Two ways to hold a result, both NumPy only (this module imports nothing else of
the kit, and never hypothesis):

- against the float64 oracle with a per-element tolerance (`oracle.tolerances`):
  `attention_mismatch` / `assert_attention_close`, whose message names the
  output, rank, global position, batch, head and dim of the first bad element
  and of the worst one;
- one of the project's backends against another that sums in the same
  precision: the same-precision table `TOL` and `assert_close` (the project's
  one tolerance table: its tests and `mpi_impl --check` use it).

    assert_attention_close(got, want, tol, name="dq", positions=pos[r], rank=r)
    assert_close(out_mpi, out_virtual, np.float32, "out")

Shapes: out, dq, dk, dv as (B, c, H, D), lse as (B, H, c), c the rank's tokens.
"""

import re
from dataclasses import dataclass

import numpy as np

# -- against the oracle, per element ----------------------------------------------


def _where(name, index, positions=None, rank=None, local=None):
    """Words for one element of a rank's out/dq/dk/dv (B, c, H, D) or lse (B, H, c).
    `local` maps the compared tokens to the rank's local indices (padding left out)."""
    if name == "lse":
        b, h, i = index
        d = None
    else:
        b, i, h, d = index
    pos = int(positions[i]) if positions is not None else i
    at = int(local[i]) if local is not None else i
    head = "kv head" if name in ("dk", "dv") else "head"
    words = [f"rank {rank}" if rank is not None else None,
             f"global position {pos}" + (f" (local {at})" if positions is not None else ""),
             f"batch {b}", f"{head} {h}", f"dim {d}" if d is not None else None]
    return ", ".join(w for w in words if w)


def attention_mismatch(actual, expected, tol, *, name="out", positions=None, rank=None, local=None):
    """None when actual matches expected element by element, else a message
    naming the first bad element (in index order) and the worst one.

    Matching: where expected is NaN, actual is NaN; where expected is +-inf,
    actual is the same inf; elsewhere |actual - expected| <= tol (an array
    broadcastable to expected, or a number)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return f"{name}" + (f" on rank {rank}" if rank is not None else "") + \
            f": shape {actual.shape}, expected {expected.shape}"
    tol = np.broadcast_to(np.asarray(tol, np.float64), expected.shape)
    with np.errstate(invalid="ignore"):
        err = np.abs(actual - expected)
        nan_e, inf_e = np.isnan(expected), np.isinf(expected)
        bad_special = np.where(nan_e, ~np.isnan(actual), inf_e & (actual != expected))
        bad_value = ~nan_e & ~inf_e & ~(err <= tol)          # NaN / inf in actual fails too
    bad = bad_special | bad_value
    if not bad.any():
        return None
    where = dict(positions=positions, rank=rank, local=local)
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    msg = f"{name}: {int(bad.sum())} of {bad.size} elements out of tolerance; first at " \
          f"{_where(name, first, **where)}: got {float(actual[first])!r}, expected {float(expected[first])!r}"
    if bad_value[first]:
        msg += f", error {err[first]:.3g} > tolerance {tol[first]:.3g} ({err[first] / tol[first]:.3g}x)"
    ratio = np.where(bad_value, err / np.maximum(tol, 1e-300), 0.0)
    ratio = np.where(np.isnan(ratio), np.inf, ratio)
    if bad_value.any():
        worst = tuple(int(i) for i in np.unravel_index(np.argmax(ratio), ratio.shape))
        if worst != first:
            msg += (f"; worst at {_where(name, worst, **where)}: got {float(actual[worst])!r}, "
                    f"expected {float(expected[worst])!r} ({ratio[worst]:.3g}x its tolerance)")
    return msg


def used_fraction(actual, expected, tol):
    """The largest error / tolerance over the finite expected elements: how much
    of its line a result that agrees uses (1 is the line)."""
    finite = np.isfinite(expected)
    err = np.abs(np.asarray(actual, np.float64) - expected)[finite]
    return float((err / np.broadcast_to(tol, expected.shape)[finite]).max(initial=0.0))


def assert_attention_close(actual, expected, tol, *, name="out", positions=None, rank=None):
    """Assert one output (out, dq, dk, dv as (B, c, H, D); lse as (B, H, c)) of
    one rank against its expected value within `tol` (per element or one
    number). `positions` (c,) are the global positions of the rank's tokens,
    so that the message names them. See `attention_mismatch` for the rules."""
    msg = attention_mismatch(actual, expected, tol, name=name, positions=positions, rank=rank)
    if msg:
        raise AssertionError(msg)


# -- one backend against another, the same precision ----------------------------------

@dataclass(frozen=True)
class Tolerance:
    """|actual - expected| <= atol * max(1, max|expected|) + rtol * |expected|."""
    rtol: float
    atol: float


# One backend against another, both accumulating in the same precision
# (docs/design.md): they differ only by summation order (measured: float64 1e-15,
# float32 1e-6); float16 results are rounded to float16 at the end, so one unit
# in the last place (2**-10) may differ.
TOL = {
    np.dtype(np.float64): Tolerance(rtol=1e-10, atol=1e-10),
    np.dtype(np.float32): Tolerance(rtol=2e-5, atol=2e-5),
    np.dtype(np.float16): Tolerance(rtol=2e-3, atol=2e-3),
}
# bfloat16 (ml_dtypes) keeps 8 significant bits: results rounded to it once at
# the end may differ by one unit in the last place, 2**-7 of the value (lse is
# float32). Measured in tests/oracle/test_masks.py (test_bfloat16_tolerance_is_measured).
try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
    TOL[BFLOAT16] = Tolerance(rtol=2 ** -7, atol=2 ** -7)
except ImportError:             # ml_dtypes is a dependency of the package; without it, no bfloat16
    BFLOAT16 = None
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
    """No NaN and no inf anywhere (docs/design.md, online softmax)."""
    for i, x in enumerate(arrays):
        name = names[i] if names else f"array {i}"
        assert np.isfinite(np.asarray(x, np.float64)).all(), f"{name} has NaN or inf"


def where_raised(text):
    """The exception line of a rank's traceback and the deepest frame above it,
    without this machine's paths (site-packages/...), for a report others read."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    where = ""
    if frames:
        i = frames[-1]
        frame = re.sub(r'File "[^"]*/site-packages/', 'File "site-packages/', lines[i].strip())   # no local paths
        where = f"\n  at {frame}\n     {lines[i + 1].strip() if i + 1 < len(lines) else ''}"
    return f"{lines[-1].strip()}{where}"
