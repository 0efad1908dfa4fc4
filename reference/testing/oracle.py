"""The oracle: float64 results of the dense formula, and each element's error budget.

`oracle(case)` gives out, lse, dq, dk, dv in float64 from `reference.attention`
and `attention_backward` on the case's inputs, and the magnitudes behind each
element; `tolerances(case, accumulate=...)` turns them into a per-element line
an implementation in the case's dtype must stay under (`ErrorModel`):

    tol = growth * (u_acc * M + u_out * M_stored) + u_out * |expected|
          + max(smallest subnormal of the output dtype, smallest normal of the accumulation dtype)

M, an element's *magnitude*, is its formula with every term made non-negative;
u_acc and u_out are the unit roundoffs of the dtypes the implementation
accumulates in and returns; `GROWTH` was measured, with its margin, by
``python -m reference.testing measure --examples 400``. Why the line sits
there, the budget of arithmetic that flushes subnormals to zero (`flushed`)
and the measured figures: docs/kit.md, "The error model".

    want = oracle(case)                                    # natural order, oracle shapes
    tol = tolerances(case, accumulate=np.float32)          # {name: array like want[name]}
"""

from dataclasses import dataclass

import numpy as np

from .. import masks
from ..dense import attention, attention_backward
from .cases import NAMES
from .compare import BFLOAT16


def finfo(dtype):
    """np.finfo, or ml_dtypes.finfo for bfloat16 (NumPy's does not know it)."""
    if np.dtype(dtype) == BFLOAT16:
        import ml_dtypes
        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def unit_roundoff(dtype):
    """u = eps / 2 of a float dtype: float64 1.1e-16, float32 6.0e-8, float16 4.9e-4, bfloat16 3.9e-3."""
    return float(finfo(dtype).eps) / 2


def accumulation(dtype):
    """The dtype sums run in by default: float64 for float64 inputs, else float32 (docs/design.md)."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


@dataclass(frozen=True)
class ErrorModel:
    """tol = growth * (u(accumulate) * M + u(output) * M_stored) + u(output) * |expected|
           + max(smallest subnormal of output, smallest normal of accumulate)."""
    growth: float = 8.0

    def tolerance(self, magnitude, stored, expected, *, accumulate, output, flushed=None):
        # below the smallest normal number of the sums, rounding is absolute, not relative
        tiny = float(finfo(accumulate).tiny)
        floor = max(float(finfo(output).smallest_subnormal), tiny)
        with np.errstate(invalid="ignore"):
            extra = np.where(np.isfinite(expected), np.abs(expected), 0.0)
        flush = 0.0 if flushed is None else self.growth * tiny * flushed
        return (self.growth * (unit_roundoff(accumulate) * magnitude + unit_roundoff(output) * stored)
                + unit_roundoff(output) * extra + floor + flush)


GROWTH = ErrorModel().growth


def _heads_first(x, Hq):
    """(B, S, H, D) -> (B, Hq, S, D) float64, a key/value head repeated for its group."""
    return np.repeat(np.asarray(x, np.float64), Hq // x.shape[2], axis=2).transpose(0, 2, 1, 3)


def _group_sum(x, Hkv):
    """(B, Hq, S, D) -> (B, S, Hkv, D): a key/value head's share summed over its query heads."""
    B, Hq, S, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, S, Hkv, Hq // Hkv, D).sum(axis=3)


def keep(case):
    """Z (B, Hq, S, S) float64: the case's dropout weights (0 or 1 / (1 - p)), or 1 without dropout."""
    qp = np.arange(case.S)
    z = masks.keep_weights(case.mask(), np.arange(case.B), np.arange(case.Hq), qp, qp, dtype=np.float64)
    return 1.0 if z is None else z


