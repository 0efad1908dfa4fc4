"""The conformance kit: point the float64 oracle at anyone's ring attention.

A user brings a ring / striped / zigzag attention (NumPy, PyTorch, JAX, CUDA)
behind a small adapter and gets, from hypothesis, the smallest problem on
which it is not exact attention, with the first bad element named:

    from hypothesis import given
    from reference.testing import Adapter, cases, check_ring_attention

    class Mine(Adapter):
        name = "mine"
        def run(self, case, shards):          # shards.q[r]: rank r's (B, c, Hq, D), ...
            return [my_ring(case, shards, r) for r in range(case.n_devices)]   # dicts: out, lse, dq, dk, dv

    @given(cases())
    def test_mine(case):
        check_ring_attention(Mine(), case)

What is here, in reading order:

- `Case` and the strategy `cases()`: one attention problem (B, S, Hq, Hkv, D,
  dtype, causal, scale, layout, N, tile size) with adversarial inputs
  (`INPUT_KINDS`: scores in the hundreds, constant rows, values on a grid
  exact in float16, NaN / inf injected at chosen positions);
- `oracle(case)`: out, lse, dq, dk, dv in float64 from `reference.attention`
  and `attention_backward`, and each element's error budget (`ErrorModel`);
- `assert_attention_close(actual, expected, tol, ...)`: the comparison; its
  failure names the output, rank, global position, batch, head and dim of the
  first bad element and its error against its tolerance;
- `Adapter` (the protocol) and `check_ring_attention(adapter, case)`;
- the older same-precision tolerances (`TOL`, `assert_close`) that the
  project's tests use to hold one of its backends against another.

The error model (why the line sits where it does). The inputs are values of
the case's dtype, so the float64 oracle sees exactly the values the
implementation sees, and every difference is rounding inside the computation.
Rounding a sum of products of a and b costs at most about u * sum |a| |b|
(u: the unit roundoff of the arithmetic), so each element's budget is the
same formula as the element with every term made non-negative, the
*magnitude* M (computed by `oracle` in float64):

    L_ij  = |scale| sum_d |q_id| |k_jd|                 a score's rounding scale
    E_ij  = 1 + L_ij + |lse_i| + sum_j P_ij L_ij        relative error of P_ij / u
    M_out = (P E) |V| + rowsum(P E) |out|       M_lse = 1 + |lse| + sum_j P_ij L_ij + n_visible
    G     = P E (|dO| |V|^T + rowsum(|dO| |out|)) + P rowsum(|dO| M_out)   the budget of dS = P (dP - delta)
    M_dv  = (P E)^T |dO|,  M_dq = |scale| G |K|,  M_dk = |scale| G^T |Q|   (summed over a group)
    M_stored (dq, dk only) = the same products with G_s = P rowsum(|dO| |out|): delta reads
            the forward's out as returned, rounded to the output dtype

    tol = growth * (u_acc * M + u_out * M_stored) + u_out * |expected|
          + max(smallest subnormal of the output dtype, smallest normal of the accumulation dtype)

u_acc is the unit roundoff of the dtype the implementation accumulates in
(`Adapter.accumulate_dtype`: float32 for float16 inputs here; flash-attn style
kernels that round P to float16 before P V declare float16), u_out that of
the dtype it returns. `growth` absorbs the constants of the bounds (sum
lengths, exp and log); `GROWTH` was measured, with its margin, by

    python -m reference.testing --examples 400

Measured (`python -m reference.testing --examples 400`, seed 0, on a shared
2-core machine): the largest error / tolerance of any element over 400
random cases per dtype (every kind, layout, N <= 4, forward and backward; 1
is the line, GROWTH = 8):

    dtype    dense oracle at dtype   virtual ring at dtype
    float64  0 (it is the oracle)    0.34
    float32  0.22                    0.27
    float16  0.98                    0.98     (the final rounding to float16: u_out |expected|,
                                               which no correct float16 result can beat)

With growth = 1 the same cases reach 2.0 (float64 ring), 1.3 / 1.8 (float32)
and 1.4 / 1.6 (float16): the sums' share of the bound is used up to twice,
so GROWTH = 8 leaves a margin of 3 to 4 above the worst correct error seen in
float32 and float64. The planted bugs of tests/test_kit.py sit 10^4 to 10^14
above the line, and an out 64 float32 ulps too large fails it.
"""

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .dense import attention, attention_backward
from .layouts import LAYOUTS, positions

