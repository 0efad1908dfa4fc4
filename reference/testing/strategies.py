"""The hypothesis strategies that draw `Case`s: shapes, masks, dtypes, inputs, heads.

`cases()` draws every layout, N, GQA / MQA heads, D, tile, scale, input kind and
the masks an adapter takes, shrinking towards the simplest case; `shape_pool`
keeps a ring that compiles per shape to a few shapes; `mask_options` draws the
mask options alone; `kv_head_counts` says which KV head counts a Ulysses gets.

    from reference.testing import cases
    case = cases(max_devices=4, masks=MASKS + DROPOUT, head_multiple=lambda n: n).example()

hypothesis is imported when a strategy is called (`cases._hypothesis`).
"""

import math
from dataclasses import replace

import numpy as np

from ..layouts import LAYOUTS, padded_length
from ..layouts import unit as layout_unit
from .cases import (DROPOUT, DROPOUT_RATES, DTYPES, INPUT_KINDS, MASKS, MAX_DEVICES, MAX_HEAD_DIM, MAX_SEQ, PLAIN,
                    Case, _hypothesis)


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
