"""The conformance kit: point the float64 oracle at anyone's ring attention.

A user brings a ring / striped / zigzag attention (NumPy, PyTorch, JAX, CUDA)
behind a small adapter and gets, from hypothesis, the smallest problem on
which it is not exact attention, with the first bad element named
(the guide: docs/kit.md):

    from hypothesis import given
    from reference.testing import Adapter, cases, check_ring_attention

    class Mine(Adapter):
        name = "mine"
        def run(self, case, shards):          # shards.q[r]: rank r's (B, c, Hq, D), ...
            return [my_ring(case, shards, r) for r in range(case.n_devices)]   # dicts: out, lse, dq, dk, dv

    @given(cases())
    def test_mine(case):
        check_ring_attention(Mine(), case)

Only NumPy is needed to import the kit; hypothesis is imported by the
strategies when they are called. Modules, in reading order:

    cases         `Case`, one problem (shapes, dtype, mask, dropout) and its inputs
    strategies    the hypothesis strategy `cases()` (heads for Ulysses: `kv_head_counts`)
    oracle        float64 out, lse, dq, dk, dv, and each element's error budget (`ErrorModel`)
    compare       `assert_attention_close`, naming the first bad element; `TOL`, backend against backend
    adapter       the `Adapter` protocol, `check_ring_attention`, `VirtualRingAdapter`
    group         `ProcessGroup`: a multi-process implementation served one example at a time
    harness/      rings written in PyTorch or JAX, each importing its framework only when used
    check         `python -m reference.testing check MODULE:ADAPTER`: draw, shrink, print a repro
    measure       how much of the error budget correct implementations use
    __main__      the kit's command line: `check` and `measure`
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