_HYPOTHESIS_MISSING = ("reference.testing's strategies need hypothesis, which is not installed: "
                       "pip install 'striped-attention[test]' (or pip install hypothesis)")


def _hypothesis():
    """(hypothesis, strategies), imported on first use: the rest of the kit needs only NumPy."""
    try:
        import hypothesis
        from hypothesis import strategies
    except ImportError as e:
        raise ImportError(_HYPOTHESIS_MISSING) from e
    return hypothesis, strategies


DTYPES = (np.float64, np.float32, np.float16)
MAX_DEVICES = 8
MAX_SEQ = 64
MAX_HEAD_DIM = 16
NAMES = ("out", "lse", "dq", "dk", "dv")
FORWARD, BACKWARD = NAMES[:2], NAMES[2:]

# -- inputs ---------------------------------------------------------------

INPUT_KINDS = ("gaussian", "large_logits", "constant_keys", "constant", "exact")


def make_qkv(rng, shape_q, shape_kv, dtype, kind="gaussian", scale=None):
    """q (B, S, Hq, D), k, v (B, S, Hkv, D) of one kind:

    gaussian       standard normal;
    large_logits   q and k scaled so that scores q.k * scale are a few hundred;
    constant_keys  every key of a (batch, head) is the same vector, so every
                   score row is constant (a uniform softmax over what is visible);
    constant       every entry of q, k, v is the same number;
    exact          multiples of 1/8 in [-2, 2]: exact in float16, and their
                   products and sums of up to 2**10 terms exact in float32, so
                   rounding of the inputs hides nothing.
    """
    D = shape_q[-1]
    scale = abs(D ** -0.5 if scale is None else scale)
    if kind == "constant":
        return tuple(np.full(s, 0.75, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))
    if kind == "exact":
        return tuple((rng.integers(-16, 17, size=s) / 8).astype(dtype) for s in (shape_q, shape_kv, shape_kv))
    q, k, v = (rng.standard_normal(s) for s in (shape_q, shape_kv, shape_kv))
    if kind == "large_logits":
        # std of q.k * scale is sigma^2 * sqrt(D) * scale; aim at ~200
        sigma = np.sqrt(200.0 / (np.sqrt(D) * scale))
        q, k = q * sigma, k * sigma
    elif kind == "constant_keys":
        k = np.broadcast_to(k[:, :1], k.shape).copy()
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


@dataclass(frozen=True)
class Case:
    """One attention problem for a ring: shapes, options, inputs' kind and seed.

    `poison` injects non-finite values: a tuple of (tensor, b, s, h, d, value)
    with tensor one of "q", "k", "v", "dout", s a global position and value
    "nan", "inf" or "-inf". `inputs()` makes the arrays, in natural token order.
    """
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
    poison: tuple = field(default=())

    @property
    def c(self):
        return self.S // self.n_devices

    def inputs(self):
        """(q, k, v, dout) of the case's dtype, natural token order."""
        rng = np.random.default_rng(self.seed)
        q, k, v = make_qkv(rng, (self.B, self.S, self.Hq, self.D), (self.B, self.S, self.Hkv, self.D),
                           self.dtype, self.kind, self.scale)
        dout = rng.standard_normal(q.shape).astype(self.dtype)
        arrays = dict(q=q, k=k, v=v, dout=dout)
        for name, b, s, h, d, value in self.poison:
            arrays[name][b, s, h, d] = float(value)
        return q, k, v, dout

    @property
    def tolerance_factor(self):
        return LARGE_LOGITS_FACTOR if self.kind == "large_logits" else 1

    @property
    def grad_tolerance_factor(self):
        return LARGE_LOGITS_GRAD_FACTOR if self.kind == "large_logits" else 1

    def options(self):
        """Keyword arguments of `reference.ring_attention` for this case."""
        return dict(n_devices=self.n_devices, layout=self.layout, causal=self.causal,
                    scale=self.scale, tile_size=self.tile_size)

    def __repr__(self):
        poison = f", poison={self.poison}" if self.poison else ""
        return (f"Case(layout={self.layout!r}, n_devices={self.n_devices}, B={self.B}, S={self.S}, "
                f"Hq={self.Hq}, Hkv={self.Hkv}, D={self.D}, tile_size={self.tile_size!r}, "
                f"causal={self.causal}, scale={self.scale!r}, dtype=np.{np.dtype(self.dtype).name}, "
                f"kind={self.kind!r}, seed={self.seed}{poison})")


