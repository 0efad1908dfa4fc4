"""A NaN (or inf) in V at a key some queries of its tile cannot see reaches only the rows that see it,
in float16 and bfloat16, forward and backward, through every path a 16-bit block takes.

One device of 64 tokens, causal, tiles of 16 (32 for fused_v2 in float16):
V holds a NaN at key 40, so queries 32-39 share a masked tile with it and must
not see it (0 x NaN is NaN).
The dense oracle says which rows are NaN; each path must give exactly those,
and the oracle's values elsewhere. The paths: the readable step on the block
as the ring widens it (`reference.ring.as_dtype`); fused_v2 (its kernels on
the CPU emulator, `tests/support/gpu/emulator.py`), whose backward hands a
block holding NaN to the readable step; and bfloat16 as CuPy holds it, its
bits in uint16, whose finiteness `isfinite` cannot see
(`reference.nonfinite.finite`). The backward's rows (out, lse) are a caller's
finite ones, so that only the block's flag guards the masked pairs.

    .venv/bin/python -m pytest tests/gpu/test_nan_at_a_masked_key.py -q
"""

import sys
from pathlib import Path

import numpy as np
import pytest

import reference
from conftest import BFLOAT16
from gpu_impl.steps import fused_v2
from gpu_impl.steps.fused_v2 import Config
from reference import ring
from reference.heads import kv_from_heads, q_from_heads, rows_from_heads
from reference.masks import CAUSAL
from reference.step import BackwardRows, ForwardAcc, Grads, Queries, ReadableStep, finish_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "gpu"))
import emulator  # noqa: E402

pytestmark = pytest.mark.skipif(emulator.GXX is None, reason="g++ not found")

C, D, NAN_KEY, TILE = 64, 64, 40, 16
CONFIG = {False: Config(D, 2, 32, False), True: Config(D, 1, 16, True)}   # as tests/gpu/test_fused_v2_backward.py
FORMS = ["float16", "bfloat16", "bfloat16 bits"]       # bits: uint16, as CuPy holds bfloat16


@pytest.fixture(scope="module")
def libraries():
    return emulator.build_v2(list(CONFIG.values()))


def inputs(form, bad=np.nan):
    """q (float32), k, v in the form's dtype (v `bad` at NAN_KEY), dout; and the float32 k, v."""
    rng = np.random.default_rng(40)
    q, k, v, dout = (rng.standard_normal((1, C, 1, D)) for _ in range(4))
    q, dout = q.astype(np.float32), dout.astype(np.float32)
    k, v = (x.astype(np.float16 if form == "float16" else BFLOAT16) for x in (k, v))
    v[0, NAN_KEY, 0, 3] = bad
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    if form == "bfloat16 bits":
        k, v = k.view(np.uint16), v.view(np.uint16)
    return q, k, v, dout, k32, v32


def block_of(k, v):
    return ring.own_block(k, v, np.arange(C), 0)


def readable(block):
    """The block as the readable step takes it: widened, or from bits as fused_v2's fallback makes it."""
    if block.k.dtype == np.uint16:
        return fused_v2.float32_block(block, "bfloat16")
    return ring.as_dtype(block, np.float32)


def emulated(libraries, form):
    """fused_v2 on the emulator for the form, and its tile (queries, keys)."""
    config = CONFIG[form != "float16"]
    step = emulator.EmulatedTensorCoreStep({config: libraries[config]},
                                           kv_format="float16" if form == "float16" else "bfloat16")
    return step, (config.queries(1), config.bn)


def assert_nan_where_the_oracle_has_it(got, want, name):
    bad_got, bad_want = ~np.isfinite(got), ~np.isfinite(want)
    rows = lambda bad: sorted(set(np.nonzero(bad)[1].tolist()))      # noqa: E731 - token axis
    assert rows(bad_got) == rows(bad_want), f"{name}: not finite at tokens {rows(bad_got)}, the oracle at " \
                                            f"{rows(bad_want)}"
    np.testing.assert_allclose(np.where(bad_want, 0, got), np.where(bad_want, 0, want), rtol=2e-2, atol=2e-2,
                               err_msg=name)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("path", ["readable", "fused_v2"])
@pytest.mark.parametrize("form", FORMS)
def test_forward(libraries, form, path, bad):
    q, k, v, _, k32, v32 = inputs(form, bad)
    with np.errstate(invalid="ignore"):
        want, _ = reference.attention(q, k32, v32)
    queries = Queries.prepare(q, 1, np.arange(C), D ** -0.5)
    acc, block = ForwardAcc.zeros(queries.q), block_of(k, v)
    with np.errstate(invalid="ignore", over="ignore"):
        if path == "readable":
            ReadableStep().forward(acc, queries, readable(block), mask=CAUSAL, tile_size=TILE)
        else:
            step, tile = emulated(libraries, form)
            step.forward(acc, queries, block, mask=CAUSAL, tile_size=tile)
        out, _ = finish_forward(acc)
    assert_nan_where_the_oracle_has_it(q_from_heads(out), want, f"{path} forward, {form}")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("path", ["readable", "fused_v2"])
@pytest.mark.parametrize("form", FORMS)
def test_backward(libraries, form, path, bad):
    q, k, v, dout, k32, v32 = inputs(form, bad)
    out, lse = reference.attention(q, k32, np.nan_to_num(v32))        # a caller's finite rows
    with np.errstate(invalid="ignore"):
        want = reference.attention_backward(q, k32, v32, out, lse, dout)
    queries = Queries.prepare(q, 1, np.arange(C), D ** -0.5)
    rows = BackwardRows.prepare(out, lse, dout, 1, np.float32)
    block = block_of(k, v)
    grads = Grads(np.zeros(queries.q.shape, np.float32), *(np.zeros(block.k.shape, np.float32) for _ in "kv"))
    with np.errstate(invalid="ignore", over="ignore"):
        if path == "readable":
            ReadableStep().backward(grads, queries, rows, readable(block), mask=CAUSAL, tile_size=TILE)
        else:
            step, tile = emulated(libraries, form)
            step.backward(grads, queries, rows, block, mask=CAUSAL, tile_size=tile)
    scale = np.float32(D ** -0.5)
    got = (q_from_heads(grads.dq) * scale, kv_from_heads(grads.dk), kv_from_heads(grads.dv))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_nan_where_the_oracle_has_it(g, w, f"{path} backward {name}, {form}")
