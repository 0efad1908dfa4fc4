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
from ..layouts import LAYOUTS, positions, unshard
from .adapter import VirtualRingAdapter, make_shards
from .cases import DTYPES, INPUT_KINDS, MAX_HEAD_DIM, MAX_SEQ, NAMES, Case
from .oracle import ErrorModel, oracle, tolerances


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
