"""Cases: one attention problem for a ring, its inputs, and the hypothesis strategy that draws it.

A `Case` is the whole problem in a few plain fields (shapes, options, the
inputs' kind and seed), so that it prints as a line that rebuilds it and can
be a dictionary key; `inputs()` makes the arrays. `cases()` draws them for
hypothesis (imported on first use: the rest of the kit needs NumPy only).

    from reference.testing import cases
    case = cases(max_devices=4).example()
    q, k, v, dout = case.inputs()          # (B, S, Hq, D), (B, S, Hkv, D) x 2, (B, S, Hq, D)

Legend: ``N`` devices, ``S`` tokens, ``c = S // N``, ``Hq`` / ``Hkv`` query /
key-value heads, ``D`` head dim.
"""

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..layouts import LAYOUTS
from .compare import LARGE_LOGITS_FACTOR, LARGE_LOGITS_GRAD_FACTOR

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
