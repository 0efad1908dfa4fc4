"""Cases: one attention problem for a ring, and its inputs.

A `Case` is the whole problem in a few plain fields (shapes, options, the
mask, the inputs' kind and seed), so that it prints as a line that rebuilds it
(`parse_case`) and can be a dictionary key; `inputs()` makes the arrays.
`strategies.cases()` draws them for hypothesis (imported on first use: the
rest of the kit needs NumPy only).

    case = Case("striped", 4, 1, 16, 4, 2, 8, None, True, None, np.float32, "gaussian", 0, window=5)
    q, k, v, dout = case.inputs()          # (B, S, Hq, D), (B, S, Hkv, D) x 2, (B, S, Hq, D)

The masks a case can carry (`MASKS`, the names adapters declare in `Adapter.masks`):

    causal, full     key k visible to query q iff k <= q (causal), or always (full)
    window           a sliding window of W keys, the query's own included (`reference.masks`)
    cu_seqlens       packed documents as flash-attn's varlen functions take them: boundaries
                     [0, l0, l0 + l1, ..., S]; a query sees keys of its own document only
    segment_ids      packed documents as one id per token (a document need not be one run)
    padding          S not a multiple of the layout's unit (N, 2N for zigzag): the shards are
                     padded at the end with random tokens that no real query may see, and
                     whose own results are not checked

and, for a ring that draws this project's keep mask (`reference.masks.keep_weights`,
keyed on global batch, head and positions), `DROPOUT`:

    dropout          attention dropout with probability p, its keep mask drawn from the case's seed

Legend: ``N`` devices, ``S`` tokens (real), ``P`` tokens padded to the layout's
unit, ``c = P // N`` tokens per rank, ``Hq`` / ``Hkv`` query / key-value heads,
``D`` head dim.
"""

from dataclasses import dataclass, field

import numpy as np

