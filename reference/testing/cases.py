"""Cases: one attention problem for a ring, its inputs, and the hypothesis strategy that draws it.

A `Case` is the whole problem in a few plain fields (shapes, options, the
mask, the inputs' kind and seed), so that it prints as a line that rebuilds it
(`parse_case`) and can be a dictionary key; `inputs()` makes the arrays.
`cases()` draws them for hypothesis (imported on first use: the rest of the
kit needs NumPy only).

    from reference.testing import cases
    case = cases(max_devices=4, masks=MASKS).example()
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

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..layouts import LAYOUTS, padded_length
from ..layouts import unit as layout_unit
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


# -- strategies -------------------------------------------------------------

def tile_sizes(c):
    """An int, a rectangular (tq, tk) pair, or None (the default, larger than any
    block here). Sizes run from about c/6 (few tiles, to stay fast) to past the
    block (a tile larger than the block); most do not divide c."""
    _, st = _hypothesis()
    side = st.integers(min_value=max(1, c // 6), max_value=c + 3)
    return st.one_of(side, st.tuples(side, side), st.just(None))


def check_masks(masks):
    """`masks` as a tuple of names of MASKS (or DROPOUT), with at least one of causal / full."""
    masks = tuple(masks)
    unknown = [m for m in masks if m not in MASKS + DROPOUT]
    if unknown:
        raise ValueError(f"unknown mask(s) {unknown}; the masks are {', '.join(MASKS + DROPOUT)}")
    if not set(masks) & set(PLAIN):
        raise ValueError(f"masks must take causal or full attention (or both), got {masks}")
    return masks


def heads_fit(Hq, Hkv, heads, replicates_kv_heads=False):
    """Whether Hq and Hkv can be dealt to `heads` ranks: both multiples of it, or
    with `replicates_kv_heads` Hq a multiple and Hkv a divisor of it."""
    return Hq % heads == 0 and (Hkv % heads == 0 or (replicates_kv_heads and heads % Hkv == 0))


def kv_head_counts(heads=1, max_kv_heads=3, replicates_kv_heads=False):
    """The KV head counts `cases` draws, simplest first, where both head counts
    must be multiples of `heads` (a Ulysses of degree u = heads deals them to u
    ranks): 1..max_kv_heads for heads = 1; above 1, two a rank first (with one
    a rank, dealing KV heads in blocks and strided look alike), then one, then
    more where max_kv_heads allows; with `replicates_kv_heads`, then the
    divisors of u below it, fewest ranks sharing a KV head first (1: MQA).

        kv_head_counts(1) == (1, 2, 3);  kv_head_counts(4, replicates_kv_heads=True) == (8, 4, 2, 1)"""
    if heads == 1:
        return tuple(range(1, max_kv_heads + 1))
    per_rank = (2, 1) + tuple(range(3, max_kv_heads // heads + 1))
    fewer = tuple(d for d in range(heads - 1, 0, -1) if heads % d == 0) if replicates_kv_heads else ()
    return tuple(heads * k for k in per_rank) + fewer


def cases(dtypes=DTYPES, layouts=LAYOUTS, kinds=INPUT_KINDS, max_devices=MAX_DEVICES, causal=None, *,
          masks=PLAIN, devices=None, max_seq=MAX_SEQ, max_head_dim=MAX_HEAD_DIM, max_kv_heads=3, max_group=3,
          max_batch=2, scales=(None, None, 0.3, 1.0, -0.7), poison=False, poison_values=("nan", "inf", "-inf"),
          seq_multiple=1, document_multiple=1, head_multiple=1, replicates_kv_heads=False, shapes=0, keep=None):
    """A hypothesis strategy of `Case`: every layout, N in 1..max_devices (or
    drawn from `devices`), c down to one token per device (two for zigzag),
    GQA (Hkv < Hq) and MQA (Hkv = 1), any D, tile and scale, every input kind.

    `masks` (names of `MASKS`): which masks to draw besides causal / full
    attention: a window, documents (cu_seqlens or segment_ids), padding;
    `causal` (True / False) fixes the flag. `poison=True` injects one of
    `poison_values` into q, k, v or dout at a drawn place. `seq_multiple` makes
    S a multiple of it too (for implementations that cut the sequence more
    finely than the layout), `document_multiple` (an int, or a function of N)
    every document's length (varlen rings that split each document over the
    ranks), `head_multiple` (an int, or a function of N) both head counts Hq
    and Hkv (implementations that deal heads to ranks, as Ulysses does: two
    KV heads a unit first, `kv_head_counts`), or Hkv a divisor of it too with
    `replicates_kv_heads`. Shrinks towards contiguous, one device, B = 1, one
    head (two KV heads a unit of `head_multiple` above 1), D = 1, float64,
    causal, no mask, gaussian.

    `shapes=K` (K > 0) draws the shape of every case (B, S, heads, D, tile,
    scale) from K per world size and layout (`shape_pool`: the smallest
    first, where shrinking ends), while the mask, dtype, kind, seed and
    poison still vary case by case: for a ring that compiles once per shape
    (JAX), K compilations per world size instead of one per case. `keep`
    (a function of a Case, true to keep) filters the pool's shapes: what the
    adapter takes."""
    _, st = _hypothesis()
    devices = tuple(devices) if devices is not None else tuple(range(1, max_devices + 1))
    masks = check_masks(masks)
    flags = [flag for flag, name in ((True, "causal"), (False, "full")) if name in masks]

    @st.composite
    def draw_case(draw):
        layout = draw(st.sampled_from(layouts))
        n = draw(st.sampled_from(devices))
        doc_unit = document_multiple(n) if callable(document_multiple) else document_multiple
        unit = math.lcm(layout_unit(n, layout), seq_multiple,                 # the layout's unit of division,
                        doc_unit if "cu_seqlens" in masks else 1)             # and the documents'
        heads = head_multiple(n) if callable(head_multiple) else head_multiple
        counts = kv_head_counts(heads, max_kv_heads, replicates_kv_heads)
        if shapes:
            shape = draw(st.sampled_from(pool(n, layout, doc_unit, unit, heads)))
        else:
            S = unit * draw(st.integers(1, max(1, max_seq // unit)))
            if "padding" in masks:           # shrinks to 0: no padding
                S -= draw(st.integers(0, unit - 1)) if unit > 1 and doc_unit == 1 else 0
                S = max(S, 1)
            Hkv = draw(st.sampled_from(counts))
            Hq = math.lcm(Hkv, heads) * draw(st.integers(1, max_group))
            B, D = draw(st.integers(1, max_batch)), draw(st.integers(1, max_head_dim))
            shape = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, tile_size=draw(tile_sizes(padded_length(S, n, layout) // n)),
                         scale=draw(st.sampled_from(scales)))
        S = shape["S"]
        case = Case(layout=layout, n_devices=n, **shape,
                    causal=draw(st.sampled_from(flags)) if causal is None else causal,
                    dtype=draw(st.sampled_from(dtypes)), kind=draw(st.sampled_from(kinds)),
                    seed=draw(st.integers(0, 2**32 - 1)), **draw(mask_options(S, masks, doc_unit)))
        if poison:
            name = draw(st.sampled_from(("q", "k", "v", "dout")))
            heads = Hq if name in ("q", "dout") else Hkv
            at = tuple(draw(st.integers(0, x - 1)) for x in (B, S, heads, D))
            value = draw(st.sampled_from(poison_values))
            case = replace(case, poison=((name,) + at + (value,),))
        return case

    pools = {}

    def pool(n, layout, doc_unit, unit, heads):
        if (n, layout) not in pools:
            probe = Case(layout, n, 1, unit, 1, 1, 1, None, flags[0] if causal is None else causal, None,
                         dtypes[0], "gaussian", 0)
            pools[n, layout] = shape_pool(probe, shapes, unit=unit, padding="padding" in masks and doc_unit == 1,
                                          max_seq=max_seq, max_head_dim=max_head_dim, max_kv_heads=max_kv_heads,
                                          max_group=max_group, max_batch=max_batch, scales=scales, keep=keep,
                                          heads=heads, replicates_kv_heads=replicates_kv_heads)
        return pools[n, layout]

    return draw_case()


def shape_pool(probe, count, *, unit, padding, max_seq, max_head_dim, max_kv_heads, max_group, max_batch, scales,
               keep=None, heads=1, replicates_kv_heads=False, seed=0, tries=50):
    """`count` shapes (dicts of B, S, Hq, Hkv, D, tile_size, scale) for the
    probe case's world size and layout, the same for the same arguments: the
    smallest (B = 1, S = one unit, the first of `kv_head_counts`, D = 1) and shapes drawn from a
    NumPy generator within the limits `cases` draws in (S a multiple of
    `unit`, less some padding where `padding`), smallest (B S Hq D) first. With `keep`, only shapes whose
    probe case (the probe with the shape) it keeps, as far as `tries` draws
    each find one."""
    rng = np.random.default_rng((seed, probe.n_devices, LAYOUTS.index(probe.layout), count))
    counts = kv_head_counts(heads, max_kv_heads, replicates_kv_heads)

    def drawn():
        S = unit * int(rng.integers(1, max(1, max_seq // unit) + 1))
        S = max(1, S - int(rng.integers(0, unit))) if padding and unit > 1 else S
        c = padded_length(S, probe.n_devices, probe.layout) // probe.n_devices
        Hkv = counts[rng.integers(len(counts))]
        side = lambda: int(rng.integers(max(1, c // 6), c + 4))                       # noqa: E731 - as tile_sizes
        tile = [side, lambda: (side(), side()), lambda: None][rng.integers(3)]()
        return dict(B=int(rng.integers(1, max_batch + 1)), S=S, Hq=math.lcm(Hkv, heads) * int(rng.integers(1, max_group + 1)),
                    Hkv=Hkv, D=int(rng.integers(1, max_head_dim + 1)), tile_size=tile,
                    scale=scales[rng.integers(len(scales))])

    kept = lambda shape: keep is None or keep(replace(probe, **shape))               # noqa: E731
    smallest = dict(B=1, S=unit, Hq=math.lcm(counts[0], heads), Hkv=counts[0], D=1, tile_size=None, scale=None)
    found = [smallest] if kept(smallest) else []
    while len(found) < count:
        shape = next((s for s in (drawn() for _ in range(tries)) if kept(s)), None)
        if shape is None:
            break
        found.append(shape)
    # smallest first: shrinking moves towards the front, so a failure ends on the smallest shape that shows it
    return tuple(sorted(found, key=lambda x: (x["B"] * x["S"] * x["Hq"] * x["D"], x["S"]))) or (smallest,)


def mask_options(S, masks, document_multiple=1):
    """A strategy of {window, cu_seqlens, segment_ids} for S real tokens, each
    drawn only where `masks` names it and shrinking to None (no mask):
    a window of 1..S keys; documents as cu_seqlens (cut points, lengths a
    multiple of `document_multiple`) or segment ids (three ids at most, in any
    order: a document need not be one run); dropout of one of DROPOUT_RATES."""
    _, st = _hypothesis()

    @st.composite
    def draw_options(draw):
        options = dict(window=None, cu_seqlens=None, segment_ids=None)
        if "window" in masks:
            options["window"] = draw(st.none() | st.integers(1, S))
        kinds = [None] + [k for k in ("cu_seqlens", "segment_ids") if k in masks]
        kind = draw(st.sampled_from(kinds))
        if kind == "cu_seqlens" and S % document_multiple == 0:      # (not with padding)
            blocks = S // document_multiple
            cuts = draw(st.lists(st.integers(1, blocks - 1), unique=True, max_size=4)) if blocks > 1 else []
            options["cu_seqlens"] = (0,) + tuple(document_multiple * c for c in sorted(cuts)) + (S,)
        elif kind == "segment_ids":
            options["segment_ids"] = tuple(draw(st.lists(st.integers(0, 2), min_size=S, max_size=S)))
        if "dropout" in masks:
            options["dropout"] = draw(st.none() | st.sampled_from(DROPOUT_RATES))
        return options

    return draw_options()
