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

One room per job, in reading order:

    cases.py       `Case` (one problem: shapes, dtype (bfloat16 too), the mask: causal or
                   full, a window, packed documents, padding, dropout) and its inputs
                   (`INPUT_KINDS`: scores in the hundreds, constant rows, values exact in
                   float16, injected NaN / inf)
    strategies.py  the hypothesis strategy `cases()` (heads for Ulysses: `kv_head_counts`;
                   shapes from a small pool, `shape_pool`, for rings that compile per shape)
    oracle.py      `oracle(case)`: float64 out, lse, dq, dk, dv, and each element's error
                   budget (`ErrorModel`, `tolerances`; `flushed`, for arithmetic that
                   flushes subnormals to zero)
    compare.py     `attention_mismatch` / `assert_attention_close` (the message naming the
                   first bad element), and the project's same-precision table (`TOL`,
                   `assert_close`) for one backend against another
    adapter.py     the `Adapter` protocol, `check_ring_attention`, `VirtualRingAdapter`
    group.py       `ProcessGroup`: a multi-process implementation served one example at a time
    harness/       rings written in a framework: `harness.jax` (N CPU devices, shard_map),
                   `harness.torch` (a gloo world per world size); each imports its framework
                   only when used
    check.py       checking an adapter: hypothesis draws, shrinks, and words the smallest
                   disagreement with a command that replays it
    measure.py     how much of the line correct implementations use
    __main__.py    the command line: `python -m reference.testing check MODULE:ADAPTER`,
                   `python -m reference.testing measure`

Only NumPy is needed to import the kit; hypothesis is imported by the
strategies when they are called.
"""

from .adapter import Adapter, Shards, Unsupported, VirtualRingAdapter, check_ring_attention, make_shards
from .cases import (ALL_DTYPES, BACKWARD, DROPOUT, DROPOUT_RATES, DTYPES, FORWARD, INPUT_KINDS, MASKS, MAX_DEVICES,
                    MAX_HEAD_DIM, MAX_SEQ, NAMES, PLAIN, Case, heads_fit, make_qkv, parse_case)
from .compare import (BFLOAT16, LARGE_LOGITS_FACTOR, LARGE_LOGITS_GRAD_FACTOR, TOL, Tolerance,
                      assert_attention_close, assert_close, assert_finite, attention_mismatch, used_fraction)
from .group import ProcessGroup, serve_requests
from .measure import measure, random_case
from .strategies import cases, kv_head_counts, mask_options, shape_pool, tile_sizes
from .oracle import GROWTH, ErrorModel, accumulation, flushed, magnitudes, oracle, tolerances, unit_roundoff

__all__ = ["Adapter", "Shards", "Unsupported", "VirtualRingAdapter", "check_ring_attention", "make_shards",
           "ALL_DTYPES", "BACKWARD", "DROPOUT", "DROPOUT_RATES", "DTYPES", "FORWARD", "INPUT_KINDS", "MASKS",
           "MAX_DEVICES", "MAX_HEAD_DIM", "MAX_SEQ", "NAMES", "PLAIN", "Case", "cases", "heads_fit", "kv_head_counts", "make_qkv", "mask_options",
           "parse_case", "shape_pool", "tile_sizes",
           "BFLOAT16", "LARGE_LOGITS_FACTOR", "LARGE_LOGITS_GRAD_FACTOR", "TOL", "Tolerance",
           "assert_attention_close", "assert_close", "assert_finite", "attention_mismatch", "used_fraction",
           "ProcessGroup", "serve_requests", "measure", "random_case",
           "GROWTH", "ErrorModel", "accumulation", "flushed", "magnitudes", "oracle", "tolerances", "unit_roundoff"]