from ..layouts import LAYOUTS, padded_length
from ..masks import make_mask
from .compare import BFLOAT16, LARGE_LOGITS_FACTOR, LARGE_LOGITS_GRAD_FACTOR

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
# every dtype the kit draws: NumPy's floats and bfloat16 (ml_dtypes, the type JAX uses)
ALL_DTYPES = DTYPES + ((BFLOAT16.type,) if BFLOAT16 is not None else ())
MASKS = ("causal", "full", "window", "cu_seqlens", "segment_ids", "padding")
DROPOUT = ("dropout",)              # only a ring that draws reference.masks' keep mask can take it
DROPOUT_RATES = (0.5, 0.1, 0.9)     # an even draw first; 0.9: most pairs dropped, the kept weighed 10
PLAIN = ("causal", "full")          # no mask option: what every ring takes
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
    """One attention problem for a ring: shapes, options, the mask, inputs' kind and seed.

    `S` counts the real tokens; where it is not a multiple of the layout's unit
    the ranks hold `P = padded_length(S, N, layout)` positions, those >= S
    padding (`padded`, `c`). The mask: `causal`, a sliding `window` (keys a
    query sees, itself included), documents as `cu_seqlens` (boundaries from 0
    to S) or `segment_ids` (one id per real token), as in `reference.masks`.
    `poison` injects non-finite values: a tuple of (tensor, b, s, h, d, value)
    with tensor one of "q", "k", "v", "dout", s a global position and value
    "nan", "inf" or "-inf". `dropout` (p, or None) drops pairs as
    `reference.attention(dropout=p, seed=seed)` does. `inputs()` makes the
    arrays, in natural token order.
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
    window: object = None
    cu_seqlens: object = None
    segment_ids: object = None
    dropout: object = None

    def __post_init__(self):
        # plain, hashable values: a dtype as its scalar type, documents as tuples of ints
        object.__setattr__(self, "dtype", np.dtype(self.dtype).type)
        for name in ("cu_seqlens", "segment_ids"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(x) for x in value))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.Hq % self.Hkv:
            raise ValueError(f"Hq ({self.Hq}) must be a multiple of Hkv ({self.Hkv})")
        self.mask()                     # a bad window or documents: make_mask's ValueError, now

    @property
    def padded(self):
        """P: the real tokens padded to the layout's unit (N, or 2N for zigzag)."""
        return padded_length(self.S, self.n_devices, self.layout)

    @property
    def c(self):
        """Tokens per rank, padding included."""
        return self.padded // self.n_devices

    @property
    def masks(self):
        """The names of `MASKS` this case uses: ("causal",), ("full", "window", "padding"), ..."""
        used = ["causal" if self.causal else "full"]
        used += [name for name in ("window", "cu_seqlens", "segment_ids") if getattr(self, name) is not None]
        return tuple(used) + (("padding",) if self.padded > self.S else ()) + (("dropout",) if self.dropout else ())

    def mask_options(self):
        """window, cu_seqlens, segment_ids (and dropout with the case's seed) as
        `reference.attention` and `ring_attention` take them."""
        docs = {name: None if getattr(self, name) is None else np.array(getattr(self, name), np.int64)
                for name in ("cu_seqlens", "segment_ids")}
        dropout = dict(dropout=self.dropout, seed=self.seed) if self.dropout else {}
        return dict(window=self.window, **docs, **dropout)

    def mask(self):
        """The `reference.masks.Mask`: the options, and positions >= S padding."""
        return make_mask(causal=self.causal, seq_len=self.S, **self.mask_options())

    def inputs(self, padded=False):
        """(q, k, v, dout) of the case's dtype, natural token order: S tokens, or
        with `padded` P, the padding tokens random (drawn apart, so that
        padding changes no real token)."""
        rng = np.random.default_rng(self.seed)
        q, k, v = make_qkv(rng, (self.B, self.S, self.Hq, self.D), (self.B, self.S, self.Hkv, self.D),
                           self.dtype, self.kind, self.scale)
        dout = rng.standard_normal(q.shape).astype(self.dtype)
        arrays = dict(q=q, k=k, v=v, dout=dout)
        for name, b, s, h, d, value in self.poison:
            arrays[name][b, s, h, d] = float(value)
        if padded and self.padded > self.S:
            extra = np.random.default_rng((self.seed, 1))
            for name, x in arrays.items():
                pad = extra.standard_normal((self.B, self.padded - self.S) + x.shape[2:]).astype(self.dtype)
                arrays[name] = np.concatenate([x, pad], axis=1)
        return arrays["q"], arrays["k"], arrays["v"], arrays["dout"]

    @property
    def scale_value(self):
        """The scale in use: `scale`, or D ** -0.5."""
        return self.D ** -0.5 if self.scale is None else self.scale

    @property
    def tolerance_factor(self):
        return LARGE_LOGITS_FACTOR if self.kind == "large_logits" else 1

    @property
    def grad_tolerance_factor(self):
        return LARGE_LOGITS_GRAD_FACTOR if self.kind == "large_logits" else 1

    def options(self):
        """Keyword arguments of `reference.ring_attention` for this case."""
        return dict(n_devices=self.n_devices, layout=self.layout, causal=self.causal,
                    scale=self.scale, tile_size=self.tile_size, **self.mask_options())

    def __repr__(self):
        extra = "".join(f", {name}={getattr(self, name)!r}" for name in ("poison", "window", "cu_seqlens",
                                                                        "segment_ids", "dropout") if getattr(self, name))
        return (f"Case(layout={self.layout!r}, n_devices={self.n_devices}, B={self.B}, S={self.S}, "
                f"Hq={self.Hq}, Hkv={self.Hkv}, D={self.D}, tile_size={self.tile_size!r}, "
                f"causal={self.causal}, scale={self.scale!r}, dtype={_dtype_repr(self.dtype)}, "
                f"kind={self.kind!r}, seed={self.seed}{extra})")


def _dtype_repr(dtype):
    name = np.dtype(dtype).name
    return f"ml_dtypes.{name}" if name == "bfloat16" else f"np.{name}"


def parse_case(text):
    """The Case a `repr(case)` line describes (what a failure message and --repro print)."""
    import ml_dtypes
    try:
        case = eval(text, {"__builtins__": {}, "Case": Case, "np": np, "ml_dtypes": ml_dtypes})  # noqa: S307
    except Exception as e:      # noqa: BLE001 - any mistake in the line is the user's, said in words
        raise ValueError(f"not a Case: {text!r} ({type(e).__name__}: {e})") from None
    if not isinstance(case, Case):
        raise ValueError(f"not a Case: {text!r}")
    return case


def heads_fit(Hq, Hkv, heads, replicates_kv_heads=False):
    """Whether Hq and Hkv can be dealt to `heads` ranks: both multiples of it, or
    with `replicates_kv_heads` Hq a multiple and Hkv a divisor of it."""
    return Hq % heads == 0 and (Hkv % heads == 0 or (replicates_kv_heads and heads % Hkv == 0))
