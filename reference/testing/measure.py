"""The measurement behind the error model's line: how much of it correct implementations use.

`measure` draws random cases (NumPy's generator, no hypothesis) per dtype and
holds two correct implementations against the oracle: the dense formula run
at the dtype, and the virtual ring. The largest error / tolerance of any
element is how close correct arithmetic comes to the line (1); the error
model's `growth` is set from it with a margin (reference/testing/oracle.py).

    python -m reference.testing measure --examples 400
"""

import numpy as np

from ..dense import attention, attention_backward
from ..layouts import LAYOUTS, padded_length, positions, unshard
from ..layouts import unit as layout_unit
from .adapter import VirtualRingAdapter, make_shards
from .cases import ALL_DTYPES, INPUT_KINDS, MAX_HEAD_DIM, MAX_SEQ, NAMES, Case
from .compare import used_fraction
from .oracle import ErrorModel, oracle, tolerances


def measure(examples=400, seed=0, dtypes=ALL_DTYPES, model=None, masks=True):
    """The largest error / tolerance over `examples` random cases per dtype (with
    a random window, documents and padding where `masks`): the dense oracle run
    at the dtype, and the virtual ring; 1 is the line. Returns {dtype name:
    (oracle ratio, ring ratio)}."""
    rng = np.random.default_rng(seed)
    model = model or ErrorModel()
    table = {}
    for dtype in dtypes:
        worst = [0.0, 0.0]
        for _ in range(examples):
            case = random_case(rng, dtype, masks=masks)
            want, tol = oracle(case), tolerances(case, model=model)
            for i, got in enumerate((_dense(case), _ring(case))):
                for name in NAMES:
                    worst[i] = max(worst[i], used_fraction(got[name], want[name], tol[name]))
        table[np.dtype(dtype).name] = tuple(worst)
    return table


def _dense(case):
    """The dense formula run at the case's dtype: {name: array}, natural order."""
    q, k, v, dout = case.inputs()
    opts = dict(causal=case.causal, scale=case.scale, **case.mask_options())
    out, lse = attention(q, k, v, **opts)
    return dict(zip(NAMES, (out, lse) + attention_backward(q, k, v, out, lse, dout, **opts)))


def _ring(case):
    """The virtual ring's results, put back in natural order (S tokens)."""
    ranks = VirtualRingAdapter().run(case, make_shards(case, positions(case.S, case.n_devices, case.layout)))
    return {name: unshard([r[name] for r in ranks], case.layout, axis=2 if name == "lse" else 1, seq_len=case.S)
            for name in NAMES}


def random_case(rng, dtype, masks=True):
    """A case like `cases()` draws, from a NumPy generator (for `measure`, without
    hypothesis); with `masks`, half of them with a window, two thirds with
    documents, and any S (padding where the layout's unit does not divide it)."""
    layout = LAYOUTS[rng.integers(3)]
    n = int(rng.integers(1, 5))
    unit = layout_unit(n, layout)
    S = unit * int(rng.integers(1, max(2, MAX_SEQ // unit + 1)))
    if masks:
        S = max(1, S - int(rng.integers(unit)))
    Hkv = int(rng.integers(1, 4))
    c = padded_length(S, n, layout) // n
    return Case(layout=layout, n_devices=n, B=int(rng.integers(1, 3)), S=S, Hq=Hkv * int(rng.integers(1, 4)),
                Hkv=Hkv, D=int(rng.integers(1, MAX_HEAD_DIM + 1)), tile_size=int(rng.integers(1, c + 2)),
                causal=bool(rng.integers(2)), scale=[None, 0.3, 1.0, -0.7][rng.integers(4)], dtype=dtype,
                kind=INPUT_KINDS[rng.integers(len(INPUT_KINDS))], seed=int(rng.integers(2**32)),
                **(_random_mask(rng, S) if masks else {}))


def _random_mask(rng, S):
    window = int(rng.integers(1, S + 1)) if rng.integers(2) else None
    documents = rng.integers(3)
    cuts = np.unique(rng.integers(1, S, size=int(rng.integers(0, 4)))) if S > 1 else []
    return dict(window=window,
                cu_seqlens=(0, *cuts, S) if documents == 1 else None,
                segment_ids=tuple(rng.integers(0, 3, size=S)) if documents == 2 else None)