# -- strategies -------------------------------------------------------------

def tile_sizes(c):
    """An int, a rectangular (tq, tk) pair, or None (the default, larger than any
    block here). Sizes run from about c/6 (few tiles, to stay fast) to past the
    block (a tile larger than the block); most do not divide c."""
    _, st = _hypothesis()
    side = st.integers(min_value=max(1, c // 6), max_value=c + 3)
    return st.one_of(side, st.tuples(side, side), st.just(None))


def cases(dtypes=DTYPES, layouts=LAYOUTS, kinds=INPUT_KINDS, max_devices=MAX_DEVICES, causal=None, *,
          devices=None, max_seq=MAX_SEQ, max_head_dim=MAX_HEAD_DIM, max_kv_heads=3, max_group=3,
          max_batch=2, scales=(None, None, 0.3, 1.0, -0.7), poison=False, poison_values=("nan", "inf", "-inf"),
          seq_multiple=1):
    """A hypothesis strategy of `Case`: every layout, N in 1..max_devices (or
    drawn from `devices`), c down to one token per device (two for zigzag),
    GQA (Hkv < Hq) and MQA (Hkv = 1), any D, tile and scale, every input kind.
    `poison=True` injects one of `poison_values` into q, k, v or dout at a drawn place.
    `seq_multiple` makes S a multiple of it too (for implementations that cut
    the sequence more finely than the layout). Shrinks towards contiguous, one
    device, B = 1, one head, D = 1, float64, causal, gaussian."""
    _, st = _hypothesis()
    devices = tuple(devices) if devices is not None else tuple(range(1, max_devices + 1))

    @st.composite
    def draw_case(draw):
        layout = draw(st.sampled_from(layouts))
        n = draw(st.sampled_from(devices))
        unit = (2 * n if layout == "zigzag" else n)           # the layout's unit of division
        unit = unit * seq_multiple // math.gcd(unit, seq_multiple)
        S = unit * draw(st.integers(1, max(1, max_seq // unit)))
        Hkv = draw(st.integers(1, max_kv_heads))
        Hq = Hkv * draw(st.integers(1, max_group))
        B, D = draw(st.integers(1, max_batch)), draw(st.integers(1, max_head_dim))
        case = Case(layout=layout, n_devices=n, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D,
                    tile_size=draw(tile_sizes(S // n)),
                    causal=draw(st.booleans()) if causal is None else causal,
                    scale=draw(st.sampled_from(scales)),
                    dtype=draw(st.sampled_from(dtypes)), kind=draw(st.sampled_from(kinds)),
                    seed=draw(st.integers(0, 2**32 - 1)))
        if poison:
            name = draw(st.sampled_from(("q", "k", "v", "dout")))
            heads = Hq if name in ("q", "dout") else Hkv
            at = tuple(draw(st.integers(0, x - 1)) for x in (B, S, heads, D))
            value = draw(st.sampled_from(poison_values))
            case = replace(case, poison=((name,) + at + (value,),))
        return case

    return draw_case()


# -- the oracle and the error model -------------------------------------------

def unit_roundoff(dtype):
    """u = eps / 2 of a float dtype: float64 1.1e-16, float32 6.0e-8, float16 4.9e-4."""
    return float(np.finfo(dtype).eps) / 2


@dataclass(frozen=True)
class ErrorModel:
    """tol = growth * (u(accumulate) * M + u(output) * M_stored) + u(output) * |expected|
           + max(smallest subnormal of output, smallest normal of accumulate)."""
    growth: float = 8.0

    def tolerance(self, magnitude, stored, expected, *, accumulate, output):
        # below the smallest normal number of the sums, rounding is absolute, not relative
        floor = max(float(np.finfo(output).smallest_subnormal), float(np.finfo(accumulate).tiny))
        with np.errstate(invalid="ignore"):
            extra = np.where(np.isfinite(expected), np.abs(expected), 0.0)
        return (self.growth * (unit_roundoff(accumulate) * magnitude + unit_roundoff(output) * stored)
                + unit_roundoff(output) * extra + floor)


GROWTH = ErrorModel().growth


def _heads_first(x, Hq):
    """(B, S, H, D) -> (B, Hq, S, D) float64, a key/value head repeated for its group."""
    return np.repeat(np.asarray(x, np.float64), Hq // x.shape[2], axis=2).transpose(0, 2, 1, 3)


def _group_sum(x, Hkv):
    """(B, Hq, S, D) -> (B, S, Hkv, D): a key/value head's share summed over its query heads."""
    B, Hq, S, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, S, Hkv, Hq // Hkv, D).sum(axis=3)


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
    visible = qp[:, None] >= qp[None, :] if case.causal else np.ones((case.S, case.S), bool)
    L = scale * Qa @ Ka.swapaxes(-1, -2)                                        # (B, Hq, S, S)
    finite_lse = np.where(np.isfinite(lse), lse, 0.0)
    # P <= 1 (clipped: a poisoned row's lse is NaN, and its result is NaN whatever the budget)
    P = np.where(visible, np.exp(np.minimum(signed * Q @ K.swapaxes(-1, -2) - finite_lse[..., None], 0.0)), 0.0)
    PL = (P * L).sum(-1)                                                        # (B, Hq, S)
    E = 1 + L + np.abs(finite_lse)[..., None] + PL[..., None]
    PE = P * E
    m_out = PE @ Va + PE.sum(-1)[..., None] * Oa
    m_lse = 1 + np.abs(finite_lse) + PL + visible.sum(-1)       # + n: the row sum of n terms
    # delta = rowsum(dO * out) reads the forward's out: its rounding in the sums
    # (u_acc M_out) and in the returned dtype (u_out |out|, the "stored" part)
    G = PE * (dOa @ Va.swapaxes(-1, -2) + (dOa * Oa).sum(-1)[..., None]) + P * (dOa * m_out).sum(-1)[..., None]
    G_stored = P * (dOa * Oa).sum(-1)[..., None]
    m_dq, s_dq = (scale * g @ Ka for g in (G, G_stored))
    m_dk, s_dk = (_group_sum(scale * g.swapaxes(-1, -2) @ Qa, case.Hkv) for g in (G, G_stored))
    m_dv = _group_sum(PE.swapaxes(-1, -2) @ dOa, case.Hkv)
    zeros = np.zeros_like
    acc = dict(out=m_out.transpose(0, 2, 1, 3), lse=m_lse, dq=m_dq.transpose(0, 2, 1, 3), dk=m_dk, dv=m_dv)
    stored = dict(out=zeros(acc["out"]), lse=zeros(m_lse), dq=s_dq.transpose(0, 2, 1, 3), dk=s_dk, dv=zeros(m_dv))
    return acc, stored


_ORACLE_CACHE = {}


def oracle(case):
    """{"out", "lse", "dq", "dk", "dv"}: float64 results of the dense formula on
    the case's inputs (natural order, oracle shapes), and "magnitude": the same
    names' rounding scales M. Cached per case (hypothesis replays while shrinking)."""
    if case not in _ORACLE_CACHE:
        if len(_ORACLE_CACHE) > 64:
            _ORACLE_CACHE.clear()
        q, k, v, dout = (x.astype(np.float64) for x in case.inputs())
        opts = dict(causal=case.causal, scale=case.scale)
        with np.errstate(all="ignore"):
            out, lse = attention(q, k, v, **opts)
            dq, dk, dv = attention_backward(q, k, v, out, lse, dout, **opts)
            mags, stored = magnitudes(case, q, k, v, dout, out, lse)
        _ORACLE_CACHE[case] = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, magnitude=mags, stored=stored)
    return _ORACLE_CACHE[case]


def tolerances(case, *, accumulate=None, model=None):
    """{name: per-element tolerance array} for an implementation of `case`
    accumulating in `accumulate` (default: float32 for float16 inputs)."""
    model = model or ErrorModel()
    accumulate = np.dtype(accumulate or (np.float64 if np.dtype(case.dtype) == np.float64 else np.float32))
    want = oracle(case)
    result = {}
    for name in NAMES:
        output = np.dtype(case.dtype) if name != "lse" else max(np.dtype(case.dtype), np.dtype(np.float32))
        result[name] = model.tolerance(want["magnitude"][name], want["stored"][name], want[name],
                                       accumulate=accumulate, output=output)
    return result


# -- the comparison -----------------------------------------------------------

def _where(name, index, positions=None, rank=None):
    """Words for one element of a rank's out/dq/dk/dv (B, c, H, D) or lse (B, H, c)."""
    if name == "lse":
        b, h, i = index
        d = None
    else:
        b, i, h, d = index
    pos = int(positions[i]) if positions is not None else i
    head = "kv head" if name in ("dk", "dv") else "head"
    words = [f"rank {rank}" if rank is not None else None,
             f"global position {pos}" + (f" (local {i})" if positions is not None else ""),
             f"batch {b}", f"{head} {h}", f"dim {d}" if d is not None else None]
    return ", ".join(w for w in words if w)


def attention_mismatch(actual, expected, tol, *, name="out", positions=None, rank=None):
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
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    msg = f"{name}: {int(bad.sum())} of {bad.size} elements out of tolerance; first at " \
          f"{_where(name, first, positions, rank)}: got {float(actual[first])!r}, expected {float(expected[first])!r}"
    if bad_value[first]:
        msg += f", error {err[first]:.3g} > tolerance {tol[first]:.3g} ({err[first] / tol[first]:.3g}x)"
    ratio = np.where(bad_value, err / np.maximum(tol, 1e-300), 0.0)
    ratio = np.where(np.isnan(ratio), np.inf, ratio)
    if bad_value.any():
        worst = tuple(int(i) for i in np.unravel_index(np.argmax(ratio), ratio.shape))
        if worst != first:
            msg += (f"; worst at {_where(name, worst, positions, rank)}: got {float(actual[worst])!r}, "
                    f"expected {float(expected[worst])!r} ({ratio[worst]:.3g}x its tolerance)")
    return msg


def assert_attention_close(actual, expected, tol, *, name="out", positions=None, rank=None):
    """Assert one output (out, dq, dk, dv as (B, c, H, D); lse as (B, H, c)) of
    one rank against its expected value within `tol` (per element or one
    number). `positions` (c,) are the global positions of the rank's tokens,
    so that the message names them. See `attention_mismatch` for the rules."""
    msg = attention_mismatch(actual, expected, tol, name=name, positions=positions, rank=rank)
    if msg:
        raise AssertionError(msg)


# -- the adapter protocol --------------------------------------------------------

@dataclass(frozen=True)
class Shards:
    """Each rank's inputs in its local order: q[r] (B, c, Hq, D), k[r], v[r]
    (B, c, Hkv, D), dout[r] like q[r]; positions[r] (c,) their global positions."""
    q: list
    k: list
    v: list
    dout: list
    positions: np.ndarray


class Unsupported(Exception):
    """An adapter cannot run this case (outside hypothesis, where it is skipped)."""


class Adapter:
    """What `check_ring_attention` needs to know about an implementation.

    Override `run`; the rest has defaults that describe this project's conventions:

    name           how messages name it;
    layouts        the layouts it runs (`positions` maps each to ranks' tokens);
    dtypes         the NumPy dtypes it takes;
    backward       whether `run` returns dq, dk, dv;
    replicated     names that every rank returns whole (natural order, not a shard):
                   every rank's copy must be the same, bit for bit;
    positions(case)         (N, c) int array: the global positions rank r holds, in its
                            local order (default `reference.positions`);
    accumulate_dtype(dtype) the dtype its sums run in (the error model's u_acc);
    supports(case)          None, or why it cannot run the case (skipped, not failed);
    run(case, shards)       one dict per rank with "out" (B, c, Hq, D) in the input dtype,
                            "lse" (B, Hq, c) natural log of the scaled scores' sum, and,
                            where `backward`, "dq", "dk", "dv" (gradients of
                            sum(out * dout), dk/dv on the rank that holds those keys),
                            query head h reading key/value head h // (Hq // Hkv).
    """
    name = "adapter"
    layouts = LAYOUTS
    dtypes = DTYPES
    backward = True
    replicated = ()

    def positions(self, case):
        return positions(case.S, case.n_devices, case.layout)

    def accumulate_dtype(self, dtype):
        return np.float64 if np.dtype(dtype) == np.float64 else np.float32

    def supports(self, case):
        if case.layout not in self.layouts:
            return f"layout {case.layout!r} not in {self.layouts}"
        if np.dtype(case.dtype) not in [np.dtype(d) for d in self.dtypes]:
            return f"dtype {np.dtype(case.dtype).name} not supported"
        return None

    def run(self, case, shards):
        raise NotImplementedError


def _skip(reason):
    """Reject the example under hypothesis (it draws another), raise Unsupported elsewhere."""
    try:
        from hypothesis import assume
        from hypothesis.control import currently_in_test_context
    except ImportError:
        raise Unsupported(reason) from None
    if currently_in_test_context():
        assume(False)
    raise Unsupported(reason)


def make_shards(case, pos):
    """The case's inputs cut into ranks' shards along the positions `pos` (N, c)."""
    q, k, v, dout = case.inputs()
    return Shards(*([np.ascontiguousarray(np.take(x, p, axis=1)) for p in pos] for x in (q, k, v, dout)),
                  positions=pos)


def _check_positions(pos, case):
    pos = np.asarray(pos)
    if pos.shape != (case.n_devices, case.c) or not np.array_equal(np.sort(pos.ravel()), np.arange(case.S)):
        raise AssertionError(f"positions must be a permutation of 0..{case.S - 1} as "
                             f"({case.n_devices}, {case.c}), got shape {pos.shape}")
    return pos


def check_ring_attention(adapter, case, *, model=None, names=None, usage=None):
    """Run `adapter` on `case` and hold each rank's out, lse, dq, dk, dv against
    the float64 oracle with the error model's per-element tolerance; replicated
    outputs must also agree between ranks. Raises AssertionError naming the
    adapter, the case and the first bad element. Returns the adapter's results.
    `usage`, a dict, collects per name the largest error / tolerance seen (how
    close to the line an implementation that agrees comes)."""
    reason = adapter.supports(case)
    if reason:
        _skip(reason)
    pos = _check_positions(adapter.positions(case), case)
    results = adapter.run(case, make_shards(case, pos))
    if len(results) != case.n_devices:
        raise AssertionError(f"{adapter.name}: run returned {len(results)} ranks' results, expected {case.n_devices}")
    names = names or (NAMES if adapter.backward else FORWARD)
    want = oracle(case)
    tol = tolerances(case, accumulate=adapter.accumulate_dtype(case.dtype), model=model)
    for name in names:
        problem = (_check_replicated(name, results, want, tol) if name in adapter.replicated
                   else _check_sharded(name, results, want, tol, pos, case))
        if usage is not None and not problem:
            usage[name] = max(usage.get(name, 0.0), _usage(name, results, want, tol, pos, adapter))
        if problem:
            raise AssertionError(f"{adapter.name} differs from the float64 oracle on\n  {case!r}\n  {problem}")
    return results


def _check_sharded(name, results, want, tol, pos, case):
    axis = 2 if name == "lse" else 1
    for r, got in enumerate(results):
        if name not in got:
            return f"{name}: rank {r} returned no {name!r}"
        x = got[name]
        if name != "lse" and np.dtype(x.dtype) != np.dtype(case.dtype):
            return f"{name}: rank {r} returned {np.dtype(x.dtype).name}, expected the input dtype {np.dtype(case.dtype).name}"
        msg = attention_mismatch(x, np.take(want[name], pos[r], axis=axis), np.take(tol[name], pos[r], axis=axis),
                                 name=name, positions=pos[r], rank=r)
        if msg:
            return msg
    return None


def _usage(name, results, want, tol, pos, adapter):
    """The largest error / tolerance over the finite expected elements of `name`."""
    axis = 2 if name == "lse" else 1
    pairs = ([(results[0][name], want[name], tol[name])] if name in adapter.replicated else
             [(got[name], np.take(want[name], p, axis=axis), np.take(tol[name], p, axis=axis))
              for got, p in zip(results, pos)])
    worst = 0.0
    for got, expected, t in pairs:
        finite = np.isfinite(expected)
        err = np.abs(np.asarray(got, np.float64) - expected)[finite]
        worst = max(worst, float((err / t[finite]).max(initial=0.0)))
    return worst


def _check_replicated(name, results, want, tol):
    first = np.asarray(results[0][name])
    for r, got in enumerate(results[1:], start=1):
        if not np.array_equal(np.asarray(got[name]), first, equal_nan=True):
            return f"{name}: rank {r}'s copy differs from rank 0's (replicated outputs must be identical)"
    return attention_mismatch(first, want[name], tol[name], name=name, rank=0)


# -- a persistent group of processes, one example at a time -----------------------
#
# Launching N processes costs about a second; hypothesis runs hundreds of
# examples and replays dozens while it shrinks. So a multi-process
# implementation is launched once per world size and served one request at a
# time: the test process listens on a Unix socket, rank 0 of the group connects
# to it, reads a request, shares it with the other ranks, and sends back the
# list of every rank's reply. Any MPI or torch.distributed program can serve
# with `serve_requests`, given its own broadcast and gather.

def _send(sock, obj):
    import pickle
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(len(data).to_bytes(8, "little") + data)


def _recv_exact(sock, n):
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(sock):
    import pickle
    return pickle.loads(_recv_exact(sock, int.from_bytes(_recv_exact(sock, 8), "little")))


class ProcessGroup:
    """N processes launched once by `command` (a list; "{socket}" in it is
    replaced by the socket's path), answering `request(message)` one at a time.
    Every wait has a timeout: the group is killed and TimeoutError raised with
    the tail of its output, never a hang.

        group = ProcessGroup(["mpiexec", "-n", "4", sys.executable, "worker.py", "--serve", "{socket}"])
        replies = group.request({"case": ...})       # one reply per rank
        group.close()
    """

    def __init__(self, command, *, timeout=120, start_timeout=120, env=None, cwd=None):
        import os
        import socket
        import subprocess
        import tempfile
        self.timeout = timeout
        self._dir = tempfile.TemporaryDirectory(prefix="ring-group-")
        path = os.path.join(self._dir.name, "socket")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self._log = open(os.path.join(self._dir.name, "output.txt"), "w+")
        self.command = [str(a).replace("{socket}", path) for a in command]
        self._proc = subprocess.Popen(self.command, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._listener.settimeout(1.0)
        self._conn = None
        deadline = _now() + start_timeout
        while self._conn is None:
            try:
                self._conn, _ = self._listener.accept()
            except socket.timeout:
                if self._proc.poll() is not None or _now() > deadline:
                    self._fail(f"did not connect within {start_timeout} s")

    def request(self, message):
        """Send `message`, return the list of every rank's reply."""
        self._conn.settimeout(self.timeout)
        try:
            _send(self._conn, message)
            replies = _recv(self._conn)
        except (OSError, ConnectionError) as e:
            self._fail(f"no reply within {self.timeout} s ({type(e).__name__}: {e})")
        for rank, (status, value) in enumerate(replies):
            if status == "error":
                raise RuntimeError(f"rank {rank} of {' '.join(self.command)} raised:\n{value}")
        return [value for _, value in replies]

    def output(self):
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def _fail(self, why):
        tail = self.close(polite=False)
        raise TimeoutError(f"{' '.join(self.command)}: {why}; its output ends:\n{tail[-3000:]}")

    def close(self, polite=True):
        """Stop the group (a polite request, then a kill); returns its output."""
        import os
        import signal
        if polite and self._proc.poll() is None and self._conn is not None:
            try:
                self._conn.settimeout(5)
                _send(self._conn, None)
                self._proc.wait(timeout=10)
            except Exception:        # noqa: BLE001 - a group that does not stop is killed below
                pass
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        text = self.output()
        for x in (self._conn, self._listener):
            if x is not None:
                x.close()
        self._log.close()
        self._dir.cleanup()
        return text


def _now():
    import time
    return time.monotonic()


def serve_requests(socket_path, rank, handle, *, broadcast, gather):
    """The group's side of `ProcessGroup`: rank 0 connects to `socket_path`;
    then, until the message None, every rank gets each request through
    `broadcast` (from rank 0), answers `handle(request)` (an exception becomes
    ("error", its traceback)), and rank 0 sends the `gather`ed replies."""
    import socket
    import traceback
    conn = None
    if rank == 0:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(socket_path)
    while True:
        request = broadcast(_recv(conn) if rank == 0 else None)
        if request is None:
            break
        try:
            reply = ("ok", handle(request))
        except Exception:            # noqa: BLE001 - reported to the test process, which raises it
            reply = ("error", traceback.format_exc())
        replies = gather(reply)
        if rank == 0:
            _send(conn, replies)
    if conn is not None:
        conn.close()


# -- the project's own same-precision tolerances -----------------------------------

@dataclass(frozen=True)
class Tolerance:
    """|actual - expected| <= atol * max(1, max|expected|) + rtol * |expected|."""
    rtol: float
    atol: float


# One backend against another, both accumulating in the same precision
# (DESIGN.md): they differ only by summation order (measured: float64 1e-15,
# float32 1e-6); float16 results are rounded to float16 at the end, so one unit
# in the last place (2**-10) may differ.
TOL = {
    np.dtype(np.float64): Tolerance(rtol=1e-10, atol=1e-10),
    np.dtype(np.float32): Tolerance(rtol=2e-5, atol=2e-5),
    np.dtype(np.float16): Tolerance(rtol=2e-3, atol=2e-3),
}
# bfloat16 (ml_dtypes) keeps 8 significant bits: results rounded to it once at
# the end may differ by one unit in the last place, 2**-7 of the value (lse is
# float32). Measured in tests/test_masks.py (test_bfloat16_tolerance_is_measured).
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
    """No NaN and no inf anywhere (DESIGN.md, online softmax)."""
    for i, x in enumerate(arrays):
        name = names[i] if names else f"array {i}"
        assert np.isfinite(np.asarray(x, np.float64)).all(), f"{name} has NaN or inf"


# -- the project's own backends as adapters ------------------------------------------

class VirtualRingAdapter(Adapter):
    """`reference.ring_attention` (N virtual devices) as an adapter: the kit's example."""
    name = "reference.ring_attention"

    def run(self, case, shards):
        from .layouts import unshard
        from .virtual import ring_attention, ring_attention_backward
        q, k, v, dout = (unshard(x, case.layout) for x in (shards.q, shards.k, shards.v, shards.dout))
        out, lse = ring_attention(q, k, v, **case.options())
        grads = ring_attention_backward(q, k, v, out, lse, dout, **case.options())
        full = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
        return [{name: np.take(x, shards.positions[r], axis=2 if name == "lse" else 1) for name, x in full.items()}
                for r in range(case.n_devices)]


def measure(examples=400, seed=0, dtypes=DTYPES, model=None):
    """The largest error / tolerance over `examples` random cases per dtype: the
    dense oracle run at the dtype, and the virtual ring; 1 is the line. Returns
    {dtype name: (oracle ratio, ring ratio)}."""
    rng = np.random.default_rng(seed)
    unit = model or ErrorModel()
    table = {}
    for dtype in dtypes:
        worst = [0.0, 0.0]
        for _ in range(examples):
            case = _random_case(rng, dtype)
            tol = tolerances(case, model=unit)
            want = oracle(case)
            q, k, v, dout = case.inputs()
            out, lse = attention(q, k, v, causal=case.causal, scale=case.scale)
            dense = dict(zip(NAMES, (out, lse) + attention_backward(q, k, v, out, lse, dout, causal=case.causal,
                                                                     scale=case.scale)))
            ring = VirtualRingAdapter().run(case, make_shards(case, positions(case.S, case.n_devices, case.layout)))
            for i, got in enumerate((dense, None)):
                for name in NAMES:
                    if got is None:
                        from .layouts import unshard
                        x = unshard([r[name] for r in ring], case.layout, axis=2 if name == "lse" else 1)
                    else:
                        x = got[name]
                    finite = np.isfinite(want[name])
                    ratio = np.abs(np.asarray(x, np.float64) - want[name])[finite] / tol[name][finite]
                    worst[i] = max(worst[i], float(ratio.max(initial=0.0)))
        table[np.dtype(dtype).name] = tuple(worst)
    return table


def _random_case(rng, dtype):
    """A case like `cases()` draws, from a NumPy generator (for `measure`, without hypothesis)."""
    layout = LAYOUTS[rng.integers(3)]
    n = int(rng.integers(1, 5))
    unit = 2 * n if layout == "zigzag" else n
    S = unit * int(rng.integers(1, max(2, MAX_SEQ // unit + 1)))
    Hkv = int(rng.integers(1, 4))
    return Case(layout=layout, n_devices=n, B=int(rng.integers(1, 3)), S=S, Hq=Hkv * int(rng.integers(1, 4)),
                Hkv=Hkv, D=int(rng.integers(1, MAX_HEAD_DIM + 1)), tile_size=int(rng.integers(1, S // n + 2)),
                causal=bool(rng.integers(2)), scale=[None, 0.3, 1.0, -0.7][rng.integers(4)], dtype=dtype,
                kind=INPUT_KINDS[rng.integers(len(INPUT_KINDS))], seed=int(rng.integers(2**32)))


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="python -m reference.testing",
                                 description="Measure the error model: the largest error / tolerance "
                                             "of correct implementations, per dtype (1 is the line).")
    ap.add_argument("--examples", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--growth", type=float, default=GROWTH)
    args = ap.parse_args()
    print(f"{'dtype':<8} {'dense oracle':>13} {'virtual ring':>13}   (max error / tolerance, growth = {args.growth:g})")
    for name, (dense, ring) in measure(args.examples, args.seed, model=ErrorModel(args.growth)).items():
        print(f"{name:<8} {dense:>13.3g} {ring:>13.3g}")