def magnitudes(case, q, k, v, dout, out, lse):
    """Each element's rounding scales, float64, oracle shapes: ({name: M}, {name:
    M_stored}), M for the rounding in the sums (u_acc), M_stored for the
    rounding of the forward's out to the output dtype (u_out), which the
    backward reads (module docstring)."""
    signed = case.scale if case.scale is not None else case.D ** -0.5
    scale = abs(signed)
    Q, K, V, dO, O = (np.nan_to_num(_heads_first(x, case.Hq), nan=0.0, posinf=0.0, neginf=0.0)
                      for x in (q, k, v, dout, out))                           # (B, Hq, S, D)
    Qa, Ka, Va, dOa, Oa = (np.abs(x) for x in (Q, K, V, dO, O))
    qp = np.arange(case.S)
    visible = masks.visible(qp, qp, case.mask())                                 # (S, S)
    Z = keep(case)                                                              # (B, Hq, S, S) or 1
    L = scale * Qa @ Ka.swapaxes(-1, -2)                                        # (B, Hq, S, S)
    finite_lse = np.where(np.isfinite(lse), lse, 0.0)
    # P <= 1 (clipped: a poisoned row's lse is NaN, and its result is NaN whatever the budget)
    P = np.where(visible, np.exp(np.minimum(signed * Q @ K.swapaxes(-1, -2) - finite_lse[..., None], 0.0)), 0.0)
    PL = (P * L).sum(-1)                                                        # (B, Hq, S)
    E = 1 + L + np.abs(finite_lse)[..., None] + PL[..., None]
    PE = P * E
    m_out = (PE * Z) @ Va + PE.sum(-1)[..., None] * Oa
    m_lse = 1 + np.abs(finite_lse) + PL + visible.sum(-1)       # + n: the row sum of n terms
    # delta = rowsum(dO * out) reads the forward's out: its rounding in the sums
    # (u_acc M_out) and in the returned dtype (u_out |out|, the "stored" part)
    G = PE * (Z * (dOa @ Va.swapaxes(-1, -2)) + (dOa * Oa).sum(-1)[..., None]) + P * (dOa * m_out).sum(-1)[..., None]
    # out rounded to the output dtype: u_out |out|, and half a subnormal's step below the normal range
    # (u_out * tiny), relatively large where out is tiny (dropout that drops a row's heaviest keys)
    G_stored = P * (dOa * (Oa + float(finfo(case.dtype).tiny))).sum(-1)[..., None]
    m_dq, s_dq = (scale * g @ Ka for g in (G, G_stored))
    m_dk, s_dk = (_group_sum(scale * g.swapaxes(-1, -2) @ Qa, case.Hkv) for g in (G, G_stored))
    m_dv = _group_sum((PE * Z).swapaxes(-1, -2) @ dOa, case.Hkv)
    zeros = np.zeros_like
    acc = dict(out=m_out.transpose(0, 2, 1, 3), lse=m_lse, dq=m_dq.transpose(0, 2, 1, 3), dk=m_dk, dv=m_dv)
    stored = dict(out=zeros(acc["out"]), lse=zeros(m_lse), dq=s_dq.transpose(0, 2, 1, 3), dk=s_dk, dv=zeros(m_dv))
    return acc, stored


def flushed(case, q, k, v, dout, out):
    """Each element's budget for subnormals flushed to zero, M_flush (module
    docstring), float64, oracle shapes: {name: array}."""
    scale = abs(case.scale if case.scale is not None else case.D ** -0.5)
    Qa, Ka, Va, dOa, Oa = (np.abs(np.nan_to_num(_heads_first(x, case.Hq), nan=0.0, posinf=0.0, neginf=0.0))
                           for x in (q, k, v, dout, out))                       # (B, Hq, S, D)
    qp = np.arange(case.S)
    seen = masks.visible(qp, qp, case.mask()).astype(np.float64)               # (S, S)
    n, m = seen.sum(-1), seen.sum(0)                    # (S,) keys each query sees, queries that see each key
    kept = seen * keep(case)                                                    # (B, Hq, S, S) with dropout
    F = seen * (1 + keep(case) * (dOa @ Va.swapaxes(-1, -2)) + (dOa * Oa).sum(-1)[..., None])  # (B, Hq, S, S)
    at = lambda x: x.transpose(0, 2, 1, 3)                                      # noqa: E731 - (B, S, Hq, D)
    return dict(out=at(kept @ Va) + n[:, None, None], lse=np.broadcast_to(n, (case.B, case.Hq, case.S)).copy(),
                dq=at(scale * F @ Ka) + n[:, None, None],
                dk=_group_sum(scale * F.swapaxes(-1, -2) @ Qa, case.Hkv) + m[:, None, None],
                dv=_group_sum(kept.swapaxes(-1, -2) @ dOa, case.Hkv) + m[:, None, None])


_ORACLE_CACHE = {}


def oracle(case):
    """{"out", "lse", "dq", "dk", "dv"}: float64 results of the dense formula on
    the case's inputs (natural order, oracle shapes), and "magnitude": the same
    names' rounding scales M. Cached per case (hypothesis replays while shrinking)."""
    if case not in _ORACLE_CACHE:
        if len(_ORACLE_CACHE) > 64:
            _ORACLE_CACHE.clear()
        q, k, v, dout = (x.astype(np.float64) for x in case.inputs())
        opts = dict(causal=case.causal, scale=case.scale, **case.mask_options())
        with np.errstate(all="ignore"):
            out, lse = attention(q, k, v, **opts)
            dq, dk, dv = attention_backward(q, k, v, out, lse, dout, **opts)
            mags, stored = magnitudes(case, q, k, v, dout, out, lse)
            flush = flushed(case, q, k, v, dout, out)
        _ORACLE_CACHE[case] = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, magnitude=mags, stored=stored,
                                   flushed=flush)
    return _ORACLE_CACHE[case]


def tolerances(case, *, accumulate=None, model=None, flush=False):
    """{name: per-element tolerance array} for an implementation of `case`
    accumulating in `accumulate` (default `accumulation(case.dtype)`: float32
    for float16 and bfloat16 inputs), with `flush` in arithmetic that flushes
    subnormals to zero; lse is held as float32 (float64 for float64 inputs),
    the other outputs as the input dtype."""
    model = model or ErrorModel()
    accumulate = np.dtype(accumulate) if accumulate is not None else accumulation(case.dtype)
    want = oracle(case)
    result = {}
    for name in NAMES:
        output = np.dtype(case.dtype) if name != "lse" else accumulation(case.dtype)
        result[name] = model.tolerance(want["magnitude"][name], want["stored"][name], want[name],
                                       accumulate=accumulate, output=output,
                                       flushed=want["flushed"][name] if flush else None)
    return result
